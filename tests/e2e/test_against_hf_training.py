"""A shardline run against an independent training loop over transformers' LlamaForCausalLM.

The reference is a plain PyTorch loop written from the README's description, not from
shardline's code: the same initial weights (exported before the run's first step), the same
global batches in the same order (read through the run's own sampler and sequences, so the
inputs are the same tensors), the loss as the mean cross-entropy over the labelled tokens of
the whole global batch (each micro-batch's summed loss divided by that count), gradients
accumulated over the micro-batches, torch's clip_grad_norm_, torch's AdamW with every matrix
decayed (embedding and output included) and the norms' weights not, and the lr of update k of
T computed from the README's curve (k/W x lr in the warm-up, then cosine down to
min_lr_ratio x lr at the last update). Everything fp32 on the CPU: the per-step losses, lrs
and gradient norms and the final weights agree to float rounding (~1e-7 here). A wrong decay
group, clipping off, the lr one step off or a per-micro-batch mean each fail it within three
steps (by 2e-5 to 2e-2 in loss, or 1e-4 relative in gradient norm).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from shardline.config import load_config
from shardline.data.sampler import batch_index
from shardline.interop.convert import convert
from shardline.interop.hf import to_hf_pretrained
from shardline.metrics import history
from shardline.models.loss import IGNORE_INDEX
from shardline.optim import lr_multiplier
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides, write_small_corpus

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

STEPS, WARMUP, GLOBAL, MICRO, SEQ = 8, 3, 8, 4, 32
LR, WD, CLIP = 3e-3, 0.1, 0.5  # a clip under the gradient norms here (~0.7-0.9): every step is clipped


@pytest.fixture(scope="module")
def verses(tmp_path_factory):
    """The small corpus's first chapters cut into one document a verse (~40 tokens): most
    sequences hold a document boundary, where the labels and the document mask act."""
    chapters = write_small_corpus(tmp_path_factory.mktemp("chapters")).read_text(encoding="utf-8").splitlines()[:40]
    lines = [v for c in chapters for v in json.loads(c)["text"].splitlines()[2:] if v.strip()]
    path = tmp_path_factory.mktemp("verses") / "verses.jsonl"
    path.write_text("".join(json.dumps({"text": v}) + "\n" for v in lines), encoding="utf-8")
    return path


def readme_lr(k: int, cfg) -> float:
    """The README's curve: update k (from 1) of T with W warm-up steps takes k/W x lr while
    k <= W, then cosine over the remaining T - W updates, the first of them one step down from
    the peak and the last at exactly min_lr_ratio x lr."""
    T, W, floor = STEPS, min(WARMUP, STEPS), cfg.optim.min_lr_ratio
    if k <= W:
        return k / W * LR
    progress = (k - W) / (T - W)
    return LR * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """A 4-D additive mask [batch, 1, seq, seq]: causal within each packed document (HF uses a
    4-D mask as given)."""
    s = doc_ids.shape[1]
    keep = torch.ones(s, s, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])
    mask = torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, torch.finfo(torch.float32).min)
    return mask[:, None]


def reference_overrides(run, corpus, *extra: str) -> list[str]:
    """The run both tests train: STEPS fp32 steps of GLOBAL sequences in micro-batches of MICRO,
    cosine after WARMUP, every step clipped, nothing held out, one checkpoint at the end."""
    return tiny_overrides(
        run, corpus, f"train.seq_len={SEQ}", f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}",
        f"train.steps={STEPS}", f"optim.warmup_steps={WARMUP}", "optim.schedule=cosine", f"optim.lr={LR}",
        f"optim.weight_decay={WD}", f"train.grad_clip={CLIP}", "train.eval_interval=0", "data.val_fraction=0",
        f"checkpoint.interval={STEPS}", "train.precision=fp32", *extra)


def train_and_export(cfg, tmp_path):
    """Train `cfg`; returns the weights its first step started from (an HF folder), its data, its
    train records by step, and its last checkpoint exported as users export it (HF tensors)."""
    trainer = Trainer(cfg).build()
    init = to_hf_pretrained(trainer.model, tmp_path / "init")  # the weights the run's first step starts from
    data = trainer.data
    trainer.train()
    logged = {r["step"]: r for r in history(cfg.run.dir) if r["kind"] == "train"}
    assert sorted(logged) == list(range(1, STEPS + 1))
    convert("to-hf", str(cfg.run.dir), str(tmp_path / "final"))
    return init, data, logged, safetensors.load_file(str(tmp_path / "final" / "model.safetensors"))


def reference_adamw(hf, cfg, norms: int) -> torch.optim.AdamW:
    """torch's AdamW as the README says ours decays: every matrix (embedding, output, experts, router
    included), not the `norms` norm weights."""
    decayed = [p for n, p in hf.named_parameters() if not n.endswith("norm.weight")]
    kept = [p for n, p in hf.named_parameters() if n.endswith("norm.weight")]
    assert len(kept) == norms
    o = cfg.optim
    return torch.optim.AdamW([{"params": decayed, "weight_decay": WD}, {"params": kept, "weight_decay": 0.0}],
                             lr=LR, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)


def step_batches(data, step: int, opt, cfg) -> tuple[list[dict], int, float]:
    """Step `step`'s micro-batches as the run read them, their labelled tokens, and the README's lr,
    set on `opt` (and checked against the run's own curve)."""
    lr = readme_lr(step + 1, cfg)
    assert lr == pytest.approx(LR * lr_multiplier(step, STEPS, cfg.optim), rel=1e-12)
    for group in opt.param_groups:
        group["lr"] = lr
    indices = data.sampler.global_batch(batch_index(step, []))
    batches = [data.train.batch(indices[i:i + MICRO]) for i in range(0, GLOBAL, MICRO)]
    return batches, sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches), lr


