"""Stop requests: SIGTERM / SIGUSR1 / a first Ctrl-C finish the step, save it and exit 5;
under torchrun every rank stops after the same step; a second Ctrl-C stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardline.errors import Interrupted, Preempted
from shardline.resilience.checkpoint import verify
from shardline.resilience.preemption import StopRequests
from tests.conftest import tiny_overrides
from tests.ports import free_port

REPO = Path(__file__).parents[2]


def test_a_first_ctrl_c_asks_a_second_one_stops_now(capsys):
    # What was there before: Python's default handler, or SIG_IGN in a job started in the
    # background by a non-interactive shell (which ignores SIGINT for it).
    before = signal.getsignal(signal.SIGINT)
    stops = StopRequests(None)
    stops.install()
    try:
        assert stops.agreed() is None
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.agreed() == "SIGINT"
        # said at once (a long step left the first press silent, and a second one, which saves nothing, came)
        assert "Ctrl-C: stopping after this step, with a checkpoint of it (Ctrl-C again: at once, without one)" \
            in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stops.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_double_ctrl_c_during_a_save_lets_the_save_finish(tiny_config, capsys):
    """Ctrl-C twice in quick succession while step 4 is saved: the second one waits for the save
    (it left a half-written folder, a 90-line traceback and exit 1), the run stops with step 4
    saved; a third Ctrl-C would abandon it."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=8", "checkpoint.interval=4", "train.eval_interval=0")).build()
    save = trainer.save_checkpoint

    def pressed_twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return save()

    trainer.save_checkpoint = pressed_twice
    with pytest.raises(Interrupted, match="SIGINT at step 4; state saved") as stop:
        trainer.train()
    # a notebook's `except KeyboardInterrupt` catches it, the CLI's `except Preempted` too (exit 5)
    assert isinstance(stop.value, KeyboardInterrupt) and isinstance(stop.value, Preempted)
    assert "a checkpoint is being written; it finishes first" in capsys.readouterr().err
    assert verify(trainer.run_dir / "checkpoints" / "step-000004")["step"] == 4


