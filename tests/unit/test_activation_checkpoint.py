"""Activation checkpointing changes memory, never the numbers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardline.trainer import Trainer
from tests.unit.test_trainer import params, train_losses


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_ac_mode_equals_no_ac(tiny_config, tmp_path, mode):
    base = Trainer(tiny_config("train.steps=3", run_dir=tmp_path / "none")).build()
    base.train()
    ac = Trainer(tiny_config("train.steps=3", f"memory.activation_checkpoint={mode}", "memory.ac_every=2",
                             run_dir=tmp_path / mode)).build()
    ac.train()
    assert train_losses(tmp_path / mode) == train_losses(tmp_path / "none")
    for name, value in params(base).items():
        torch.testing.assert_close(params(ac)[name], value, rtol=0, atol=0)


def measure(trainer) -> tuple[int, int]:
    """(bytes autograd keeps for backward in forward, matmul FLOPs of forward + backward)."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    batch = trainer.data.train.batch([0, 1, 2, 3])
    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = trainer.runner.loss_sum(batch)
        loss.backward()
    return saved, flops.get_total_flops()


def test_ac_modes_trade_memory_for_recompute(tiny_config, tmp_path):
    result = {mode: measure(Trainer(tiny_config(f"memory.activation_checkpoint={mode}", "memory.ac_every=2",
                                                run_dir=tmp_path / mode)).build())
              for mode in ("none", "op", "selective", "full")}
    saved = {mode: r[0] for mode, r in result.items()}
    flops = {mode: r[1] for mode, r in result.items()}
    assert saved["full"] < saved["selective"] < saved["none"]
    assert flops["none"] < flops["selective"] < flops["full"]  # recomputed forward matmuls
    # op-level keeps matmul outputs, so it recomputes no matmul; what it saves lives in
    # the checkpoint's own cache, which these hooks do not see.
    assert flops["op"] == flops["none"]


@pytest.mark.parametrize("mode", ["full", "op"])
def test_the_split_backward_of_zero_bubble_schedules_defeats_checkpointing(mode):
    """The premise of the layout rule against checkpointing under zbv/dualpipev
    (layout/rules.py `_ac_split_backward`), in torch's own split backward: a fully
    checkpointed block is recomputed in the input pass and again in every weight group's
    pass; an op-level one refuses the second read. If torch changes this, this test fails:
    revisit the rule."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from shardline.models.factory import build_model_on
    from shardline.models.llama import ModelArgs
    from shardline.parallel.activation_checkpoint import apply_ac

    model = build_model_on(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64), "cpu")
    model.init_weights(seed=0)
    apply_ac(model, mode)
    block = model.layers["0"]
    forwards = []
    block.attention.register_forward_hook(lambda *_: forwards.append(1))
    x = torch.randn(2, 16, 32, requires_grad=True)
    cos, sin = model.rotary(torch.arange(16), x.device)
    out = block(x, cos, sin, None)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
    if mode == "op":
        with pytest.raises(RuntimeError, match="backward an extra time"):
            stage_backward_weight(block.parameters(), groups)
        return
    stage_backward_weight(block.parameters(), groups)
    assert all(p.grad is not None for p in block.parameters())
    split_recomputes = len(forwards) - 1
    forwards.clear()
    block(x, cos, sin, None).sum().backward()  # one backward, as 1F1B runs it
    assert len(forwards) - 1 == 1
    assert split_recomputes > 2, split_recomputes  # 1 in the input pass + 1 per weight group (9 here: 10)


def test_op_level_checkpointing_keeps_the_experts_grouped_gemms(tiny_config, tmp_path):
    """An MoE block's expert GEMMs (torch._grouped_mm, on the CPU in fp32 as on Hopper in bf16)
    are saved as the dense matmuls are: any op the policy does not name runs again in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardline.models.moe.layer import grouped_mm_usable

    class GroupedGemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._grouped_mm.default
            return func(*args, **(kwargs or {}))

    if not grouped_mm_usable(torch.zeros(1)):
        pytest.skip("this torch has no CPU grouped GEMM")
    counts = {}
    for mode in ("none", "op"):
        trainer = Trainer(tiny_config("moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_dim=32",
                                      f"memory.activation_checkpoint={mode}", run_dir=tmp_path / mode)).build()
        with GroupedGemms() as mode_counter:
            trainer.runner.loss_sum(trainer.data.train.batch([0, 1])).backward()
        counts[mode] = mode_counter.count
    assert counts["none"] > 0 and counts["op"] == counts["none"], counts
