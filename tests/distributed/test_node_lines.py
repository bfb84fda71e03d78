"""A node other than rank 0's says on its console that it joined the run, and how it ended: on a
healthy run its log (a Slurm task's output) was empty, and an operator could not tell it was alive."""

from __future__ import annotations

import contextlib
import io
import os

import torch.multiprocessing as mp

from tests.distributed.harness import PARITY_OVERRIDES, gloo_rank, start_ranks
from tests.ports import free_port


def _worker(rank: int, world: int, port: int, run_dir: str, data: str, per_node: int, said, extra: list) -> None:
    from shardline.config import load_config
    from shardline.errors import AnomalyHalt
    from shardline.trainer import Trainer

    with gloo_rank(rank, world, port):
        os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node))
        cfg = load_config(None, [*PARITY_OVERRIDES, f"run.dir={run_dir}", f"data.path={data}", "train.steps=2",
                                 "checkpoint.interval=0", "train.eval_interval=0", *extra])
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(AnomalyHalt):
            Trainer(cfg).build().train()
        said.put((rank, out.getvalue()))


def _lines(tmp_path, small_corpus, per_node: int, extra: tuple = ()) -> dict[int, str]:
    said = mp.get_context("spawn").SimpleQueue()
    run_dir = str(tmp_path / f"run{per_node}{len(extra)}")
    start_ranks(_worker, args=(2, free_port(), run_dir, str(small_corpus), per_node, said, list(extra)), nprocs=2)
    found = {}
    while not said.empty():
        rank, text = said.get()
        found[rank] = text
    return found


def test_a_second_node_says_it_joined_and_how_it_ended_and_one_nodes_ranks_say_nothing(tmp_path, small_corpus):
    two_nodes = _lines(tmp_path, small_corpus, per_node=1)
    lines = [line for line in two_nodes[1].splitlines() if line.startswith("shardline: ")]
    assert len(lines) == 2, two_nodes[1]
    assert "(ranks 1-1) joined the run in " in lines[0] and "at step 0 (2 ranks)" in lines[0], lines
    assert lines[1].endswith("(ranks 1-1) ended at step 2: complete"), lines
    assert "joined" not in two_nodes[0]  # (rank 0's node logs the run)
    one_node = _lines(tmp_path, small_corpus, per_node=2)
    assert "joined" not in one_node[1] and "ended at" not in one_node[1], one_node[1]


def test_a_second_node_says_a_halt_ended_its_run(tmp_path, small_corpus):
    """A halt (an anomaly the run stops at) ends the node's account too: its last line said it joined."""
    halted = _lines(tmp_path, small_corpus, per_node=1, extra=("faults.nan_step=2", "anomaly.action=halt"))
    lines = [line for line in halted[1].splitlines() if line.startswith("shardline: ")]
    assert lines[-1].endswith("(ranks 1-1) ended at step 1: halted (nonfinite_loss at step 2)"), lines
