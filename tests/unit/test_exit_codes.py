"""Exit codes a requeue script acts on: 2 for an input the same command meets again (fix it),
75 (try later) for a storage that failed or a run dir another live run holds."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from shardline import errors
from shardline.errors import TRY_LATER, AnomalyHalt, CheckpointUnreadable, ConfigError, DataError, TryLater, exit_code
from shardline.parallel.distributed import agreed
from shardline.resilience.run_lock import LOCK, RunLock
from shardline.trainer import Trainer
from tests.unit.test_run_lock import write_lock


@pytest.fixture
def trained(tiny_config, tmp_path):
    Trainer(tiny_config("train.steps=12")).build().train()  # checkpoints at 6 and 12
    return tmp_path / "run"


def _raised_while(handling: OSError, error: errors.ShardlineError) -> errors.ShardlineError:
    try:
        try:
            raise handling
        except OSError:
            raise error from None  # (the shape of the code's reads: said as the file, the OSError its context)
    except errors.ShardlineError as e:
        return e


@pytest.mark.parametrize("code,expected", [(errno.EIO, TRY_LATER), (errno.ESTALE, TRY_LATER),
                                           (errno.ETIMEDOUT, TRY_LATER), (errno.EACCES, 2), (errno.ENOENT, 2),
                                           (errno.ENOSPC, 2)])
def test_an_error_raised_on_a_failed_read_takes_the_storages_code(code, expected):
    error = _raised_while(OSError(code, "x"), DataError("data/x.jsonl cannot be read"))
    assert exit_code(error) == expected


def test_each_kind_keeps_its_code():
    assert exit_code(ConfigError("train.lr=-1 is invalid")) == 2
    assert exit_code(CheckpointUnreadable("checkpoint x: cannot read y")) == TRY_LATER
    assert isinstance(CheckpointUnreadable("x"), errors.CheckpointError)  # (caught as one by the resume's search)
    assert exit_code(errors.RunDirInUse("in use")) == TRY_LATER and isinstance(errors.RunDirInUse(""), ConfigError)
    assert exit_code(_raised_while(OSError(errno.EIO, "x"), AnomalyHalt("loss is nan"))) == 3  # (not a retry)
    # a model changed in the code but not in its count or tp plan: one line (a ValueError still, to a caller)
    assert exit_code(errors.ModelError("parameter x has no tensor-parallel layout")) == 2
    assert isinstance(errors.ModelError(""), ValueError)


@pytest.mark.parametrize("code,kind", [(errno.EIO, TryLater), (errno.EACCES, errors.ShardlineError)])
def test_a_checks_storage_error_keeps_whether_it_may_pass_later(code, kind):
    def check():
        raise OSError(code, "the storage said no")

    with pytest.raises(errors.ShardlineError) as raised:
        agreed(check, world_size=1)
    assert type(raised.value) is kind and "the storage said no" in str(raised.value)


def test_a_run_dir_this_jobs_last_launch_still_holds_exits_75_another_jobs_2(tmp_path, monkeypatch):
    """A requeue whose last launch is still leaving may pass later; another job given the same
    run.dir would only race it on each retry."""
    from shardline.cli import main

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    try:
        write_lock(tmp_path / "run", other.pid, job="SLURM_JOB_ID=42")
        with pytest.raises(errors.RunDirInUse):
            RunLock(tmp_path / "run").acquire_for_job(is_main=True, world_size=1)
        assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.steps=2"]) == TRY_LATER
        assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.stepz=2"]) == 2
        write_lock(tmp_path / "run", other.pid, job="SLURM_JOB_ID=7")  # another job's
        assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.steps=2"]) == 2
        monkeypatch.delenv("SLURM_JOB_ID")
        write_lock(tmp_path / "run", other.pid)  # no launcher: two shells' runs
        assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.steps=2"]) == 2
        assert (tmp_path / "run" / LOCK).is_file()
    finally:
        other.kill()
        other.wait()


def test_a_refusal_raised_on_a_failed_write_keeps_its_code_through_the_lock_broadcast(tmp_path, monkeypatch):
    """The checkpoints folder's write probe failed with EIO: acquire() said 75, but the broadcast
    every rank raises from rebuilt a plain ConfigError, 2."""
    from pathlib import Path

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    write = Path.write_bytes

    def failing(self, data):
        if ".write-probe-" in self.name:
            raise OSError(errno.EIO, "Input/output error")
        return write(self, data)

    monkeypatch.setattr(Path, "write_bytes", failing)
    with pytest.raises(errors.ShardlineError, match="is not writable \\(Input/output error\\)") as raised:
        RunLock(tmp_path / "run").acquire_for_job(is_main=True, world_size=1)
    assert exit_code(raised.value) == TRY_LATER


def test_a_resume_the_storage_fails_to_read_exits_75(trained, monkeypatch, capsys):
    """The newest checkpoint's read fails with EIO: the launch stops (not passing over it) and says
    try later, where a corrupt checkpoint's refusal (all damaged) is 2."""
    from shardline.cli import main
    from shardline.resilience import checkpoint

    sha256 = checkpoint._sha256

    def failing_disk(f):
        if "step-000012" in str(f):
            raise OSError(errno.EIO, "Input/output error")
        return sha256(f)

    monkeypatch.setattr(checkpoint, "_sha256", failing_disk)
    assert main(["train", f"--run.dir={trained}", "--train.steps=14"]) == TRY_LATER
    assert "the storage failed, so the run stops" in capsys.readouterr().err
