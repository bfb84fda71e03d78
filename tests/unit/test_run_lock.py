"""One job per run dir: a live holder stops a second run with one line; a dead one's lock,
or the same job's after a restart, is taken over."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from shardline.errors import CheckpointError, ConfigError
from shardline.resilience.run_lock import LOCK, RunLock, job_id, start_time_of
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides


def write_lock(run_dir, pid, host=None, job="", start="auto"):
    run_dir.mkdir(parents=True, exist_ok=True)
    start = start_time_of(pid) if start == "auto" else start
    (run_dir / LOCK).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "start": start,
                                            "job": job, "since": time.time()}))


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_stops_a_second_run_with_one_line(tmp_path, other_process):
    write_lock(tmp_path, other_process.pid)
    with pytest.raises(ConfigError) as err:
        RunLock(tmp_path).acquire()
    text = str(err.value)
    assert f"in use by another run (pid {other_process.pid} on {socket.gethostname()}" in text
    assert "\n" not in text and (tmp_path / LOCK).is_file()
    # its pid runs here: not "delete the lock" (another host's is never guessed away, and so advised)
    assert text.endswith("use another run.dir, or stop that run first") and "delete" not in text


def test_a_run_dir_the_lock_made_goes_with_it_where_nothing_was_written(tmp_path):
    """A launch refused after taking the lock (a corrupt --resume PATH) left an empty run dir behind;
    one that wrote anything, or a folder that was there before, stays."""
    for folder, writes, kept in ((tmp_path / "new", False, False), (tmp_path / "used", True, True)):
        lock = RunLock(folder)
        lock.acquire()
        if writes:
            (folder / "config.toml").write_text("")
        lock.release()
        assert folder.exists() == kept
    (tmp_path / "mine").mkdir()
    lock = RunLock(tmp_path / "mine")
    lock.acquire()
    lock.release()
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


def test_a_run_dir_removed_by_a_refused_launch_as_this_one_starts_is_made_again(tmp_path, monkeypatch):
    """Launch A, refused, removed the run dir it had made just after launch B found it there: B's lock
    could not be written (ENOENT). B makes the folder again and takes the lock."""
    real, calls = RunLock._publish, []

    def folder_gone_first(self, me):
        if not calls:
            calls.append(1)
            self.path.parent.rmdir()  # (A's release, between B's mkdir and its write)
        return real(self, me)

    monkeypatch.setattr(RunLock, "_publish", folder_gone_first)
    lock = RunLock(tmp_path / "run")
    assert lock.acquire() is None and lock.held and (tmp_path / "run" / LOCK).is_file()
    lock.release()
    assert not (tmp_path / "run").exists()  # (this launch made it again: it goes with its lock too)


def test_a_dead_holders_lock_is_taken_over_and_released(tmp_path, other_process):
    pid = other_process.pid
    write_lock(tmp_path, pid)
    other_process.kill()
    other_process.wait()
    lock = RunLock(tmp_path)
    assert lock.acquire().startswith(f"stale: pid {pid}")
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_an_abandoned_lock_is_one_whose_holder_here_is_gone(tmp_path, other_process):
    """What `shardline eval` removes a killed evaluation's folder by: its holder on this host gone."""
    live, dead, elsewhere = (tmp_path / name for name in ("live", "dead", "elsewhere"))
    write_lock(live, other_process.pid)
    write_lock(elsewhere, other_process.pid, host="another-host")
    write_lock(dead, other_process.pid)
    assert not RunLock(live).abandoned() and not RunLock(elsewhere).abandoned()
    other_process.kill()
    other_process.wait()
    assert RunLock(dead).abandoned() and not RunLock(elsewhere).abandoned()
    assert not RunLock(tmp_path / "none").abandoned()


def test_a_reused_pid_is_another_process(tmp_path, other_process):
    write_lock(tmp_path, other_process.pid, start=1.0)  # the pid's process started at another time
    assert "is another process now" in RunLock(tmp_path).acquire()


