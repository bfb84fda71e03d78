"""A prepared folder's readers: a run holds a shared lock on the folder's manifest.json while it
reads the folder's shards, and `prepare --overwrite` asks for the lock exclusively before it
removes anything, so a folder is not replaced under a running job.

Shards are memory-mapped as they are first read (a held-out split at the first evaluation), so
a folder replaced mid-run gave that run the new folder's tokens, tokenized by another tokenizer,
and its eval losses were the new data's without a word. flock locks are kept by the open file,
on this host and, on file systems that pass them on (NFS), on the others; where a file system
refuses them, nothing is checked.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from shardline.errors import DataError

MANIFEST = "manifest.json"  # a finished folder's record, written last (shards.py)


def reading(root: Path) -> IO | None:
    """The open manifest of folder `root`, shared-locked for as long as the caller keeps it (the
    splits hold it); None where there is no manifest (read_manifest says so) or no lock to take."""
    try:
        handle = open(root / MANIFEST, encoding="utf-8")
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        replaced = os.fstat(handle.fileno()).st_nlink == 0  # (removed between the open and the lock)
    except BlockingIOError:
        replaced = True
    except OSError:  # a file system without flock
        return handle
    if replaced:
        handle.close()
        raise DataError(f"{root} is being prepared again (a `shardline prepare --overwrite` holds it): wait for it "
                        "to finish, or train from another folder")
    return handle


@contextmanager
def unread(root: Path):
    """Inside: no run reads folder `root` (its manifest held exclusively, so none starts), or a
    DataError naming the way out; for prepare --overwrite, before it removes anything."""
    try:  # (read-write: NFS emulates flock with fcntl locks, whose exclusive kind needs a write open)
        handle = open(root / MANIFEST, "r+", encoding="utf-8")
    except OSError:  # no manifest (nothing reads an unfinished folder), or one prepare cannot replace anyway
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"{root} is being read by a run (train or eval on it): replacing it would "
                            "change that run's data under it; stop the run first, or prepare into another --out"
                            ) from None
        except OSError:  # a file system without flock: not checked
            pass
        yield
