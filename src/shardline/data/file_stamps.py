"""The data files a run read, stamped with their size and modification time: saved with its data
position, so a resume refused because its training tokens changed names the files that changed
since (a token fingerprint says that something changed, not where)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from shardline.data.readers import MANIFEST
from shardline.data.shards import is_prepared
from shardline.data.sources import input_files
from shardline.errors import DataError

MAX_FILES = 10_000  # past it, none are stamped: a checkpoint's state stays small
NAMED = 5  # changes named in one line


def stamp_files(paths: list[str]) -> dict[str, list[int]]:
    """{real path: [size, mtime_ns]} of the files the sources read: raw files, or a prepared folder's
    manifest (a prepare writes it anew); {} past MAX_FILES or where a file cannot be read. Taken
    before the files are read: one edited while a long read ran is named at the next resume."""
    stamps: dict[str, list[int]] = {}
    try:
        for path in paths:
            files = [Path(path) / MANIFEST] if is_prepared(path) else input_files(path)
            for f in files:
                info = os.stat(f)
                stamps[os.path.realpath(f)] = [info.st_size, info.st_mtime_ns]  # (the same file from any cwd)
                if len(stamps) > MAX_FILES:
                    return {}
    except (OSError, DataError):
        return {}
    return stamps


def changed_files(saved: dict, now: dict) -> str:
    """The files that changed between two stampings, in words ("a.jsonl (modified 2026-12-07 10:41,
    1,204 -> 1,380 bytes), b.jsonl (new)"), or "" where the stamps are missing or alike."""
    if not isinstance(saved, dict) or not saved or not now:
        return ""
    changes = [f"{name} (new)" for name in now if name not in saved]
    changes += [f"{name} (gone)" for name in saved if name not in now]
    for name, stamp in now.items():
        old = saved.get(name)
        if isinstance(old, (list, tuple)) and len(old) == 2 and list(old) != list(stamp):
            when = datetime.datetime.fromtimestamp(stamp[1] / 1e9).strftime("%Y-%m-%d %H:%M")
            size = f", {old[0]:,} -> {stamp[0]:,} bytes" if old[0] != stamp[0] else ""
            what = "prepared again" if Path(name).name == MANIFEST else "modified"
            changes.append(f"{Path(name).parent if what == 'prepared again' else name} ({what} {when}{size})")
    more = f" and {len(changes) - NAMED} more" if len(changes) > NAMED else ""
    return ", ".join(changes[:NAMED]) + more
