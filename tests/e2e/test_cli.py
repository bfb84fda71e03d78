"""The command line as a user runs it: in a subprocess, and the bad-input cases through its main()."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.errors import ConfigError
from tests.conftest import tiny_overrides

REPO = Path(__file__).parents[2]


def shardline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardline", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def overrides(run_dir, corpus, *extra):
    return [f"--{o}" for o in tiny_overrides(run_dir, corpus, *extra)]


def test_train_writes_metrics_config_and_checkpoints(tmp_path, small_corpus):
    run = tmp_path / "run"
    out = shardline("train", *overrides(run, small_corpus, "metrics.progress=plain", "metrics.tensorboard=true"))
    assert out.returncode == 0, out.stderr
    assert "step 12/12 | loss" in out.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert kinds == {"train", "eval", "event"}
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert all({"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= r.keys() for r in train)
    assert any((run / "tensorboard").iterdir())
    assert 'preset = "tiny"' in (run / "config.toml").read_text()


def test_resume_continues_where_it_stopped(tmp_path, small_corpus):
    run = tmp_path / "run"
    assert shardline("train", *overrides(run, small_corpus, "train.stop_at_step=6")).returncode == 0
    out = shardline("train", "--resume", *overrides(run, small_corpus))
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, 13))


def test_a_relaunch_naming_the_run_dir_alone_resumes_with_its_saved_config(tmp_path, small_corpus, capsys):
    """The first launch's settings come back from its config.toml (the tiny shape, the data, 12
    steps), its early stop does not (it would end the relaunch at once), and an override given
    applies on top (in-process, through main())."""
    run = tmp_path / "run"
    assert main(["train", *overrides(run, small_corpus, "train.stop_at_step=6", "optim.lr=0.002")]) == 0
    assert main(["train", f"--run.dir={run}", "--metrics.progress=none", "--optim.weight_decay=0.05"]) == 0
    assert f"{run} holds checkpoints: resuming with the config.toml it saved" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    saved = (run / "config.toml").read_text()
    assert "lr = 0.002" in saved and "weight_decay = 0.05" in saved and "stop_at_step = 0" in saved


def test_a_relaunch_takes_the_saved_config_unless_told_another(tmp_path, capsys):
    """A run dir whose only checkpoint a crash left renamed aside (the trainer repairs it and
    resumes it) counts, and so does one with a config.toml and no checkpoint (trained again from
    step 0); a --config or run.resume=never takes another."""
    from shardline.resilience.relaunch import relaunch_config as _relaunch_config
    from shardline.config import load_config, save_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    save_config(load_config(None, ["optim.lr=0.002"]), run / "config.toml")
    assert _relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002  # nothing to resume: trained again
    (run / "checkpoints" / "step-000004.deleting").mkdir()  # a second save's older folder, its step gone
    assert _relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002
    assert _relaunch_config(None, [f"run.dir={run}", "run.resume=never"]).optim.lr == 3e-3
    (tmp_path / "other.toml").write_text("[optim]\nlr = 0.001\n")
    assert _relaunch_config(str(tmp_path / "other.toml"), [f"run.dir={run}"]).optim.lr == 0.001
    # train.precision=auto, from a file that never names it: the run's saved precision on a resume (an fp32 run
    # of before auto was the default went on in bf16 on a GPU), by the device for a new run (nothing held there)
    save_config(load_config(None, ["train.precision=fp32"]), run / "config.toml")
    assert _relaunch_config(str(tmp_path / "other.toml"), [f"run.dir={run}"]).train.precision == "fp32"
    assert _relaunch_config(str(tmp_path / "other.toml"), [f"run.dir={tmp_path / 'new'}"]).train.precision == "auto"
    # Degrees a launch with another world size gave and saved: the refusal says where they come from
    save_config(load_config(None, ["parallel.tp=2", "parallel.pp=2"]), run / "config.toml")
    with pytest.raises(ConfigError, match=re.escape(f"(parallel.tp=2 parallel.pp=2 from {run / 'config.toml'}, the "
                                                    "run's saved config a relaunch takes over: give --parallel.tp "
                                                    "or --parallel.pp for this world size)")):
        _relaunch_config(None, [f"run.dir={run}"], world=1)
    assert _relaunch_config(None, [f"run.dir={run}", "parallel.tp=1", "parallel.pp=1"], world=1).parallel.tp == 1
    with pytest.raises(ConfigError, match=r"does not divide the world size 1 .*\(parallel.pp=2 from .*give "
                                          r"--parallel.pp for"):  # (the command line's tp is not blamed on the file)
        _relaunch_config(None, [f"run.dir={run}", "parallel.tp=1"], world=1)
    with pytest.raises(ConfigError, match="parallel.tp=0 is invalid"):  # (was a ZeroDivisionError)
        _relaunch_config(None, [f"run.dir={run}", "parallel.tp=0"], world=1)
    # ... and an expert-parallel degree a smaller world cannot hold (dp_shard -1 follows the world)
    save_config(load_config(None, ["model.preset=tiny-moe", "parallel.ep=2"]), run / "config.toml")
    with pytest.raises(ConfigError, match=re.escape(f"parallel.ep=2 (from {run / 'config.toml'}, the run's saved "
                                                    "config a relaunch takes over) must divide dp_shard x cp = 1 on "
                                                    "1 process(es): give --parallel.ep")):
        _relaunch_config(None, [f"run.dir={run}"], world=1)
    assert _relaunch_config(None, [f"run.dir={run}"], world=2).parallel.ep == 2
    assert _relaunch_config(None, [f"run.dir={run}", "parallel.ep=1"], world=1).parallel.ep == 1
    # A hybrid run relaunched as Ulysses: its saved cp_ulysses (hybrid's alone) was refused, a key not given
    save_config(load_config(None, ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2"]),
                run / "config.toml")
    again = _relaunch_config(None, [f"run.dir={run}", "parallel.cp=2", "parallel.cp_mode=ulysses"], world=2)
    assert (again.parallel.cp_mode, again.parallel.cp_ulysses) == ("ulysses", 0)
    assert _relaunch_config(None, [f"run.dir={run}", "parallel.cp=2"], world=2).parallel.cp_ulysses == 2  # (mode kept)
    # A run that trained to its end and saved no checkpoint: --run.dir alone trained the defaults into it
    done = tmp_path / "done"
    done.mkdir()
    save_config(load_config(None, ["model.dim=64", "train.steps=12"]), done / "config.toml")
    (done / "progress.json").write_text('{"run_complete": true, "high_water_step": 12}')
    with pytest.raises(ConfigError, match=re.escape(f"run.dir={done} holds a run that trained to its end (step 12) "
                                                    "and holds no checkpoint of it: nothing to resume or extend; "
                                                    "another --run.dir trains anew (--config FILE: another run in "
                                                    "this folder")):  # (not run.resume=never: refused over records)
        _relaunch_config(None, [f"run.dir={done}", "train.steps=20"])
    assert _relaunch_config(None, [f"run.dir={done}", "run.resume=never"]).model.dim == 0  # (asked: another run)
    (tmp_path / "ckpt").mkdir()  # (a checkpoint named: the launch's own word)
    assert _relaunch_config(None, [f"run.dir={done}", f"run.resume={tmp_path / 'ckpt'}"]).run.resume.endswith("ckpt")
    (done / "progress.json").write_text('{"run_complete": false, "high_water_step": 5}')  # (cut short: trained again)
    assert _relaunch_config(None, [f"run.dir={done}"]).model.dim == 64
    (done / "config.toml").write_text("[train]\nsteps = 12\nunknown_later_key = 1\n[model]\n")  # (another
    capsys.readouterr()
    assert _relaunch_config(None, [f"run.dir={done}"]).model.dim == 0  # shardline's key: not read, the note says so)
    assert "is not read (its launch saved nothing to resume, and it is not a config this shardline reads: " \
           "unknown config key train.unknown_later_key): this launch takes the defaults" in capsys.readouterr().err
    (done / "config.toml").write_text("")  # emptied by a crash: an in-memory snapshot run's went on as the defaults
    with pytest.raises(ConfigError, match=re.escape(f"{done / 'config.toml'}, the config of a run that trained (to "
                                                    "step 5), is emptied, cut short (a crash?) or not TOML")):
        _relaunch_config(None, [f"run.dir={done}"])


def test_a_relaunch_of_a_run_kept_in_memory_alone_takes_its_saved_config(tmp_path, capsys):
    """checkpoint.interval=0 with in-memory snapshots: stopped at step 8, `--run.dir` alone started a
    new run over it with the defaults (its snapshots orphaned). The run dir's account says it trained."""
    import json

    from shardline.config import load_config, save_config
    from shardline.resilience.relaunch import relaunch_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, ["optim.lr=0.002", "checkpoint.interval=0", "checkpoint.memory_interval=3"]),
                run / "config.toml")
    assert relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002  # it trained nothing yet: again from step 0
    assert "saved nothing to resume: training it again from step 0" in capsys.readouterr().out
    (run / "progress.json").write_text(json.dumps({"high_water_step": 8, "finished": False}))
    assert relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002
    assert "holds a run kept in in-memory snapshots: resuming with the config.toml" in capsys.readouterr().out
    (run / "progress.json").write_text(json.dumps({"high_water_step": 200, "finished": True}))  # (an older file)
    with pytest.raises(ConfigError, match="holds a run that trained to its end"):  # (its RAM given back: nothing
        relaunch_config(None, [f"run.dir={run}"])                                 # to resume or extend)
    (run / "progress.json").write_text(json.dumps({"high_water_step": 100, "finished": True}))  # a stop_at_step's
    assert relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002
    (run / "progress.json").write_text(json.dumps({"high_water_step": 200, "finished": True, "run_complete": False}))
    assert relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002  # (its last state not kept: a rerun)
    save_config(load_config(None, ["optim.lr=0.002", "checkpoint.interval=0"]), run / "config.toml")
    assert relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002  # no snapshots kept: trained again
    (run / "progress.json").write_text("{torn")
    assert relaunch_config(None, [f"run.dir={run}"]).optim.lr == 0.002
    assert relaunch_config(None, [f"run.dir={run}", "run.resume=never"]).optim.lr == 3e-3  # (another run)


