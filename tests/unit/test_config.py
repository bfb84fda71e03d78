"""Config: TOML + overrides, typed keys, and one clear ConfigError per mistake."""

from __future__ import annotations

import json
import re
from pathlib import Path
import tomllib

import pytest

from shardline.config import Config, from_dict, load_config, load_relaunch_config, save_config, to_toml
from shardline.errors import ConfigError
from shardline.preflight import check_config

REQUIRED_KEYS = ["model.preset", "train.steps", "train.seq_len", "train.global_batch_size",
                 "train.micro_batch_size", "train.seed", "train.precision", "optim.lr", "run.dir",
                 "checkpoint.interval", "checkpoint.keep", "metrics.log_interval", "data.path"]


def test_documented_keys_exist():
    flat = {f"{s}.{k}" for s, keys in Config().to_dict().items() for k in keys}
    assert set(REQUIRED_KEYS) <= flat


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\nprecision = "bf16"\n[optim]\nlr = 1e-4\n')
    cfg = load_config(path, ["--train.steps=9", "run.dir=runs/x", "optim.lr=2", "train.compile=true"])
    assert cfg.train.steps == 9 and cfg.train.precision == "bf16"
    assert cfg.optim.lr == 2.0 and isinstance(cfg.optim.lr, float)
    assert cfg.run.dir == "runs/x" and cfg.train.compile is True


def test_resolved_config_round_trips():
    cfg = load_config(None, ["train.steps=5", 'data.path=a "quoted" path', "train.precision=fp16"])
    again = from_dict(tomllib.loads(to_toml(cfg)))
    assert again == cfg
    # control characters (a field name with a newline, a tab, DEL) written as escapes, not raw
    cfg = load_config(None, ["data.text_field=a\nb\tc\x7fd\x01", "run.dir=runs/ü"])
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg


def test_a_relaunch_reads_the_saved_config_but_its_launch_only_settings(tmp_path):
    """A run's saved config.toml gives a relaunch its settings, not those of one launch: the early
    stop, the checkpoint it resumed, its drills; run.dir is where the file was found."""
    first = load_config(None, ["run.dir=old/place", "run.resume=elsewhere/step-000004", "train.steps=50",
                               "train.stop_at_step=20", "faults.nan_step=7", "faults.slow_rank=1",
                               "faults.slow_factor=2", "optim.lr=2e-5", "data.path=corpus dir",
                               "metrics.profile_steps=[3, 4]"])
    save_config(first, tmp_path / "config.toml")
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # written through a file set aside
    again = load_relaunch_config(tmp_path / "config.toml", str(tmp_path), ["train.steps=60"])
    defaults = Config()
    assert again.run.dir == str(tmp_path) and again.run.resume == defaults.run.resume
    assert again.train.stop_at_step == 0 and again.faults == defaults.faults
    assert (again.train.steps, again.optim.lr, again.data.path) == (60, 2e-5, "corpus dir")
    assert again.metrics.profile_steps == first.metrics.profile_steps



def test_a_hand_broken_saved_config_names_its_file_and_an_override_mends_it(tmp_path):
    """`steps = "lots"` in a run's config.toml: the relaunch's `--train.steps=6` was refused as
    'train.steps='lots' has the wrong type', naming neither the file nor a way past it."""
    saved = tmp_path / "config.toml"
    save_config(load_config(None, ["train.steps=4"]), saved)
    saved.write_text(saved.read_text(encoding="utf-8").replace("steps = 4", 'steps = "lots"'), encoding="utf-8")
    assert load_relaunch_config(saved, str(tmp_path), ["--train.steps=6"]).train.steps == 6
    with pytest.raises(ConfigError, match=rf"train.steps='lots' has the wrong type.*\(in {re.escape(str(saved))}, the "
                                          r"run's saved config: fix it there, or give --train.steps=VALUE\)$"):
        load_relaunch_config(saved, str(tmp_path), ["optim.lr=1e-4"])
    saved.write_text("[train]\nsteps", encoding="utf-8")  # cut short
    with pytest.raises(ConfigError, match=r"is not valid TOML.*\(the run's saved config: fix it there, or give "
                                          r"--config FILE\)$"):
        load_relaunch_config(saved, str(tmp_path))
    saved.write_text("", encoding="utf-8")  # emptied (a crash after the rename, before the data reached the disk)
    with pytest.raises(ConfigError, match=r"holds no \[model\] table .*give --config FILE"):  # (read as the defaults)
        load_relaunch_config(saved, str(tmp_path), ["--train.steps=6"])


