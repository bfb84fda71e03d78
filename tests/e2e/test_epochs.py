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


def test_a_relaunch_names_epochs_where_steps_would_be_replaced_or_run_behind(tiny_config, tmp_path, capsys):
    run = ["train", f"--run.dir={tmp_path / 'run'}", f"--data.path={tiny_config().data.path}", "--train.seq_len=32",
           "--train.global_batch_size=8", "--train.micro_batch_size=4", "--model.dim=64", "--model.n_layers=2",
           "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128", "--train.eval_interval=0",
           "--metrics.tensorboard=false", "--metrics.progress=none", "--data.vocab_size=512", "--train.epochs=0.003",
           "--checkpoint.interval=4"]
    assert main(run) == 0
    assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.steps=40"]) == 2  # an extension that would not
    assert "--train.steps=40 would be replaced: train.epochs=0.003 derives the run's steps" in capsys.readouterr().err
    assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.steps=40", "--train.epochs=0.006"]) == 2
    assert "--train.steps=40 and --train.epochs=0.006 both give the run's length: give one" in capsys.readouterr().err
    assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.epochs=0.001"]) == 2  # behind the saved step
    assert "train.epochs=0.001 gives train.steps=2, behind" in capsys.readouterr().err
    assert main(["train", f"--run.dir={tmp_path / 'run'}", "--train.epochs=0.006"]) == 0  # more passes: it goes on
    ends = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ends if e.get("kind") == "train"][-1] == math.ceil(0.006 * 8242 / 8)


def test_the_steps_are_not_one_more_for_a_float_product(tiny_config):
    train = tiny_config("train.epochs=0.07", "train.global_batch_size=8").train
    assert train.steps_for_epochs(800) == 7  # (0.07 x 800 is 56.000000000000007)


def test_the_dry_run_names_shrunk_data_before_the_steps_it_gives(tmp_path, capsys, small_corpus, small_prepared):
    """Under epochs the steps follow the data: a resume onto fewer sequences is that change (as the
    launch says it), not a run behind its checkpoint to be given more epochs."""
    data = tmp_path / "data.jsonl"
    lines = small_corpus.read_text().splitlines()
    data.write_text("\n".join(lines) + "\n")
    args = ["train", f"--run.dir={tmp_path / 'run'}", f"--data.path={data}",
            f"--data.tokenizer={small_prepared / 'tokenizer.json'}",
            "--train.seq_len=32", "--train.global_batch_size=8", "--train.micro_batch_size=4", "--model.dim=64",
            "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
            "--train.eval_interval=0", "--metrics.tensorboard=false", "--metrics.progress=none",
            "--train.epochs=0.004", "--checkpoint.interval=4"]
    assert main(args) == 0
    data.write_text("\n".join(lines[:40]) + "\n")  # a quarter of the text: fewer steps than saved
    assert main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "was trained on other data" in err and "raise train.epochs" not in err


def test_a_printed_or_saved_config_says_its_steps_are_the_epochs_to_set(tiny_config, tmp_path, capsys):
    """Under train.epochs, train.steps in a printed config (or plan --emit-config's) is a default the
    launch replaces: its line says so, and the file still reads as the same config."""
    from shardline.config import load_config

    assert main(["train", "--print-config", "--train.epochs=2"]) == 0
    text = capsys.readouterr().out
    steps_line = next(line for line in text.splitlines() if line.startswith("steps = "))
    assert steps_line.endswith("# train.epochs=2 sets this at launch, from the data")
    (tmp_path / "my.toml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "my.toml") == load_config(None, ["train.epochs=2"])
    assert main(["train", "--print-config"]) == 0  # (without epochs: no remark)
    assert "sets this at launch" not in capsys.readouterr().out
    trainer = Trainer(tiny_config("train.epochs=0.01", "train.eval_interval=0")).build()
    saved = (tmp_path / "run" / "config.toml").read_text(encoding="utf-8")
    assert f"steps = {trainer.cfg.train.steps}  # train.epochs=0.01 sets" in saved
    assert load_config(tmp_path / "run" / "config.toml").train.steps == trainer.cfg.train.steps