@pytest.mark.parametrize("tied, document_mask_on", [(False, False), (True, True)],
                         ids=["untied-no-doc-mask", "tied-doc-mask"])
def test_training_matches_a_plain_loop_over_hf_llama(tmp_path, verses, tied, document_mask_on):
    cfg = load_config(None, reference_overrides(tmp_path / "run", verses, f"model.tie_embeddings={int(tied)}",
                                                f"train.document_mask={str(document_mask_on).lower()}"))
    init, data, logged, final = train_and_export(cfg, tmp_path)

    hf = transformers.LlamaForCausalLM.from_pretrained(init, attn_implementation="sdpa").float().train()
    assert hf.config.tie_word_embeddings == tied
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    opt = reference_adamw(hf, cfg, norms=2 * 2 + 1)

    several_documents = False
    for step in range(STEPS):
        k = step + 1
        batches, n_tokens, lr = step_batches(data, step, opt, cfg)
        for b in batches:  # next-token labels, ignored only where the next token opens another document
            x, y, docs = b["input_ids"], b["labels"], b["doc_ids"]
            same = docs[:, 1:] == docs[:, :-1]
            assert torch.equal(y[:, :-1][same], x[:, 1:][same]) and (y[:, :-1][~same] == IGNORE_INDEX).all()
            several_documents |= bool((~same).any())
        opt.zero_grad(set_to_none=True)
        loss_total = 0.0
        for b in batches:
            mask = document_mask(b["doc_ids"]) if document_mask_on else None
            logits = hf(input_ids=b["input_ids"], attention_mask=mask).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / n_tokens
            loss.backward()
            loss_total += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP).item()
        opt.step()
        record = logged[k]
        assert record["lr"] == pytest.approx(lr, rel=1e-12), f"step {k}: lr"
        assert record["loss"] == pytest.approx(loss_total, abs=1e-5), f"step {k}: loss"
        assert record["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), f"step {k}: gradient norm"
        assert grad_norm > CLIP, f"step {k}: not clipped, so the check says nothing about clipping"
    assert several_documents  # the labels (and, masked, the attention) cross document boundaries

    state = hf.state_dict()
    assert set(final) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, weight in final.items():
        torch.testing.assert_close(state[name], weight, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
