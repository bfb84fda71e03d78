"""A save the disk refuses: one clear line, no partial folder, and training goes on (or stops)
by checkpoint.on_error; a later run resumes from the last good checkpoint.

A real full disk: a small tmpfs mounted as the run dir (needs root, as on our CI machines;
skipped elsewhere)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from shardline.errors import TRY_LATER, AnomalyHalt, CheckpointError, ConfigError, ShardlineError, exit_code
from shardline.resilience.checkpoint import Checkpointer
from shardline.trainer import Trainer


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    # ~2.5 MB: the tiny model's first checkpoint (~1.7 MB with Adam states) fits, a second does not.
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)])


def events(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "event"]


def test_a_full_disk_is_one_line_leaves_nothing_and_training_goes_on(tiny_config, small_disk):
    run = small_disk / "run"
    # Trained to its end, its last state not kept: not a success for the scheduler (it exited 0)
    with pytest.raises(CheckpointError, match=r"^checkpoint of step 12 failed: no space left on .*; the run ends "
                                              r"here; a rerun resumes step-000006: free space and rerun"):
        Trainer(tiny_config("train.steps=12", "checkpoint.keep=3", run_dir=run)).build().train()
    failed = [e for e in events(run) if e["event"] == "checkpoint_failed"]
    assert failed and failed[0]["step"] == 12
    assert events(run)[-1]["event"] == "end" and events(run)[-1]["outcome"] == "save_refused"  # (not "complete")
    account = json.loads((run / "progress.json").read_text())  # its last state is not kept: to be rerun
    assert account["finished"] is False and account["run_complete"] is False
    assert account["phase"] == "failed"  # (the refusal comes after the launch's end: an error ended it all the same)
    assert failed[0]["error"].startswith(f"no space left on {run / 'checkpoints'} (needs ~")
    assert " MB, " in failed[0]["error"] and " GB" not in failed[0]["error"]  # 1.7 MB, not "0.00 GB"
    assert "with checkpoint.keep=3 the disk holds up to 4 at once" in failed[0]["error"]  # (why keep 3 did not fit)
    assert "lower keep" not in failed[0]["error"]  # (one checkpoint held: a lower keep would free nothing)
    # The last step's save has no next interval to retry it: the line says what a rerun resumes (not RAM: no tier).
    assert failed[0]["action"] == "none: the run ends here; a rerun resumes step-000006: free space and rerun to " \
                                  "save this state"
    assert not list((run / "checkpoints").glob("*.tmp"))  # the partial save is gone
    assert Checkpointer(run, keep=3).latest_valid().name == "step-000006"
    resumed = Trainer(tiny_config("train.steps=12", "checkpoint.interval=0", run_dir=run)).build()
    assert resumed.step == 6


def test_a_finished_run_whose_last_save_the_disk_refused_keeps_its_newer_ram_snapshot(tiny_config, small_disk,
                                                                                      tmp_path):
    """Its last step's state is then only in RAM (the memory tier): a rerun resumes from there,
    not from the older checkpoint on disk (here one trained on to step 16). Once a finished run's
    last step is on disk, the snapshots go."""
    run, shm = small_disk / "run", tmp_path / "shm"
    tiers = ["train.steps=12", "checkpoint.keep=3", "checkpoint.memory_interval=4", f"checkpoint.memory_dir={shm}"]
    with pytest.raises(CheckpointError, match="checkpoint of step 12 failed"):
        Trainer(tiny_config(*tiers, run_dir=run)).build().train()
    assert [e["step"] for e in events(run) if e["event"] == "checkpoint_failed"] == [12]
    held = {f.name for f in shm.rglob("own-*.bin")}
    assert held and all("-000012" in name or "-12." in name for name in held), held
    shutil.rmtree(run / "checkpoints" / "step-000006")  # room for step 12 now
    rerun = Trainer(tiny_config(*tiers, "train.steps=16", run_dir=run)).build()
    assert rerun.step == 12
    rerun.train()
    assert Checkpointer(run, keep=3).latest_valid().name == "step-000016" and not list(shm.rglob("own-*.bin"))


def test_on_error_stop_stops_with_the_reason(tiny_config, small_disk):
    run = small_disk / "run"
    with pytest.raises(CheckpointError, match="no space left on .*checkpoint.on_error=stop.*earlier checkpoints are "
                                              "intact"):
        Trainer(tiny_config("train.steps=12", "checkpoint.on_error=stop", run_dir=run)).build().train()
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert not (run / ".lock").exists()
    # The run's log says why it ended (it ended at `start`: the reason was on stderr alone)
    (failed,) = [e for e in events(run) if e["event"] == "checkpoint_failed"]
    assert failed["step"] == 12 and failed["action"] == "stop (checkpoint.on_error=stop)"


def test_read_only_run_dir_or_checkpoints_folder_is_one_line_before_training(tiny_config, small_disk):
    run = small_disk / "run"
    Trainer(tiny_config("train.steps=6", run_dir=run)).build().train()
    ckpts = run / "checkpoints"
    # A read-only file system over checkpoints/ (root ignores permission bits, not a ro mount).
    ro = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=100k", "tmpfs", str(ckpts)], capture_output=True)
    if ro.returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        before = sorted(p.name for p in run.iterdir())
        with pytest.raises(ConfigError) as err:
            Trainer(tiny_config("train.steps=12", run_dir=run)).build()
        assert f"{ckpts} is not writable (Read-only file system)" in str(err.value)
        assert "\n" not in str(err.value) and sorted(p.name for p in run.iterdir()) == before  # lock released
    finally:
        subprocess.run(["umount", "-l", str(ckpts)])
    if subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True).returncode:
        pytest.skip("cannot remount read-only here")
    try:
        with pytest.raises(ConfigError, match=f"run.dir='{run}' is not writable: Read-only file system"):
            Trainer(tiny_config("train.steps=12", run_dir=run)).build()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)])


@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_a_halt_whose_save_the_disk_refuses_says_so(tiny_config, small_disk, on_error):
    """The halt is what is reported either way, naming the failed save, not a path never written."""
    run = small_disk / "run"
    trainer = Trainer(tiny_config("train.steps=12", "faults.nan_step=9", "anomaly.action=halt",
                                  f"checkpoint.on_error={on_error}", run_dir=run)).build()
    with pytest.raises(AnomalyHalt, match=r"at step 9; the state before that step could not be saved \(") as halted:
        trainer.train()
    assert (halted.value.__cause__ is not None) == (on_error == "stop")
    assert [e["checkpoint"] for e in events(run) if e["event"] == "halt"] == [None]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_halt_whose_resave_after_a_rollback_the_disk_refuses_says_so(tiny_config, small_disk, mode):
    """The halt right after a rollback saves its step again (the copy on disk lacks the rollback);
    refused, the older copy of that step is still there and is not named as the state saved."""
    run = small_disk / "run"
    trainer = Trainer(tiny_config("anomaly.action=rollback", "anomaly.max_rollbacks=1", "anomaly.min_history=2",
                                  "checkpoint.interval=3", "train.eval_interval=0", f"checkpoint.mode={mode}",
                                  "faults.nan_step=4", "faults.spike_step=4", run_dir=run)).build()
    with pytest.raises(AnomalyHalt, match=r"at step 4; the state before that step could not be saved \(.*\); what "
                                          r"is on disk predates the rollback to step 3: rerun with "
                                          r"train.skip_batches=\[3\]"):
        trainer.train()
    # step 3 saved again right after the rollback, then by the halt: both refused
    assert [e["step"] for e in events(run) if e["event"] == "checkpoint_failed"] == [3, 3]
    assert [e["checkpoint"] for e in events(run) if e["event"] == "halt"] == [None]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_whose_resave_after_a_rollback_the_disk_refuses_says_so(tiny_config, small_disk, mode):
    """A stop right after a rollback saves that step again; refused, the older copy of the step
    (without the rollback and the batch it skipped) is not named as the state saved."""
    from shardline.errors import Preempted

    run = small_disk / "run"
    trainer = Trainer(tiny_config("anomaly.action=rollback", "anomaly.min_history=2", "checkpoint.interval=3",
                                  "train.eval_interval=0", f"checkpoint.mode={mode}", "faults.spike_step=4",
                                  run_dir=run)).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.rollbacks else None
    with pytest.raises(Preempted, match=r"SIGTERM at step 3; its checkpoint could not be written .*; what is on "
                                        r"disk predates the rollback to step 3: rerun with train.skip_batches=\[3\]"):
        trainer.train()
    # step 3 saved again right after the rollback, then by the stop: both refused; no interval retries the stop's
    failed = [e for e in events(run) if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [3, 3] and failed[-1]["action"].startswith("none: the run ends here")
    assert [e["checkpoint"] for e in events(run) if e["event"] == "preempted"] == [None]


def _fill(disk) -> None:
    """Fill the disk with a file of its own, to the last byte (as another job's output would)."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_a_disk_filled_by_something_else_never_stops_the_run(tiny_config, small_disk, capsys):
    """progress.json (every step), metrics.jsonl and TensorBoard are written as the run goes: a
    full disk raised OSError out of the loop (a traceback, exit 1). They are the run's accounts,
    not its work: it trains to its end, the saves refused as on_error says, and a warning once."""
    run = small_disk / "run"
    trainer = Trainer(tiny_config("train.steps=8", "checkpoint.interval=4", "metrics.log_interval=1",
                                  "metrics.tensorboard=true", run_dir=run)).build()
    _fill(small_disk)
    with pytest.raises(CheckpointError, match="checkpoint of step 8 failed: no space left"):
        trainer.train()
    assert trainer.step == 8
    err = capsys.readouterr().err
    assert err.count("metrics.jsonl cannot be written") == 1, err
    (small_disk / "filler").unlink()
    assert not list((run / "checkpoints").glob("step-*"))  # refused, not half-written


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rollback_whose_resave_the_disk_refuses_under_on_error_stop_names_the_batches(tiny_config, small_disk,
                                                                                        mode):
    """The copy of step 3 on disk predates the rollback: a rerun from it trains the bad batch again,
    so the stop names train.skip_batches (it said only "earlier checkpoints are intact")."""
    run = small_disk / "run"
    trainer = Trainer(tiny_config("anomaly.action=rollback", "anomaly.min_history=2", "checkpoint.interval=3",
                                  "train.eval_interval=0", "checkpoint.on_error=stop", "faults.nan_step=4",
                                  f"checkpoint.mode={mode}", run_dir=run)).build()
    with pytest.raises(CheckpointError, match=r"checkpoint.on_error=stop.*predates the rollback to step 3: rerun "
                                              r"with train.skip_batches=\[3\]"):
        trainer.train()


def test_a_stop_says_which_refused_save_no_interval_retries(tiny_config, small_disk):
    """Async saves, the disk holding one: step 4's write is refused as the stop after step 5 drains
    it (retried: the stop saves step 5), then the stop's own save of step 5 (not retried)."""
    from shardline.errors import Preempted

    run = small_disk / "run"
    trainer = Trainer(tiny_config("train.steps=8", "checkpoint.interval=2", "checkpoint.mode=async",
                                  "train.eval_interval=0", run_dir=run)).build()
    trainer.guard.stop_requested = lambda: "SIGTERM" if trainer.step == 5 else None
    with pytest.raises(Preempted, match="SIGTERM at step 5; its checkpoint could not be written"):
        trainer.train()
    failed = [(e["step"], e["action"].split(";")[0]) for e in events(run) if e["event"] == "checkpoint_failed"]
    assert failed == [(4, "continue"), (5, "none: the run ends here")], failed
    retried = next(e["action"] for e in events(run) if e["event"] == "checkpoint_failed")
    assert retried == "continue; retried at the next interval; newest on disk: step-000002"  # since when none saved


def _fill_but(disk, leave: int) -> None:
    """Fill the file system of `disk` but for `leave` bytes."""
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(disk).free - leave))