@contextlib.contextmanager
def beating(lock, when=lambda: None):
    """A live holder on another host while the block runs: its beat touches `lock` every 20 ms (`when`:
    the time it writes, None for now)."""
    done = threading.Event()

    def beat():
        while not done.wait(0.02):
            t = when()
            os.utime(lock, None if t is None else (1.0, t))

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_the_same_jobs_lock_on_another_host_is_taken_once_quiet(tmp_path, monkeypatch):
    """Another host's lock of the same job is a dead holder's once it goes untouched: a live holder touches
    it every beat (two launches given one --rdzv_id, on two hosts, trained in one run dir at once, and a
    torchrun restart of the refused one would do the same)."""
    from shardline.resilience import run_lock

    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    write_lock(tmp_path, 1, host="node-7", job="TORCHELASTIC_RUN_ID=job42")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with beating(tmp_path / LOCK):  # node-7's run, touching its lock
        with pytest.raises(ConfigError, match="in use by another run"):
            RunLock(tmp_path).acquire()
    lock = RunLock(tmp_path)
    assert lock.acquire() == "same job (TORCHELASTIC_RUN_ID=job42): a restart; its lock untouched for 0.15 s"
    lock.release()


def test_another_jobs_lock_on_another_host_is_taken_once_untouched(tmp_path, monkeypatch):
    """The job before, in a chain of Slurm jobs, SIGKILLed at its time limit: its lock (another job,
    another host) refused every later job in one line, exit 2, which a requeue script stops on. One that
    stays untouched for OTHER_JOB_QUIET_BEATS beats is a dead holder's; a live holder's beat keeps it (no
    clock compared: only whether the file changes while the launch watches)."""
    from shardline.resilience import run_lock

    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    write_lock(tmp_path, 4242, host="node07", job="SLURM_JOB_ID=2002.0")
    with beating(tmp_path / LOCK, lambda: time.time() - 7200):  # (its clock, or its file server's, far behind)
        with pytest.raises(ConfigError, match=r"in use by another run \(pid 4242 on node07, since .*\); use another "
                                              r"run.dir, or stop that run first$"):
            RunLock(tmp_path).acquire()
    lock = RunLock(tmp_path)
    assert lock.acquire() == "stale: the lock of SLURM_JOB_ID=2002.0 on node07; its lock untouched for 0.3 s"
    lock.release()


def test_a_holder_whose_lock_another_launch_took_stops_before_it_saves(tmp_path, monkeypatch, tiny_config):
    """Its beat sees another holder's lock: it neither touches it nor saves over that launch's checkpoints
    (it checked the lock only as training began). A lock renamed aside and back a moment (a racing launch's
    look) is still its own: the beat goes on."""
    from shardline.resilience import run_lock

    monkeypatch.setattr(run_lock, "BEAT_S", 0.02)
    lock = RunLock(tmp_path)
    lock.acquire()
    aside = tmp_path / "aside"
    os.rename(tmp_path / LOCK, aside)
    time.sleep(0.1)
    os.rename(aside, tmp_path / LOCK)
    time.sleep(0.1)
    assert not lock.lost and lock.still_held()
    (tmp_path / LOCK).unlink()
    write_lock(tmp_path, 1, host="node-7")
    time.sleep(0.2)
    assert lock.lost["host"] == "node-7"
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "node-7"  # (not ours to remove)
    trainer = Trainer(tiny_config(run_dir=tmp_path / "run")).build()
    trainer.lock.lost = {"host": "node-7", "pid": 1}
    with pytest.raises(CheckpointError,
                       match=r"another launch \(pid 1 on node-7\) took over the lock of .* stopping before a save"):
        trainer.save_checkpoint()
    trainer.close()


