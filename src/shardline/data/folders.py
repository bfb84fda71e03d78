"""Which files a data folder holds: the one walk a run and `shardline prepare` both read a folder
(or a glob pattern's matches) by, so that raw and prepared data are the same documents in the same
order."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def read_root(root: Path) -> Path:
    """The folder whose files an input reads: a `datasets` save_to_disk DatasetDict's train split,
    else the input itself."""
    return root / "train" if (root / "dataset_dict.json").is_file() and (root / "train").is_dir() else root


def other_splits(root: Path) -> list[str] | None:
    """A `datasets` DatasetDict folder's splits besides train (validation, test), by their folders' names
    (hidden ones, a download's .cache, are none); None where `root` is no DatasetDict."""
    if not (Path(root) / "dataset_dict.json").is_file():
        return None
    return sorted(p.name for p in Path(root).iterdir()
                  if p.is_dir() and p.name != "train" and not p.name.startswith("."))


def folder_entries(root: Path) -> list[Path]:
    """The files under folder `root` (and links to nothing), sorted as paths; hidden ones left out (.git,
    .ipynb_checkpoints, macOS's ._ files). The folder's own tree first, then the folders linked into
    it, each real folder once (a link back up, or to a folder inside, adds nothing); a file reached
    again through a link is read once, under its own path; a link to a folder above it is not followed."""
    found, walked, links, above = [], set(), [Path(root)], Path(os.path.realpath(root)).parents
    while links:
        for top, dirs, names in os.walk(links.pop(0)):
            real = os.path.realpath(top)
            dirs[:] = [] if real in walked else sorted(d for d in dirs if not d.startswith("."))
            links += [Path(top) / d for d in dirs if os.path.islink(os.path.join(top, d))  # (walked after)
                      and Path(os.path.realpath(os.path.join(top, d))) not in above]
            found += [] if real in walked else [Path(top) / n for n in names if not n.startswith(".")]
            walked.add(real)
    return read_once(found)


def read_once(paths: Iterable[Path]) -> list[Path]:
    """`paths` sorted, each real file once: under a path that is no link where it has one, else
    under its first link in sorted order (a link to nothing kept as it is, to be named)."""
    plain, linked, folders = {}, [], {}
    for path in sorted(set(paths)):
        if path.is_symlink():
            linked.append(path)
        else:  # (its folder resolved, once a folder, not the file: a plain file is its own real path there)
            if path.parent not in folders:
                folders[path.parent] = os.path.realpath(path.parent)
            plain.setdefault(os.path.join(folders[path.parent], path.name), path)
    for path in linked:
        plain.setdefault(os.path.realpath(path) if path.exists() else str(path), path)
    return sorted(plain.values())
