"""ZeRO-1 composed with tensor and pipeline parallelism trains exactly like one process.

parallel.zero=1 with tp and pp: optimizer states sharded over the dp group of each
(tp, pp) coordinate, gradients reduce-scattered by the optimizer, parameters
all-gathered after the update (shardline/parallel/zero1.py). Losses, the clipped
gradient norms and final parameters are compared with one process (1e-5, fp32), and
checkpoints are resumed across world sizes both ways: a zero1 x tp2 checkpoint by one
process, and one process's checkpoint (tied embeddings) by zero1 x tp2 x pp2 on 8 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.cli import main
from shardline.config import load_config
from shardline.trainer import Trainer
from tests.distributed.harness import PARITY_OVERRIDES, assert_same_grad_norms, assert_same_run, losses, run_world

ZERO1 = ["parallel.zero=1", "parallel.dp_shard=2"]
LAYOUTS_4 = {
    "zero1_tp2": [*ZERO1, "parallel.tp=2"],
    "zero1_pp2": [*ZERO1, "parallel.pp=2"],
}
LAYOUTS_8 = {"zero1_tp2_pp2": [*ZERO1, "parallel.tp=2", "parallel.pp=2"]}
# Tied embeddings: the last stage's copy is reduce-scattered and updated like the first's,
# and its state is saved under the embedding's name (here: loaded from one process's).
TIED_TP2_PP2 = [*LAYOUTS_8["zero1_tp2_pp2"], "model.tie_embeddings=1"]
HALF = "train.stop_at_step=2"


def _base(corpus) -> list[str]:
    return [*PARITY_OVERRIDES, f"data.path={corpus}"]


def _train(corpus, run_dir, *extra: str) -> None:
    """One single-process run (or half of one) in this process."""
    Trainer(load_config(None, [*_base(corpus), *extra, f"run.dir={run_dir}"])).build().train()


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_corpus):
    root = tmp_path_factory.mktemp("zero1_reference")
    _train(small_corpus, root / "plain")
    _train(small_corpus, root / "tied", "model.tie_embeddings=1")
    return root


@pytest.fixture(scope="module")
def world4(tmp_path_factory, small_corpus):
    """The layouts of 4 ranks, and a zero1 x tp2 first half that one process then finishes."""
    root = tmp_path_factory.mktemp("zero1_world4")
    jobs = [(root / name, [*_base(small_corpus), *extra]) for name, extra in LAYOUTS_4.items()]
    jobs.append((root / "zero1_tp2_to_single", [*_base(small_corpus), *LAYOUTS_4["zero1_tp2"], HALF]))
    run_world(4, jobs)
    _train(small_corpus, root / "zero1_tp2_to_single")
    return root


def _emit_zero1_tp2_pp2(corpus, path: Path) -> None:
    """What `shardline plan` ranks best for 8 CPU ranks with zero=1, tp=2, pp=2 pinned, as a config."""
    small = [o for o in PARITY_OVERRIDES if o.split("=")[0].split(".")[0] in ("model", "optim", "data", "metrics")]
    code = main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "8", "--seq-len", "32", "--global-batch", "16",
                 "--fix", "zero=1,tp=2,pp=2", "--emit-config", str(path), f"--data.path={corpus}",
                 "--train.steps=2", "--checkpoint.interval=2", *(f"--{o}" for o in small)])
    assert code == 0


@pytest.fixture(scope="module")
def world8(tmp_path_factory, small_corpus):
    """zero1 x tp2 x pp2; one tied process's first half that it finishes (tied); and the
    plan `shardline plan --emit-config` writes for zero=1, tp=2, pp=2, with its one-process twin."""
    root = tmp_path_factory.mktemp("zero1_world8")
    _train(small_corpus, root / "single_tied_to_zero1_tp2_pp2", "model.tie_embeddings=1", HALF)
    _emit_zero1_tp2_pp2(small_corpus, root / "plan.toml")
    one = [f"parallel.{k}=1" for k in ("dp_shard", "tp", "pp")]
    Trainer(load_config(root / "plan.toml", [*one, f"run.dir={root / 'plan_single'}"])).build().train()
    jobs = [(root / name, [*_base(small_corpus), *extra]) for name, extra in LAYOUTS_8.items()]
    jobs.append((root / "single_tied_to_zero1_tp2_pp2", [*_base(small_corpus), *TIED_TP2_PP2]))
    jobs.append((root / "plan", [], root / "plan.toml"))
    run_world(8, jobs)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_zero1_with_tp_or_pp_matches_single_process(world4, references, layout):
    assert_same_run(world4 / layout, references / "plain")
    assert_same_grad_norms(world4 / layout, references / "plain")  # the norm sums the slices over dp_shard


def test_zero1_tp2_pp2_on_8_ranks_matches_single_process(world8, references):
    assert_same_run(world8 / "zero1_tp2_pp2", references / "plain")
    assert_same_grad_norms(world8 / "zero1_tp2_pp2", references / "plain")


def test_emitted_zero1_tp2_pp2_plan_trains_like_one_process(world8):
    plan = load_config(world8 / "plan.toml").parallel
    assert (plan.zero, plan.tp, plan.pp, plan.dp_shard) == (1, 2, 2, 2), plan
    assert sorted(losses(world8 / "plan")) == [1, 2]
    assert_same_run(world8 / "plan", world8 / "plan_single")


@pytest.mark.parametrize("world, name", [("world4", "zero1_tp2_to_single"), ("world8", "single_tied_to_zero1_tp2_pp2")])
def test_resume_between_zero1_with_tp_pp_and_one_process(request, references, world, name):
    run = request.getfixturevalue(world) / name
    reference = references / ("tied" if "tied" in name else "plain")
    assert sorted(losses(run)) == [1, 2, 3, 4]  # two halves, one log
    assert_same_run(run, reference)
    assert_same_grad_norms(run, reference)
