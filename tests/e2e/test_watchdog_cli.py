"""The watchdog wired into `shardline train` under torchrun: hangs and stragglers."""

from __future__ import annotations

import json

import pytest

from shardline.config import load_config
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.e2e.test_cli import shardline
from tests.e2e.test_torchrun import torchrun

# Detection times and straggler ratios are held to the watchdog's contract: no test beside these.
pytestmark = pytest.mark.alone


def events(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "event"]


def test_hang_is_detected_dumped_and_named(tmp_path, small_prepared):
    run = tmp_path / "run"
    out = torchrun(2, *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "parallel.dp_replicate=2", "parallel.dp_shard=1", "watchdog.timeout_s=3",
        "faults.hang_rank=1", "faults.hang_step=5")])
    assert out.returncode != 0
    hang = [e for e in events(run) if e["event"] == "hang"]
    # Rank 1 is named; the healthy rank may be named too when its stack, sampled while it
    # waits, is not inside torch.distributed (the watchdog's heuristic; see hangs.py).
    assert hang and 1 in hang[0]["stopped_ranks"] and hang[0]["step"] == 5, out.stderr[-2000:]
    dump = next(run.glob("hang-*"))
    report = json.loads((dump / "report.json").read_text())
    assert 1 in report["stopped_ranks"]
    assert "before_step" in (dump / "rank1.txt").read_text()  # where the hung rank sleeps
    assert not (run / ".lock").exists()  # the exit (os._exit, no atexit) freed the run dir for a rerun elsewhere


@pytest.mark.parametrize("slow", [1, 0])
def test_slow_rank_is_reported_as_straggler(tmp_path, small_prepared, slow):
    # Rank 0's watchdog judges peers once per poll (1 s): the run must last a few polls,
    # or a fast machine finishes before the slow steps are ever compared (at 60 steps one clean
    # CI run of 2026-12-07 named no straggler; 100 gives it a few more polls).
    run = tmp_path / "run"
    out = torchrun(2, *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "parallel.dp_replicate=2", "parallel.dp_shard=1", "watchdog.timeout_s=60",
        "watchdog.straggler_steps=3", f"faults.slow_rank={slow}", "faults.slow_factor=4", "train.steps=100")])
    # On failure show the workers' own errors, not only torchrun's summary at the end.
    clues = [line for line in out.stderr.splitlines() if "rror" in line or "terminate" in line or "what()" in line]
    assert out.returncode == 0, "\n".join(clues[:20]) + out.stderr[-1500:]
    stragglers = [e for e in events(run) if e["event"] == "straggler"]
    assert stragglers and {e["rank"] for e in stragglers} == {slow}
    # Rank 0 waited for it before each step, or (itself the slow one, its account the run's) took
    # that much longer than its peer: the run's account names it, not "other" nor useful steps.
    account = json.loads((run / "progress.json").read_text())["seconds"]
    assert account["peer_wait"] > account["useful"], json.dumps(account)


def _report(run) -> dict:
    return json.loads((next(run.glob("hang-*")) / "report.json").read_text())


def test_a_hang_in_one_process_leaves_progress_json_failed(tmp_path, small_prepared):
    """The watchdog's exit (os._exit: no except, no atexit) left phase "train" with a heartbeat growing
    old, which a dashboard reads as a run still training."""
    run = tmp_path / "run"
    out = shardline("train", *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "watchdog.timeout_s=3", "faults.hang_rank=0", "faults.hang_step=4")])
    assert out.returncode == 4, out.stderr[-2000:]
    account = json.loads((run / "progress.json").read_text())
    assert (account["phase"], account["step"], account["finished"], account["exit_code"]) == ("failed", 3, False, 4)
    assert "stopped at step 4: no progress for 3 s (hung, or slower than watchdog.timeout_s allows" in out.stderr
    first = shardline("train", *[f"--{o}" for o in tiny_overrides(  # a first step runs under the long limit
        tmp_path / "first", small_prepared, "watchdog.timeout_s=2", "watchdog.long_timeout_s=4",
        "faults.hang_rank=0", "faults.hang_step=1")])
    assert first.returncode == 4, first.stderr[-2000:]
    assert "no progress for 4 s (hung, or slower than watchdog.long_timeout_s allows" in first.stderr