def test_a_model_switch_takes_true_and_false_as_on_and_off():
    """qk_norm, qkv_bias, tie_embeddings and moe.norm_topk are -1/0/1 (-1 keeps the preset's):
    `--model.qk_norm=true` was refused as a wrong type."""
    cfg = load_config(None, ["model.qk_norm=true", "model.tie_embeddings=false", "moe.norm_topk=true"])
    assert (cfg.model.qk_norm, cfg.model.tie_embeddings, cfg.moe.norm_topk, cfg.model.qkv_bias) == (1, 0, 1, -1)
    assert type(cfg.model.qk_norm) is int


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown config key train.stepz (did you mean train.steps?); valid keys: steps"),
    ("run.dir=a\0b", "run.dir='a\\x00b' is invalid: must be a non-empty path (no NUL byte)"),  # (a traceback)
    ("checkpoint.memory_dir=\0", "checkpoint.memory_dir='\\x00' is invalid: a folder path (no NUL byte)"),
    ("train.bogus=3", "unknown config key train.bogus; valid keys: steps"),  # (nothing close: no guess)
    ("train.batch_size=8", "unknown config key train.batch_size (did you mean train.micro_batch_size or "
                           "train.global_batch_size?)"),  # (about as close: both, not the one that wins by 0.03)
    ("train.warmup_steps=5", "unknown config key train.warmup_steps; it belongs under [optim] (optim.warmup_steps)"),
    ("trian.steps=3", "unknown config section [trian] (did you mean train?)"),
    ("train.steps=many", "train.steps='many' has the wrong type: expected int"),
    ("train.steps=1.5", "expected int"),
    ("train.compile=1", "train.compile=1 has the wrong type: expected true or false"),
    ("model.tie_embeddings=2", "model.tie_embeddings=2 is invalid: -1, 0 or 1"),
    ("moe.norm_topk=yes", "moe.norm_topk='yes' has the wrong type: expected int; valid: -1 (the preset's or the "
                          "starting weights'), 0 or false (off), 1 or true (on)"),
    ("parallel.zero=zero3", "parallel.zero='zero3' has the wrong type: expected int; valid: 1, 2 or 3"),
    ("train.steps=0", "train.steps=0 is invalid: must be > 0"),
    ("train.steps=99999999999999999999999", "is invalid: must be > 0 (and < 2**63)"),  # (was trained, lr stuck)
    ("parallel.tp=-1", "parallel.tp=-1 is invalid: must be >= 1 (-1, the rest of the world size, is dp_shard's alone)"),
    ("optim.lr=5.e999", "optim.lr='5.e999' is not a finite number"),
    ("optim.lr=1" + "0" * 400, "is not a finite number"),
    ("faults.kill_rank=-5", "faults.kill_rank=-5 is invalid: must be a rank, or -1 (off)"),
    ("faults.kill_step=3", "faults.kill_step=3 is invalid: needs faults.kill_rank, the rank it fires on"),
    ("faults.hang_rank=1", "faults.hang_rank=1 is invalid: needs faults.hang_step, the step it hangs at"),
    ("faults.slow_rank=1", "faults.slow_rank=1 is invalid: needs faults.slow_factor > 1"),
    ("faults.nan_step=201", "faults.nan_step=201 is past train.steps=200: the drill would never fire; give a step in "
                            "1..200"),
    ("faults.spike_step=20", "faults.spike_step=20 comes before the spike detector judges any step: it needs "
                             "anomaly.min_history=20 healthy steps first"),
    ('data.mix=[{path = "a", weight = inf}]', "data.mix[0].weight=inf is not a finite number"),
    ("watchdog.probe_interval=-1", "watchdog.probe_interval=-1 is invalid: must be >= 0 (0 = off)"),
    ("faults.slow_in=gpu", "faults.slow_in='gpu' is invalid: one of host, compute, data"),  # (was a tuple)
    ("train.stop_at_step=300", "train.stop_at_step=300 is invalid: must be <= train.steps (200)"),
    ("train.skip_batches=[5, 5]", "train.skip_batches=[5, 5] is invalid: must name each batch once"),
    ("train.seed=99999999999999999999", "train.seed=99999999999999999999 is invalid: must be in [0, 2**63)"),
    ("train.precision=fp4", "one of auto, fp32, bf16, fp16, fp8"),
    ("train.attention=flash3", "one of auto, sdpa, flex, varlen"),
    ("fp8.recipe=blockwise", "one of tensorwise, rowwise"),
    ("metrics.profile_steps=[3]", "[first, last]"),
    ("model.preset=gpt5", "model.preset='gpt5' is invalid: one of tiny, llama3.2-1b"),
    ("optim.schedule=step", "optim.schedule='step'"),
    ("run.device=cuda:abc", "run.device='cuda:abc' is invalid: use auto, cpu, cuda or cuda:N"),
    ("checkpoint.keep=0", "checkpoint.keep=0"),
    ("train.global_batch_size=10", "not divisible by train.micro_batch_size=8"),
    ("steps=3", "must look like --section.key=value"),
])
def test_bad_values_raise_config_error(override, message):
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, [override])
        cfg.check()
        check_config(cfg)  # the launch's checks add the model table, which the config cannot see
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_spike_drill_after_another_anomaly_drill_needs_one_more_healthy_step():
    """A skipped anomalous step stays out of the detector's history: a spike drill at min_history + 1
    after one went unjudged, its loss taken in, and the drill passed in silence."""
    with pytest.raises(ConfigError, match=r"faults.spike_step=21 comes before the spike detector judges any step: "
                                          r"it needs anomaly.min_history=20 healthy steps first \(and faults' "
                                          r"earlier anomalous step, which it leaves out\)"):
        load_config(None, ["faults.spike_step=21", "faults.nan_step=5"]).check()
    load_config(None, ["faults.spike_step=22", "faults.nan_step=5"]).check()
    load_config(None, ["faults.spike_step=21", "faults.overflow_step=5", "train.precision=fp16"]).check()
    load_config(None, ["faults.spike_step=21", "faults.nan_step=5", "anomaly.action=rollback"]).check()  # (restored)
    with pytest.raises(ConfigError, match=r"healthy steps first \(and faults' earlier anomalous step,"):  # (one step)
        load_config(None, ["faults.spike_step=21", "faults.nan_step=5", "faults.overflow_step=5"]).check()