def test_torch_s_writer_cut_short_by_a_full_disk_is_the_storage_s(small_disk):
    """torch.save to a path reports a full disk as a RuntimeError ("unexpected pos", an iostream
    error), not an OSError: a save failing so (DCP writes its tensors with it) stopped a run with a
    traceback. It is a full disk where the folder's file system is nearly full, else an I/O error."""
    import errno

    import torch

    from shardline.resilience.save_failures import storage_error

    _fill_but(small_disk, 4096)
    raised = []
    for name, size in [("big", 100_000), ("small", 10)]:
        try:
            torch.save(torch.zeros(size), small_disk / f"{name}.pt")
        except Exception as e:  # noqa: BLE001 (whatever torch raises: each must read as the storage's)
            raised.append(e)
    assert len(raised) == 2 and any(isinstance(e, RuntimeError) for e in raised)  # (what torch 2.x raises)
    assert [storage_error(e, small_disk).errno for e in raised] == [errno.ENOSPC] * 2
    runtime = next(e for e in raised if isinstance(e, RuntimeError))
    assert storage_error(runtime).errno == errno.EIO  # (no folder to look at: the storage's all the same)
    (small_disk / "filler").unlink()
    assert storage_error(runtime, small_disk).errno == errno.EIO  # room enough: not a full disk
    assert storage_error(RuntimeError("CUDA error: an illegal memory access")) is None  # not the storage's


