"""Data sources that read the same documents: two data.mix sources over one file (sampled more than
their weights say), or data.val_path inside a training source (an eval loss that is a training loss).
Allowed, but rarely meant: the launch and the dry run name them.

A source reads its roots (a folder, a file, a pattern's matches; a DatasetDict's train split), a
path through a link as its target's, and a prepared folder also the files it was prepared from (as
its manifest lists them) and its training tokens' fingerprint: two folders prepared from the same
files alike hold the same documents, whatever their paths.
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

from shardline.config import Config
from shardline.data.folders import read_root
from shardline.data.shards import is_prepared, read_manifest
from shardline.errors import ShardlineError

OVERLAP_WHY = "their files are read by each: sampled more than the weights say"
HELD_OUT_APART = ", and each source holds out its own documents, so one may evaluate on what another trains on"


def source_roots(path: str) -> list[Path]:
    """What a data source reads, as paths: its folder or file (a DatasetDict's train split), else a pattern's
    matches."""
    return [read_root(Path(path))] if path and Path(path).exists() else [
        Path(m) for m in glob.glob(path or "", recursive=True)]


def _reads(path: str) -> tuple[set[Path], str]:
    """(the source's roots, a file link by its own name, as HF's cache links its files, a folder by its
    target; with a prepared folder's input files), and a prepared folder's training fingerprint ("")."""
    roots = {Path(os.path.realpath(p)) if p.is_dir() else Path(os.path.realpath(p.parent)) / p.name
             for p in source_roots(path)}
    fingerprint = ""
    if path and is_prepared(path):
        with contextlib.suppress(ShardlineError, OSError, ValueError, TypeError, AttributeError, IndexError):
            manifest = read_manifest(Path(path))
            roots |= {Path(entry[0]) for entry in manifest.get("request", {}).get("inputs", [])}
            fingerprint = manifest.get("train_fingerprint") or ""
    return roots, fingerprint


def _meet(mine: set[Path], theirs: set[Path]) -> bool:
    """One set holds a path of the other, or a folder above one (looked up with its parents in a set: two
    patterns of many files each cost no product of the two)."""
    return any(not mine.isdisjoint([p, *p.parents]) for p in theirs) or \
        any(not theirs.isdisjoint([p, *p.parents]) for p in mine)


def overlapping_sources(cfg: Config) -> tuple[str, str]:
    """Two data.mix sources that read the same files in the same way (one folder inside another, the same
    pattern, a prepared folder and a file it was prepared from, two folders prepared alike): (`key=path and
    key=path`, why it matters); ("", "") for none."""
    read = [(f"data.mix[{i}].path={s.path}", *_reads(s.path), is_prepared(s.path),
             (s.format or cfg.data.format, s.text_field or cfg.data.text_field))
            for i, s in enumerate(cfg.data.mix) if s.path]
    for i, (key, mine, print_, prepared, how) in enumerate(read):
        for other, theirs, their_print, their_prepared, their_how in read[i + 1:]:
            if (how == their_how and _meet(mine, theirs)) or (print_ and print_ == their_print):
                # (two prepared folders' splits are prepare's: the same files give the same split)
                held = "" if cfg.data.val_path or (prepared and their_prepared) else HELD_OUT_APART
                return f"{key} and {other}", OVERLAP_WHY + held
    return "", ""


def val_path_in_training_data(cfg: Config) -> str:
    """The training source data.val_path is (or lies inside, or was prepared from, or is prepared
    alike), as `key=path`, where it is evaluated on; "" for none."""
    if not cfg.data.val_path or not cfg.train.eval_interval:
        return ""
    val, val_print = _reads(cfg.data.val_path)
    for key, path in [(f"data.mix[{i}].path", s.path) for i, s in enumerate(cfg.data.mix)] or [
            ("data.path", cfg.data.path)]:
        read, fingerprint = _reads(path)
        if any(v.is_relative_to(r) or r.is_relative_to(v) for v in val for r in read) or (
                val_print and val_print == fingerprint):
            return f"{key}={path}"
    return ""


def split_apart(evaluated: list[str], trained: list[str]) -> tuple[str, str] | None:
    """A source evaluated on that reads files a run trained on, split by its own held-out rule (another
    folder prepared from some of them, a raw file the run read through a folder): (it, the trained
    source), else None. The same source, or a folder prepared alike, is split alike: none."""
    for mine in filter(None, evaluated):
        reads, fingerprint = _reads(mine)
        for theirs in filter(None, trained):
            their_reads, their_print = _reads(theirs)
            same = os.path.realpath(mine) == os.path.realpath(theirs) or (fingerprint and fingerprint == their_print)
            if not same and _meet(reads, their_reads):
                return mine, theirs
    return None