def test_rsqrt_without_a_warmup_is_refused_in_one_line():
    """lr x sqrt(warmup_steps / step) is 0 with no warm-up: the key is named, not a flat run at the floor."""
    with pytest.raises(ConfigError, match=r"^optim.warmup_steps=0 is invalid: optim.schedule=rsqrt needs >= 1"):
        load_config(None, ["optim.schedule=rsqrt", "optim.warmup_steps=0"]).check()
    load_config(None, ["optim.schedule=rsqrt", "optim.warmup_steps=1"]).check()


def test_a_file_s_unquoted_number_for_a_text_key_is_refused_not_rewritten(tmp_path):
    """TOML reads `dir = 2024.10` as the number 2024.1: taken as text it named another folder."""
    path = tmp_path / "c.toml"
    path.write_text("[run]\ndir = 2024.10\n")
    with pytest.raises(ConfigError, match=r"run.dir=2024.1 has the wrong type: expected a quoted string"):
        load_config(path)
    path.write_text('[run]\ndir = "2024.10"\n')
    assert load_config(path).run.dir == "2024.10"


def test_a_rollback_with_nothing_saved_is_refused(tiny_config, tmp_path):
    """Each anomaly would be skipped with no checkpoint to roll back to: the run looked protected.
    A resumed run has the checkpoint it resumed; the dry run says the same."""
    from shardline.dry_run import dry_run
    from shardline.trainer import Trainer

    unsaved = ["anomaly.action=rollback", "checkpoint.interval=0", "train.eval_interval=0"]
    says = "anomaly.action='rollback' is invalid with checkpoint.interval=0 and checkpoint.memory_interval=0"
    with pytest.raises(ConfigError, match=says):
        Trainer(tiny_config(*unsaved)).build()
    with pytest.raises(ConfigError, match=says):
        dry_run(tiny_config(*unsaved, "run.device=cpu"), 1)
    assert not (tmp_path / "run").exists()
    Trainer(tiny_config("train.stop_at_step=6", "train.eval_interval=0")).build().train()
    assert Trainer(tiny_config(*unsaved)).build().step == 6  # resumed: rolls back to step 6


def test_paths_given_as_numbers_stay_as_written():
    cfg = load_config(None, ["--run.dir=1.50", "data.path=007", "train.steps=5"])
    assert cfg.run.dir == "1.50" and cfg.data.path == "007" and cfg.train.steps == 5
    # ... and so do dates and times, which TOML would read as such
    cfg = load_config(None, ["run.dir=2024-06-01", "data.path=12:00:00", "run.resume=runs/x/step-000010"])
    assert (cfg.run.dir, cfg.data.path, cfg.run.resume) == ("2024-06-01", "12:00:00", "runs/x/step-000010")


def test_a_hang_drill_that_could_never_fire_is_refused():
    """A phase's hang fires at the first such phase from hang_step on (a save's, an eval's recur): past
    train.steps, or in a phase the run never has (no evaluation, no save, no snapshot, no anomaly to halt
    on), it passed as if drilled."""
    for phase in ("step", "drain"):
        with pytest.raises(ConfigError, match="faults.hang_step=300 is past train.steps=200: the drill would never"):
            load_config(None, ["faults.hang_rank=0", "faults.hang_step=300", f"faults.hang_phase={phase}"]).check()
    load_config(None, ["faults.hang_rank=0", "faults.hang_phase=drain", "watchdog.timeout_s=30"]).check()
    with pytest.raises(ConfigError, match=r"faults.hang_rank=0 needs watchdog.timeout_s > 0: nothing would end the "
                                          r"hang"):  # (a walkthrough's hung process outlived its SIGTERM)
        load_config(None, ["faults.hang_rank=0", "faults.hang_phase=drain"]).check()
    for phase, off, key in (("eval", "train.eval_interval=0", "train.eval_interval"),
                            ("save", "checkpoint.interval=0", "checkpoint.interval"),
                            ("snapshot", "checkpoint.memory_interval=0", "checkpoint.memory_interval"),
                            ("halt", "faults.nan_step=0", "faults.nan_step or faults.spike_step")):
        with pytest.raises(ConfigError, match=rf"faults.hang_phase={phase} would never fire: this run has no {phase} "
                                              rf"phase; set {re.escape(key)}"):
            load_config(None, ["faults.hang_rank=0", f"faults.hang_phase={phase}", off]).check()
    load_config(None, ["faults.hang_rank=0", "faults.hang_phase=snapshot", "checkpoint.memory_interval=5",
                       "watchdog.timeout_s=30"]).check()


