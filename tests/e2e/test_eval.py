"""`shardline eval`: a checkpoint's held-out loss, as its run's training evaluated it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.trainer import Trainer
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_prepared):
    """A tiny run of 4 steps that evaluated at its last step, on the prepared small corpus."""
    from tests.conftest import tiny_overrides
    from shardline.config import load_config

    run = tmp_path_factory.mktemp("eval") / "run"
    Trainer(load_config(None, tiny_overrides(run, small_prepared, "train.steps=4", "train.eval_interval=4",
                                             "checkpoint.interval=4", "train.eval_batches=2"))).build().train()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, next(r for r in logged if r["kind"] == "eval" and r["step"] == 4)


def _eval(capsys, *args: str) -> dict:
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_gives_the_loss_the_run_logged_at_that_step(trained, capsys, small_corpus, monkeypatch):
    from shardline import evaluate

    run, logged = trained
    made, original = [], evaluate.work_dir
    monkeypatch.setattr(evaluate, "work_dir", lambda: made.append(original()) or made[-1])
    got = _eval(capsys, str(run))
    assert made and not made[-1].exists() and made[-1].name.startswith("shardline-eval-")  # its run dir removed
    assert got["step"] == 4 and got["checkpoint"] == str(run / "checkpoints" / "step-000004")
    assert got["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6) and got["sequences"] == logged["eval_sequences"]
    assert got["perplexity"] == pytest.approx(logged["eval_ppl"], rel=1e-6) and got["labelled_tokens"] > 0
    everything = _eval(capsys, str(run / "checkpoints" / "step-000004"), "--batches", "0")  # a checkpoint folder
    assert everything["sequences"] > got["sequences"] and everything["loss"] != got["loss"]
    # Other data given as an override: the raw file the folder was prepared from holds out the same documents
    assert main(["eval", str(run), f"--data.path={small_corpus}", "--batches", "0", "--json"]) == 0
    said = capsys.readouterr()
    raw = json.loads(said.out.strip().splitlines()[-1])
    assert raw["loss"] == pytest.approx(everything["loss"], rel=1e-6) and raw["data"] == str(small_corpus)
    assert "split of its own" not in said.err  # (split alike: no note of files read apart)
    # Other windows give another number, which read as the logged one's drift (said on stderr)
    assert main(["eval", str(run), "--train.seq_len=16", "--json"]) == 0
    assert "evaluated in windows of train.seq_len=16 tokens, where the run evaluated in 32: not comparable" in \
        capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--model.init_from=elsewhere"], "eval sets model.init_from itself"),
    (["--model.preset=tiny-moe"], "--model.preset: eval takes the model, its shape and weights, from the checkpoint"),
    (["--batches", "-1"], "batches=-1 is invalid"),
    (["--train.seq_len=16384"], "too few for one sequence of train.seq_len=16384"),  # (and its way out for eval:)
    (["--train.seq_len=16384"], "evaluate on all of a file (data.val_path)"),
    (["--data.path=", "--data.val_fraction=0"], "data.val_fraction=0: the data holds nothing out to evaluate on"),
])
def test_eval_mistakes_are_one_line(trained, capsys, args, says):
    run, _ = trained
    assert main(["eval", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_eval_on_two_ranks_gives_one_process_loss(trained):
    """Under torchrun every rank takes part (FSDP over both by default; tp 2 given): the same loss."""
    run, logged = trained
    for layout in ([], ["--parallel.tp=2"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "shardline", "eval", str(run), "--json", *layout]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, out.stdout  # rank 0 says it
        assert json.loads(lines[0])["loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)


def test_a_renamed_checkpoint_keeps_its_step_and_a_relative_data_path_is_named(trained, tmp_path, capsys, monkeypatch,
                                                                                small_prepared, small_corpus):
    """The step comes from the manifest (a folder copied under another name read -1); the saved
    config's relative data path is relative to where the run trained: said as such from elsewhere."""
    import shutil

    from shardline.config import load_config
    from tests.conftest import tiny_overrides

    run, logged = trained
    shutil.copytree(run / "checkpoints" / "step-000004", tmp_path / "kept")
    assert _eval(capsys, str(tmp_path / "kept"))["step"] == 4  # moved out of its run: the folder's tokenizer
    assert main(["eval", str(tmp_path / "kept"), f"--data.path={small_corpus}"]) == 2  # raw: none known
    assert "has no tokenizer.json beside it or in a run dir above it" in capsys.readouterr().err
    assert _eval(capsys, str(tmp_path / "kept"), f"--data.path={small_corpus}",
                 f"--data.tokenizer={run / 'tokenizer.json'}")["step"] == 4
    monkeypatch.chdir(small_prepared.parent)
    relative = tmp_path / "relative"
    overrides = [o for o in tiny_overrides(relative, small_prepared, "train.steps=2", "train.eval_interval=2")
                 if not o.startswith("data.path=")]
    Trainer(load_config(None, [*overrides, f"data.path={small_prepared.name}"])).build().train()
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(relative)]) == 2
    err = capsys.readouterr().err
    assert f"data.path='{small_prepared.name}' (from the run's saved config: relative to the directory it trained " \
           f"in) is not found from {tmp_path}" in err
    assert _eval(capsys, str(relative), f"--data.path={small_prepared}")["step"] == 2