@pytest.mark.parametrize("taken_in", ["step", "eval", "save"])
def test_a_run_whose_lock_another_launch_took_stops_writing_nothing_more(tmp_path, monkeypatch, tiny_config, taken_in):
    """Taken over in a step, an evaluation or a save (an async save's write, as a sync one's): the run
    stops there, not at its next save, which before then appended to the log and rewrote progress.json
    beside the run that took the dir over; the save is not sealed."""
    from shardline.resilience import run_lock

    monkeypatch.setattr(run_lock, "BEAT_S", 0.02)
    trainer = Trainer(tiny_config("--train.steps=8", "--metrics.log_interval=1", "--checkpoint.interval=3",
                                  "--train.eval_interval=3", "--train.eval_batches=2", "--train.micro_batch_size=4",
                                  run_dir=tmp_path / "run")).build()
    run_dir, seen = trainer.run_dir, {}

    def taken_over(work):
        def then_taken():
            out = work()
            if trainer.step == 3 or taken_in != "step":  # another host's launch of this job took the lock over
                (run_dir / LOCK).unlink()
                write_lock(run_dir, 1, host="node-7")
                time.sleep(0.2)  # (its beats see it)
                seen.update(log=(run_dir / "metrics.jsonl").read_text(),
                            progress=(run_dir / "progress.json").read_text())
            return out
        return then_taken

    if taken_in == "step":
        trainer.train_step = taken_over(trainer.train_step)
    elif taken_in == "eval":  # after its first micro-batch: the stop check between them finds it
        forward = trainer.model.forward
        trainer.model.forward = lambda *a, **k: taken_over(lambda: forward(*a, **k))() if not trainer.model.training \
            and not seen else forward(*a, **k)
    else:  # between the save's files and its seal
        trainer.tiers.faults.during_save = lambda step: taken_over(lambda: None)()
    with pytest.raises(CheckpointError, match=r"another launch \(pid 1 on node-7\) took over the lock of run.dir="):
        trainer.train()
    assert trainer.step == 3
    assert not list((run_dir / "checkpoints").glob("step-*[0-9]")), taken_in  # (a save's .tmp may stay)
    assert (run_dir / "progress.json").read_text() == seen["progress"]
    assert (run_dir / "metrics.jsonl").read_text() == seen["log"]
    assert json.loads((run_dir / LOCK).read_text())["host"] == "node-7"  # (not ours to remove)


