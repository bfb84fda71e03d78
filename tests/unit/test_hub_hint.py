"""A Hub id given where a local folder is read: the refusal says how to get the folder, and names the
snapshot a local Hub cache holds (a walkthrough's `me/tiny-llama` with a filled cache said only that the
folder did not exist)."""

from __future__ import annotations

import pytest

from shardline.cli import main
from shardline.interop.hub import hub_hint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_a_hub_id_is_told_where_its_cached_snapshot_is(cache, tmp_path, monkeypatch, capsys):
    repo = cache / "models--me--tiny-llama"
    for revision in ("old", "abc123"):
        (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "from-hf", "me/tiny-llama", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert f"the local Hub cache holds it at {repo / 'snapshots' / 'abc123'}" in said, said
    assert main(["train", "--model.hf_path=me/tiny-llama", "--dry-run"]) == 2
    assert "model.hf_path='me/tiny-llama' does not exist or is not a folder (a Hub id?" in capsys.readouterr().err


def test_without_a_cached_copy_it_says_how_to_download(cache):
    assert "`hf download org/model --local-dir DIR`" in hub_hint("org/model")


def test_paths_that_are_no_hub_id_get_no_hint(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_hint("org/model") == ""  # (it exists: some other problem)
    assert hub_hint("runs/a/b") == hub_hint("/abs/path") == hub_hint("model") == hub_hint("./org/x") == ""