def test_eval_of_a_run_whose_data_changed_since_says_so(tmp_path, small_corpus, capsys):
    """The run's own held-out split, cut from data edited since the checkpoint: scored, and said
    (a different split, which may hold documents the run trained on); not said where it is unchanged."""
    from tests.conftest import tiny_overrides
    from shardline.config import load_config

    corpus, run = tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text(small_corpus.read_text())
    Trainer(load_config(None, tiny_overrides(run, corpus, "train.steps=2", "checkpoint.interval=2",
                                             "train.eval_interval=2", "train.eval_batches=1"))).build().train()
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    unchanged = capsys.readouterr()
    assert '"loss"' in unchanged.out and "data changed" not in unchanged.err
    corpus.write_text(small_corpus.read_text().replace("e", "a"))  # the same length, other tokens
    assert main(["eval", str(run), "--json"]) == 0
    said = capsys.readouterr().err
    assert "the run's data changed since step-000002 was saved" in said and "may hold documents it trained on" in said
    assert f"; changed: {corpus} (modified " in said, said


def test_eval_on_a_folder_prepared_from_files_the_run_trained_on_says_its_split_is_its_own(tmp_path, small_corpus,
                                                                                             small_prepared, capsys):
    """A corpus prepared again with files added held out other documents (by position): eval on the old
    folder's held-out split scored documents the run trained on (11 of 12 in a walkthrough), with no word said.
    By content, a folder at another share holds out others (a larger share: some the run trained on)."""
    from shardline.config import load_config
    from shardline.data.prepare import PrepareOptions, prepare
    from tests.conftest import tiny_overrides

    lines = small_corpus.read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[::2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[1::2]))
    tok = str(small_prepared / "tokenizer.json")
    for out, inputs, share in (("old", ["a.jsonl"], 0.1), ("same", ["a.jsonl"], 0.05), ("new", ["a.jsonl", "b.jsonl"],
                                                                                      0.05)):
        prepare(PrepareOptions(inputs=[str(tmp_path / i) for i in inputs], out=str(tmp_path / out), tokenizer=tok,
                               val_fraction=share, progress=False))
    run = tmp_path / "run"
    Trainer(load_config(None, tiny_overrides(run, tmp_path / "new", "train.steps=2", "checkpoint.interval=2",
                                             "train.eval_interval=0"))).build().train()
    capsys.readouterr()
    assert main(["eval", str(run), f"--data.path={tmp_path / 'old'}", "--batches", "1"]) == 0
    assert (f"shardline eval: note: {tmp_path / 'old'} reads files the run trained on (its data {tmp_path / 'new'}), "
            "with a held-out split of its own") in capsys.readouterr().err
    for alike in ("new", "same"):  # its own split; a part of its files at its share: held out as the run held them
        assert main(["eval", str(run), f"--data.path={tmp_path / alike}", "--batches", "1"]) == 0
        assert "note" not in capsys.readouterr().err, alike


