"""train.compile under tensor parallelism on real gloo ranks: compiled blocks train like eager ones.

The compiled run must also show that its blocks ran compiled code: each block has its
compiled call, dynamo captured graphs and broke none of them (a block that fell back to
eager, whole or in part, fails), and the embedding's AsyncCollectiveTensor output is
resolved before the first block (without that, backward fails under tp).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardline.config import load_config
from tests.distributed.harness import ALL_STEPS, PARITY_OVERRIDES, free_port, losses

TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch._dynamo.utils import counters

    from shardline.trainer import Trainer

    try:
        for run_dir, overrides in jobs:
            counters.clear()
            trainer = Trainer(load_config(None, [*overrides, f"run.dir={run_dir}"])).build()
            trainer.train()
            if rank == 0:
                seen = {"compiled_blocks": [b._compiled_call_impl is not None for b in trainer.model.layers.values()],
                        "graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"])}
                (Path(run_dir) / "compiled.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two ranks compiling with inductor on 2 CPU cores: ~40 s
def test_compiled_tensor_parallel_with_sequence_parallel_trains_like_eager(tmp_path, small_corpus):
    base = [*PARITY_OVERRIDES, f"data.path={small_corpus}", *TP_SP]
    jobs = [(str(tmp_path / "eager"), base), (str(tmp_path / "compiled"), [*base, "train.compile=true"])]
    mp.start_processes(_worker, args=(2, free_port(), jobs), nprocs=2, start_method="spawn")
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(eager) == sorted(compiled) == ALL_STEPS
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5), (step, compiled, eager)
    seen = json.loads((tmp_path / "compiled" / "compiled.json").read_text())
    assert all(seen["compiled_blocks"]) and seen["compiled_blocks"], seen
    assert seen["graphs"] >= 1 and not seen["breaks"], seen  # every block one graph, redistributions included
    assert json.loads((tmp_path / "eager" / "compiled.json").read_text())["graphs"] == 0