@pytest.mark.parametrize("at, in_save", [(3, False), (1, False), (4, True), (1, True)])
def test_the_steps_a_stop_ends_are_logged(tiny_config, tmp_path, at, in_save):
    """A SIGTERM at step 3 under metrics.log_interval=5: the run saved step 3 and resumed at 4, and
    the losses of steps 1-3 were in no record (at step 23 of a 10-step interval: 21-23, for good).
    In a launch's first step (whose time the first window leaves out) and in a save, both at once too."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=12", "metrics.log_interval=5", "train.eval_interval=0",
                                  f"checkpoint.interval={4 if at > 1 else 1}", run_dir=tmp_path / f"run{at}")).build()
    name = "save_checkpoint" if in_save else "compute_gradients"
    inner, calls = getattr(trainer, name), []

    def stopped_in_it():
        calls.append(1)
        if len(calls) == (1 if in_save else at):
            os.kill(os.getpid(), signal.SIGTERM)
        return inner()

    setattr(trainer, name, stopped_in_it)
    with pytest.raises(Preempted, match=f"SIGTERM at step {at}"):
        trainer.train()
    assert [r["step"] for r in records(trainer.run_dir) if r.get("kind") == "train"] == [at]
    # (the log's last record: a stop's end is no run's end to a requeue script)
    assert [r["outcome"] for r in records(trainer.run_dir) if r.get("event") == "end"] == ["stopped"]


def test_a_third_ctrl_c_in_a_save_or_a_ctrl_c_inside_torchs_writer_is_an_interrupt():
    from torch.distributed.checkpoint.api import CheckpointException

    from shardline.errors import interrupted

    stops = StopRequests(None)
    stops.install()
    try:
        stops.writing = True
        os.kill(os.getpid(), signal.SIGINT)  # the stop request
        os.kill(os.getpid(), signal.SIGINT)  # held: the save finishes first
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stops.restore()
    wrapped = CheckpointException("save failed", {0: (KeyboardInterrupt(), None)})
    assert interrupted(wrapped) and not interrupted(CheckpointException("x", {0: (OSError(), None)}))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(run: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and any(r.get("kind") == "train" and r["step"] >= step
                                                    for r in records(run)):
            return
        time.sleep(0.2)
    raise AssertionError("the run never reached step %d" % step)


def launch(run: Path, corpus: Path, nproc: int, *extra: str, stdout=subprocess.DEVNULL,
           stderr=subprocess.PIPE) -> subprocess.Popen:
    args = [f"--{o}" for o in tiny_overrides(run, corpus, "train.steps=100000", "checkpoint.interval=1000",
                                             "train.eval_interval=0", *extra)]
    if nproc == 1:
        cmd = [sys.executable, "-m", "shardline", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "shardline", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)


def test_sigterm_saves_the_step_and_exits_5_then_resumes(tmp_path, small_prepared):
    run = tmp_path / "run"
    proc = launch(run, small_prepared, 1)
    wait_for_step(run, proc, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == Preempted.exit_code, err[-2000:]
    assert "stopped: SIGTERM at step" in err and len(err.strip().splitlines()) == 1
    (event,) = [r for r in records(run) if r.get("event") == "preempted"]
    assert verify(Path(event["checkpoint"]))["step"] == event["step"] >= 3
    assert not (run / ".lock").exists()
    again = subprocess.run([sys.executable, "-m", "shardline", "train",
                            *[f"--{o}" for o in tiny_overrides(run, small_prepared, "train.steps=100000",
                                                               "checkpoint.interval=1000", "train.eval_interval=0",
                                                               f"train.stop_at_step={event['step'] + 2}")]],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = [r for r in records(run) if r.get("event") == "resume"]
    assert resumed and resumed[-1]["step"] == event["step"]
    # The time between the preempted run's end and the rerun's start is a restart gap to goodput.
    end = [r for r in records(run) if r.get("event") == "end"][-1]
    assert end["seconds"]["restart_gap"] > 0
    assert 0 < end["this_launch_s"] < end["total_s"]  # the run's total spans both launches; this one's apart
    # progress.json's total is the end event's (its categories summed to more than its wall_s, the gap left out)
    progress = json.loads((run / "progress.json").read_text())
    assert progress["total_s"] == pytest.approx(end["total_s"], abs=1e-3)
    assert progress["total_s"] >= sum(progress["seconds"].values())
    # what no category took, beside them: the categories add up to total_s (a tool's first check)
    assert sum(progress["seconds"].values()) + progress["other_s"] == pytest.approx(progress["total_s"], abs=1e-6)
    assert progress["other_s"] == pytest.approx(end["seconds"]["other"], abs=1e-3)
    assert progress["goodput"] == pytest.approx(end["goodput"], abs=1e-4)


def test_a_ctrl_c_that_takes_the_log_pipe_with_it_still_saves_and_sighup_stops_as_sigterm(tmp_path, small_prepared):
    """`shardline train | tee log` and Ctrl-C: tee died with it, the next console line raised
    BrokenPipeError and the run exited 1 with nothing saved; a closed terminal's SIGHUP killed the run
    unsaved. The console goes quiet (said once on stderr), the stop saves; SIGHUP is a stop request,
    and one the process was started ignoring (nohup) stays ignored."""
    run = tmp_path / "run"
    piped = launch(run, small_prepared, 1, "metrics.progress=plain", "metrics.log_interval=1", stdout=subprocess.PIPE)
    piped.stdout.readline()  # (a line read, then the reader gone, as tee with the Ctrl-C)
    piped.stdout.close()
    wait_for_step(run, piped, 3)
    piped.send_signal(signal.SIGHUP)
    _, err = piped.communicate(timeout=120)
    assert piped.returncode == Preempted.exit_code, err[-2000:]
    assert "the console's output failed" in err and "stopped: SIGHUP at step" in err, err[-2000:]
    (event,) = [r for r in records(run) if r.get("event") == "preempted"]
    assert verify(Path(event["checkpoint"]))["step"] == event["step"]
    progress = json.loads((run / "progress.json").read_text())
    assert (progress["phase"], progress["exit_code"]) == ("ended", Preempted.exit_code)  # (a stop is no failure)
    ignoring = subprocess.Popen([sys.executable, "-c", "import signal, sys; from shardline.resilience.preemption "
                                 "import StopRequests; s = StopRequests(None); s.install(); "
                                 "sys.exit(int(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN))"],
                                cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert ignoring.wait(timeout=120) == 1  # (nohup's SIGHUP stays ignored)


def test_a_log_pipe_holding_stderr_too_gone_with_the_ctrl_c_still_exits_5(tmp_path, small_prepared):
    """`2>&1 | tee` (or a closed ssh): stderr is the dead pipe too, so the stop's own line raised and
    the run exited 1 after saving (a requeue keyed on 5 misfired); rich's progress bar exited the
    process itself on a broken pipe (SystemExit 1), nothing saved."""
    run = tmp_path / "run"
    piped = launch(run, small_prepared, 1, "metrics.progress=rich", "metrics.log_interval=1",
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    piped.stdout.readline()
    piped.stdout.close()
    wait_for_step(run, piped, 3)
    piped.send_signal(signal.SIGINT)
    assert piped.wait(timeout=120) == Preempted.exit_code
    (event,) = [r for r in records(run) if r.get("event") == "preempted"]
    assert verify(Path(event["checkpoint"]))["step"] == event["step"]


def test_under_torchrun_a_signal_to_one_rank_stops_both_after_the_same_step(tmp_path, small_prepared):
    run = tmp_path / "run"
    proc = launch(run, small_prepared, 2, "parallel.dp_shard=2")
    wait_for_step(run, proc, 3)
    workers = subprocess.run(["pgrep", "-f", f"run.dir={run}"], capture_output=True, text=True).stdout.split()
    ranks = [int(p) for p in workers if int(p) != proc.pid]
    assert len(ranks) >= 2, workers
    os.kill(max(ranks), signal.SIGUSR1)  # one worker only (not torchrun)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0  # torchrun reports the workers' exit code 5 as a failure
    (event,) = [r for r in records(run) if r.get("event") == "preempted"]
    manifest = verify(Path(event["checkpoint"]))  # saved collectively: both ranks' shards are in it
    assert manifest["step"] == event["step"] and event["signal"] == "SIGUSR1"
    assert {"trainer/rank0.pt", "trainer/rank1.pt"} <= set(manifest["files"])


def record_phases(trainer) -> list[tuple[str, int]]:
    """The (phase, step) of every watched phase the trainer enters from now on, in order."""
    from contextlib import contextmanager

    phases, phase = [], trainer.guard.phase

    @contextmanager
    def recorded(name, step):
        phases.append((name, step))
        with phase(name, step):
            yield

    trainer.guard.phase = recorded
    return phases


def test_a_stop_skips_the_due_evaluation_and_every_eval_and_save_is_a_watched_phase(tiny_config):
    """The grace before the kill (torchrun: 30 s) is for the save, not an evaluation; and each
    eval and save runs as a phase under watchdog.long_timeout_s (a first eval that compiles,
    a slow save: not a hung step)."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=8", "train.eval_interval=2", "checkpoint.interval=2")).build()
    phases = record_phases(trainer)
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.step == 4 else None
    with pytest.raises(Preempted, match="SIGTERM at step 4; state saved"):
        trainer.train()
    assert [p for p in phases if p[0] != "drain"] == [("eval", 2), ("save", 2), ("save", 4)]  # no eval at 4
    evaluated = [r["step"] for r in records(trainer.run_dir) if r["kind"] == "eval"]
    assert evaluated == [2]