@pytest.mark.parametrize("bad, message", [
    (["--train.bogus=1"], "unknown config key train.bogus"),
    (["--train.steps=ten"], "wrong type: expected int"),
    (["--train.global_batch_size=7"], "not divisible"),
    (["--data.path=/no/such/data"], "does not exist"),
    (["--data.tokenizer=/no/such/tokenizer.json"], "cannot be read as a tokenizer.json"),
    (["--config", "/no/such.toml"], "does not exist"),
    (["--optim.lr=inf"], "optim.lr=inf is not a finite number"),
    (["--optim.weight_decay=inf"], "optim.weight_decay=inf is not a finite number"),
    (["--model.rope_theta=nan"], "model.rope_theta=nan is not a finite number"),
    (["--optim.eps=-1"], "optim.eps=-1.0 is invalid: must be > 0"),
    (["--optim.eps=nan"], "not a finite number"),
    (["--config", "CONFIG_FOLDER"], "is a folder; give a .toml file"),
    (["--config", "LATIN1_TOML"], "is not UTF-8 text"),
    (["--resume", "--run.resume=never"], "--resume and --run.resume=never both say what to resume; give one"),
    (["--resume", "OTHER_RUN"], "is a run dir, not a checkpoint folder: to resume that run, give --run.dir="),
])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(tmp_path, small_corpus, capsys, bad, message):
    # In this process, through the CLI's own main() (a fresh interpreter per case cost ~2.5 s
    # each); test_unknown_argument_is_rejected and the train tests run the real subprocess.
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "event", "event": "precious"}\n')  # (a run's log: its record)
    base = [o for o in overrides(run, small_corpus) if not any(o.startswith(b.split("=")[0]) for b in bad)]
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[run]\ndir = "caf\xe9"\n')
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)
    bad = [{"CONFIG_FOLDER": str(tmp_path), "LATIN1_TOML": str(latin1), "OTHER_RUN": str(tmp_path / "other")}.get(b, b)
           for b in bad]
    code = main(["train", *base, *bad])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == '{"kind": "event", "event": "precious"}\n'


