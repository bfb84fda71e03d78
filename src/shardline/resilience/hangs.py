"""What a rank does about a hang: dump its stacks, and (on the detecting rank) name the culprits.

Pure functions over files and plain records, so the watchdog thread stays small and
the verdict logic is testable without processes.
"""

from __future__ import annotations

import faulthandler
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

# A frame of the innermost few under this path means the rank is waiting for peers in
# a collective (or a send/recv), not stuck in its own work. Several frames because
# functional collectives enter C++ through torch/_ops.py, one frame further in.
_COLLECTIVE_PATH = "/torch/distributed/"
_INNER_FRAMES = 3


def where(thread_id: int | None) -> list[str]:
    """The innermost frames of a thread, innermost first, as 'file:line in function'."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    out = []
    while frame is not None and len(out) < 8:
        code = frame.f_code
        out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return out


def is_waiting(frames: list[str]) -> bool:
    return any(_COLLECTIVE_PATH in f.replace("\\", "/") for f in frames[:_INNER_FRAMES])


def dump_stacks(folder: Path, rank: int, step: int, train_thread: int | None) -> dict[str, Any]:
    """Write this process's Python stacks (and the NCCL flight recorder, if any) to folder."""
    folder.mkdir(parents=True, exist_ok=True)
    frames = where(train_thread)
    with open(folder / f"rank{rank}.txt", "w", encoding="utf-8") as f:
        f.write(f"rank {rank} host {socket.gethostname()} step {step} at {time.strftime('%H:%M:%S')}\n\n")
        f.flush()  # faulthandler writes to the file descriptor, past Python's buffer
        faulthandler.dump_traceback(f, all_threads=True)
    nccl = _dump_nccl_trace(folder / f"rank{rank}.nccl_trace.pkl")
    return {"where": frames, "waiting": is_waiting(frames), "nccl_trace": nccl}


def _dump_nccl_trace(path: Path) -> bool:
    # The flight recorder holds the last collectives of every NCCL communicator (what
    # each rank was waiting on); it only exists on CUDA builds, and only records with
    # TORCH_NCCL_TRACE_BUFFER_SIZE > 0. Never fail the dump over it.
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or not torch.cuda.is_available():
        return False
    try:
        path.write_bytes(dump())
        return True
    except Exception:  # noqa: BLE001 - best effort: the Python stacks matter more
        return False


def stuck(rec: dict[str, Any]) -> bool:
    return bool(rec["in_step"]) and rec["elapsed_s"] > rec["limit_s"]


def stopped_ranks(world: int, records: dict[int, dict], dumps: dict[int, dict]) -> list[int]:
    """The ranks that stopped, from the strongest evidence to the weakest.

    records are each rank's last state, published as it answered the hang (so fresh),
    dumps what each rank's stack dump found. In order:
    1. dead: a live rank whose watchdog did not dump its stacks (process gone, or frozen
       with the GIL held), or that never published a record;
    2. behind: inside a step older than the newest step any rank began (the others
       went on without it);
    3. failed: a rank whose training raised (its error is in its own log) and left the others
       in a collective; after 1 and 2, since a rank killed mid-collective makes its peers raise;
    4. all inside one step (the usual picture: the others wait in a collective for the
       culprit): the ranks not waiting inside torch.distributed, over the limit first;
    5. everyone waits (a mismatched collective): the ranks over the limit, else all.
    """
    live = {r: records.get(r) for r in range(world) if not (records.get(r) or {}).get("closed")}
    dead = {r for r, rec in live.items() if rec is None or r not in dumps}
    inside = {r: rec for r, rec in live.items() if r not in dead and rec["in_step"]}
    newest = max((rec["step"] for rec in live.values() if rec is not None), default=0)
    behind = {r for r, rec in inside.items() if rec["step"] < newest}
    if dead or behind:
        return sorted(dead | behind)
    failed = sorted(r for r in range(world) if (records.get(r) or {}).get("failed"))
    if failed:
        return failed
    late = {r for r, rec in inside.items() if stuck(rec)}
    busy = {r for r in inside if not dumps[r]["waiting"]}
    return sorted((busy & late) or busy or late or inside)


def where_stopped(stopped: list[int], records: dict[int, dict], dumps: dict[int, dict],
                  own: dict) -> tuple[int, str, float]:
    """The (step, phase, limit_s) a hang report names: the stopped ranks' records where they are
    current, else the reporting rank's own record `own`. A rank that could not dump (frozen,
    gone) left the record its watchdog last published, every poll: it can lag by steps, a save
    since finished say. It counts if at most one step behind the newest any rank began: the
    others could not have gone two steps on without it (a record one step old can still lag: a
    save just finished; that much is ambiguous)."""
    newest = max([own["step"]] + [rec["step"] for rec in records.values()])
    current = [r for r in stopped if r in records and (r in dumps or records[r]["step"] >= newest - 1)]
    # one rank's step, phase and limit: one that dumped (known current) first, then the earliest step
    first = records[min(current, key=lambda r: (r not in dumps, records[r]["step"]))] if current else own
    return first["step"], first.get("phase", "step"), first["limit_s"]


def write_report(folder: Path, report: dict[str, Any]) -> None:
    tmp = folder / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(folder / "report.json")  # a reader never sees half a report