def test_a_signal_that_lands_while_a_step_is_logged_still_skips_the_evaluation(tiny_config):
    """The stop is asked right after a step (its wait is a slow peer's); a signal landing after that,
    while the step is logged, is asked for again before an evaluation or save that is due."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=8", "train.eval_interval=2", "checkpoint.interval=2")).build()
    phases = record_phases(trainer)
    asked = []

    def stop_requested():  # at step 4: nothing at the first ask, the signal at the second
        asked.append(trainer.step)
        return "SIGTERM" if asked.count(4) >= 2 else None

    trainer.guard.stop_requested = stop_requested
    with pytest.raises(Preempted, match="SIGTERM at step 4; state saved"):
        trainer.train()
    assert [p for p in phases if p[0] != "drain"] == [("eval", 2), ("save", 2), ("save", 4)]  # no eval at 4


def rerun_makes_up_the_eval_at_step_4(tiny_config, settings: list[str], run_dir: Path, whole: Path) -> None:
    """The rerun of a run stopped at step 4 (of 6, evaluating every 2) evaluates step 4 before its
    first step, and its eval losses are an uninterrupted run's (in `whole`), step for step."""
    from shardline.trainer import Trainer

    rerun = Trainer(tiny_config(*settings)).build()
    phases = record_phases(rerun)
    rerun.train()
    assert [p for p in phases if p[0] == "eval"] == [("eval", 4), ("eval", 6)]
    Trainer(tiny_config(*settings, run_dir=whole)).build().train()
    losses = {run: [(r["step"], r["eval_loss"]) for r in records(run) if r["kind"] == "eval"]
              for run in (run_dir, whole)}
    assert losses[run_dir] == losses[whole] and [s for s, _ in losses[whole]] == [2, 4, 6]


def stop_inside_the_eval_at_step_4(trainer) -> list[int]:
    """Every rank's stop answer (StopRequests.agreed) says SIGTERM from its third ask at step 4 on:
    after the step, before the eval, then inside it (before its second micro-batch). Returns the
    steps each ask came at."""
    asked = []

    def agreed(step_s=None):  # (a step's own time beside it: one process compares it with none)
        trainer.guard.stops.fastest_s = step_s
        asked.append(trainer.step)
        return "SIGTERM" if asked.count(4) >= 3 else None

    trainer.guard.stops.agreed = agreed
    return asked