def test_a_save_torch_s_writer_fails_on_a_full_disk_is_said_as_a_full_disk(tiny_config, small_disk, monkeypatch):
    """Where torch's writer is cut short (which write that is depends on the bytes left: the test
    above shows torch raising so on this disk), the run says one line, leaves no partial folder and
    trains on to its end (a two-rank run stopped with a traceback). torch.save here raises as it
    does when a write is cut short (DCP writes its tensors with it), before any Python-level write
    meets the full disk with an OSError."""
    import torch

    run = small_disk / "run"

    def cut_short(*args, **kwargs):  # (the disk is full: what torch raises where its write is cut short)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    trainer = Trainer(tiny_config("train.steps=4", "checkpoint.interval=2", "train.eval_interval=0",
                                  run_dir=run)).build()
    _fill_but(small_disk, 4096)
    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(CheckpointError, match=r"^checkpoint of step 4 failed: no space left on "):
        trainer.train()
    failed = [e for e in events(run) if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [2, 4] and failed[0]["action"].startswith("continue")
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_a_relaunch_on_a_disk_still_full_is_one_line_and_leaves_nothing(tiny_config, small_disk):
    """A rerun before space is freed stopped with a traceback writing config.toml, and left its
    temporary file behind."""
    run = small_disk / "run"
    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0", run_dir=run)).build().train()
    before = sorted(p.name for p in run.iterdir())
    _fill_but(small_disk, 4096)  # (a page: the run's lock is written, its config is not)
    # Its next save would be refused after training to it (under torchrun's restarts, again and again):
    # refused before it trains, by the size of its newest checkpoint
    with pytest.raises(CheckpointError, match=rf"^no space to save on {run / 'checkpoints'}: 4.1 kB free, and a "
                                              r"checkpoint of this run takes ~1.\d MB \(step-000002\); free space "):
        Trainer(tiny_config("train.steps=4", "checkpoint.interval=2", "train.eval_interval=0", run_dir=run)).build()
    with pytest.raises(ShardlineError, match=r"No space left on device: cannot write the run's files into "
                                             rf"{run}: free space there, or give another run.dir"):
        Trainer(tiny_config("train.steps=4", "checkpoint.interval=0", "train.eval_interval=0", run_dir=run)).build()
    assert sorted(p.name for p in run.iterdir()) == before  # (no .config.toml.*.tmp)
    # A relaunch with nothing left to train saves nothing: not refused (a requeue of a finished run)
    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0", run_dir=run)).build().close()


def test_a_run_dir_s_tokenizer_is_replaced_whole_or_not_at_all(tiny_config, small_disk):
    """The run dir's tokenizer.json (eval and export read it) was rewritten in place: a full disk
    left it cut short. Now a launch that cannot write it leaves the old one whole and says so in one
    line; one whose copy is already the same writes nothing (a relaunch on a nearly full disk)."""
    run = small_disk / "run"
    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0", run_dir=run)).build().train()
    own = run / "tokenizer.json"
    stamp = own.stat().st_mtime_ns
    # (no saves: the disk has no room for a second checkpoint, which a relaunch that saves is refused over)
    Trainer(tiny_config("train.steps=4", "checkpoint.interval=0", "train.eval_interval=0", run_dir=run)).build().close()
    assert own.stat().st_mtime_ns == stamp  # the same tokenizer: not written again
    fresh = small_disk / "fresh"  # a launch that died before it saved anything left another tokenizer there
    fresh.mkdir()
    (fresh / "tokenizer.json").write_text('{"stale": true}', encoding="utf-8")
    _fill_but(small_disk, 8192)  # the lock's page and the config's; not the tokenizer's
    with pytest.raises(ShardlineError, match=r"No space left on device: cannot write the run's files into "):
        Trainer(tiny_config("train.steps=4", "train.eval_interval=0", run_dir=fresh)).build()
    assert (fresh / "tokenizer.json").read_text() == '{"stale": true}' and not list(fresh.glob(".tokenizer.json.*"))


def test_an_async_save_the_disk_refuses_says_what_it_needs(tiny_config, small_disk):
    """A background save refused before any checkpoint was on disk said "needs ~0 B": its size is
    the model's (~16 bytes a parameter), as a synchronous one's."""
    run = small_disk / "run"
    trainer = Trainer(tiny_config("train.steps=4", "checkpoint.interval=2", "checkpoint.mode=async",
                                  "train.eval_interval=0", run_dir=run)).build()
    _fill_but(small_disk, 256 << 10)  # (room for the log, not a checkpoint)
    with pytest.raises(CheckpointError, match="checkpoint of step 4 failed: no space left on "):
        trainer.train()
    needs = [e["error"].split("needs ~")[1].split(",")[0] for e in events(run) if e["event"] == "checkpoint_failed"]
    assert needs and all(n != "0 B" and n.endswith("MB") for n in needs), needs


def test_an_export_to_a_full_disk_is_one_line_and_leaves_no_folder(tiny_config, small_disk, tmp_path, capsys):
    """safetensors reports a full disk as its own error ("... (os error 28)"): a traceback, where
    the storage's refusal is one line."""
    from shardline.cli import main

    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0")).build().train()
    _fill_but(small_disk, 400 << 10)
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(small_disk / "a" / "b" / "hf")]) == 2
    assert "No space left on device: writing " in capsys.readouterr().err
    assert [p.name for p in small_disk.iterdir()] == ["filler"]  # (nor the folders made for it)


