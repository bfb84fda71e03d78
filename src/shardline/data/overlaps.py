"""Data sources that read the same documents: two data.mix sources over one file (sampled more than
their weights say), or data.val_path inside a training source (an eval loss that is a training loss).
Allowed, but rarely meant: the launch and the dry run name them.

A source reads its roots (a folder, a file, a pattern's matches; a DatasetDict's train split), a
file by its link's name and its target, and a prepared folder also the files it was prepared from
(as its manifest lists them) and its training tokens' fingerprint: two folders prepared from the
same files alike hold the same documents, whatever their paths. Two sources split alike hold out the
same documents: both by content at the same share (a document held out in one is in the other), or,
for folders prepared before that rule, the same files in order at the same share; others each their own.
"""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass
from pathlib import Path

from shardline.config import Config
from shardline.data.folders import read_root
from shardline.data.shards import is_prepared, read_manifest
from shardline.data.sources import input_files
from shardline.data.validation import SPLIT_RULE, training_val_fraction
from shardline.errors import ShardlineError

OVERLAP_WHY = "their files are read by each: sampled more than the weights say"
HELD_OUT_APART = ", and each source holds out its own documents, so one may evaluate on what another trains on"


def source_roots(path: str) -> list[Path]:
    """What a data source reads, as paths: its folder or file (a DatasetDict's train split), else a pattern's
    matches."""
    return [read_root(Path(path))] if path and Path(path).exists() else [
        Path(m) for m in glob.glob(path or "", recursive=True)]


@dataclass
class _Read:
    """What a source reads: its roots (for overlaps: a folder by its target, a file by its link's name and
    its target, a prepared folder with the files it was prepared from), those files in reading order with
    the share held out of them (what decides its split), and a prepared folder's training fingerprint."""

    roots: set[Path]
    files: tuple[str, ...] = ()
    fraction: float | None = None
    fingerprint: str = ""
    rule: str | None = SPLIT_RULE  # how its documents were held out (None: by position, a folder from before)


def _reads(path: str, fraction: float, split: str = "content") -> _Read:
    """The source at `path`, read with `fraction` held out by data.split's `split` where it is raw (a
    prepared folder's split is its own)."""
    read = _Read(set(), fraction=fraction, rule=SPLIT_RULE if split == "content" else None)
    for p in source_roots(path):
        read.roots |= {Path(os.path.realpath(p))} if p.is_dir() else {Path(os.path.realpath(p.parent)) / p.name,
                                                                      Path(os.path.realpath(p))}
    with contextlib.suppress(ShardlineError, OSError, ValueError, TypeError, AttributeError, IndexError, KeyError):
        if path and is_prepared(path):
            manifest = read_manifest(Path(path))
            read.files = tuple(entry[0] for entry in manifest["request"]["inputs"])
            read.roots |= set(map(Path, read.files))
            read.fraction, read.fingerprint = manifest.get("val_fraction"), manifest.get("train_fingerprint") or ""
            read.rule = manifest["request"].get("split")
        elif path:
            read.files = tuple(str(f.resolve()) for f in input_files(path))
    return read


def _held_out_within(a: _Read, b: _Read) -> bool:
    """Whether source `a` holds out only documents `b` holds out: the same training tokens, or both split by
    content, `a` at the same share or a smaller one (the documents whose hash is below it: a part of b's), or
    by position (folders prepared before) from the same files in order at the same share."""
    if a.fingerprint and a.fingerprint == b.fingerprint:
        return True
    if a.rule != b.rule or a.fraction is None or b.fraction is None:
        return False
    if a.rule == SPLIT_RULE:
        return a.fraction <= b.fraction
    return a.fraction == b.fraction and bool(a.files) and a.files == b.files


def _meet(mine: set[Path], theirs: set[Path]) -> bool:
    """One set holds a path of the other, or a folder above one (looked up with its parents in a set: two
    patterns of many files each cost no product of the two)."""
    return any(not mine.isdisjoint([p, *p.parents]) for p in theirs) or \
        any(not theirs.isdisjoint([p, *p.parents]) for p in mine)


def overlapping_sources(cfg: Config) -> tuple[str, str]:
    """Two data.mix sources that read the same files in the same way (one folder inside another, the same
    pattern, a prepared folder and a file it was prepared from, two folders prepared alike): (`key=path and
    key=path`, why it matters); ("", "") for none. Each holds out its own documents, unless split alike."""
    fraction = training_val_fraction(cfg)
    read = [(f"data.mix[{i}].path={s.path}", _reads(s.path, fraction, cfg.data.split),
             (s.format or cfg.data.format, s.text_field or cfg.data.text_field))
            for i, s in enumerate(cfg.data.mix) if s.path]
    for i, (key, mine, how) in enumerate(read):
        for other, theirs, their_how in read[i + 1:]:
            if (how == their_how and _meet(mine.roots, theirs.roots)) or (
                    mine.fingerprint and mine.fingerprint == theirs.fingerprint):
                alike = _held_out_within(mine, theirs) and _held_out_within(theirs, mine)  # (both ways: each trains)
                held = "" if cfg.data.val_path or alike else HELD_OUT_APART
                return f"{key} and {other}", OVERLAP_WHY + held
    return "", ""


def val_path_in_training_data(cfg: Config) -> str:
    """The training source data.val_path is (or lies inside, or was prepared from, or is prepared
    alike), as `key=path`, where it is evaluated on; "" for none."""
    if not cfg.data.val_path or not cfg.train.eval_interval:
        return ""
    keyed = [(f"data.mix[{i}].path", s.path) for i, s in enumerate(cfg.data.mix)] or [("data.path", cfg.data.path)]
    found = reads_trained_files(cfg.data.val_path, [path for _, path in keyed])
    return next((f"{key}={path}" for key, path in keyed if path == found), "")


def reads_trained_files(val_path: str, trained: list[str]) -> str:
    """The first of the `trained` sources whose files `val_path` reads (it is, or lies inside, or was
    prepared from one, or is prepared alike); "" for none."""
    val = _reads(val_path, 0.0)
    for path in trained:
        read = _reads(path, 0.0)
        if _meet(val.roots, read.roots) or (val.fingerprint and val.fingerprint == read.fingerprint):
            return path
    return ""


def split_apart(evaluated: list[str], fraction: float, trained: list[str], trained_fraction: float,
                split: str = "content", trained_split: str = "content") -> tuple[str, str] | None:
    """A source evaluated on (with `fraction` held out by data.split's `split`) that reads files a run
    trained on (with `trained_fraction`, by `trained_split`), split otherwise (another folder prepared from
    some of them, another share or rule): (it, the trained source), else None. A source split alike
    holds out the same documents."""
    theirs = [(path, _reads(path, trained_fraction, trained_split)) for path in filter(None, trained)]
    for mine in filter(None, evaluated):
        read = _reads(mine, fraction, split)
        for path, their in theirs:
            if _meet(read.roots, their.roots) and not _held_out_within(read, their):
                return mine, path
    return None
