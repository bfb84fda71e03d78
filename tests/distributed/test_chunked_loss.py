"""train.loss_chunk_tokens trains exactly like the plain loss: in one process, under tensor
parallelism with loss parallelism (vocab-sharded chunks), on a pipeline's last stage, and
under FSDP with activation checkpointing (gloo, world 2)."""

from __future__ import annotations

import pytest

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.distributed.harness import PARITY_OVERRIDES, assert_same_run, losses, run_world

# 24 does not divide a micro-batch's 64 tokens: the last chunk is short.
CHUNK = "train.loss_chunk_tokens=24"
LAYOUTS = {
    "tp2_sp_lossparallel": ["parallel.tp=2"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "fsdp2_ac_full": ["parallel.dp_shard=2", "memory.activation_checkpoint=full"],
}


def _base(corpus):
    """The parity setting, two steps long (each layout's run costs its steps)."""
    return [*PARITY_OVERRIDES, f"data.path={corpus}", "train.steps=2", "train.eval_interval=2", "checkpoint.interval=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_prepared):
    """The plain loss in one process (the reference), the chunked one, and the layouts chunked."""
    root = tmp_path_factory.mktemp("chunked")
    for name, extra in {"plain": [], "single": [CHUNK]}.items():
        Trainer(load_config(None, [*_base(small_prepared), *extra, f"run.dir={root / name}"])).build().train()
    run_world(2, [(root / name, [*_base(small_prepared), CHUNK, *extra]) for name, extra in LAYOUTS.items()])
    return root


def test_chunked_loss_trains_like_the_plain_loss_in_one_process(runs):
    assert sorted(losses(runs / "single")) == [1, 2]
    assert_same_run(runs / "single", runs / "plain")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_loss_under_a_layout_matches_the_plain_single_process(runs, layout):
    assert_same_run(runs / layout, runs / "plain")
