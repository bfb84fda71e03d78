"""The data files a run read, stamped: a refused resume names what changed since, not a fingerprint."""

from __future__ import annotations

import json
import os

from shardline.data import file_stamps
from shardline.data.file_stamps import changed_files, stamp_files


def _write(folder, names):
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text(json.dumps({"text": f"document {name}"}) + "\n")


def test_new_gone_and_modified_files_are_named_and_a_long_list_is_cut(tmp_path):
    data = tmp_path / "data"
    _write(data, ["a.jsonl", "b.jsonl"])
    before = stamp_files([str(data)])
    assert sorted(before) == [str(data / "a.jsonl"), str(data / "b.jsonl")]
    assert changed_files(before, stamp_files([str(data)])) == ""  # (nothing changed: nothing named)
    (data / "a.jsonl").unlink()
    _write(data, ["c.jsonl"])
    (data / "b.jsonl").write_text("x" * 3000)
    os.utime(data / "b.jsonl", ns=(0, 10**18))
    said = changed_files(before, stamp_files([str(data)]))
    assert said.startswith(f"{data / 'c.jsonl'} (new), {data / 'a.jsonl'} (gone), {data / 'b.jsonl'} (modified ")
    assert said.endswith(" -> 3,000 bytes)")
    _write(data, [f"more{i}.jsonl" for i in range(6)])
    assert changed_files(before, stamp_files([str(data)])).endswith(" and 4 more")


def test_a_corpus_past_the_bound_or_unreadable_stamps_nothing(tmp_path, monkeypatch):
    data = tmp_path / "data"
    _write(data, ["a.jsonl", "b.jsonl", "c.jsonl"])
    monkeypatch.setattr(file_stamps, "MAX_FILES", 2)
    assert stamp_files([str(data)]) == {}
    assert stamp_files([str(tmp_path / "gone")]) == {}
    assert changed_files({}, {"x": [1, 2]}) == "" and changed_files(["not", "a dict"], {"x": [1, 2]}) == ""


def test_a_checkpoint_from_before_stamps_or_unchanged_files_gets_the_causes_alone(tmp_path):
    """Saved with no stamps (an older checkpoint), or files that kept theirs (the tokenizer changed):
    no file is blamed; the changed one is named before the causes, which stay (a touched file may
    not be the cause)."""
    import pytest

    from shardline.errors import CheckpointError
    from shardline.resilience.resume_checks import check_data_position

    data = tmp_path / "data"
    _write(data, ["a.jsonl"])
    stamps = stamp_files([str(data)])
    saved = {"content": "old", "num_samples": 10, "seed": 0, "global_batch_size": 2, "samples_seen": 0,
             "split": "content-hash"}
    for before in ({}, {"files": stamps}):
        with pytest.raises(CheckpointError) as refused:
            check_data_position("ck", {**saved, **before}, 10, 0, 2, {"content": "new", "files": stamps})
        assert "its training tokens differ: the files were edited or replaced, or the tokenizer" in str(refused.value)
    # Saved before the held-out split was chosen by content (no "split"), resumed on raw files by content:
    # that is the cause, named with the key that resumes it
    with pytest.raises(CheckpointError, match=r"was trained with the raw documents held out by position "
                                              r"\(data.split=position; .*resume it with --data.split=position$"):
        check_data_position("ck", {k: v for k, v in saved.items() if k != "split"}, 10, 0, 2, {"content": "new"},
                            split="content-hash")
    os.utime(data / "a.jsonl", ns=(0, 10**18))
    with pytest.raises(CheckpointError, match=r"differ \(files changed since: .*a.jsonl \(modified [^)]*\)\): the "):
        check_data_position("ck", {**saved, "files": stamps}, 10, 0, 2, {"content": "new",
                                                                         "files": stamp_files([str(data)])})