def test_a_signal_that_lands_during_an_evaluation_ends_it_and_the_resumed_run_makes_it_up(tiny_config, tmp_path):
    """A long evaluation (many eval_batches) ran to its end before the stop's save, eating the grace
    before the kill: it now ends between its micro-batches, logs nothing, and is owed to the rerun,
    which evaluates that step first, as the uninterrupted run did."""
    from shardline.trainer import Trainer

    settings = ["train.steps=6", "train.eval_interval=2", "checkpoint.interval=2", "train.eval_batches=2"]
    trainer = Trainer(tiny_config(*settings)).build()
    phases = record_phases(trainer)
    asked = stop_inside_the_eval_at_step_4(trainer)
    with pytest.raises(Preempted, match="SIGTERM at step 4; state saved"):
        trainer.train()
    assert asked.count(4) == 4  # after the step, before the eval, in it before its 2nd micro-batch of 4, after it
    assert [p for p in phases if p[0] != "drain"] == [("eval", 2), ("save", 2), ("eval", 4), ("save", 4)]
    assert [r["step"] for r in records(trainer.run_dir) if r["kind"] == "eval"] == [2]  # nothing logged at 4
    rerun_makes_up_the_eval_at_step_4(tiny_config, settings, trainer.run_dir, tmp_path / "whole")


def test_a_stop_during_an_evaluation_takes_no_memory_snapshot_before_its_disk_save(tiny_config, tmp_path):
    """The grace before the kill is the save's: a stop that ended an evaluation went on to the memory
    snapshot due at that step first, as a stop asked before the evaluation does not."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=6", "train.eval_interval=2", "checkpoint.interval=3",
                                  "checkpoint.memory_interval=2", f"checkpoint.memory_dir={tmp_path / 'shm'}",
                                  "train.eval_batches=2")).build()
    phases = record_phases(trainer)
    stop_inside_the_eval_at_step_4(trainer)
    with pytest.raises(Preempted, match="SIGTERM at step 4; state saved"):
        trainer.train()
    assert [p for p in phases if p[0] != "drain"] == [("eval", 2), ("snapshot", 2), ("save", 3), ("eval", 4),
                                                      ("save", 4)]


@pytest.mark.parametrize("memory", [False, True])
def test_the_evaluation_a_stop_skipped_is_made_up_by_the_resumed_run(tiny_config, tmp_path, memory):
    """Stopped at step 4, an eval step: the rerun evaluates step 4 before its first step, from a
    disk checkpoint or a memory snapshot; an uninterrupted run's eval losses, step for step."""
    from shardline.trainer import Trainer

    settings = ["train.steps=6", "train.eval_interval=2", "checkpoint.interval=2"]
    if memory:
        settings = ["train.steps=6", "train.eval_interval=2", "checkpoint.interval=0", "checkpoint.memory_interval=2",
                    f"checkpoint.memory_dir={tmp_path / 'shm'}"]
    trainer = Trainer(tiny_config(*settings)).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.step == 4 else None
    with pytest.raises(Preempted, match="SIGTERM at step 4"):
        trainer.train()
    rerun_makes_up_the_eval_at_step_4(tiny_config, settings, trainer.run_dir, tmp_path / "whole")


def test_a_stop_during_rollbacks_stops_there_with_the_rolled_back_state_saved(tiny_config):
    """SIGTERM lands in step 5, which rolls back to step 3: the run stops there (more rollbacks,
    each a restore, could outlast the grace), saving step 3 again with the batch it skips."""
    from shardline.resilience.checkpoint import step_dir_name
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("faults.spike_step=5", "anomaly.action=rollback", "anomaly.min_history=3",
                                  "checkpoint.interval=3", "train.eval_interval=0")).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.rollbacks else None
    with pytest.raises(Preempted, match="SIGTERM at step 3; state saved"):
        trainer.train()
    assert [r["step"] for r in records(trainer.run_dir) if r["kind"] == "train"] == [1, 2, 3, 4]
    saved = torch.load(trainer.run_dir / "checkpoints" / step_dir_name(3) / "trainer" / "rank0.pt", weights_only=False)
    assert saved["data"]["skipped_batches"] == [4]
    progress = json.loads((trainer.run_dir / "progress.json").read_text(encoding="utf-8"))
    assert (progress["step"], progress["high_water_step"]) == (3, 4)  # (the state it went back to, saved: was 4)


