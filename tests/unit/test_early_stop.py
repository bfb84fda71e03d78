"""train.early_stop_patience: a run ends once that many evaluations in a row have not lowered its lowest
eval loss, its step saved; a rerun of it trains nothing, one that raises the patience trains on."""

from __future__ import annotations

import json

import pytest

from shardline.errors import ConfigError
from shardline.trainer import Trainer

# lr 2 diverges on the tiny model: its second eval loss is above its first (then they wander down again).
DIVERGING = ("optim.lr=2.0", "train.steps=24", "train.eval_interval=2", "checkpoint.interval=8", "checkpoint.keep=1")


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def first_stall(evals: list[tuple[int, float]], patience: int, min_delta: float = 0.0) -> int | None:
    """The step where `patience` evaluations in a row missed the lowest loss by min_delta, worked out apart."""
    lowest, since = float("inf"), 0
    for step, loss in evals:
        lowest, since = (loss, 0) if loss < lowest - min_delta else (lowest, since + 1)
        if since >= patience:
            return step
    return None


def test_the_run_ends_where_the_eval_loss_stalls_and_stays_ended(tiny_config, tmp_path):
    run = tmp_path / "run"
    Trainer(tiny_config(*DIVERGING, "train.early_stop_patience=1", "checkpoint.keep_best=true")).build().train()
    logged = records(run)
    evals = [(r["step"], r["eval_loss"]) for r in logged if r["kind"] == "eval"]
    stopped = first_stall(evals, 1)
    assert stopped is not None and stopped < 24 and evals[-1][0] == stopped, evals
    assert max(r["step"] for r in logged if r["kind"] == "train") == stopped  # (its last step logged)
    end = [r for r in logged if r.get("event") == "end"][-1]
    assert (end["step"], end["outcome"]) == (stopped, "early_stopped")
    progress = json.loads((run / "progress.json").read_text())
    assert (progress["run_complete"], progress["exit_code"], progress["phase"]) == (True, 0, "ended")
    said = [r for r in logged if r.get("event") == "early_stop"]
    best = min(evals, key=lambda e: e[1])
    assert [(r["step"], r["lowest_at"], r["evaluations_since"]) for r in said] == [(stopped, best[0], 1)]
    # its step saved (not a multiple of checkpoint.interval), beside the best's folder
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{best[0]:06d}", f"step-{stopped:06d}"]
    # A rerun of the same command resumes it and trains nothing: the run is over, and says how to go on
    again = Trainer(tiny_config(*DIVERGING, "train.early_stop_patience=1", "checkpoint.keep_best=true")).build()
    assert (again.step, again.early_stopped_at, again.last_step) == (stopped, stopped, stopped)
    again.train()
    from shardline.dry_run import dry_run  # (the dry run reads it from the checkpoint's meta.json)

    said = dry_run(tiny_config(*DIVERGING, "train.early_stop_patience=1"), 1)[0]
    assert f"nothing to train: it stopped early at step {stopped}" in said, said
    assert "nothing to train" not in dry_run(tiny_config(*DIVERGING, "train.early_stop_patience=2"), 1)[0]
    resume = [r for r in records(run) if r.get("event") == "resume"][-1]
    assert "nothing to train: stopped early at step" in resume["note"] and "early_stop_patience=1" in resume["note"]
    assert [r["outcome"] for r in records(run) if r.get("event") == "end"][-1] == "early_stopped"
    # ... and one that raises the patience trains on from there, its count going on
    Trainer(tiny_config(*DIVERGING, "train.early_stop_patience=100")).build().train()
    assert [r["outcome"] for r in records(run) if r.get("event") == "end"][-1] == "complete"
    assert max(r["step"] for r in records(run) if r["kind"] == "train") == 24


def test_min_delta_counts_only_a_large_enough_drop(tiny_config, tmp_path):
    run = tmp_path / "run"
    # lr 1e-3 lowers the eval loss each time, by far less than 100: every evaluation after the first stalls
    Trainer(tiny_config("optim.lr=1e-3", "train.steps=12", "train.eval_interval=2", "checkpoint.interval=0",
                        "train.early_stop_patience=2", "train.early_stop_min_delta=100")).build().train()
    logged = records(run)
    evals = [(r["step"], r["eval_loss"]) for r in logged if r["kind"] == "eval"]
    assert evals[1][1] < evals[0][1] and first_stall(evals, 2) is None  # (without the delta it trains on)
    assert [r["step"] for r in logged if r.get("event") == "early_stop"] == [6] == [first_stall(evals, 2, 100.0)]
    assert [r["outcome"] for r in logged if r.get("event") == "end"] == ["early_stopped"]


