"""train.epochs: a run's length in passes over its training sequences, train.steps derived at
launch once the data is read (and again, alike, by a resume)."""

from __future__ import annotations

import json
import math

import pytest

from shardline.cli import main
from shardline.errors import ConfigError
from shardline.trainer import Trainer


def _events(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_steps_are_those_of_that_many_passes_and_a_resume_keeps_them(tiny_config, tmp_path):
    trainer = Trainer(tiny_config("train.epochs=0.02", "train.steps=999", "train.eval_interval=0",
                                  "train.stop_at_step=2", "checkpoint.interval=2")).build()
    sequences = len(trainer.data.train)
    steps = math.ceil(0.02 * sequences / 8)
    assert trainer.cfg.train.steps == steps and steps > 2  # (a train.steps given too is replaced)
    trainer.train()
    events = _events(tmp_path / "run")
    note = next(e for e in events if e.get("event") == "steps_from_epochs")
    assert (note["epochs"], note["steps"]) == (0.02, steps)
    data = next(e for e in events if e.get("event") == "data")
    assert data["epochs"] == pytest.approx(0.02, abs=8 / sequences)  # the data event's count of passes agrees
    assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.stop_at_step=0"]) == 0  # the saved config
    ends = [e for e in _events(tmp_path / "run") if e.get("kind") == "train"]
    assert ends[-1]["step"] == steps and not [e for e in _events(tmp_path / "run") if e.get("event") == "optim_changed"]


def test_values_that_depend_on_the_steps_are_checked_once_they_are_known(tiny_config, tmp_path, capsys):
    with pytest.raises(ConfigError, match="train.epochs"):
        Trainer(tiny_config("train.epochs=-1")).build()
    with pytest.raises(ConfigError, match=r"train.stop_at_step=50 is invalid: must be <= train.steps \(\d+\), which "
                                          r"train.epochs=0.01 gives over 8,\d+ training sequences"):
        Trainer(tiny_config("train.epochs=0.01", "train.stop_at_step=50")).build()
    with pytest.raises(ConfigError, match=r"faults.nan_step=500 is past train.steps=\d+: the drill would never fire"):
        Trainer(tiny_config("train.epochs=0.01", "faults.nan_step=500")).build()
    cfg = tiny_config()
    args = ["train", "--dry-run", f"--run.dir={tmp_path / 'dry'}", f"--data.path={cfg.data.path}",
            "--train.epochs=0.02", "--train.global_batch_size=8", "--train.seq_len=32"]
    assert main(args) == 0
    assert "steps (train.epochs=0.02)" in capsys.readouterr().out
