"""The chunked output projection + cross-entropy (models/loss.py): exact against the plain
loss, and never holding the logits of the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.models.llama import Llama, ModelArgs
from shardline.models.loss import IGNORE_INDEX, LinearCrossEntropy, cross_entropy_sum

VOCAB, BATCH, SEQ = 300, 2, 20


@pytest.fixture(scope="module")
def setup():
    model = Llama(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=64))
    model.init_weights(seed=3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, :7] = IGNORE_INDEX  # a prompt the loss skips
    return model, ids, labels


def _loss_and_grads(model, ids, labels, chunk: int | None):
    """Mean loss and every gradient; chunk None: logits out of the model, scored outside it."""
    model.zero_grad(set_to_none=True)
    model.loss = LinearCrossEntropy(chunk or 0)
    total = cross_entropy_sum(model(ids), labels) if chunk is None else model(ids, labels=labels)
    loss = total / (labels != IGNORE_INDEX).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [0, 1, 7, 16, 64])
def test_chunked_loss_has_the_gradients_of_the_plain_loss(setup, chunk):
    model, ids, labels = setup
    want_loss, want = _loss_and_grads(model, ids, labels, None)
    got_loss, got = _loss_and_grads(model, ids, labels, chunk)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_wrong_gradient_would_be_seen(setup):
    """The comparison above can fail: one label changed moves the output weight's gradient."""
    model, ids, labels = setup
    _, want = _loss_and_grads(model, ids, labels, None)
    other = labels.clone()
    other[1, 3] = (other[1, 3] + 1) % VOCAB
    _, got = _loss_and_grads(model, ids, other, 7)
    assert (got["output.weight"] - want["output.weight"]).abs().max() > 1e-4


class LargestOutput(TorchDispatchMode):
    """The most elements any op produced (forward and backward, recomputation included)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk, holds_all_logits", [(0, True), (8, False)])
def test_chunked_loss_never_makes_the_logits_of_the_batch(setup, chunk, holds_all_logits):
    model, ids, labels = setup
    model.loss = LinearCrossEntropy(chunk)
    with LargestOutput() as mode:
        model(ids, labels=labels).backward()
    model.zero_grad(set_to_none=True)
    assert (mode.largest >= BATCH * SEQ * VOCAB) == holds_all_logits


def test_loss_chunk_tokens_must_not_be_negative():
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        load_config(None, ["train.loss_chunk_tokens=-1"]).check_sections()


@pytest.mark.parametrize("chunk", [0, 16])
def test_the_split_backward_of_zero_bubble_schedules_recomputes_each_chunk_in_both_passes(chunk):
    """The premise of the planner's chunked-loss recompute (planner/compute.py
    loss_recompute_time): a checkpointed chunk runs the output projection again in one
    backward, and in each pass of zbv/dualpipev's split backward; the plain loss never."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    head, labels = torch.nn.Linear(32, 100, bias=False), torch.randint(0, 100, (2, 32))
    projections = []
    head.register_forward_hook(lambda *_: projections.append(1))
    hidden = torch.randn(2, 32, 32, requires_grad=True)
    chunks = 4 if chunk else 1

    LinearCrossEntropy(chunk)(hidden * 1.0, head, labels).backward()
    assert len(projections) == chunks * (2 if chunk else 1)  # forward, then the recompute
    projections.clear()
    loss = LinearCrossEntropy(chunk)(hidden * 1.0, head, labels)
    _, groups = stage_backward_input([loss], None, [hidden], head.parameters())
    stage_backward_weight(head.parameters(), groups)
    assert len(projections) == chunks * (3 if chunk else 1)  # forward, input pass, weight pass


VIEW_WARNING = """
import sys, warnings
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from shardline.trainer.step import _VIEW_OUTPUT

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)


class Head(torch.nn.Module):  # returns a view, as tp's replicated logits are (a DTensor's local tensor)
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).view(-1)


model = fully_shard(Head())
counts = []
for filtered in (False, True):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if filtered:
            warnings.filterwarnings("ignore", message=_VIEW_OUTPUT)
        model(torch.ones(2, 4))
    counts.append(sum("returned a view tensor" in str(w.message) for w in seen))
print(counts)
dist.destroy_process_group()
"""


def test_the_filter_of_fsdp_view_output_warning_matches_torchs_message():
    """FSDP2 warned on every rank, every step, that a root's view output could get wrong gradients
    (tp without loss parallel under FSDP: the logits); the trainer's scoped filter must match the
    message this torch writes, and nothing else is silenced with it."""
    import subprocess
    import sys

    from tests.ports import free_port

    done = subprocess.run([sys.executable, "-c", VIEW_WARNING, str(free_port())], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[1, 0]"