def test_a_save_drill_at_a_step_with_no_save_is_refused():
    """faults.refuse_save_step, fail_save_step and corrupt_checkpoint_step fire in a disk save: at a
    step with none (between intervals, or checkpoint.interval=0) they passed as if drilled."""
    with pytest.raises(ConfigError, match=r"faults.refuse_save_step=7 is no step a checkpoint is saved at: the drill "
                                          r"would never fire; give a multiple of checkpoint.interval=5 or the run's"):
        load_config(None, ["faults.refuse_save_step=7", "checkpoint.interval=5", "train.steps=20"]).check()
    with pytest.raises(ConfigError, match="faults.fail_save_step=5 would never fire: checkpoint.interval=0 saves no"):
        load_config(None, ["faults.fail_save_step=5", "checkpoint.interval=0"]).check()
    for at in ("faults.corrupt_checkpoint_step=10", "faults.refuse_save_step=18", "faults.fail_save_step=12"):
        load_config(None, [at, "checkpoint.interval=5", "train.steps=18", "train.stop_at_step=12"]).check()


def test_bad_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    path.write_text("[train]\nsteps = 3\n[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: unknown config section \[nope\]"):
        load_config(path)  # (the file named: a launch may read a config it did not write, a run dir's)
    path.write_text("[train]\nstep = 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: unknown config key train.step \(did you "):
        load_config(path)
    path.write_text("[train]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"^unknown config key train.stepz"):  # (an override's: not the file's)
        load_config(path, ["train.stepz=1"])


def test_shipped_configs_are_valid():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))
    assert configs, "configs/ should hold example configs"
    for path in configs:
        load_config(path).check()


def test_reader_unions_keep_a_members_own_type():
    from shardline.config.reader import coerce

    assert coerce("k", 5, str | int) == 5 and coerce("k", "optimal", int | str) == "optimal"
    assert coerce("k", 3, float | None) == 3.0 and isinstance(coerce("k", 3, float | None), float)
    with pytest.raises(ConfigError, match="k=True has the wrong type"):
        coerce("k", True, int | None)


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(tmp_path, monkeypatch):
    """A TOML value or a quoted argument reaches the config unexpanded: `~/runs/x` would make a
    folder named "~" in the working directory (and a later `rm -rf ~` of it, the home folder)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('[run]\ndir = "~/runs/x"\n[data]\nmix = [{path = "~/a.jsonl", weight = 1.0}]\n')
    cfg = load_config(tmp_path / "c.toml", ["model.init_from=~/ck", "data.tokenizer=~/tok.json", "run.resume=never"])
    assert cfg.run.dir == str(tmp_path / "runs" / "x") and cfg.data.mix[0].path == str(tmp_path / "a.jsonl")
    assert (cfg.model.init_from, cfg.data.tokenizer) == (str(tmp_path / "ck"), str(tmp_path / "tok.json"))
    assert cfg.run.resume == "never" and load_config(None, ["run.dir=a~b"]).run.dir == "a~b"
    with pytest.raises(ConfigError, match="the home folder of '~no-such-user-here' is not known"):
        load_config(None, ["run.dir=~no-such-user-here/x"])


def test_near_misses_get_a_pointed_error_or_their_meaning(tmp_path):
    """A key above every [section] header is named with its section; a float TOML does not
    spell (.001, 5.) is still the number the user wrote; a non-number is still a type error."""
    (tmp_path / "c.toml").write_text("steps = 5\n[train]\nseq_len = 64\n")
    with pytest.raises(ConfigError, match=r"config key steps = 5 is outside any \[section\]; it belongs under "
                                          r"\[train\]"):
        load_config(tmp_path / "c.toml")
    assert load_config(None, ["optim.lr=.001", "optim.weight_decay=5."]).optim.lr == 0.001
    for word in ("fast", "Inf", "NaN", "-Infinity"):  # float() reads the last three: not numbers to train with
        with pytest.raises(ConfigError, match=f"optim.lr='{word}' has the wrong type: expected float"):
            load_config(None, [f"optim.lr={word}"])


def test_config_changes_name_what_a_resume_changed_beside_one_launchs_own_settings():
    from shardline.config import config_changes

    saved = load_config(None, ["run.dir=a", "train.stop_at_step=5", "faults.nan_step=3", "train.precision=fp32"])
    now = load_config(None, ["run.dir=b", "train.precision=bf16", "data.path=x"]).to_dict()
    old = saved.to_dict()
    del old["data"]["path"]  # a key saved before it existed is no change
    assert config_changes(old, now) == {"train.precision": ["fp32", "bf16"]}
    assert config_changes({}, now) == {}
    # a mixture saved before its sources had a format: the same mixture, and a format given is a change
    mixed = load_config(None, ['data.mix=[{path = "a"}, {path = "b", weight = 0.5}]']).to_dict()
    before = {"data": {"mix": [{"path": "a", "weight": 1.0}, {"path": "b", "weight": 0.5}]}}
    assert config_changes(before, mixed) == {}
    mixed["data"]["mix"][1]["format"] = "chat"
    assert list(config_changes(before, mixed)) == ["data.mix"]


def test_a_stray_argument_is_read_as_what_it_likely_meant(capsys):
    """`--train.steps 40` named the stray 40 only; another command's option was told about overrides."""
    from shardline.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--train.steps", "40"])
    assert "give --train.steps=40: config overrides take their value after '='" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "runs/x", "--top_k", "5"])
    err = capsys.readouterr().err  # (said by the command's parser, which points at its own --help)
    assert "unrecognized arguments: --top_k 5 (see shardline generate --help)" in err
    assert "section.key" not in err
    with pytest.raises(SystemExit):
        main(["train", "--bogus"])
    assert capsys.readouterr().err.rstrip().endswith("(see shardline train --help)")


