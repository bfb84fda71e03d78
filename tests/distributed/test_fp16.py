"""fp16 dynamic loss scaling under FSDP, PP and TP on real gloo ranks (and bf16 under FSDP).

The overflow verdict is all-reduced, so every rank skips or applies a step together,
and the data-parallel factor is applied after the reduction, so the fp16 backward sees
the values of one process. One spawn runs every layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.distributed.harness import PARITY_OVERRIDES, assert_same_run, losses, start_ranks
from tests.ports import free_port

FP16 = ["train.precision=fp16"]
LAYOUTS = {
    "fsdp2": ["parallel.dp_shard=2"],
    "pp2": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "tp2": ["parallel.tp=2"],
    # ZeRO-1: the optimizer's slices get their gradients before the scaler unscales them.
    "zero1": ["parallel.dp_shard=2", "parallel.zero=1"],
}
# faults.overflow_step: an inf written into one gradient element of rank 0 only, at step 2, after the
# backward (as an fp16 overflow leaves it): under FSDP one rank's shard, under PP the first stage's.
INJECTED = {"fsdp2_inf": LAYOUTS["fsdp2"], "pp2_inf": LAYOUTS["pp2"]}
INJECT_STEP = 2
DRILL = [f"faults.overflow_step={INJECT_STEP}"]


def _fp32_drill(corpus):
    """fp32 with the drill: every replica's gradients hold the inf (as an all-reduce spreads one), so every
    rank's anomaly check skips the step (a DDP norm is reduced over no rank: rank 0's alone diverged)."""
    return [*PARITY_OVERRIDES, f"data.path={corpus}", "train.precision=fp32", "anomaly.action=skip", *DRILL]


def _base(corpus):
    return [*PARITY_OVERRIDES, f"data.path={corpus}", *FP16]


def _bf16(corpus):
    return [*PARITY_OVERRIDES, f"data.path={corpus}", "train.precision=bf16"]


def _train(overrides: list[str], run_dir: Path, rank: int) -> None:
    trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
    trainer.train()
    record = {"skipped": trainer.scaler.skipped_steps, "scale": trainer.scaler.scaler.get_scale()}
    (Path(run_dir) / f"scaler-rank{rank}.json").write_text(json.dumps(record))


def _worker(rank: int, world: int, port: int, jobs: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for run_dir, overrides in jobs:
            _train(overrides, Path(run_dir), rank)
    finally:
        dist.destroy_process_group()


def _scalers(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("scaler-rank*.json"))]


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("fp16_reference")
    for name, drill in (("plain", []), ("inf", DRILL)):
        _train([*_base(small_prepared), *drill], root / name, rank=0)
    _train(_bf16(small_prepared), root / "bf16", rank=0)
    _train(_fp32_drill(small_prepared), root / "fp32_drill", rank=0)
    return root


@pytest.fixture(scope="module")
def world2(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("fp16_world2")
    jobs = [(str(root / name), [*_base(small_prepared), *extra]) for name, extra in LAYOUTS.items()]
    jobs += [(str(root / name), [*_base(small_prepared), *extra, *DRILL]) for name, extra in INJECTED.items()]
    jobs.append((str(root / "fsdp2_bf16"), [*_bf16(small_prepared), *LAYOUTS["fsdp2"]]))
    jobs.append((str(root / "ddp2_fp32_drill"), [*_fp32_drill(small_prepared), "parallel.dp_replicate=2",
                                                 "parallel.dp_shard=1"]))
    start_ranks(_worker, args=(2, free_port(), jobs), nprocs=2)
    return root


def test_fp16_pipeline_matches_single_process(world2, references):
    # Losses within 1e-5; as under FSDP, a rarely seen embedding row may differ by ~2e-5
    # (fp16-rounded gradients whose tiny sum Adam's normalisation amplifies), hence atol.
    assert_same_run(world2 / "pp2", references / "plain", atol=1e-4, grad_rtol=1e-4)


def test_fp16_fsdp_matches_single_process(world2, references):
    # Losses within 1e-5; a few rarely seen embedding rows differ by up to ~3e-5, and one element of
    # 32,768 by 1.3e-4 on the batches of 2026-12-07's held-out split (the fp32 reduction order of
    # fp16-rounded gradients near zero, whose sign Adam's normalisation turns into a step of ~lr), hence atol.
    assert_same_run(world2 / "fsdp2", references / "plain", atol=2e-4, grad_rtol=1e-4)


def test_fp16_zero1_matches_single_process(world2, references):
    assert_same_run(world2 / "zero1", references / "plain", atol=2e-4, grad_rtol=1e-4)  # as FSDP's: fp16-rounded sums


def test_fp16_tensor_parallel_trains_like_single_process(world2, references):
    # TP sums fp16 partial matmul outputs across ranks where one process rounds once: losses
    # agree to ~1e-5, gradient norms to ~1e-3 (measured 7e-4; bound 2e-3), parameters in norm
    # to ~1e-2 (measured 7e-3 in attention's output projection, which starts small: AdamW moves
    # elements whose gradients are rounding noise by its step size; bound 0.03). A lost
    # gradient moves them further; a doubled one shows in the gradient norm.
    assert_same_run(world2 / "tp2", references / "plain", rtol=5e-5, grad_rtol=2e-3, params_rel=0.03)


def test_no_overflow_means_no_skipped_step(world2, references):
    for run in (references / "plain", world2 / "fsdp2", world2 / "pp2", world2 / "tp2", world2 / "zero1"):
        assert [s["skipped"] for s in _scalers(run)] == [0] * len(_scalers(run)), run


@pytest.mark.parametrize("layout", list(INJECTED))
def test_overflow_on_one_rank_skips_the_step_on_every_rank(world2, references, layout):
    want = _scalers(references / "inf")[0]
    assert want["skipped"] == 1 and want["scale"] == 2.0**15  # one skip halved the initial 2^16
    assert _scalers(world2 / layout) == [want, want]  # both ranks skipped and halved, not only rank 0
    events = [json.loads(line) for line in (world2 / layout / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "skipped_step"] == [INJECT_STEP]  # logged by rank 0
    assert_same_run(world2 / layout, references / "inf", atol=1e-4, grad_rtol=1e-4)


def test_bf16_fsdp_trains_like_single_process_to_bf16s_precision(world2, references):
    """FSDP2 gathers bf16 weights where one process casts its fp32 ones under autocast: the
    matmuls see the same values, the norms' weights are rounded to bf16 (one process keeps
    them fp32), so the losses agree to ~1e-4 (measured 7e-5 at step 3), not bit for bit."""
    got, want = losses(world2 / "fsdp2_bf16"), losses(references / "bf16")
    assert len(want) >= 3 and max(abs(got[s] - want[s]) for s in want) > 0  # bf16 gathers: not bit-identical
    # Gradient norms measured within 3e-3, parameters in norm within 0.035 (as under fp16 TP).
    assert_same_run(world2 / "fsdp2_bf16", references / "bf16", rtol=1e-3, grad_rtol=5e-3, params_rel=0.1)


def test_the_overflow_drill_outside_fp16_skips_the_step_on_every_replica(world2, references):
    events = [json.loads(line) for line in (world2 / "ddp2_fp32_drill" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["anomaly"], e["action"]) for e in events if e.get("event") == "anomaly"] == [
        (INJECT_STEP, "nonfinite_grad_norm", "skip")]
    assert_same_run(world2 / "ddp2_fp32_drill", references / "fp32_drill")  # (no replica took the update)