@pytest.mark.parametrize("interval, snapshots", [(4, [1, 2]), (0, [1, 2, 3])])
def test_a_stop_with_a_disk_save_to_come_takes_no_snapshot_first(tiny_config, tmp_path, interval, snapshots):
    """The grace before the kill is the disk save's; without one (checkpoint.interval=0) the
    snapshot is what a rerun has."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=8", "train.eval_interval=0", f"checkpoint.interval={interval}",
                                  "checkpoint.memory_interval=1", f"checkpoint.memory_dir={tmp_path / 'shm'}")).build()
    phases = record_phases(trainer)
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.step == 3 else None
    with pytest.raises(Preempted, match="SIGTERM at step 3"):
        trainer.train()
    assert [step for name, step in phases if name == "snapshot"] == snapshots
    assert [step for name, step in phases if name == "save"] == ([3] if interval else [])


def test_a_stop_right_after_a_rollback_to_ram_names_the_batches_to_skip(tiny_config, tmp_path):
    """checkpoint.interval=0: nothing is saved, and the snapshots held predate the rollback (they
    lack the batch it skipped): the line names the batches a rerun must skip."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("faults.spike_step=5", "anomaly.action=rollback", "anomaly.min_history=3",
                                  "checkpoint.interval=0", "checkpoint.memory_interval=3", "train.eval_interval=0",
                                  f"checkpoint.memory_dir={tmp_path / 'shm'}")).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.rollbacks else None
    with pytest.raises(Preempted, match=r"SIGTERM at step 3; checkpoint.interval=0, so nothing was saved to disk; "
                                        r"the in-memory snapshots stay for a rerun, but predate the rollback: rerun "
                                        r"with train.skip_batches=\[4\]"):
        trainer.train()


def test_a_stop_counts_the_snapshot_still_in_flight_before_it_says_what_ram_holds(tiny_config, tmp_path):
    """A rollback at step 5 back to step 3, then a stop at step 6, whose async snapshot holds the
    rollback: once it has landed, the line does not call the snapshots older than the rollback."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("faults.spike_step=5", "anomaly.action=rollback", "anomaly.min_history=3",
                                  "checkpoint.interval=0", "checkpoint.memory_interval=3", "train.eval_interval=0",
                                  "checkpoint.memory_mode=async", f"checkpoint.memory_dir={tmp_path / 'shm'}")).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.rollbacks and trainer.step == 6 else None
    with pytest.raises(Preempted) as stopped:
        trainer.train()
    assert str(stopped.value).endswith("at step 6; checkpoint.interval=0, so nothing was saved to disk; the "
                                       "in-memory snapshots stay for a rerun"), str(stopped.value)


def test_a_stop_without_disk_saves_snapshots_the_step_it_stopped_after(tiny_config, tmp_path):
    """checkpoint.interval=0, snapshots every 4 steps: a stop after step 6 snapshotted nothing, and
    the rerun trained steps 5 and 6 again; now the rerun resumes at step 6."""
    from shardline.trainer import Trainer

    settings = ["train.steps=8", "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.memory_interval=4",
                f"checkpoint.memory_dir={tmp_path / 'shm'}"]
    trainer = Trainer(tiny_config(*settings)).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.step == 6 else None
    with pytest.raises(Preempted, match="SIGTERM at step 6; checkpoint.interval=0, so nothing was saved to disk; "
                                        "the in-memory snapshots stay for a rerun"):
        trainer.train()
    assert Trainer(tiny_config(*settings)).build().step == 6


def test_a_new_run_in_a_run_dir_without_checkpoints_starts_a_new_goodput_account(tiny_config):
    """Five layouts tried one after another in one run dir (checkpoint.interval=0) were counted as
    one run restarted four times: goodput 0.08, the other launches' steps "recomputed"."""
    from shardline.trainer import Trainer

    settings = ["train.steps=3", "train.eval_interval=0", "checkpoint.interval=0"]
    for _ in range(2):
        trainer = Trainer(tiny_config(*settings)).build()
        trainer.train()
    end = [r for r in records(trainer.run_dir) if r.get("event") == "end"][-1]
    assert end["seconds"]["recomputed"] == 0 and end["seconds"]["restart_gap"] == 0, end
    assert end["total_s"] == pytest.approx(end["this_launch_s"], abs=0.5)


