"""The watchdog on real processes: injected hangs and stragglers, seen through the c10d store.

Each test spawns a fake training loop (step_begin, sleep, optionally a gloo
all_reduce, step_end) and injects one fault. Detection times are checked against the
contract: no earlier than timeout_s after the hang began, and within one more
timeout_s after that.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardline.config.resilience import WatchdogConfig
from shardline.resilience.watchdog import Watchdog
from tests.ports import free_port

EXIT = 3
# Detection times are held to the contract above: no test beside these.
pytestmark = pytest.mark.alone


def _stuck_forever(run_dir: Path, rank: int, how: str) -> None:
    (run_dir / f"hang-began-rank{rank}.txt").write_text(str(time.time()))
    if how == "sigstop":  # the whole process freezes, watchdog thread included
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(3600)


def _worker(rank: int, world: int, port: int, run_dir: str, plan: dict) -> None:
    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    store = None
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    if plan.get("collective"):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    events = run_dir / f"events-rank{rank}.jsonl"

    def on_event(event: str, **fields) -> None:
        with open(events, "a") as f:
            f.write(json.dumps({"event": event, **fields}) + "\n")

    cfg = WatchdogConfig(timeout_s=plan["timeout"], straggler_factor=1.5, straggler_steps=3)
    wd = Watchdog(cfg, run_dir, rank, world, store, on_event, exit_code=EXIT,
                  first_step_timeout_s=plan.get("first_timeout"))
    wd.start()
    for step in range(1, plan["steps"] + 1):
        wd.step_begin(step)
        t0 = time.perf_counter()
        if rank == plan.get("hang_rank") and step == plan["hang_step"]:
            _stuck_forever(run_dir, rank, plan.get("how", "sleep"))
        slow = plan.get("slow_factor", 1) if rank == plan.get("slow_rank") else 1
        time.sleep(plan.get("first_step_s", plan["step_s"]) if step == 1 else plan["step_s"] * slow)
        own = time.perf_counter() - t0  # this rank's own work; the wait below is for peers
        if plan.get("collective"):
            dist.all_reduce(torch.ones(1))
        wd.step_end(step, own)
    wd.close()
    if plan.get("collective"):
        dist.barrier()  # rank 0 hosts the store: let every rank close first
        dist.destroy_process_group()


def _spawn(world: int, plan: dict, run_dir: Path, frozen: tuple[int, ...] = (), limit_s: float = 40) -> list:
    """Run the workers; return their exit codes (None: still running, killed at the end)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(run_dir), plan), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + limit_s
    while time.monotonic() < end and any(p.is_alive() for r, p in enumerate(procs) if r not in frozen):
        time.sleep(0.05)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return codes


def _events(run_dir: Path, rank: int) -> list[dict]:
    path = run_dir / f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _one_hang_dir(run_dir: Path) -> Path:
    dirs = [d for d in run_dir.iterdir() if d.is_dir() and d.name.startswith("hang-")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _assert_detected_in_time(run_dir: Path, report: dict, rank: int, timeout: float) -> None:
    began = float((run_dir / f"hang-began-rank{rank}.txt").read_text())
    latency = report["detected_at"] - began
    print(f"detected {latency:.2f} s after the hang began, exited {time.time() - began:.2f} s after")
    assert timeout - 0.1 <= latency <= 2 * timeout, latency


def test_single_process_hang_detected_dumped_and_exits(tmp_path):
    # The first step takes longer than timeout_s, within first_step_timeout_s: no hang.
    plan = {"timeout": 1.5, "first_timeout": 6.0, "first_step_s": 2.0, "steps": 10, "step_s": 0.05,
            "hang_rank": 0, "hang_step": 3}
    codes = _spawn(1, plan, tmp_path)
    assert codes == [EXIT]
    folder = _one_hang_dir(tmp_path)
    report = json.loads((folder / "report.json").read_text())
    assert report["stopped_ranks"] == [0] and report["step"] == 3
    assert "_stuck_forever" in (folder / "rank0.txt").read_text()
    _assert_detected_in_time(tmp_path, report, 0, plan["timeout"])
    hangs = [e for e in _events(tmp_path, 0) if e["event"] == "hang"]
    assert [(e["stopped_ranks"], e["dump_dir"]) for e in hangs] == [([0], str(folder))]


def test_hang_in_one_rank_while_the_others_wait_in_a_collective(tmp_path):
    plan = {"timeout": 2.0, "steps": 1000, "step_s": 0.05, "hang_rank": 1, "hang_step": 4, "collective": True}
    codes = _spawn(3, plan, tmp_path)
    assert codes == [EXIT] * 3
    folder = _one_hang_dir(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.txt", "rank1.txt", "rank2.txt", "report.json"]
    assert "_stuck_forever" in (folder / "rank1.txt").read_text()
    for waiting in (0, 2):
        stacks = (folder / f"rank{waiting}.txt").read_text()
        assert "all_reduce" in stacks and "_stuck_forever" not in stacks
    report = json.loads((folder / "report.json").read_text())
    assert report["stopped_ranks"] == [1] and report["step"] == 4
    _assert_detected_in_time(tmp_path, report, 1, plan["timeout"])
    # Whichever rank detected it, rank 0 (whose events reach metrics.jsonl) reports it.
    hangs = [e for e in _events(tmp_path, 0) if e["event"] == "hang"]
    assert [(e["stopped_ranks"], e["step"]) for e in hangs] == [([1], 4)]


def test_frozen_rank_found_by_its_silent_heartbeat(tmp_path):
    # No collective: rank 0 keeps stepping, so only the silent heartbeat can tell.
    plan = {"timeout": 2.0, "steps": 1000, "step_s": 0.05, "hang_rank": 1, "hang_step": 4, "how": "sigstop"}
    codes = _spawn(2, plan, tmp_path, frozen=(1,))
    assert codes[0] == EXIT and codes[1] is None  # a frozen process cannot exit by itself
    folder = _one_hang_dir(tmp_path)
    assert (folder / "rank0.txt").exists() and not (folder / "rank1.txt").exists()
    report = json.loads((folder / "report.json").read_text())
    assert report["stopped_ranks"] == [1] and report["detected_by"] == 0
    assert report["ranks"]["1"]["dumped"] is False
    _assert_detected_in_time(tmp_path, report, 1, plan["timeout"])


def test_straggler_reported_healthy_ranks_not(tmp_path):
    plan = {"timeout": 4.0, "steps": 20, "step_s": 0.05, "slow_rank": 2, "slow_factor": 3.0, "collective": True}
    codes = _spawn(3, plan, tmp_path)
    assert codes == [0, 0, 0]  # a slow rank is no hang
    assert not [d for d in tmp_path.iterdir() if d.name.startswith("hang-")]
    found = [e for e in _events(tmp_path, 0) if e["event"] == "straggler"]
    assert [(e["rank"], e["host"]) for e in found] == [(2, socket.gethostname())]
    assert 2.0 < found[0]["factor"] < 4.0, found