def test_unknown_argument_is_rejected():
    out = shardline("train", "--stepz", "3")
    assert out.returncode == 2 and "config overrides look like --section.key=value" in out.stderr


def test_usage_and_environment_mistakes_are_one_line(tmp_path, small_corpus, capsys, monkeypatch):
    """A second --config would silently replace the first; a malformed WORLD_SIZE reached the dry
    run as a ValueError traceback."""
    (tmp_path / "a.toml").write_text("[train]\nsteps = 3\n")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "a.toml"), "--dry-run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--config given twice" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main(["train", "--dry-run", *overrides(tmp_path / "run", small_corpus)]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE='two' in the environment is not a positive integer" in err and "Traceback" not in err


def test_srun_tasks_that_cannot_be_ranks_are_one_line_and_a_ranked_dry_run_prints_once(tmp_path, small_corpus,
                                                                                       capsys, monkeypatch):
    """srun's tasks are the ranks (parallel/slurm.py; launched for real in tests/e2e/test_torchrun.py):
    a process below a task (a shell of `srun --pty bash`), or an sbatch export that disagrees with
    the task's ids, is one line before anything is written, where it would wait for peers; a task's
    ranks last as long as the command (main() called in-process keeps its environment); under
    torchrun a dry run on every rank would print the report 8 times."""
    slurm = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_TASK_PID": "1"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert main(["train", *overrides(tmp_path / "run", small_corpus)]) == 2
    err = capsys.readouterr().err
    assert "srun started 2 tasks, and this process is not one of them" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
    assert main(["train", "--dry-run", *overrides(tmp_path / "run", small_corpus)]) == 0  # a dry run: one process
    assert "dry run: 1 rank(s)" in capsys.readouterr().out
    monkeypatch.setenv("SLURM_TASK_PID", str(os.getpid()))  # srun's task itself
    monkeypatch.setenv("RANK", "1")  # an sbatch script's export
    assert main(["train", *overrides(tmp_path / "run", small_corpus)]) == 2
    assert "RANK set in the environment of srun's tasks (an sbatch export?)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("SLURM_LOCALID", "1")  # ... said by the node's first task only
    assert main(["train", *overrides(tmp_path / "run", small_corpus)]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.delenv("RANK")
    assert main(["train", "--dry-run", *overrides(tmp_path / "run", small_corpus)]) == 0  # rank 0 of 2: it prints
    assert "layout" in capsys.readouterr().out
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ  # the command's ranks are gone with it
    for key in slurm:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's worker: the dry run checks, rank 1 stays quiet
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "--dry-run", *overrides(tmp_path / "run", small_corpus)]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--dry-run", *overrides(tmp_path / "run", small_corpus)]) == 0
    assert "layout" in capsys.readouterr().out


def test_a_relaunch_from_another_folder_names_the_saved_relative_data_path(tmp_path, monkeypatch):
    """`--run.dir` from another folder: the saved relative data.path was "does not exist", not
    where it came from."""
    from shardline.config import load_config, save_config
    from shardline.resilience.relaunch import relaunch_config

    (tmp_path / "proj" / "corpus").mkdir(parents=True)
    run = tmp_path / "proj" / "run"
    (run / "checkpoints" / "step-000004.deleting").mkdir(parents=True)  # (a checkpoint held: see above)
    save_config(load_config(None, ["data.path=corpus"]), run / "config.toml")
    monkeypatch.chdir(tmp_path / "proj")
    assert relaunch_config(None, [f"run.dir={run}"]).data.path == "corpus"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^data.path='corpus' \(from .*config.toml, the run's saved config: a "
                                          r"relative path, read from where the run was launched\) does not exist"):
        relaunch_config(None, [f"run.dir={run}"])
    assert relaunch_config(None, [f"run.dir={run}", f"data.path={tmp_path / 'proj' / 'corpus'}"]).data.path


def test_a_closed_stdout_a_stray_rank_and_a_too_long_run_dir(tmp_path, small_corpus):
    """Started with stdout closed (`>&-`, as some cron and daemon launchers do), train died at
    start-up and eval after its work (sys.stdout is None); a RANK left in the shell without a
    WORLD_SIZE made eval print nothing and exit 0; a run-dir name too long was a traceback."""
    run = tmp_path / "run"
    closed = subprocess.run([sys.executable, "-c", "import os, sys; os.close(1); sys.stdout = None; "
                             "from shardline.cli import main; sys.exit(main(sys.argv[1:]))", "train",
                             *overrides(run, small_corpus, "train.steps=2", "checkpoint.interval=2")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert closed.returncode == 0, closed.stderr[-2000:]
    assert (run / "checkpoints" / "step-000002").is_dir()
    evaluated = subprocess.run([sys.executable, "-c", "import os, sys; os.close(1); sys.stdout = None; "
                                "from shardline.cli import main; sys.exit(main(sys.argv[1:]))", "eval", str(run),
                                "--batches", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    stray = subprocess.run([sys.executable, "-m", "shardline", "eval", str(run), "--batches", "1", "--json"],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env={**env, "RANK": "1"})
    assert stray.returncode == 0 and json.loads(stray.stdout.splitlines()[-1])["step"] == 2, stray.stderr[-2000:]
    long = shardline("train", f"--run.dir={tmp_path / ('x' * 300)}", "--train.steps=1")
    assert long.returncode == 2 and long.stderr.strip().splitlines()[-1].endswith("cannot be used: File name too long")


def test_print_config_writes_a_whole_config_that_config_reads(tmp_path, capsys, monkeypatch, small_prepared):
    """An installed package has no configs/ folder to start from: `train --print-config` writes
    the config the command would train with, which --config then reads as the same config."""
    from shardline.config import load_config
    from shardline.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    given = ["--train.steps=7", "--model.preset=tiny-moe", "--optim.lr=1e-3"]
    assert main(["train", "--print-config", *given]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# shardline ") and not (tmp_path / "runs").exists()  # nothing run
    # An override left unset says what its 0 or -1 means; one given says nothing (0.0 is dropless there)
    assert "\ndim = 0  # unset: keeps the preset's (or the starting weights')\n" in text
    assert "\nqk_norm = -1  # unset: keeps the preset's" in text
    assert '\nrouter = ""  # unset: keeps the model\'s' in text
    assert main(["train", "--print-config", "--moe.capacity_factor=0"]) == 0
    assert "\ncapacity_factor = 0.0\n" in capsys.readouterr().out
    (tmp_path / "my.toml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "my.toml") == load_config(None, [g.removeprefix("--") for g in given])
    assert main(["train", "--print-config", "--optim.schedule=rsqrt", "--optim.warmup_steps=0"]) == 2
    assert "optim.warmup_steps=0 is invalid" in capsys.readouterr().err  # (no file that fails on first use)
    # What the config names on another host (a checkpoint to resume there) is not this host's to check
    assert main(["train", "--print-config", f"--run.resume={tmp_path / 'on-the-cluster'}"]) == 0
    assert 'resume = "' in capsys.readouterr().out
    # One launch's settings (an early stop, a drill) say on their line that a relaunch drops them
    assert main(["train", "--print-config", "--train.stop_at_step=5", "--faults.nan_step=3"]) == 0
    text = capsys.readouterr().out
    assert "\nstop_at_step = 5  # this launch's alone: a relaunch from the run dir starts without it\n" in text
    assert "\nnan_step = 3  # this launch's alone" in text and "steps = 200  #" not in text
    (tmp_path / "launch.toml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "launch.toml") == load_config(None, ["train.stop_at_step=5", "faults.nan_step=3"])
    assert main(["train", "--print-config", "--dry-run"]) == 2
    assert "--print-config takes no --dry-run, --world-size or --gpu" in capsys.readouterr().err
    # A run dir holding a run: the config its relaunch trains with, and nothing else on stdout (the
    # relaunch's "resuming" note made the file unreadable)
    run = tmp_path / "run"
    Trainer(load_config(None, tiny_overrides(run, small_prepared, "train.steps=2", "checkpoint.interval=2",
                                             "train.eval_interval=0"))).build().train()
    assert main(["train", "--print-config", f"--run.dir={run}", "--train.steps=4"]) == 0
    printed = capsys.readouterr()
    (tmp_path / "relaunch.toml").write_text(printed.out, encoding="utf-8")
    # ... said on stderr: a user who wanted the defaults got the saved run's (its steps, its paths) in silence
    assert f"{run} holds " in printed.err and "this is the config.toml it saved, as a relaunch there reads it " \
        "(another --run.dir prints the defaults)" in printed.err
    relaunch = load_config(tmp_path / "relaunch.toml")
    assert relaunch.train.steps == 4 and relaunch.data.path == str(small_prepared)
