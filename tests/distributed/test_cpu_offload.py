"""CPU offload (FSDP2's CPUOffloadPolicy) through the trainer, on CPU: the same run with
and without offload, in one process (and resumed) and on 2 gloo ranks where no rank shares
its states (shard degree 1: HSDP 2 x 1).

On a CPU device offload saves nothing (the states are in host memory already) but runs
the path a GPU runs: FSDP2 even at shard degree 1 (a one-rank group and mesh in one
process, made by the trainer itself), the offload policy (without pinned memory), the
optimizer picked for host tensors, clipping, checkpoints and resume. The host<->GPU
copies themselves are tests/gpu's (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from shardline.config import load_config
from shardline.models.moe.layer import moe_layers
from shardline.trainer import Trainer
from tests.distributed.harness import (ALL_STEPS, PARITY_OVERRIDES, assert_same_run, gloo_rank, losses,
                                       start_ranks)
from tests.ports import free_port

OFFLOAD = "memory.cpu_offload=true"
MOE = ["model.preset=tiny-moe", "moe.num_experts=4", "moe.expert_ffn_dim=32"]
LAYOUTS_2 = {
    "hsdp2x1": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],  # DDP's layout, offloaded: HSDP, shard 1
    # Experts split over tp are their own FSDP unit (over a size-1 shard dim): offloaded too.
    "moe_tp2": [*MOE, "parallel.tp=2"],
    # Each stage's blocks and ends are FSDP units over a one-rank shard dimension beside pp.
    "pp2": ["parallel.pp=2"],
    "tp2": ["parallel.tp=2"],  # DTensor TP shards, FSDP over a one-rank dimension beside tp
    "fsdp2": ["parallel.dp_shard=2"],  # offload where FSDP shards anyway
}


def offload_report(trainer: Trainer) -> dict:
    """What says the states really are FSDP2's on the host, with the offload policy."""
    pipeline = trainer.runner.pipeline  # under pp each local stage module is the root unit, outside the model
    modules = [*trainer.model.modules(), *(pipeline.modules if pipeline else [])]
    units = [m for m in modules if isinstance(m, FSDPModule)]
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in units}
    params = list(trainer.model.parameters())
    states = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
    return {"units": len(units), "blocks": len(trainer.model.layers), "policies": sorted(policies),
            "moe_blocks": len(list(moe_layers(trainer.model))),
            "params_on_host_dtensors": all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params),
            "states": len(states),
            "states_on_host_dtensors": all(isinstance(v, DTensor) and v.device.type == "cpu" for v in states),
            "optimizer": [type(trainer.optimizer).__name__, bool(trainer.optimizer.defaults.get("fused"))],
            "shard_mesh": list(next(iter(params)).device_mesh.shape)}


def _train_and_report(run_dir: Path, overrides: list[str]) -> None:
    trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
    trainer.train()  # the optimizer states exist after the first step
    if dist.get_rank() == 0:
        (run_dir / "offload.json").write_text(json.dumps(offload_report(trainer)))


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    with gloo_rank(rank, world, port):
        for run_dir, overrides in jobs:
            _train_and_report(Path(run_dir), overrides)


def _assert_offloaded(report: dict, mesh: list[int], expert_units: int = 0) -> None:
    assert report["units"] == report["blocks"] + 1 + expert_units, report  # each block, the root (the experts)
    assert report["policies"] == [CPUOffloadPolicy.__name__], report
    assert report["params_on_host_dtensors"] and report["states"] and report["states_on_host_dtensors"], report
    assert report["optimizer"] == ["WindowedAdamW", True] and report["shard_mesh"] == mesh, report  # fused, on the host


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("offload")
    # optim.implementation=auto: what the trainer picks for host states (the windowed fused kernel) is checked.
    base = [*PARITY_OVERRIDES, "optim.implementation=auto", f"data.path={small_prepared}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks run: tiny matmuls on shared cores only slow down with more
    Trainer(load_config(None, [*base, f"run.dir={root / 'reference'}"])).build().train()
    Trainer(load_config(None, [*base, *MOE, f"run.dir={root / 'moe_reference'}"])).build().train()
    assert not dist.is_initialized()
    try:
        # One process, no torchrun: the trainer makes its one-rank group and mesh itself. The
        # second run stops at step 2 and is resumed: offloaded states saved and loaded back.
        trainer = Trainer(load_config(None, [*base, OFFLOAD, f"run.dir={root / 'one'}"])).build()
        assert dist.is_initialized() and dist.get_world_size() == 1
        trainer.train()
        (root / "one" / "offload.json").write_text(json.dumps(offload_report(trainer)))
        for extra in (["train.stop_at_step=2"], []):
            Trainer(load_config(None, [*base, OFFLOAD, *extra, f"run.dir={root / 'resumed'}"])).build().train()
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    jobs = [(str(root / name), [*base, OFFLOAD, *extra]) for name, extra in LAYOUTS_2.items()]
    start_ranks(_worker, args=(2, free_port(), jobs), nprocs=2)
    return root


def test_one_process_offload_trains_like_no_offload(runs):
    _assert_offloaded(json.loads((runs / "one" / "offload.json").read_text()), mesh=[1])
    events = [json.loads(line).get("event") for line in (runs / "one" / "metrics.jsonl").read_text().splitlines()]
    assert "cpu_offload_saves_nothing" in events  # said once, in the log, on a CPU device
    assert_same_run(runs / "one", runs / "reference")


def test_offloaded_states_resume(runs):
    assert sorted(losses(runs / "resumed")) == ALL_STEPS
    assert_same_run(runs / "resumed", runs / "reference")


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_two_rank_offload_matches_one_process(runs, layout):
    # The first parameter's mesh: dp_replicate x dp_shard; tp; the one-rank shard dimension.
    mesh = {"hsdp2x1": [2, 1], "moe_tp2": [1, 2], "pp2": [1], "tp2": [1, 2], "fsdp2": [2]}[layout]
    report = json.loads((runs / layout / "offload.json").read_text())
    _assert_offloaded(report, mesh=mesh, expert_units=report["moe_blocks"])
    assert_same_run(runs / layout, runs / ("moe_reference" if layout.startswith("moe") else "reference"))