@pytest.mark.parametrize("section,key,value,message", [
    ("train", "compile", "false", "train.compile='false' has the wrong type: expected true or false"),
    ("train", "steps", 4.5, "train.steps=4.5 has the wrong type: expected int"),
    ("train", "seq_len", "64", "train.seq_len='64' has the wrong type: expected int"),
    ("train", "stepz", 5, "unknown config key train.stepz (did you mean train.steps?); valid keys: steps"),
    ("data", "mix", [{"path": "a"}],
     "data.mix[0]={'path': 'a'} has the wrong type: expected a table {path, weight, format, text_field} (in code: "
     "MixSource(...), from shardline.config)"),
    ("moe", "capacity_factor", "1.5", "moe.capacity_factor='1.5' has the wrong type: expected float"),
])
def test_values_set_in_code_are_checked_as_a_files_are(section, key, value, message):
    """A config built in Python and changed by attribute gets the reader's one-line errors from
    check_sections (which Trainer and the dry run call): the string "false" would otherwise switch
    compile on, and 4.5 steps train 5 and save a config.toml no launch reads back."""
    cfg = load_config(None)
    cfg.check_sections()
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        cfg.check_sections()


def test_a_value_check_refuses_names_the_file_that_set_it(tmp_path):
    """`steps = -3` in a config file was refused naming the key alone: with --config and a saved
    config.toml in play, not where to mend it. An override's value, or one set in code since, is not the file's."""
    path = tmp_path / "my.toml"
    path.write_text("[train]\nsteps = -3\n[model]\ndim = 64\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"train.steps=-3 is invalid: must be > 0 (and < 2**63) "
                                                    f"(train.steps from {path})")):
        load_config(path).check()
    for cfg in (load_config(path, ["train.steps=-4"]), load_config(path)):
        cfg.train.steps = cfg.train.steps if cfg.train.steps == -4 else -9
        with pytest.raises(ConfigError, match=r"must be > 0 \(and < 2\*\*63\)$"):
            cfg.check()
    saved = tmp_path / "config.toml"
    save_config(load_config(None, ["train.steps=4"]), saved)
    saved.write_text(saved.read_text(encoding="utf-8").replace("steps = 4", "steps = -4"), encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"(train.steps from {saved}, the run's saved config)")):
        load_relaunch_config(saved, str(tmp_path)).check()


def test_values_of_the_right_type_set_in_code_pass_as_a_file_would_give_them(tmp_path):
    """numpy's numbers and tuples pass, put back as Python's and lists: saved as they were, the
    run's config.toml (np.float64(0.0003)) could not be read back by a relaunch."""
    import numpy as np

    cfg = load_config(None, ["data.mix=[{path = 'a', weight = 1}, {path = 'b', weight = 3}]"])
    cfg.optim.lr, cfg.train.compile, cfg.model.tie_embeddings = 1, True, 1  # an int for a float; a switch's int
    cfg.optim.beta2, cfg.train.steps, cfg.train.skip_batches = np.float64(0.95), np.int64(7), (3, np.int64(4))
    cfg.metrics.profile_steps, cfg.train.compile = list(np.array([2, 3])), np.bool_(True)
    cfg.check_sections()
    assert type(cfg.optim.beta2) is float and type(cfg.train.steps) is int and cfg.train.skip_batches == [3, 4]
    assert type(cfg.metrics.profile_steps[0]) is int and cfg.train.compile is True
    save_config(cfg, tmp_path / "config.toml")
    back = load_config(tmp_path / "config.toml")
    assert back.optim.beta2 == 0.95 and back.train.steps == 7 and back.train.skip_batches == [3, 4]