def test_hang_while_restoring_is_reported_by_phase(tmp_path, small_prepared):
    # A stuck restore (a hung filesystem, a peer that never answers) used to hang the job
    # for ever: the watchdog only started with the first step.
    run = tmp_path / "run"
    first = tiny_overrides(run, small_prepared, "train.steps=2", "checkpoint.interval=2", "train.eval_interval=0")
    Trainer(load_config(None, first)).build().train()  # its checkpoint, in-process (the hung run is the CLI's)
    hung = shardline("train", *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "train.steps=4", "checkpoint.interval=2", "train.eval_interval=0",
        "watchdog.timeout_s=1", "watchdog.long_timeout_s=2", "faults.hang_rank=0", "faults.hang_phase=restore")])
    assert hung.returncode == 4, hung.stderr[-2000:]
    assert "stopped in restore (after step 2): no progress for " in hung.stderr  # the step it restored, not 0
    assert "(hung, or slower than watchdog.long_timeout_s allows: its stacks tell which)" in hung.stderr
    report = _report(run)
    assert (report["phase"], report["step"], report["stopped_ranks"], report["limit_s"]) == ("restore", 2, [0], 2.0)
    assert "in_phase" in (next(run.glob("hang-*")) / "rank0.txt").read_text()
    # The run's log was not open yet: rank 0 appended the event itself (it was held for the log, and lost)
    assert [e["phase"] for e in events(run) if e["event"] == "hang"] == ["restore"]


def test_hang_in_the_final_drain_is_reported_by_phase(tmp_path, small_prepared):
    run = tmp_path / "run"
    hung = shardline("train", *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "train.steps=3", "checkpoint.interval=3", "checkpoint.mode=async",
        "train.eval_interval=0", "watchdog.timeout_s=30", "watchdog.long_timeout_s=2",
        "faults.hang_rank=0", "faults.hang_phase=drain")])
    assert hung.returncode == 4, hung.stderr[-2000:]
    report = _report(run)
    assert (report["phase"], report["step"], report["stopped_ranks"]) == ("drain", 3, [0])
    hang = [e for e in events(run) if e["event"] == "hang"]
    assert [(e["phase"], e["step"]) for e in hang] == [("drain", 3)]  # the log was open: the event is there


@pytest.mark.parametrize("phase, from_step, at", [("eval", 0, 2), ("save", 3, 4)])
def test_a_hang_in_an_evaluation_or_a_save_is_reported_by_phase(tmp_path, small_prepared, phase, from_step, at):
    """Phases the watchdog watches under long_timeout_s that no drill reached (a SIGSTOP in an eval was
    found as a step's hang); faults.hang_step picks the first such phase from that step on."""
    run = tmp_path / "run"
    hung = shardline("train", *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "train.steps=4", "checkpoint.interval=2", f"train.eval_interval={2 * (phase == 'eval')}",
        "watchdog.timeout_s=30", "watchdog.long_timeout_s=2", "faults.hang_rank=0", f"faults.hang_phase={phase}",
        f"faults.hang_step={from_step}")])
    assert hung.returncode == 4, hung.stderr[-2000:]
    report = _report(run)
    assert (report["phase"], report["step"], report["stopped_ranks"], report["limit_s"]) == (phase, at, [0], 2.0)


def test_a_hang_in_an_anomaly_halts_save_is_reported_by_phase(tmp_path, small_prepared):
    """The halt once stopped the watchdog before its collective save: a peer lost there left
    the job waiting for the process group's timeout."""
    run = tmp_path / "run"
    hung = shardline("train", *[f"--{o}" for o in tiny_overrides(
        run, small_prepared, "train.steps=8", "checkpoint.interval=8", "train.eval_interval=0",
        "anomaly.action=halt", "anomaly.min_history=3", "faults.nan_step=5",
        "watchdog.timeout_s=30", "watchdog.long_timeout_s=2", "faults.hang_rank=0", "faults.hang_phase=halt")])
    assert hung.returncode == 4, hung.stderr[-2000:]
    report = _report(run)
    assert (report["phase"], report["step"], report["stopped_ranks"]) == ("halt", 4, [0])