def test_eval_with_another_split_or_on_the_training_file_says_it_scores_trained_documents(tmp_path, small_corpus,
                                                                                           capsys):
    """A walkthrough's silent cases: --data.val_fraction (a larger share) or --data.split=position on the
    run's own raw data held out documents the run trained on, and --data.val_path on its training file scored
    every one of them, each with no word said and a JSON alike to a held-out split's."""
    from tests.conftest import tiny_overrides
    from shardline.config import load_config

    run = tmp_path / "run"
    Trainer(load_config(None, tiny_overrides(run, small_corpus, "train.steps=2", "checkpoint.interval=2",
                                             "train.eval_interval=0", "data.val_fraction=0.05"))).build().train()
    capsys.readouterr()
    own = _eval(capsys, str(run), "--batches", "1")
    assert (own["validation_data"], own["all_sequences"], own["seq_len"], own["data"]) == (
        False, False, 32, str(small_corpus))
    for other in ("--data.val_fraction=0.2", "--data.split=position"):
        assert main(["eval", str(run), other, "--batches", "1"]) == 0
        assert (f"shardline eval: note: {small_corpus} reads files the run trained on (its data {small_corpus}), with "
                "a held-out split of its own") in capsys.readouterr().err, other
    for part in ("--data.val_fraction=0.01", "--data.val_fraction=0.05"):  # by content, a smaller share: held out
        assert main(["eval", str(run), part, "--batches", "1"]) == 0
        assert "note" not in capsys.readouterr().err, part
    assert main(["eval", str(run), f"--data.val_path={small_corpus}", "--batches", "1"]) == 0
    said = capsys.readouterr()
    assert f"--data.val_path={small_corpus} reads files the run trained on" in said.err
    assert " sequences of 32 tokens, " in said.out and f"labelled tokens of the validation data {small_corpus}" in \
        said.out
    every = _eval(capsys, str(run), f"--data.val_path={small_corpus}", "--batches", "0")
    assert (every["validation_data"], every["all_sequences"]) == (True, True)


def test_a_killed_one_process_evaluations_folder_goes_with_the_next_one(monkeypatch):
    """SIGKILL skips an evaluation's cleanup: its temporary run dir stayed in /tmp for good where
    one process ran it (only ranked ones' were swept). A folder whose lock's process is gone goes
    with the next evaluation; a live one's stays."""
    import socket

    from shardline import evaluate
    from shardline.resilience.run_lock import LOCK

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    made = []
    for name, pid in (("killed", int(gone.stdout)), ("live", os.getpid())):
        folder = Path("/tmp") / f"shardline-eval-{os.getuid()}-test-{name}-{os.getpid()}"
        folder.mkdir()
        (folder / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "start": -1.0}))
        made.append(folder)
    try:
        fresh = evaluate.work_dir()
        assert fresh.is_dir() and not made[0].exists() and made[1].exists()
        fresh.rmdir()
    finally:
        for folder in made:
            if folder.exists():
                (folder / LOCK).unlink()
                folder.rmdir()


