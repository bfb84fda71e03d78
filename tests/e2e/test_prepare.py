"""`shardline prepare`, then training from the folder and resuming it on another layout under torchrun."""

from __future__ import annotations

import json
import re

from shardline.cli import main
from shardline.config import load_config
from shardline.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.e2e.test_cli import shardline
from tests.e2e.test_torchrun import torchrun


def losses(run) -> dict[int, float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_prepare_then_train_and_resume_on_two_ranks_matches_the_raw_run(tmp_path, small_corpus):
    prep = tmp_path / "prep"
    out = shardline("prepare", str(small_corpus), "--out", str(prep), "--vocab-size", "512", "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert f"train with --data.path={prep}" in out.stdout and "150/150 documents" in out.stderr
    # (its pace in the last line too, which a --quiet run or a log's tail keeps; a .txt file's documents counted)
    assert re.search(r"from 150 documents of \d+ file\(s\) in [\d.]+ s \([\d,]+ tokens/s\); train with", out.stdout)
    raw, folder = tmp_path / "raw", tmp_path / "folder"
    Trainer(load_config(None, tiny_overrides(raw, small_corpus))).build().train()  # the reference, in-process
    Trainer(load_config(None, tiny_overrides(folder, prep, "train.stop_at_step=6"))).build().train()
    out = torchrun(2, *[f"--{o}" for o in tiny_overrides(folder, prep, "parallel.dp_shard=2")])
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = losses(raw), losses(folder)
    assert sorted(b) == list(range(1, 13))
    assert all(abs(a[s] - b[s]) <= 1e-5 * abs(a[s]) for s in a), (a, b)


def test_prepare_errors_are_one_line(tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err  # named as the command's input, not as a config key the user never set
    assert f"prepare INPUT='{tmp_path / 'missing.jsonl'}' does not exist" in err and "data.path" not in err
    assert main(["prepare", "--out", str(tmp_path / "nowhere"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "does not exist or is not a folder: nothing to verify" in err and "unfinished" not in err
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "progress.json").write_text("{}")
    assert main(["train", "--dry-run", f"--data.path={tmp_path / 'p'}"]) == 2
    err = capsys.readouterr().err
    assert "unfinished prepared folder" in err and len(err.strip().splitlines()) == 1


def test_a_short_held_out_split_is_named_when_prepared(tmp_path, capsys):
    """A .txt file whose paragraphs are one blank line apart is one document: a tiny held-out
    split, named by prepare itself (before, first by a training start that refused it)."""
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(f"paragraph {i} about the history of the city and its river" for i in range(400)))
    out = tmp_path / "prep"
    assert main(["prepare", str(text), "--out", str(out), "--vocab-size", "300", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note: the held-out split is" in err and "(1 read; a .txt file's documents end at two blank lines)" in err
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("\n\n\n".join(f"document {i}: " + "the city and its river " * 40 for i in range(400)))
    assert main(["prepare", str(spaced), "--out", str(tmp_path / "prep2"), "--vocab-size", "300", "--val-fraction",
                 "0.1", "--quiet"]) == 0
    assert "note: the held-out split" not in capsys.readouterr().err


def test_a_home_path_on_the_command_line_is_the_home_folder_as_in_a_config(tmp_path, small_corpus, monkeypatch,
                                                                          capsys):
    """A quoted `~/prep` made a folder named `~` in the current one, and prepare's hint then named a
    path that a run (which expands `~` in config keys) did not find."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    shutil.copy(small_corpus, tmp_path / "home" / "corpus.jsonl")
    assert main(["prepare", "~/corpus.jsonl", "--out", "~/my prep", "--vocab-size", "512", "--quiet"]) == 0
    assert (tmp_path / "home" / "my prep" / "manifest.json").is_file() and not (tmp_path / "~").exists()
    assert f"train with '--data.path={tmp_path / 'home' / 'my prep'}'" in capsys.readouterr().out


def test_a_folder_the_file_system_refuses_is_one_line_not_a_traceback(tmp_path, small_corpus, capsys):
    assert main(["prepare", str(small_corpus), "--out", "/proc/shardline-prep", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline: error: ") and "/proc/shardline-prep" in err and err.count("\n") == 1, err


def test_verify_tells_a_missing_shard_from_a_changed_one(tmp_path, small_prepared, capsys):
    """A deleted shard was reported as a checksum mismatch, and the way out was to prepare again,
    where the inputs may not be on this machine (a folder copied between machines)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small_prepared, copy)
    (copy / "train" / "tokens-00000.bin").unlink()
    with open(copy / "val" / "docs.idx", "ab") as f:
        f.write(b"\0")
    assert main(["prepare", "--out", str(copy), "--verify"]) == 2
    err = capsys.readouterr().err
    assert (f"{copy}: missing: train/tokens-00000.bin; checksum mismatch in val/docs.idx; copy the folder again from "
            "a good copy, or prepare it again with --overwrite") in err, err
    # the tokenizer too, which every run checks (--verify passed a folder every run refused)
    shutil.rmtree(copy)
    shutil.copytree(small_prepared, copy)
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    assert main(["prepare", "--out", str(copy), "--verify"]) == 2
    assert f"{copy}: checksum mismatch in tokenizer.json;" in capsys.readouterr().err


def test_options_a_prepare_does_not_read_are_said(tmp_path, small_prepared, small_corpus, capsys):
    """`--verify` with inputs checked the folder alone, and --vocab-size beside --tokenizer was unused,
    each without a word."""
    assert main(["prepare", str(small_corpus), "--out", str(small_prepared), "--verify"]) == 0
    assert f"note: --verify checks {small_prepared} as it was prepared; the inputs given are not read" in \
        capsys.readouterr().err
    out = tmp_path / "prep"
    assert main(["prepare", str(small_corpus), "--out", str(out), "--tokenizer", str(small_prepared / "tokenizer.json"),
                 "--vocab-size", "999", "--quiet"]) == 0
    assert "note: --vocab-size 999 is not used: --tokenizer gives the vocabulary" in capsys.readouterr().err
