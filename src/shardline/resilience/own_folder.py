"""Folders of this user's own in places every user shares (/dev/shm, /tmp): the memory tier's
snapshots and a multi-rank evaluation's run dir have names anyone can work out, so another user
could make them first, or plant a symbolic link there, and read the snapshots or have a run
write, and remove its older snapshots, in a folder of their choosing. Each folder from the shared
place down is made by this user, private (0700), or is refused in one line where it is a link or
another user's.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardline.errors import CheckpointError


def make_own(folder: Path, shared: Path, key: str, way_out: str) -> None:
    """Make `folder` and each folder between it and `shared` (which must hold it; made as any folder
    where missing: a place the user named) where missing, private; CheckpointError naming `key` and
    `way_out` where one is a link, not a folder, or not this user's, or cannot be made."""
    folder, shared = Path(folder), Path(shared)
    chain = [folder, *folder.parents[:len(folder.relative_to(shared).parts) - 1]][::-1]
    for path in [shared, *chain]:
        try:
            if path == shared:  # (the place itself: the user's, made as any folder)
                shared.mkdir(parents=True, exist_ok=True)
                continue
            path.mkdir(mode=0o700, exist_ok=True)
            info = path.lstat()
        except OSError as e:
            raise CheckpointError(f"{key}: cannot create {path} on this node ({e.strerror}); {way_out}") from e
        if not is_own(info):
            what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else (
                "not a folder" if not stat.S_ISDIR(info.st_mode) else f"another user's (uid {info.st_uid})")
            raise CheckpointError(f"{key}: {path} is {what}, not a folder of this user's own: another user may "
                                  f"have made it to read or place what is written there; {way_out}")
        if info.st_mode & 0o077:  # (made open by an earlier version, or by hand)
            path.chmod(0o700)


def is_own(info: os.stat_result) -> bool:
    """Whether an lstat result is a folder of this user's (not a link to one)."""
    uid = os.getuid() if hasattr(os, "getuid") else info.st_uid
    return stat.S_ISDIR(info.st_mode) and not stat.S_ISLNK(info.st_mode) and info.st_uid == uid