def test_a_held_lock_is_touched_each_beat_and_no_longer_once_released(tmp_path, monkeypatch):
    from shardline.resilience import run_lock

    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    first = (tmp_path / LOCK).stat().st_mtime_ns
    time.sleep(0.3)
    assert (tmp_path / LOCK).stat().st_mtime_ns > first
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_the_same_jobs_lock_is_not_taken_while_its_holder_runs_here(tmp_path, other_process, monkeypatch):
    """Two srun steps of one allocation share SLURM_JOB_ID; the step id tells them apart, and a
    holder of the same job that still runs on this host is not a restart."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "9f1c")  # torchrun --standalone: a new one every launch
    assert job_id() == "SLURM_JOB_ID=77.1"
    write_lock(tmp_path, other_process.pid, job="SLURM_JOB_ID=77.1")
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {other_process.pid}"):
        RunLock(tmp_path).acquire()
    other_process.kill()
    other_process.wait()
    assert RunLock(tmp_path).acquire() == "same job (SLURM_JOB_ID=77.1): a restart"


@pytest.mark.parametrize("written", [True, False])
def test_a_stale_lock_another_run_took_first_is_not_taken_from_it(tmp_path, other_process, monkeypatch, written):
    """Two starts read the same stale lock; the first replaces it with its own live one (written,
    or just created and still empty) before the second removes it: the second must stop, not
    delete the live lock."""
    write_lock(tmp_path, 999_999_999)  # no such pid: stale
    from shardline.resilience import run_lock

    judge = run_lock._why_free

    def racing_run_takes_it_first(holder, me):
        why = judge(holder, me)
        if written:
            write_lock(tmp_path, other_process.pid)  # the racing run's lock, written after our read
        else:
            (tmp_path / LOCK).write_text("")  # created (O_EXCL), its contents not yet written
        return why

    monkeypatch.setattr(run_lock, "_why_free", racing_run_takes_it_first)
    with pytest.raises(ConfigError, match="in use by another run" if written else "locked by another run"):
        RunLock(tmp_path).acquire()
    held = (tmp_path / LOCK).read_text()
    assert (json.loads(held)["pid"] == other_process.pid) if written else held == ""  # still the racing run's
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]  # nothing left aside


def test_trainer_refuses_a_run_dir_in_use_and_writes_nothing(tiny_config, tmp_path, other_process):
    run = tmp_path / "run"
    write_lock(run, other_process.pid)
    with pytest.raises(ConfigError, match="in use by another run"):
        Trainer(tiny_config(run_dir=run)).build()
    assert sorted(p.name for p in run.iterdir()) == [LOCK]


def test_two_real_runs_on_one_run_dir(tmp_path, small_prepared):
    """A runs; B on the same dir exits 2 with one line; A is killed; C takes the stale lock."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardline", "train"]
    args = [f"--{o}" for o in tiny_overrides(run, small_prepared, "checkpoint.interval=0", "train.eval_interval=0")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    a = subprocess.Popen([*cmd, *args, "--train.steps=100000"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run / LOCK).exists() and time.time() < deadline and a.poll() is None:
            time.sleep(0.2)
        assert (run / LOCK).exists(), "the first run never took the lock"
        b = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)
        assert b.returncode == 2 and "is in use by another run" in b.stderr
        assert len(b.stderr.strip().splitlines()) == 1
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
    c = subprocess.run([*cmd, *args, "--train.steps=3"], env=env, capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stderr[-2000:]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    taken = [e for e in events if e.get("event") == "run_dir_lock_taken_over"]
    assert taken and taken[-1]["reason"].startswith(f"stale: pid {a.pid}")
    assert not (run / LOCK).exists()


def test_release_leaves_a_lock_another_run_took_over(tmp_path, monkeypatch):
    """The same job on another host takes a lock over (a requeue there); when the first holder
    ends after all, its release must not delete the new holder's lock."""
    lock = RunLock(tmp_path)
    assert lock.acquire() is None
    write_lock(tmp_path, 1, host="node-7", job="TORCHELASTIC_RUN_ID=job42")  # taken over meanwhile
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "node-7"


def test_a_lock_that_cannot_be_written_leaves_none_and_an_empty_old_one_is_free(tmp_path, monkeypatch):
    """A start that failed writing its lock (a full disk at close) left it empty: every later start,
    the same job's requeue too, was refused until someone deleted it. A lock is now published
    with its content (written aside, then linked), so none is left, and an empty lock a minute
    old (left by an older start killed between creating and writing it) is taken over."""
    def full_disk(obj, file, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)  # the lock's content, written aside
    with pytest.raises(ConfigError, match=r"its lock cannot be written \(No space left on device\)"):
        RunLock(tmp_path).acquire()
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    lock = RunLock(tmp_path)
    assert lock.acquire() is None and json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]  # the file written aside is gone
    lock.release()
    (tmp_path / LOCK).write_text("")
    with pytest.raises(ConfigError, match="is locked by another run"):  # young: perhaps a start still writing it
        RunLock(tmp_path).acquire()
    old = time.time() - 120
    os.utime(tmp_path / LOCK, (old, old))
    assert RunLock(tmp_path).acquire().startswith("an empty lock a minute old")


def test_a_later_trainer_of_one_process_takes_the_dir_and_the_earlier_refuses_to_train(tiny_config, tmp_path):
    """Within one process the pid says nothing, and a Trainer built and dropped unclosed (a notebook
    rebinding its name) cannot free its lock: a later one takes the dir over, and the earlier one
    refuses to train instead of training over the later one's checkpoints (both trained from step
    0, the second overwriting the first's saves). close() frees the dir and is idempotent."""
    cfg = tiny_config("train.steps=2", "train.eval_interval=0", run_dir=tmp_path / "run")
    earlier = Trainer(cfg).build()
    later = Trainer(cfg).build()
    with pytest.raises(ConfigError, match="was taken over since this Trainer was built"):
        earlier.train()
    earlier.close()  # its release leaves the lock, which is not its own
    assert json.loads((tmp_path / "run" / LOCK).read_text())["since"] == later.lock.mine["since"]
    later.train()
    with pytest.raises(ConfigError, match="this Trainer has trained or was closed, freeing its run dir"):
        later.train()
    with Trainer(cfg).build() as looked_at:  # built, looked at, not trained: leaving the block frees the dir
        assert looked_at.step == 2 and (tmp_path / "run" / LOCK).exists()
    assert not (tmp_path / "run" / LOCK).exists()
    looked_at.close()
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in events if e.get("event") == "run_dir_lock_taken_over"] == [
        "this process: an earlier Trainer in it, ended or not closed, which now refuses to train"]


