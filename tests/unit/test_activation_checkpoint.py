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
            loss = trainer.steps.loss_sum(batch)
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