def test_at_the_runs_last_step_it_is_complete_and_an_extension_trains_on(tiny_config, tmp_path):
    """A stall reached at the last step stops nothing: the run ends there as planned, and a relaunch that
    extends it trains on (the review's find: its saved count read as an early stop, so it trained nothing)
    until its next evaluation, which goes on counting."""
    settings = ("optim.lr=1e-3", "train.eval_interval=2", "checkpoint.interval=6", "train.early_stop_patience=2",
                "train.early_stop_min_delta=100")
    Trainer(tiny_config(*settings, "train.steps=6")).build().train()
    logged = records(tmp_path / "run")
    assert not [r for r in logged if r.get("event") == "early_stop"]
    assert [r["outcome"] for r in logged if r.get("event") == "end"] == ["complete"]
    longer = Trainer(tiny_config(*settings, "train.steps=12")).build()
    assert (longer.step, longer.early_stopped_at, longer.eval_trend[2]) == (6, None, 2)
    longer.train()
    ends = [(r["step"], r["outcome"]) for r in records(tmp_path / "run") if r.get("event") == "end"]
    assert ends[-1] == (8, "early_stopped")  # (its first evaluation: 3 in a row)


def test_a_diverged_evaluation_counts_neither_way(tiny_config, tmp_path):
    trainer = Trainer(tiny_config("train.early_stop_patience=1", "checkpoint.interval=0")).build()
    try:
        trainer.eval_trend = (5.0, 2, 0)
        assert not trainer._stalled(float("nan"), 4) and not trainer._stalled(float("inf"), 4)
        assert trainer.eval_trend == (5.0, 2, 0) and trainer.early_stopped_at is None
        assert trainer._stalled(6.0, 6) and trainer.early_stopped_at == 6  # (a finite one above: the stop)
    finally:
        trainer.close()


def test_a_checkpoint_saved_before_the_spread_evaluation_counts_anew(tiny_config, tmp_path):
    """Its evaluations read the split's first sequences: its best loss and stall count are not compared with
    the spread evaluation's (a false best, or one never beaten); the best's folder stays kept meanwhile."""
    import torch

    from tests.conftest import resealed

    run = tmp_path / "run"
    settings = (*DIVERGING, "checkpoint.keep_best=true", "train.early_stop_patience=5", "checkpoint.interval=4")
    Trainer(tiny_config(*settings, "train.stop_at_step=4")).build().train()
    meta = (run / "checkpoints" / "step-000004" / "meta.json").read_text()
    json.loads(meta, parse_constant=lambda c: pytest.fail(f"meta.json holds {c}: not JSON"))
    folder = run / "checkpoints" / "step-000004"
    state = torch.load(folder / "trainer" / "rank0.pt", weights_only=True)
    assert state.pop("eval_order") == "spread" and state["best_eval"][1] == 2 and state["eval_trend"][2] == 1
    torch.save(state, folder / "trainer" / "rank0.pt")
    resealed(folder, "trainer/rank0.pt")
    resumed = Trainer(tiny_config(*settings)).build()
    try:
        assert resumed.best_eval == (float("inf"), 2) and resumed.eval_trend == (float("inf"), 0, 0)  # (its step
        assert resumed.checkpointer.keep_also == [run / "checkpoints" / "step-000002"]  # kept: across resumes too)
    finally:
        resumed.close()
    said = [r for r in records(run) if r.get("event") == "eval_changed"]
    assert len(said) == 1 and "count anew" in said[0]["note"]


@pytest.mark.parametrize("settings, message", [
    (("train.early_stop_patience=-1",), "train.early_stop_patience=-1 is invalid: must be >= 0"),
    (("train.early_stop_patience=3", "train.eval_interval=0"),
     "train.early_stop_patience=3 is invalid: needs train.eval_interval > 0"),
    (("train.early_stop_min_delta=-0.1",), "train.early_stop_min_delta=-0.1 is invalid: must be >= 0"),
])
def test_bad_settings_are_refused(tiny_config, settings, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*settings).check()


def test_the_evaluation_a_stop_left_owed_can_end_the_run(tiny_config, tmp_path):
    """The resumed run makes up the evaluation a stop skipped before training: a stall there ends the run at
    once, its step saved again so that the checkpoint says so (a rerun trains nothing)."""
    run = tmp_path / "run"
    Trainer(tiny_config(*DIVERGING, "train.stop_at_step=3", "train.eval_interval=3", "checkpoint.interval=3")
            ).build().train()  # (evaluated at 3: its loss the lowest, none since)
    resumed = Trainer(tiny_config(*DIVERGING, "train.early_stop_patience=1")).build()
    assert resumed.step == 3 and resumed.early_stopped_at is None and resumed.eval_trend[1:] == (3, 0)
    resumed.eval_owed, resumed.eval_trend = True, (0.0, 2, 0)  # (as if step 3's evaluation was skipped by a stop)
    resumed.train()
    logged = records(run)
    assert [r["step"] for r in logged if r.get("event") == "early_stop"] == [3]
    assert [(r["step"], r["outcome"]) for r in logged if r.get("event") == "end"][-1] == (3, "early_stopped")
    assert max(r["step"] for r in logged if r["kind"] == "train") == 3
    again = Trainer(tiny_config(*DIVERGING, "train.early_stop_patience=1")).build()
    assert (again.step, again.early_stopped_at, again.eval_trend[2]) == (3, 3, 1)
    again.close()