def test_a_prepare_the_disk_fills_under_says_so_and_resumes(small_disk, small_corpus, capsys):
    """numpy's refused write says "N requested and M written": the line names the full disk, the
    folder and what a rerun does, and the rerun once space is freed finishes it."""
    from shardline.cli import main

    out = small_disk / "prep"
    args = ["prepare", str(small_corpus), "--out", str(out), "--vocab-size", "512", "--quiet", "--shard-tokens", "4096"]
    _fill_but(small_disk, 48 << 10)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"shardline: error: prepare: the disk holding {out} is full (" in err and "free space, then the same " \
        "command" in err, err
    (small_disk / "filler").unlink()
    assert main(args) == 0
    assert main(["prepare", "--verify", "--out", str(out)]) == 0


def test_an_evaluation_whose_stdout_is_a_full_disk_says_so_in_one_line(tiny_config, small_disk, tmp_path):
    import os
    import sys

    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=2")).build().train()
    _fill(small_disk)
    with open(small_disk / "out.json", "w") as out:
        done = subprocess.run([sys.executable, "-m", "shardline", "eval", str(tmp_path / "run"), "--json"], stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "the evaluation's result could not be written to stdout (No space left on device): loss " in done.stderr


def test_a_run_whose_progress_file_the_full_disk_froze_says_so_at_its_end(tiny_config, small_disk, capsys):
    """progress.json, which a requeue script reads, could not be written after the disk filled: it
    still said step 0, unfinished, and the run ended with a single progress_not_written event."""
    import json as _json

    run = small_disk / "run"
    trainer = Trainer(tiny_config("train.steps=3", "checkpoint.interval=0", "train.eval_interval=0", run_dir=run))
    trainer.build()
    _fill(small_disk)
    trainer.train()
    assert f"shardline: warning: {run / 'progress.json'} could not be written at the end (" in capsys.readouterr().err
    progress = run / "progress.json"  # (never written, or an earlier state: what the warning is for)
    assert not progress.exists() or _json.loads(progress.read_text())["phase"] != "ended"


def test_a_last_snapshot_refused_under_no_disk_saves_says_nothing_is_kept(tiny_config, small_disk, tmp_path):
    """Under checkpoint.interval=0 a run that trains to its end lets its snapshots go: its last
    one refused said "a rerun resumes an older snapshot", which the end had just removed."""
    run = tmp_path / "run"
    Trainer(tiny_config("train.steps=4", "checkpoint.interval=0", "checkpoint.memory_interval=2",
                        "train.eval_interval=0", f"checkpoint.memory_dir={small_disk}", run_dir=run)).build().train()
    failed = [e for e in events(run) if e["event"] == "memory_snapshot_failed"]
    assert [e["step"] for e in failed] == [4], failed
    assert failed[0]["action"].startswith("none: the run ends here, trained to its end (checkpoint.interval=0")
    assert not list(small_disk.rglob("own-*.bin"))  # (what the line says: nothing kept)


def test_tensorboard_s_writer_thread_meeting_a_full_disk_is_one_warning(tiny_config, small_disk, capsys,
                                                                         monkeypatch):
    """TensorBoard's own writer thread raised the disk's error, which Python printed as a thread's
    traceback before the log's one-line warning."""
    run = small_disk / "run"
    trainer = Trainer(tiny_config("train.steps=40", "checkpoint.interval=0", "train.eval_interval=0",
                                  "metrics.tensorboard=true", "metrics.log_interval=1", run_dir=run)).build()
    import threading

    raised = []  # (what Python would print as "Exception in thread ...")
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    _fill(small_disk)  # (the files' last pages fill first: 40 logged steps pass them)
    trainer.train()
    assert not raised, raised
    err = capsys.readouterr().err
    assert "shardline: warning: TensorBoard cannot be written (" in err
    assert "Exception in thread" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_refused_save_drill_takes_the_on_error_path(tiny_config, tmp_path, mode):
    """faults.fail_save_step kills the rank mid-save (a crash): checkpoint.on_error had no drill short
    of filling a disk. faults.refuse_save_step has the storage refuse that step's save: `continue`
    goes on (the next save lands), `stop` ends the run in one line, and nothing is left half-written."""
    drill = ["train.steps=12", "train.eval_interval=0", "faults.refuse_save_step=6", f"checkpoint.mode={mode}"]
    trainer = Trainer(tiny_config(*drill, run_dir=tmp_path / "go_on")).build()
    trainer.train()
    assert trainer.tiers.refused == {6}  # (what a best named there is told by: trainer/intervals.py)
    (failed,) = [e for e in events(tmp_path / "go_on") if e["event"] == "checkpoint_failed"]
    assert failed["step"] == 6 and "the storage refused the write (drill: faults.refuse_save_step)" in failed["error"]
    assert failed["action"].startswith("continue; retried at the next interval")
    assert [p.name for p in Checkpointer(tmp_path / "go_on", keep=3).list()] == ["step-000012"]
    assert not list((tmp_path / "go_on" / "checkpoints").glob("*.tmp"))
    with pytest.raises(CheckpointError, match=r"^checkpoint of step 6 failed: cannot write .*drill: "
                                              r"faults.refuse_save_step\); stopping \(checkpoint.on_error=stop\), "
                                              r"none was saved before it") as stopped:
        Trainer(tiny_config(*drill, "checkpoint.on_error=stop", run_dir=tmp_path / "stop")).build().train()
    assert not list((tmp_path / "stop" / "checkpoints").glob("*"))
    # The drill's EIO is transient: TRY_LATER (75), sync or async (a walkthrough's async run exited 2, which a
    # requeue script stops on), and so for a refused last save under on_error=continue
    assert exit_code(stopped.value) == TRY_LATER
    with pytest.raises(CheckpointError, match="checkpoint of step 12 failed") as last:
        Trainer(tiny_config(*drill[:2], "faults.refuse_save_step=12", f"checkpoint.mode={mode}",
                            run_dir=tmp_path / "last")).build().train()
    assert exit_code(last.value) == TRY_LATER
    progress = json.loads((tmp_path / "last" / "progress.json").read_text())  # (what a script under torchrun reads)
    assert (progress["phase"], progress["exit_code"], progress["run_complete"]) == ("failed", TRY_LATER, False)


def test_the_no_room_check_counts_a_save_cut_at_the_step_it_saves_next_as_free(tmp_path, monkeypatch):
    """A save killed mid-write leaves step-N.tmp, which the relaunch's save of step N removes first: its
    bytes are free to that save (a leftover of another step is not: nothing removes it before)."""
    from collections import namedtuple

    from shardline.config import load_config
    from shardline.resilience import tiers

    root = tmp_path / "checkpoints"
    (root / "step-000002").mkdir(parents=True)
    (root / "step-000002" / "state").write_bytes(b"x" * 1000)
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda _: namedtuple("U", "total used free")(10**6, 0, 500))
    cfg = load_config(None, ["checkpoint.interval=2", "train.steps=6"])
    with pytest.raises(CheckpointError, match=r"^no space to save on .*: 500 B free, and a checkpoint of this run "):
        tiers.refuse_no_room(cfg, root / "step-000002", root)
    for step, refused in ((6, True), (4, False)):  # (its next save: step 4)
        (root / f"step-{step:06d}.tmp").mkdir()
        (root / f"step-{step:06d}.tmp" / "part").write_bytes(b"x" * 800)
        if refused:
            with pytest.raises(CheckpointError):
                tiers.refuse_no_room(cfg, root / "step-000002", root)
        else:
            tiers.refuse_no_room(cfg, root / "step-000002", root)