def test_relaunching_a_finished_run_leaves_its_account_as_it_was(tiny_config):
    """A requeue loop relaunching a run that had finished: each launch found nothing to train and
    still added its start-up, lowering the run's goodput every time (0.90 -> 0.87 -> 0.85)."""
    import json

    from shardline.trainer import Trainer

    settings = ["train.steps=3", "train.eval_interval=0", "checkpoint.interval=3"]
    Trainer(tiny_config(*settings)).build().train()
    run = Path(tiny_config(*settings).run.dir)
    before = json.loads((run / "progress.json").read_text())
    saved = (run / "config.toml").read_text()
    again = Trainer(tiny_config(*settings, "train.micro_batch_size=2")).build()
    again.train()
    assert json.loads((run / "progress.json").read_text()) == before
    assert (run / "config.toml").read_text() == saved  # its overrides were kept for the next relaunch
    ends = [r for r in records(run) if r.get("event") == "end"]
    first, last = ends[0]["seconds"], ends[-1]["seconds"]
    assert ends[-1]["goodput"] == pytest.approx(ends[0]["goodput"], abs=1e-3) and last["startup"] == first["startup"]
    assert last["other"] == pytest.approx(first["other"], abs=0.05)  # (its wall read a moment apart)


def test_a_relaunch_after_a_crash_before_any_save_keeps_the_account(tiny_config):
    """Nothing to resume, but the run before did not finish (a crash before its first save, a
    relaunch by hand or a script): its time is this run's history, not a new account."""
    from shardline.trainer import Trainer

    settings = ["train.steps=6", "train.eval_interval=0", "checkpoint.interval=0"]
    crashed = Trainer(tiny_config(*settings)).build()
    compute = crashed.compute_gradients
    crashed.compute_gradients = lambda: compute() if crashed.step < 2 else (_ for _ in ()).throw(RuntimeError("x"))
    with pytest.raises(RuntimeError):
        crashed.train()
    again = Trainer(tiny_config(*settings)).build()
    again.train()
    end = [r for r in records(again.run_dir) if r.get("event") == "end"][-1]
    assert end["seconds"]["recomputed"] > 0 and end["total_s"] > end["this_launch_s"], end


