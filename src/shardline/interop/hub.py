"""What to say when a Hugging Face Hub id ("org/name") is given where shardline reads a local folder.

shardline never downloads at run time (every rank of a job would, and a run's config must name
what it read), so a Hub id is refused; the refusal says how to get the folder, and names the
snapshot a local Hub cache already holds (transformers' and huggingface_hub's layout:
`<cache>/models--org--name/snapshots/<revision>`, `refs/main` naming the revision).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_caches() -> list[Path]:
    """Where huggingface_hub keeps its cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return [Path(home).expanduser() / "hub"]


def cached_snapshot(hub_id: str) -> Path | None:
    """The snapshot folder of `hub_id` a local Hub cache holds (its main revision's, else the newest), or None."""
    for cache in hub_caches():
        repo = cache / f"models--{hub_id.replace('/', '--')}"
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        try:
            main = snapshots / (repo / "refs" / "main").read_text(encoding="utf-8").strip()
        except OSError:
            main = None
        if main is not None and main.is_dir():
            return main
        found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


def hub_hint(value: str) -> str:
    """": <how to get it>" where `value`, a path that does not exist, reads as a Hub id; "" otherwise."""
    if not _HUB_ID.match(value) or Path(value).exists():
        return ""
    snapshot = cached_snapshot(value)
    if snapshot is not None:
        return f" (a Hub id? shardline reads local folders only: the local Hub cache holds it at {snapshot})"
    return (f" (a Hub id? shardline reads local folders only, never downloading: `hf download {value} --local-dir "
            "DIR` (or huggingface-cli download), then give DIR)")