def test_a_ranked_evaluations_folder_planted_by_another_is_refused(tmp_path, monkeypatch):
    """Under torchrun the evaluation's run dir in /tmp has a name another user can work out from the
    job: a link planted there is refused in one line, and a stale-folder sweep leaves what is not
    this user's own folder alone."""
    import uuid

    from shardline import evaluate
    from shardline.errors import CheckpointError

    job = uuid.uuid4().hex[:8]
    for key, value in (("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", job), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    planted = Path("/tmp") / f"shardline-eval-{os.getuid()}-{job}--h-1"
    (tmp_path / "theirs").mkdir()
    planted.symlink_to(tmp_path / "theirs")
    try:
        with pytest.raises(CheckpointError, match=re.escape(f"shardline eval: {planted} is a symbolic link, not a "
                                                            "folder of this user's own")):
            evaluate.work_dir()
        assert planted.is_symlink() and (tmp_path / "theirs").is_dir()  # (the sweep passed it over)
    finally:
        planted.unlink()
    folder = evaluate.work_dir()
    try:
        assert folder == planted and folder.is_dir() and oct(folder.stat().st_mode & 0o777) == "0o700"
    finally:
        folder.rmdir()


def test_a_run_whose_checkpoints_folder_links_to_another_disk_finds_its_tokenizer(tiny_config, tmp_path, capsys):
    """`<run>/checkpoints` a link to another disk: eval said "no tokenizer.json beside it or in a run dir
    above it", and `convert to-hf` wrote an export without a tokenizer, exit 0."""
    run, disk = tmp_path / "run", tmp_path / "other_disk" / "ck"
    disk.mkdir(parents=True)
    run.mkdir()
    (run / "checkpoints").symlink_to(disk)
    Trainer(tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0", run_dir=run)).build().train()
    capsys.readouterr()
    assert main(["eval", str(run), "--batches", "1"]) == 0
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and "without a tokenizer" not in capsys.readouterr().err


@pytest.mark.parametrize("given", ["run dir", "checkpoint"])
def test_a_checkpoint_is_hashed_once_by_an_evaluation(trained, capsys, monkeypatch, given):
    """Hashing a large checkpoint takes minutes: a run dir's newest valid one is verified as it is
    chosen, and not again as it loads (it was twice); a checkpoint named is verified by its load."""
    from shardline.resilience import checkpoint

    run, logged = trained
    hashed, sha256 = [], checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: hashed.append(path.name) or sha256(path))
    src = run if given == "run dir" else run / "checkpoints" / "step-000004"
    assert _eval(capsys, str(src))["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert hashed.count("meta.json") == 1


def test_a_checkpoint_converted_from_hf_asks_for_the_data_to_evaluate_on(trained, tmp_path, capsys, small_prepared):
    """It holds no run's config: eval took the defaults, and scored the weights on the shipped corpus (the
    King James Bible), a number of no data the user meant."""
    run, _ = trained
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf")]) == 0
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "ckpt")]) == 2
    assert "holds no run's config (converted from HF?), so no data of its own: give the data to evaluate on, " \
           "--data.path=PATH" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "ckpt"), f"--data.path={small_prepared}", "--batches", "1"]) == 0
    assert "windows of train.seq_len=256 tokens, the default" in capsys.readouterr().err
    from shardline.data.sources import shipped_corpus  # (no run's data: nothing "it trained on" to name)

    assert main(["eval", str(tmp_path / "ckpt"), f"--data.val_path={shipped_corpus()}", "--batches", "1",
                 "--train.seq_len=32"]) == 0
    assert "note" not in capsys.readouterr().err


def test_eval_of_a_mixture_run_on_one_source_and_of_a_one_source_run_on_a_mixture(trained, tmp_path, capsys,
                                                                                    small_prepared):
    """--data.path on a run trained on data.mix was refused, "set data.path or data.mix, not both": the run's
    own mixture, saved, beside the data given. The data given replaces the run's, either way."""
    from shardline.config import load_config
    from tests.conftest import tiny_overrides

    run = tmp_path / "mixed"
    mix = f'data.mix=[{{path = "{small_prepared}"}}, {{path = "{small_prepared}", weight = 0.5}}]'
    Trainer(load_config(None, tiny_overrides(run, small_prepared, "data.path=", mix, "train.steps=2",
                                             "checkpoint.interval=2", "train.eval_interval=0"))).build().train()
    capsys.readouterr()
    assert main(["eval", str(run), f"--data.path={small_prepared}", "--batches", "1", "--json"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["data"] == str(small_prepared) and one["sequences"] > 0
    assert main(["eval", str(trained[0]), f"--data.mix=[{{path = \"{small_prepared}\"}}]", "--batches", "1"]) == 0
