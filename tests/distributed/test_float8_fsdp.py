"""train.precision = fp8 (torchao float8, emulated on CPU) on 2 real gloo ranks.

FSDP with float8 all-gather (tensorwise): each weight is cast to float8 before it is
gathered, with the scale its whole (unsharded) tensor would get, which the trainer
precomputes in one all-reduce after each optimizer step; so 2 ranks train like one
process up to the order of the sums. The pipeline cut after conversion keeps each
stage's Float8Linear layers, so pp=2 gives one process's losses, under zbv too, whose
split backward runs each float8 matmul's input and weight gradients in separate passes. A run stopped and
resumed from its checkpoint under FSDP float8 all-gather logs the uninterrupted run's
losses, and a rollback logs a cold resume's (the restored weights' scales, not the
discarded ones'). Tensor parallelism (tp=2, sequence and loss parallel) under either recipe gives
one process's losses: its projections stay Float8Linear, now with DTensor weights, and
casting a tp-sharded weight takes the scale of the whole weight (the amax is reduced
across the tp ranks), per tensor or per row, which the workers check on every such
weight. One spawn runs every layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from shardline.config import load_config  # noqa: E402
from shardline.trainer import Trainer  # noqa: E402
from tests.distributed.harness import (ALL_STEPS, PARITY_OVERRIDES, assert_same_params, assert_same_run, losses,
                                       start_ranks)  # noqa: E402
from tests.ports import free_port  # noqa: E402

pytestmark = pytest.mark.slow

# Two blocks (torchao's emulated float8 is the cost of these runs): pp 2 still gets one a stage.
LAYERS = 2
FP8 = [f"model.n_layers={LAYERS}", "train.precision=fp8", "fp8.recipe=tensorwise", "train.eval_interval=0"]
ZBV_DEPTH = ["model.n_layers=4"]  # zbv: 2 stages a rank, a block each
LAYOUTS = {"fsdp2": ["parallel.dp_shard=2", "fp8.fsdp_all_gather=true"],
           "pp2": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
           # zbv: an input pass and a weight pass through each float8 matmul (parallel/float8.py)
           "pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2", *ZBV_DEPTH],
           "tp2": ["parallel.tp=2"],  # sequence and loss parallel on (the defaults)
           "tp2_rowwise": ["parallel.tp=2", "fp8.recipe=rowwise"]}
BLOCK_LINEARS = {"attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}


def gathers_in_float8(trainer: Trainer) -> bool:
    """Whether every Float8Linear weight is FSDP's float8-gathered tensor."""
    linears = [m for m in trainer.model.modules() if isinstance(m, Float8Linear)]
    return bool(linears) and all(isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
                                 for m in linears)


def scales_precomputed(trainer: Trainer) -> bool:
    """Whether the trainer's step left every gathered weight its next scale (one all-reduce)."""
    return all(m.weight._local_tensor._precomputed_scale is not None
               for m in trainer.model.modules() if isinstance(m, Float8Linear))


def scales_checked(trainer: Trainer, gathered: bool) -> None:
    """At a step's first pass, once FSDP's lazy init ran: every float8-gathered weight has its
    scale (else FSDP's hook reduces the amax over its shard ranks: under tp each shard its own)."""
    if gathered and not scales_precomputed(trainer):
        raise AssertionError(f"no float8 scales before the gathers of step {trainer.step + 1}")


def tp_float8_layers(trainer: Trainer) -> dict[str, int]:
    """How many of the block projections are Float8Linear with a tp-sharded DTensor weight
    (of how many), and how many of those cast with the scales of their whole weight."""
    projections = [m for name, m in trainer.model.named_modules() if name.split(".", 2)[-1] in BLOCK_LINEARS]
    sharded = [m for m in projections if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
               and m.weight.placements[0].is_shard()]
    return {"projections": len(projections), "float8_dtensor": len(sharded),
            "whole_weight_scales": sum(_casts_like_whole_weight(m) for m in sharded)}


