"""train.compile under tensor and pipeline parallelism on real gloo ranks: compiled blocks
train like eager ones.

Compiled runs must also show that their blocks ran compiled code: each block has its
compiled call (or, under activation checkpointing, a compiled forward the checkpoint
wraps), dynamo captured graphs and broke none of them (a block that fell back to eager,
whole or in part, fails), except, under the zero-bubble schedule, at its Linear layers,
which it runs eagerly on purpose (parallel/compile.py). Without the embedding's AsyncCollectiveTensor output resolved
before the first block, backward fails; with the checkpoint traced into the block, too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._functorch.config

from shardline.config import load_config
from shardline.parallel.compile import config_problem as compile_problem
from tests.distributed.harness import ALL_STEPS, PARITY_OVERRIDES, free_port, gloo_rank, losses, start_ranks

TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    from torch._dynamo.utils import counters

    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port):
        for run_dir, overrides in jobs:
            torch._dynamo.reset()  # each run compiles its own graphs, counted afresh
            counters.clear()
            trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
            trainer.train()
            if rank == 0:
                seen = {"compiled_blocks": [_compiled(b) for b in trainer.model.layers.values()],
                        "graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"]),
                        "aot_cache": torch._functorch.config.enable_autograd_cache}
                (Path(run_dir) / "compiled.json").write_text(json.dumps(seen))


def _compiled(block: torch.nn.Module) -> bool:
    """The block's call is compiled, or a forward somewhere under its checkpoint wrapper is."""
    forward = block.forward
    while forward is not None and not hasattr(forward, "_torchdynamo_orig_callable"):
        forward = getattr(forward, "__wrapped__", None)
    return block._compiled_call_impl is not None or forward is not None


ZBV = ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"]


@pytest.mark.slow  # two ranks compiling with inductor on 2 CPU cores: ~75 s with a cold cache
def test_compiled_tensor_and_pipeline_parallel_train_like_eager(tmp_path, small_prepared):
    """TP with SP (plain and under op AC), and the zero-bubble pipeline, whose split backward
    runs its weight pass over the compiled regions between eager Linear layers."""
    base = [*PARITY_OVERRIDES, f"data.path={small_prepared}"]
    runs = {"compiled": ("eager", [*TP_SP, "train.compile=true"]),
            "compiled_op_ac": ("eager", [*TP_SP, "train.compile=true", "memory.activation_checkpoint=op"]),
            "compiled_zbv": ("eager_zbv", [*ZBV, "train.compile=true"])}
    eager = {"eager": TP_SP, "eager_zbv": ZBV}
    if compile_problem(True, 2, "zbv"):  # torch < 2.13 refuses it at preflight (test_compile.py)
        del runs["compiled_zbv"], eager["eager_zbv"]
    jobs = [*[(str(tmp_path / n), [*base, *extra]) for n, extra in eager.items()],
            *[(str(tmp_path / n), [*base, *extra]) for n, (_, extra) in runs.items()]]
    start_ranks(_worker, args=(2, free_port(), jobs), nprocs=2)
    for name in eager:
        assert sorted(losses(tmp_path / name)) == ALL_STEPS, name
        assert json.loads((tmp_path / name / "compiled.json").read_text())["graphs"] == 0, name
    for name, (reference, extra) in runs.items():
        want, compiled = losses(tmp_path / reference), losses(tmp_path / name)
        assert sorted(compiled) == ALL_STEPS, name
        for step in want:
            assert compiled[step] == pytest.approx(want[step], rel=1e-5), (name, step, compiled, want)
        seen = json.loads((tmp_path / name / "compiled.json").read_text())
        assert seen["compiled_blocks"] and all(seen["compiled_blocks"]), (name, seen)
        assert seen["graphs"] >= 1, (name, seen)
        if name == "compiled_zbv":  # the Linear layers run eagerly between compiled regions, nothing else breaks
            assert seen["breaks"] and all("Linear.forward" in reason for reason in seen["breaks"]), (name, seen)
        else:  # one graph a block, collectives included
            assert not seen["breaks"], (name, seen)
        if "parallel.tp=2" in extra:
            assert seen["aot_cache"] is False, (name, seen)  # a rank must not load another rank's graph