def test_paths_and_one_override_string_from_python_read_as_a_files_strings(tmp_path):
    """A notebook passes pathlib.Paths and often one override: a Path was refused as "the wrong type:
    expected str" (run.dir, which load_relaunch_config sets), one string read character by character."""
    cfg = load_config(None, "train.steps=5")
    assert cfg.train.steps == 5
    cfg.run.dir, cfg.data.path = tmp_path / "run", tmp_path / "data.jsonl"
    cfg.check_sections()
    assert cfg.run.dir == str(tmp_path / "run") and type(cfg.data.path) is str
    save_config(cfg, tmp_path / "config.toml")
    again = load_relaunch_config(tmp_path / "config.toml", tmp_path / "moved", "train.steps=7")
    again.check_sections()
    assert again.run.dir == str(tmp_path / "moved") and again.train.steps == 7
    cfg.train.steps = tmp_path  # a Path where a number belongs: still the wrong type
    with pytest.raises(ConfigError, match="^train.steps=.* has the wrong type: expected int"):
        cfg.check_sections()


def test_a_trainer_trained_before_it_is_built_says_so_and_is_charged_from_its_making(tmp_path):
    """train() before build() was an AttributeError ('proc'); a notebook's Trainer was charged the
    whole process's age as start-up (an idle kernel's hour read as goodput near 0)."""
    import time

    from shardline.trainer import Trainer

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    before = time.time()
    trainer = Trainer(cfg)
    assert before <= trainer.started <= time.time()
    assert Trainer(cfg, started=12.5).started == 12.5  # (the CLI's: the process's start)
    with pytest.raises(ConfigError, match=re.escape("this Trainer is not built: call build() first")):
        trainer.train()


@pytest.mark.parametrize("name,value,message", [
    ("optimizer", 1, "unknown config section 'optimizer'; valid: run, model, moe, train"),
    ("train", {"steps": 5}, "config section train is a dict, not a TrainConfig"),
])
def test_a_section_set_wrong_in_code_is_one_line(name, value, message):
    cfg = load_config(None)
    setattr(cfg, name, value)
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        cfg.check_sections()


def test_a_home_path_set_in_code_is_expanded_by_the_trainer(tmp_path, monkeypatch):
    """load_config expands a leading ~; one set in code afterwards made a folder named "~"."""
    from shardline.trainer import Trainer

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None)
    cfg.run.dir = "~/runs/nb"
    trainer = Trainer(cfg)
    assert trainer.run_dir == tmp_path / "runs" / "nb" and trainer.cfg.run.dir == str(tmp_path / "runs" / "nb")
    assert cfg.run.dir == "~/runs/nb"  # (the caller's object is not written: the Trainer works on a copy)


def test_a_run_dir_holding_files_no_run_wrote_is_refused_before_they_are_written_over(tmp_path, capsys):
    """A project folder's own config.toml (no [model] table) was replaced by the run's, after a note that
    called it "emptied, cut short or not TOML"; a log of another tool had the run's records appended."""
    from shardline.cli import main

    project = tmp_path / "project"
    project.mkdir()
    (project / "config.toml").write_text("[server]\nport = 8080\n")
    (project / "metrics.jsonl").write_text('{"loss": 1}\n')
    for argv in ([], ["--config", "configs/tiny.toml"]):
        assert main(["train", "--train.steps=2", f"--run.dir={project}", *argv]) == 2
        err = capsys.readouterr().err
        assert "holds config.toml and metrics.jsonl that no shardline run wrote" in err and "not read" not in err
    with pytest.raises(ConfigError, match="holds config.toml and metrics.jsonl that no shardline run wrote"):
        check_config(load_config(None, [f"run.dir={project}"]))  # (the Python API's launch checks too)
    assert (project / "config.toml").read_text() == "[server]\nport = 8080\n"
    (project / "progress.json").write_text("{}")  # a run's folder: its own files, whatever they hold
    check_config(load_config(None, [f"run.dir={project}"]))


