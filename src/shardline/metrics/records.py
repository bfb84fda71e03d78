"""Reading a run's metrics.jsonl back: the records that stand (`history`), and whether a file is
a run's log at all (a run dir's check that it writes over nothing another tool left)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardline.errors import ConfigError


def history(path: Path | str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl that stand, in order. The file is only appended to: each
    launch's `start` event at step s, and a rollback's `anomaly` event with `to_step` s, supersede
    the `train` and `eval` records of the steps past s logged before them (a resume from an older
    checkpoint, a new run in a run dir whose checkpoints are gone, a rollback), as TensorBoard
    drops its superseded points. Events stay: they say what happened. A last line not ended (a
    run writing it, or killed) is left out, and so is a line that is no record (damaged by hand or by
    the storage: a launch appends after it all the same). `path` may be the run dir that holds it."""
    path = Path(path) / "metrics.jsonl" if Path(path).is_dir() else Path(path)
    if not path.is_file():  # (a run dir that trained nothing, a typo: one line, not open()'s traceback)
        raise ConfigError(f"{path} does not exist: give a run dir that has trained, or its metrics.jsonl")
    kept: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):  # a record being written, or cut short by a kill: not yet one
                break
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not is_record(rec):
                continue
            cut = {"start": rec.get("step"), "anomaly": rec.get("to_step")}.get(rec.get("event"))
            if isinstance(cut, int):
                kept = [r for r in kept if r["kind"] == "event" or r["step"] <= cut]
            kept.append(rec)
    return kept


def is_record(rec: Any) -> bool:
    """Whether a line of metrics.jsonl, as read, is a record the logger writes: a train or eval record
    with its step, or an event."""
    return isinstance(rec, dict) and rec.get("kind") in ("train", "eval", "event") and isinstance(
        rec.get("step", 0 if rec.get("kind") == "event" else None), int)


def written_by_a_run(path: Path) -> bool:
    """Whether a metrics.jsonl is empty or opens with a record (one another tool wrote does not)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
    try:
        return not first.strip() or is_record(json.loads(first))
    except ValueError:
        return False
