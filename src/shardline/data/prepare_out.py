"""What `shardline prepare --out DIR` finds there, and whether it may write it: a new or empty
folder, a finished prepare (of these inputs: nothing to do; of others: replaced only with
--overwrite, naming what differs), an interrupted one (resumed, or started over), or someone
else's files (refused).
"""

from __future__ import annotations

import json
from pathlib import Path

from shardline.data.shards import MANIFEST, PROGRESS, SPLITS, TOKENIZER
from shardline.data.tokenizer import TOKENIZER_SIDE_FILES
from shardline.errors import DataError

LOCK = "prepare.lock"  # held while a prepare writes the folder; empty, and left in place


def check_out(root: Path, files: list[Path]) -> None:
    """--out must be new, empty or a prepared folder: prepare deletes what it finds unfinished there.
    A prepared folder holds a manifest (finished) or a progress file (from the first write on):
    a train/ or val/ folder without either is someone's data, not ours."""
    if root.exists() and not root.is_dir():
        raise DataError(f"--out {root} is a file; give a folder")
    ours = {*SPLITS, MANIFEST, PROGRESS, TOKENIZER, LOCK, *TOKENIZER_SIDE_FILES} | {
        f"{n}.tmp" for n in (MANIFEST, PROGRESS, TOKENIZER)}
    held = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    others = [name for name in held if name not in ours]
    if others:
        raise DataError(f"--out {root} holds {others[0]}, which a prepared folder does not: give a new or empty "
                        "folder (prepare deletes what it finds unfinished there)")
    marks = {MANIFEST, PROGRESS, LOCK, f"{MANIFEST}.tmp", f"{PROGRESS}.tmp"}
    if held and not marks & set(held):
        raise DataError(f"--out {root} holds {held[0]} but no {MANIFEST} or {PROGRESS}: it was not made by "
                        "shardline prepare; give a new or empty folder")
    inside = [f for f in files if root.resolve() in f.resolve().parents]
    if inside:
        raise DataError(f"--out {root} holds input {inside[0]}; write the prepared folder elsewhere")


def made(root: Path) -> tuple[dict, dict] | None:
    """(manifest, the request it was made from) of a finished prepare there, None where none is read."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        return manifest, {k: v for k, v in manifest["request"].items() if k != "tokenizer_sha256"}
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def written(root: Path) -> tuple[int, int] | None:
    """Which write of the manifest is there (a rewrite is a new file: os.replace), None for none."""
    try:
        st = (root / MANIFEST).stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def finished(root: Path, request: dict) -> dict | None:
    """The manifest of a finished prepare of the same request (its tokenizer follows from it)."""
    found = made(root)
    return found[0] if found is not None and found[1] == request else None


OPTION_WORDS = {"split": "the held-out documents' rule (by position before 2026-12-07, by content since)"}


def differs(before: dict, request: dict) -> str:
    """What differs between the request a folder was made from and this one: the inputs file by file
    (added, gone, or changed in size or modification time: a touch or a copy counts), then the options."""
    old = {f[0]: f[1:] for f in before.get("inputs", [])}
    new = {f[0]: f[1:] for f in request.get("inputs", [])}
    names = ([f"+ {n}" for n in new if n not in old] + [f"- {n}" for n in old if n not in new]
             + [f"{n} changed (size or time)" for n in new if n in old and old[n] != new[n]])
    parts = [("inputs: " + ", ".join(names[:3]) + f", and {len(names) - 3} more" * (len(names) > 3)) if names else
             "the inputs' order"] if old != new or list(old) != list(new) else []
    options = [OPTION_WORDS.get(k, k) for k in {**before, **request}  # (the tokenizer's hash follows from it)
               if k not in ("inputs", "tokenizer_sha256") and before.get(k) != request.get(k)]
    return "; ".join(parts + ([", ".join(options)] if options else [])) or "the trained tokenizer's bytes"


def check_replacing(root: Path, request: dict, overwrite: bool) -> str:
    """A finished folder of other inputs or options is replaced only when asked: a slip in the
    inputs would drop tokens that took hours, which the runs trained on them resume against.
    Returns what to say where it is replaced ("" where there is nothing to replace)."""
    found = made(root)
    if found is None or found[1] == request:
        return ""
    what = differs(found[1], request)
    if not overwrite:
        raise DataError(f"--out {root} holds a finished prepare of other inputs or options ({what}); preparing "
                        "it again replaces its tokens, which runs trained on it resume against: give another "
                        "--out, or --overwrite to replace it")
    return f"{root} was prepared from other inputs or options ({what}); --overwrite: replacing it"