def test_the_half_saved_drill_says_so_and_a_rerun_resumes_the_save_before(tmp_path, small_prepared):
    """faults.fail_save_step ended the process midway through a save with no word (exit 1, nothing
    printed, a .tmp folder left): read as a crash of the run's own. It says it is the drill."""
    run = tmp_path / "run"
    args = [f"--{o}" for o in tiny_overrides(run, small_prepared, "train.steps=6", "checkpoint.interval=2",
                                             "train.eval_interval=0")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    died = subprocess.run([sys.executable, "-m", "shardline", "train", *args, "--faults.fail_save_step=4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert died.returncode == 1
    assert "drill: faults.fail_save_step=4 ends rank 0 midway through the save" in died.stderr, died.stderr[-2000:]
    assert [p.name for p in (run / "checkpoints").glob("step-*.tmp")] == ["step-000004.tmp"]
    again = subprocess.run([sys.executable, "-m", "shardline", "train", f"--run.dir={run}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    starts = [r for r in records(run) if r.get("event") == "start"]
    assert starts[-1]["step"] == 2 and not list((run / "checkpoints").glob("*.tmp"))


def test_progress_json_says_a_launch_began_and_which_step_it_is_at(tiny_config):
    """A dashboard polling progress.json saw the last launch's `finished: true` (and its step) through
    a relaunch's whole start: the file is written as training starts, with the step resumed, the
    host and process; each step then moves `step` on."""
    import json
    import os
    import socket

    from shardline.trainer import Trainer

    settings = ["train.steps=6", "train.eval_interval=0", "checkpoint.interval=3"]
    Trainer(tiny_config(*settings, "train.stop_at_step=3")).build().train()
    run = Path(tiny_config(*settings).run.dir)
    first = json.loads((run / "progress.json").read_text())
    assert (first["step"], first["finished"], first["pid"], first["host"]) == (3, True, os.getpid(),
                                                                               socket.gethostname())
    again = Trainer(tiny_config(*settings)).build()

    def fail_the_first_step():  # (what a dashboard sees before this launch's first step ends)
        raise RuntimeError(json.dumps(json.loads((run / "progress.json").read_text())))

    again.compute_gradients = fail_the_first_step
    with pytest.raises(RuntimeError) as seen:
        again.train()
    began = json.loads(str(seen.value))
    assert (began["step"], began["finished"], began["high_water_step"]) == (3, False, 3)
    assert began["time"] > first["time"]


def test_progress_json_names_the_phase_a_launch_is_in(tiny_config):
    """`time` is refreshed after each step only: a dashboard read a long save or evaluation as a hang.
    Each phase is said as it begins (with a fresh `time`) and the end of the launch as `ended`."""
    import json

    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=2", "train.eval_interval=2", "checkpoint.interval=2")).build()
    run, seen = Path(trainer.cfg.run.dir), []

    def reading(work):
        def read_then_work(*args):
            seen.append(json.loads((run / "progress.json").read_text()))
            return work(*args)
        return read_then_work

    trainer.evaluate, trainer.save_checkpoint = reading(trainer.evaluate), reading(trainer.save_checkpoint)
    trainer.train()
    assert [(r["phase"], r["step"]) for r in seen] == [("eval", 2), ("save", 2)]
    assert seen[1]["time"] > seen[0]["time"]
    assert json.loads((run / "progress.json").read_text())["phase"] == "ended"
    failing = Trainer(tiny_config("train.steps=4", "train.eval_interval=2", "checkpoint.interval=2")).build()

    def broken_eval(*args):
        raise RuntimeError("eval broke")

    failing.evaluate = broken_eval  # (a halt, a crash or Ctrl-C alike: the phase it died in read "train" after)
    with pytest.raises(RuntimeError, match="eval broke"):
        failing.train()
    last = json.loads((run / "progress.json").read_text())
    assert (last["phase"], last["finished"], last["step"]) == ("failed", False, 4)


def test_a_failure_after_the_launchs_end_keeps_what_end_said_and_one_writer_at_a_time(tmp_path):
    """An error after end() (a Ctrl-C as the run closes its log) wrote finished and run_complete false
    over a complete run, and no later launch (nothing to train: left out) put them back, so a requeue
    loop waiting for run_complete ran for ever. A hang's exit writes from the watchdog's thread: it
    waits for the main thread's write, a little, rather than write over it."""
    import json
    import threading
    import time

    from shardline.resilience.goodput import Goodput

    account = Goodput(tmp_path, enabled=True)
    account.begin(0)
    account.end(True, time.time(), run_complete=True)
    account.fail()
    last = json.loads((tmp_path / "progress.json").read_text())
    assert (last["phase"], last["finished"], last["run_complete"]) == ("failed", True, True)
    held = threading.Lock()
    account._writing = held
    held.acquire()  # (the main thread inside a write)
    account.phase = "train"
    account.fail(wait_s=0.1)  # not written over it: given up after its wait
    assert json.loads((tmp_path / "progress.json").read_text())["time"] == last["time"]
    held.release()


def test_a_straggling_rank_0s_excess_is_peer_wait_once_a_step(tmp_path):
    """Rank 0's account is the run's: where rank 0 itself straggled, its peers' wait showed nowhere
    (peer_wait 0.06 s of a run at a third of its pace). The stop check's all-reduce carries the least
    step time; rank 0's excess over it moves to peer_wait once a step, though a step's evaluation and
    save ask for stops again."""
    from types import SimpleNamespace

    from shardline.resilience.goodput import Goodput
    from shardline.resilience.guard import RunGuard

    class Peers:  # the stop check of a 2-rank job whose other rank took 0.25 s a step
        fastest_s = None

        def agreed(self, step_s=None):
            self.fastest_s = None if step_s is None else min(step_s, 0.25)
            return None

    guard = SimpleNamespace(stops=Peers(), goodput=Goodput(tmp_path, enabled=False), _compared_s=0.0, _step=0)
    for step, seconds in ((1, 1.0), (2, 0.2)):  # rank 0 slow, then the fastest
        guard.goodput.step(step, seconds, "updated")
        guard._step, guard._compared_s = step, seconds
        for _ in range(3):  # after the step, then before and after its evaluation and save
            RunGuard.stop_requested(guard)
    assert guard.goodput.seconds["useful"] == pytest.approx(0.25 + 0.2)
    assert guard.goodput.seconds["peer_wait"] == pytest.approx(0.75, abs=0.01)  # (+ the calls' own microseconds)


def test_a_damaged_progress_file_is_said_as_the_account_starts_again(tiny_config):
    """`xx{` in progress.json: the resume was right, but the earlier launches' time left the account
    with no word (wall_s 7 s where it had 42 s)."""
    from shardline.trainer import Trainer

    settings = ["train.steps=6", "train.eval_interval=0", "checkpoint.interval=3"]
    Trainer(tiny_config(*settings, "train.stop_at_step=3")).build().train()
    run = Path(tiny_config(*settings).run.dir)
    assert not [r for r in records(run) if r.get("event") == "progress_reset"]  # (a readable one: no word)
    (run / "progress.json").write_text("xx{")
    Trainer(tiny_config(*settings)).build().train()
    (reset,) = [r for r in records(run) if r.get("event") == "progress_reset"]
    assert reset["step"] == 3 and "did not read as an account" in reset["reason"]


def test_a_restart_with_nothing_saved_says_it_starts_over(tiny_config):
    """A first attempt killed before its first save landed (an async save in flight): the restart went back
    to step 0 with no word, though goodput counted those steps as recomputed."""
    from shardline.trainer import Trainer

    settings = ["train.steps=8", "train.eval_interval=0", "checkpoint.interval=6"]
    trainer = Trainer(tiny_config(*settings)).build()
    compute = trainer.compute_gradients

    def crash():
        if trainer.step == 4:
            raise RuntimeError("injected crash")
        return compute()

    trainer.compute_gradients = crash
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    run = trainer.run_dir
    assert not [r for r in records(run) if r.get("event") == "starts_over"]
    again = Trainer(tiny_config(*settings)).build()
    assert again.step == 0
    (said,) = [r for r in records(run) if r.get("event") == "starts_over"]
    assert said["recomputed_steps"] == 4 and "trained again" in said["why"]


def _crashing_at(trainer, step: int):
    """`trainer`, whose gradients fail at `step` (a crash before anything is saved)."""
    compute = trainer.compute_gradients

    def crash():
        if trainer.step == step:
            raise RuntimeError("injected crash")
        return compute()

    trainer.compute_gradients = crash
    return trainer


def test_a_launch_of_another_model_over_one_that_saved_nothing_starts_a_new_account(tiny_config):
    """A launch killed before its first save, then one with another model in that run dir (its config.toml is
    not read): starts_over counted the first one's steps as recomputed and goodput summed the two runs. The
    same run launched again (its data path spelled otherwise) still trains its steps again."""
    from shardline.trainer import Trainer

    settings = ["train.steps=8", "train.eval_interval=0", "checkpoint.interval=6"]
    first = _crashing_at(Trainer(tiny_config(*settings)).build(), 4)
    with pytest.raises(RuntimeError, match="injected"):
        first.train()
    run, data = first.run_dir, first.cfg.data.path
    spelled = os.path.relpath(data) if os.path.isabs(data) else os.path.abspath(data)
    again = _crashing_at(Trainer(tiny_config(*settings, f"data.path={spelled}", "train.steps=5")).build(), 3)
    with pytest.raises(RuntimeError, match="injected"):
        again.train()
    (said,) = [r for r in records(run) if r.get("event") == "starts_over"]
    assert said["recomputed_steps"] == 4
    Trainer(tiny_config(*settings, "model.n_layers=1", "train.steps=2")).build().train()
    assert len([r for r in records(run) if r.get("event") == "starts_over"]) == 1
    (reset,) = [r for r in records(run) if r.get("event") == "progress_reset"]
    assert reset["reason"] == ("this launch resumes nothing and trains another run than the account's "
                               "(model.n_layers differ)") and reset["step"] == 0
    account = json.loads((run / "progress.json").read_text())
    assert account["high_water_step"] == 2 and account["seconds"]["recomputed"] == 0
    assert account["seconds"]["restart_gap"] == 0 and account["trains"]["model.n_layers"] == 1


def test_a_restart_after_a_run_ended_with_nothing_kept_says_so(tiny_config, monkeypatch):
    """A run of checkpoint.interval=0 trained to its end, then a torchrun restart (a worker failed in its
    teardown): nothing to resume, and starts_over said its save never landed."""
    from shardline.trainer import Trainer, state

    settings = ["train.steps=3", "train.eval_interval=0", "checkpoint.interval=0"]
    first = Trainer(tiny_config(*settings)).build()
    first.train()
    monkeypatch.setattr(state, "restarted", lambda: True)
    Trainer(tiny_config(*settings)).build()
    (said,) = [r for r in records(first.run_dir) if r.get("event") == "starts_over"]
    assert said["recomputed_steps"] == 3 and said["why"].endswith("; it had trained to its end")


def test_a_stop_at_step_behind_the_resumed_step_is_named(tiny_config):
    """A requeue's stale --train.stop_at_step=2 over a run saved at step 4: exit 0 with "train.steps
    (or stop_at_step) reached", as if the run had ended."""
    from shardline.trainer import Trainer

    Trainer(tiny_config("train.steps=8", "checkpoint.interval=4", "train.stop_at_step=4",
                        "train.eval_interval=0")).build().train()
    trainer = Trainer(tiny_config("train.steps=8", "checkpoint.interval=4", "train.stop_at_step=2",
                                  "train.eval_interval=0")).build()
    trainer.train()
    (resume,) = [r for r in records(trainer.run_dir) if r.get("event") == "resume"]
    assert resume["note"] == "train.stop_at_step=2 is behind the step resumed: nothing to train (raise it, or 0: to " \
                             "train.steps)"