def test_a_run_dir_that_is_another_tools_folder_is_refused_before_anything_is_written(tmp_path, small_prepared):
    """A prepared data folder or an HF model given as run.dir had its tokenizer.json replaced by the
    run's (the prepared folder no longer opened: its tokenizer's hash had changed)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    step = tmp_path / "step-000004"  # a checkpoint: manifest.json (as a prepared folder has) and meta.json
    step.mkdir()
    (step / "manifest.json").write_text('{"step": 4, "files": {}}')
    (step / "meta.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in small_prepared.iterdir() if p.is_file()}
    for folder, what in [(hf, "a Hugging Face model folder (config.json)"), (small_prepared, "a prepared data folder"),
                         (step, "a checkpoint (manifest.json)"),
                         (tmp_path, "a run's checkpoints folder (step-N checkpoints)")]:  # (another run's history)
        with pytest.raises(ConfigError, match=re.escape(f"run.dir={str(folder)!r} is {what}: a run would write over")):
            check_config(load_config(None, [f"run.dir={folder}"]))
    assert {p.name: p.read_bytes() for p in small_prepared.iterdir() if p.is_file()} == before
    check_config(load_config(None, [f"run.dir={tmp_path / 'new'}"]))  # a new folder, or a run dir, passes
    (tmp_path / "notes.txt").write_text("mine")  # ("cannot be created: File exists")
    with pytest.raises(ConfigError, match=re.escape(f"run.dir={str(tmp_path / 'notes.txt')!r} is a file, not a")):
        check_config(load_config(None, [f"run.dir={tmp_path / 'notes.txt'}"]))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "checkpoints").write_text("")  # a run trained to its end, then failed every save
    with pytest.raises(ConfigError, match=re.escape("its checkpoints is a file, where a run keeps its folder of")):
        check_config(load_config(None, [f"run.dir={tmp_path / 'odd'}"]))
    (tmp_path / "odd" / "checkpoints").unlink()
    (tmp_path / "odd" / "config.toml").mkdir()  # a traceback at the config's save, after the lock
    with pytest.raises(ConfigError, match=re.escape("its config.toml is a folder, where a run keeps its file")):
        check_config(load_config(None, [f"run.dir={tmp_path / 'odd'}"]))
    (tmp_path / "odd" / "config.toml").rmdir()
    # A traceback once the run dir was written (TensorBoard's folder; set-aside's, past a bad checkpoint)
    for name in ("tensorboard", "checkpoints/set-aside"):
        (tmp_path / "odd" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "odd" / name).write_text("mine")
        with pytest.raises(ConfigError, match=re.escape(f"its {name} is a file, where a run keeps its folder of")):
            check_config(load_config(None, [f"run.dir={tmp_path / 'odd'}"]))
        (tmp_path / "odd" / name).unlink()


def test_a_garbled_progress_json_does_not_make_a_run_dir_a_data_folder(tmp_path, tiny_config):
    """An empty or torn progress.json (goodput's account) made a run dir with checkpoints "a prepared
    data folder": every relaunch was refused, naming the wrong cause."""
    from shardline.trainer import Trainer

    cfg = tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0")
    Trainer(cfg).build().train()
    (Path(cfg.run.dir) / "progress.json").write_text("garbage{")
    again = Trainer(tiny_config("train.steps=4", "checkpoint.interval=2", "train.eval_interval=0")).build()
    assert again.step == 2
    again.train()
    assert json.loads((Path(cfg.run.dir) / "progress.json").read_text())["step"] == 4
    from shardline.data.shards import is_prepared  # other JSON than an account: a list, an object without it

    for garbled in ("[1, 2]", "{}", '"text"'):
        (Path(cfg.run.dir) / "progress.json").write_text(garbled)
        assert not is_prepared(cfg.run.dir), garbled


def test_a_vocabulary_too_large_to_train_is_one_line_not_an_abort():
    """data.vocab_size=99999999999 reached the BPE trainer, which aborted the process (exit 134)
    asking for 4.5 TB."""
    with pytest.raises(ConfigError, match=r"^data.vocab_size=99999999999 is invalid: must be <= 1048576 for a BPE"):
        load_config(None, ["data.vocab_size=99999999999"]).check_sections()


def test_a_drill_on_a_rank_the_job_lacks_is_refused_before_the_data():
    """faults.hang_rank=9 on 8 ranks ran to its end: a drill that never fires passed as if it had."""
    from shardline.preflight import check_layout_before_data

    fits = ["train.micro_batch_size=2", "faults.hang_step=4", "watchdog.timeout_s=30"]  # 16 sequences on 8 ranks
    with pytest.raises(ConfigError, match=r"^faults.hang_rank=9 is not a rank of this 8-rank job \(0-7\)$"):
        check_layout_before_data(load_config(None, [*fits, "faults.hang_rank=9"]), 8)
    check_layout_before_data(load_config(None, [*fits, "faults.hang_rank=7"]), 8)


def test_a_batch_that_does_not_split_says_what_fits_a_resume_too():
    """A 3-rank resume of a run saved at global batch 16 was told to use a multiple of 24, then that
    the checkpoint keeps 16: the message now names the micro batches that fit, or that none does."""
    with pytest.raises(ConfigError, match=r"use a multiple of 32, or train.micro_batch_size 1 or 2 or 4 \(a resumed"):
        load_config(None, ["train.global_batch_size=16"]).check(4)
    with pytest.raises(ConfigError, match="no micro batch fits 16 sequences on 3 data-parallel ranks: a resumed run"):
        load_config(None, ["train.global_batch_size=16"]).check(3)
    # the ones nearest the micro batch asked for (its memory), not the largest that divide
    with pytest.raises(ConfigError, match=r"multiple of 24, or train.micro_batch_size 1 or 2 or 4 \("):
        load_config(None, ["train.global_batch_size=512", "train.micro_batch_size=3"]).check(8)


def test_a_mixture_written_as_json_on_the_command_line_says_to_write_toml():
    """`--data.mix='[{"path": "a"}]'` (JSON) is no TOML: it was read as a string and refused as the wrong type."""
    with pytest.raises(ConfigError, match=r"data.mix='\[\{\"path\": \"a\"\}\]' is not TOML: write a list of inline "
                                          r"tables, \[\{path = \.\.\., weight = \.\.\., format = \.\.\., "
                                          r"text_field = \.\.\.\}, \.\.\.\]"):
        load_config(None, ['data.mix=[{"path": "a"}]'])
    assert load_config(None, ['data.mix=[{path = "a", format = "chat"}]']).data.mix[0].format == "chat"


def test_a_config_file_with_a_byte_order_mark_reads(tmp_path):
    """Windows Notepad writes one: it was "not valid TOML (at line 1, column 1)"."""
    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff[train]\r\nsteps = 7\r\n".encode())
    assert load_config(path).train.steps == 7


def test_a_run_dir_inside_its_raw_data_folder_is_refused(tmp_path, small_corpus):
    """It trained once, then its next launch read its own metrics.jsonl as a data file (an error
    about data.text_field); a .txt it held would have been trained on."""
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(small_corpus, data / "corpus.jsonl")
    inside = load_config(None, [f"data.path={data}", f"run.dir={data / 'runs' / 'a'}"])
    with pytest.raises(ConfigError, match=r"run.dir=.* is inside data.path=.*: the run's own files"):
        check_config(inside)
    check_config(load_config(None, [f"data.path={data}", f"run.dir={tmp_path / 'runs' / 'a'}"]))
    check_config(load_config(None, [f"data.path={data}", f"run.dir={data / '.runs' / 'a'}"]))  # (hidden: not read)


def test_a_run_dirs_config_of_a_launch_that_saved_nothing_is_trained_again_by_run_dir_alone(tmp_path, capsys):
    """A launch killed in start-up (or before its first save) left config.toml and nothing to resume;
    a requeue by --run.dir alone trained the defaults there (another model, on the shipped corpus),
    with a note. It trains that run again from step 0 now, with the overrides given."""
    from shardline.resilience.relaunch import relaunch_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, [f"run.dir={run}", "train.steps=12", "train.seq_len=64"]), run / "config.toml")
    cfg = relaunch_config(None, [f"--run.dir={run}"])
    assert (cfg.train.steps, cfg.train.seq_len) == (12, 64)
    out, err = capsys.readouterr()
    assert "saved nothing to resume: training it again from step 0 with the config.toml it saved" in out, out
    assert err == ""
    assert relaunch_config(None, [f"--run.dir={run}", "--train.steps=20"]).train.steps == 20
    assert relaunch_config(None, [f"--run.dir={run}", "--run.resume=never"]).train.steps == 200  # (another run)
    relaunch_config(None, [f"--run.dir={run}"], printing=True)  # --print-config: what it prints is that file
    assert "holds a run whose last launch saved nothing to resume: this is the config.toml it saved" in \
        capsys.readouterr().err