def _casts_like_whole_weight(layer: Float8Linear) -> bool:
    """Whether this rank's float8 cast of its weight shard equals its slice of the cast of
    the whole weight, as Float8Linear casts it in forward (transposed, the weight config)."""
    config = layer.config.cast_config_weight

    def cast(weight: torch.Tensor) -> torch.Tensor:
        return hp_tensor_to_float8_dynamic(weight.t(), config.target_dtype, layer.linear_mm_config,
                                           gemm_input_role=GemmInputRole.WEIGHT,
                                           scaling_granularity=config.scaling_granularity,
                                           axiswise_dim=get_maybe_axiswise_dim(0, config.scaling_granularity))

    with torch.no_grad():
        got = cast(layer.weight).to_local().to_original_precision()
        whole = cast(layer.weight.full_tensor()).to_original_precision()
        want = distribute_tensor(whole, layer.weight.device_mesh, layer.weight.t().placements,
                                 src_data_rank=None).to_local()
    return torch.equal(got, want)


def _worker(rank: int, port: int, jobs: list[tuple[str, list[str]]], world: int = 2) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    # A collective one rank skips fails here within minutes instead of hanging the suite.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=240))
    try:
        for run_dir, overrides in jobs:
            trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
            gathered = "fp8.fsdp_all_gather=true" in overrides
            if gathered and not gathers_in_float8(trainer):
                raise AssertionError("FSDP does not gather the float8 weights in float8")
            due = trainer.runner._scales_once  # each step: the whole weights' scales before its first gather
            trainer.runner._scales_once = lambda due=due, t=trainer, g=gathered: (due(), scales_checked(t, g))
            trainer.train()
            if gathered and not scales_precomputed(trainer):
                raise AssertionError("no float8 scales were precomputed after the optimizer step")
            if "parallel.tp=2" in overrides:  # trained weights; a file, as a worker's raise hides which check failed
                (Path(run_dir) / f"tp_layers.{rank}.json").write_text(json.dumps(tp_float8_layers(trainer)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_prepared) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    base = [*PARITY_OVERRIDES, f"data.path={small_prepared}", *FP8]
    Trainer(load_config(None, [*base, f"run.dir={root / 'one'}"])).build().train()
    Trainer(load_config(None, [*base, "fp8.recipe=rowwise", f"run.dir={root / 'one_rowwise'}"])).build().train()
    Trainer(load_config(None, [*base, *ZBV_DEPTH, f"run.dir={root / 'one_deeper'}"])).build().train()
    jobs = [(str(root / name), [*base, *extra]) for name, extra in LAYOUTS.items()]
    split = [*base, *LAYOUTS["fsdp2"], "checkpoint.interval=2"]  # the float8-gathered weights saved, loaded
    jobs += [(str(root / "resumed"), [*split, "train.stop_at_step=2"]), (str(root / "resumed"), split)]
    # A rollback from step 4 to the step-2 checkpoint, against a cold resume of the same data.
    four = [*split, "train.steps=4"]
    jobs += [(str(root / "rolled"), [*four, "faults.spike_step=4", "anomaly.action=rollback", "anomaly.min_history=2"]),
             (str(root / "cold"), [*four, "train.skip_batches=[3]", "train.stop_at_step=2"]),
             (str(root / "cold"), [*four, "train.skip_batches=[3]"])]
    start_ranks(_worker, args=(free_port(), jobs), nprocs=2)
    return root


@pytest.fixture(scope="module")
def uneven(tmp_path_factory, small_prepared) -> Path:
    """FSDP over 3 ranks: wk's 32 rows split 11, 11, 10. torchao's float8 all-gather sends each
    shard as it is, so the ranks' messages differed in size (a collective mismatch at the first
    gather); such a layout gathers in bf16. Fresh, stopped and resumed, against one process."""
    root = tmp_path_factory.mktemp("fp8_uneven")
    base = [*PARITY_OVERRIDES, f"data.path={small_prepared}", *FP8, "train.global_batch_size=6"]
    Trainer(load_config(None, [*base, f"run.dir={root / 'one'}"])).build().train()
    three = [*base, "parallel.dp_shard=3", "checkpoint.interval=2"]  # fp8.fsdp_all_gather: true, the default
    jobs = [(str(root / "fsdp3"), three), (str(root / "resumed"), [*three, "train.stop_at_step=2"]),
            (str(root / "resumed"), three)]
    start_ranks(_worker, args=(free_port(), jobs, 3), nprocs=3)
    return root


def test_unequal_fsdp_shards_gather_in_bf16_and_train_like_one_process(uneven):
    assert_same_run(uneven / "fsdp3", uneven / "one", **CLOSE)
    # Bit for bit: the step-3 loss is the restored weights', the parameters carry the restored moments.
    assert losses(uneven / "resumed") == losses(uneven / "fsdp3")
    assert_same_params(uneven / "resumed", uneven / "fsdp3", rtol=0, atol=0)


# Float8 rounds sums taken in another order: losses agree to 2e-3, gradient norms to 2e-2 (measured
# 6e-4 under FSDP, 3e-3 under tp, 9e-3 rowwise), and AdamW carries the rounding of near-zero
# gradients to its whole step size, so parameters agree in norm only to 0.2 (measured 0.07, in
# attention's output projections, which start small). A block's lost gradients move its
# parameters by more than that (they keep their initial values); a gradient doubled
# everywhere doubles the norm.
CLOSE = {"rtol": 2e-3, "grad_rtol": 2e-2, "params_rel": 0.2, "evaluated": False}


def test_fsdp_float8_all_gather_trains_like_one_process(runs):
    assert_same_run(runs / "fsdp2", runs / "one", **CLOSE)


def test_a_float8_gathered_checkpoint_is_plain_tensors_that_export_without_torchao(runs, tmp_path):
    """FSDP's float8 all-gather holds weights and moments in a torchao subclass; saved as such,
    DCP pickles the class, and only a process that imported torchao can read it: `convert`
    could not (nor a resume in bf16). A fresh interpreter exports it."""
    done = subprocess.run([sys.executable, "-m", "shardline", "convert", "to-hf", str(runs / "fsdp2"),
                           str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("run, reference", [("pp2", "one"), ("pp2_zbv", "one_deeper")])
def test_pipeline_cut_after_conversion_matches_one_process(runs, run, reference):
    assert_same_run(runs / run, runs / reference, rtol=1e-4, atol=1e-4, evaluated=False)  # measured 8e-9


def test_fsdp_float8_resume_is_bit_identical(runs):
    records = [json.loads(line) for line in (runs / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "resume"] == [2]  # resumed, not restarted
    assert [r["step"] for r in records if r["kind"] == "train"] == ALL_STEPS
    assert losses(runs / "resumed") == losses(runs / "fsdp2")  # step 3's: the restored weights
    assert_same_params(runs / "resumed", runs / "fsdp2", rtol=0, atol=0)  # and the restored moments


def test_fsdp_float8_rollback_gathers_the_restored_weights_with_their_own_scales(runs):
    """The scales precomputed after step 3's update belong to weights the rollback discards;
    the restored step-2 weights must be gathered with theirs, as a cold resume does."""
    records = [json.loads(line) for line in (runs / "rolled" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["action"]) for r in records if r.get("event") == "anomaly"] == [(4, "rollback")]
    assert losses(runs / "rolled") == losses(runs / "cold")
    assert_same_params(runs / "rolled", runs / "cold", rtol=0, atol=0)


@pytest.mark.parametrize("run, reference", [("tp2", "one"), ("tp2_rowwise", "one_rowwise")])
def test_tensor_parallel_fp8_trains_like_one_process(runs, run, reference):
    assert_same_run(runs / run, runs / reference, **CLOSE)  # as FSDP: the split matmuls' sums in another order


@pytest.mark.parametrize("run", ["tp2", "tp2_rowwise"])
def test_tensor_parallel_projections_are_float8_with_whole_weight_scales(runs, run):
    for rank in (0, 1):
        counts = json.loads((runs / run / f"tp_layers.{rank}.json").read_text())
        n = LAYERS * len(BLOCK_LINEARS)  # every projection a multiple of 16
        assert counts == {"projections": n, "float8_dtensor": n, "whole_weight_scales": n}, (rank, counts)