def test_a_relaunch_on_a_run_dir_in_use_says_nothing_of_resuming_before_its_refusal(tiny_config, tmp_path,
                                                                                    other_process, capsys):
    """`--run.dir` alone on a dir another live run holds printed "holds checkpoints: resuming with the
    config.toml it saved" and then refused it: two lines, the first untrue."""
    from shardline.cli import main

    run = tmp_path / "run"
    Trainer(tiny_config("train.steps=6", run_dir=run)).build().train()
    capsys.readouterr()
    write_lock(run, other_process.pid)
    assert main(["train", f"--run.dir={run}"]) == 2
    out, err = capsys.readouterr()
    assert "resuming with the config.toml" not in out and "is in use by another run" in err
    (run / LOCK).unlink()
    assert main(["train", f"--run.dir={run}", "--dry-run"]) == 0
    assert "resuming with the config.toml it saved" in capsys.readouterr().out  # (free: said as before)


def test_the_dry_run_refuses_a_run_dir_under_a_file_as_the_launch_does(tmp_path, capsys):
    """A parent of run.dir that is a file: the launch could not create it, the dry run said it passed."""
    from shardline.cli import main

    (tmp_path / "notes").write_text("a file")
    for dry in (["--dry-run"], []):
        assert main(["train", f"--run.dir={tmp_path / 'notes' / 'run'}", "--run.device=cpu", *dry]) == 2
        err = capsys.readouterr().err
        assert f"run.dir='{tmp_path / 'notes' / 'run'}' cannot be created: " in err, err


def test_a_trainer_that_trained_leaves_no_group_and_refuses_to_evaluate_or_save(tiny_config, tmp_path):
    """A one-process run under CPU offload made itself a one-rank group: its end takes it down (a caller's
    own init_process_group after it failed with "initialize the default process group twice"), and
    evaluate() or save_checkpoint() after the end are refused (they logged nowhere, and saved into a run
    dir whose lock was let go)."""
    import torch.distributed as dist

    cfg = tiny_config("train.steps=2", "train.eval_interval=0", "checkpoint.interval=0",
                      "memory.cpu_offload=true", run_dir=tmp_path / "run")
    assert not dist.is_initialized()
    try:
        trainer = Trainer(cfg).build()
        assert dist.is_initialized() and trainer.dims.mesh is not None
        assert trainer.evaluate() > 0  # (built, not trained: a look at the model)
        trainer.train()
        assert not dist.is_initialized()
        for call in (trainer.evaluate, trainer.save_checkpoint):
            with pytest.raises(ConfigError, match=r"after this Trainer's train\(\) or close\(\)"):
                call()
        assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))
        # Two Trainers of one process share the group made for the first: the first's end leaves it to the other
        first, second = (Trainer(tiny_config("train.steps=2", "train.eval_interval=0", "memory.cpu_offload=true",
                                             run_dir=tmp_path / name)).build() for name in "ab")
        first.train()
        assert dist.is_initialized()
        second.train()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_build_that_fails_after_the_log_opened_lets_go_of_all_it_took(tiny_config, tmp_path, monkeypatch):
    """A build failing late (its launch notes, here) kept the run dir's descriptor, the log's file and
    the watchdog open until close(): a notebook keeps the failed Trainer in its traceback."""
    import shardline.trainer.state as state

    def broken_notes(*args, **kwargs):
        raise RuntimeError("a note that failed")

    monkeypatch.setattr(state, "launch_notes", broken_notes)
    trainer = Trainer(tiny_config("train.steps=2", run_dir=tmp_path / "run"))
    with pytest.raises(RuntimeError, match="a note that failed"):
        trainer.build()
    assert trainer._run_dir_fd is None and not (tmp_path / "run" / LOCK).exists()
    assert trainer.metrics._jsonl.closed and trainer.ended