def test_hostile_sizes_and_paths_are_one_line_errors(tmp_path, tiny_config, capsys):
    """Each was a traceback: a model of 2**62 layers (a MemoryError building its stages), train.epochs=1e300
    (blamed on train.steps, never set), a run.dir that is a loop of links (RuntimeError), check --size 1e8."""
    from shardline.cli import main
    from shardline.preflight import check_config, resolve_epochs

    with pytest.raises(ConfigError, match=r"^model.n_layers=4611686018427387904 is invalid: .* at most 100000 layers"):
        load_config(None, ["model.n_layers=4611686018427387904"]).check_sections()
    with pytest.raises(ConfigError, match=r"^model.dim=2147483648 is invalid: .* at most 2\*\*31 - 1"):
        load_config(None, ["model.dim=2147483648"]).check_sections()
    cfg = tiny_config("train.epochs=1e300")
    with pytest.raises(ConfigError, match=r"^train.epochs=1e\+300 is invalid: over 100 training sequences it gives "
                                          r"2\*\*63 steps or more"):
        resolve_epochs(cfg, 100)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"cannot be resolved .*: give a folder, not a loop of links"):
        check_config(tiny_config(run_dir=tmp_path / "a"))
    with pytest.raises(SystemExit) as stop:  # (argparse's own exit 2, in one line)
        main(["check", "--run.device=cpu", "--size", "100000000"])
    assert stop.value.code == 2 and "is not a positive integer up to 32768" in capsys.readouterr().err
