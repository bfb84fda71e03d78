"""Health watchdog ([watchdog]): hangs and stragglers, watched by a thread on every rank.

Why a thread and the c10d store, never a collective: a hung collective blocks the
training thread and every later collective, but the store is a separate TCP channel,
so a thread that only talks to the store keeps working while the step is stuck.

The training thread only records where it is (step_begin / step_end, and
phase_begin / phase_end around long work outside steps: the start-up restore and the
final drain of saves; no I/O, so the hot path pays nothing). Each rank's thread, every poll (min(1 s, timeout / 4)):
  - publishes the rank's record under shardline/wd/rec/<rank>: step, inside a step or
    not and for how long (by its own clock: hosts' clocks need not agree), the limit
    of this step, the recent step times (and compute probes, batch reads), a beat counter;
  - looks for the hang flag, and answers it if set (dump own stacks, exit non-zero);
  - checks its own step against the limit: the stuck rank is the first to know;
  - on rank 0 only, reads every record: a peer whose beat stops moving for timeout_s
    has died or froze with the GIL held; the times feed the straggler verdicts.
    Only rank 0 reads them all, so the store serves O(world) requests per poll.
A hang is claimed with compare_set (the claim names the dump folder, so all ranks
write to the same one); the claimant waits for the dumps, writes report.json naming
the stopped ranks, reports, and every rank exits with exit_code.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardline.resilience.hangs import dump_stacks, stopped_ranks, stuck, where_stopped, write_report
from shardline.config.resilience import WatchdogConfig
from shardline.resilience.stragglers import PeerWatch

PREFIX = "shardline/wd"
RECENT_STEPS = 32  # step times per record: steps may end faster than rank 0 polls
_SPIN_S = 0.05  # poll period while waiting for the dumps of a declared hang
REPORT_DEADLINE_S = 30.0  # past the dumps' grace: a hang's report that takes longer (blocked writes) is given up


def _key(*parts: object) -> str:
    return "/".join([PREFIX, *map(str, parts)])


@dataclass(frozen=True)
class _Progress:
    """Where the training thread is; replaced whole, so the watchdog reads a consistent copy."""

    step: int = 0
    in_step: bool = False  # inside watched work: a step, or a phase outside steps
    since: float = 0.0  # time.monotonic() when this state began
    limit_s: float = 0.0  # how long this work may take
    phase: str = "step"  # what the work is: "step", or a phase such as "restore" or "drain"


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, run_dir: Path, rank: int, world_size: int,
                 store: dist.Store | None, on_event: Callable[..., None], exit_code: int = 3,
                 first_step_timeout_s: float | None = None, phase_timeout_s: float | None = None):
        """first_step_timeout_s: the limit of the first step (compilation, warm-up); default timeout_s.
        phase_timeout_s: the limit of a phase outside steps (phase_begin); default timeout_s."""
        if store is None and world_size > 1:
            raise ValueError(f"a watchdog for {world_size} ranks needs the c10d store (got store=None)")
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world_size
        # One process has no peers, but a private store lets it share the code path.
        self.store = store if store is not None else dist.HashStore()
        self.on_event, self.exit_code = on_event, exit_code
        self.timeout = cfg.timeout_s
        self.first_limit = first_step_timeout_s or cfg.timeout_s
        self.phase_limit = phase_timeout_s or cfg.timeout_s
        self.poll_s = min(1.0, self.timeout / 4) if self.timeout > 0 else 1.0
        self.grace_s = 2 * self.poll_s + 2.0  # for every live rank to see the flag and dump
        self.host = socket.gethostname()
        self._progress = _Progress()
        self._outer = self._progress  # what a phase interrupted (phase_end goes back to it)
        self._times: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)
        self._probes: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)  # (step, compute probe seconds)
        self._reads: deque[tuple[int, float]] = deque(maxlen=RECENT_STEPS)  # (step, seconds reading its batch)
        self._lock = threading.Lock()  # _times: appended by the training thread, read by the watchdog
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # for the training thread to deliver
        self._peers = PeerWatch(cfg) if rank == 0 and world_size > 1 else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._train_thread: int | None = None
        self._steps_begun = self._beat = 0
        self._store_lost = False
        self.responding = False  # a hang's report under way: its `hang` event, not a peer's `failed`, says it
        self._store_failing_since: float | None = None  # when the store's calls began to fail
        self.before_exit: Callable[[], None] | None = None  # e.g. free the run dir's lock: os._exit skips atexit

    # ----- the training thread's side: cheap, no I/O -----

    def start(self) -> None:
        if self._thread is not None or (self.timeout <= 0 and self.world == 1):
            return
        self._safe(self._publish)  # rank 0 sees this rank from the start
        self._thread = threading.Thread(target=self._run, name=f"shardline-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    def step_begin(self, step: int) -> None:
        self._train_thread = threading.get_ident()
        limit = self.first_limit if self._steps_begun == 0 else self.timeout
        self._steps_begun += 1
        self._progress = _Progress(step, True, time.monotonic(), limit)
        self._deliver()

    def phase_begin(self, phase: str, step: int) -> None:
        """Long work outside a step begins (phase: "restore", "drain", ...), watched like a step
        under phase_timeout_s; a hang there is reported with the phase's name. Inside a step
        (an anomaly's rollback), the step's watch resumes when the phase ends."""
        self._train_thread = threading.get_ident()
        self._outer = self._progress
        self._progress = _Progress(step, True, time.monotonic(), self.phase_limit, phase)
        self._deliver()

    def phase_end(self) -> None:
        outer = self._outer
        if outer.in_step and outer.phase == "step":  # back to the step it interrupted, its clock restarted
            self._progress = _Progress(outer.step, True, time.monotonic(), outer.limit_s)
        else:
            self._progress = _Progress(self._progress.step, False, time.monotonic())
        self._deliver()

    def step_end(self, step: int, step_time_s: float, probe_s: float | None = None,
                 read_s: float | None = None) -> None:
        """step_time_s: this rank's own time, waits for peers excluded (see stragglers.py);
        probe_s: its compute probe's time, on the steps that ran one (compute_probe.py);
        read_s: the time it spent reading the step's batch."""
        with self._lock:
            self._times.append((step, step_time_s))
            if probe_s is not None:
                self._probes.append((step, probe_s))
            if read_s is not None:
                self._reads.append((step, read_s))
        self._progress = _Progress(step, False, time.monotonic())
        self._deliver()  # the heartbeat itself is published by the thread within a poll

    def close(self, failed: bool = False) -> None:
        """Stop watching; `failed`: this rank's training raised (its peers, left in a collective,
        will report a hang: this rank is the one to name)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 2.0)  # a thread stuck on a dead store is a daemon
        self._thread = None
        self._safe(self._publish, True, failed)  # rank 0 must not take the end of training for a death
        self._deliver()

    def _deliver(self) -> None:
        while not self._events.empty():
            event, fields = self._events.get()
            self.on_event(event, **fields)

    # ----- the watchdog thread -----

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        incident = self._safe(self._read_incident)
        if incident:
            self._respond(incident)
        self._safe(self._publish)
        suspects = [self.rank] if stuck(self._record(now)) else []
        if self._peers is not None:
            records = self._safe(self._read_records) or {}
            suspects += self._peers.silent(records, now)
            for s in self._peers.stragglers(records):
                self._events.put(("straggler", {
                    "step": s.step, "rank": s.rank, "host": records[s.rank]["host"], "measure": s.measure,
                    "factor": round(s.factor, 2), f"{s.measure}_time_s": round(s.step_time_s, 4),
                    "median_s": round(s.median_s, 4), "steps": self.cfg.straggler_steps}))
        if suspects and self.timeout > 0:
            self._declare(sorted(set(suspects)))

    def _record(self, now: float, closed: bool = False, failed: bool = False) -> dict[str, Any]:
        p = self._progress
        with self._lock:
            times, probes, reads = list(self._times), list(self._probes), list(self._reads)
        return {"beat": self._beat, "host": self.host, "pid": os.getpid(), "step": p.step,
                "in_step": p.in_step, "phase": p.phase, "elapsed_s": round(now - p.since, 3), "limit_s": p.limit_s,
                "times": times, "probes": probes, "reads": reads, "closed": closed, "failed": failed}

    def _publish(self, closed: bool = False, failed: bool = False) -> None:
        self._beat += 1
        self.store.set(_key("rec", self.rank), json.dumps(self._record(time.monotonic(), closed, failed)))

    def _read_incident(self) -> dict[str, Any] | None:
        key = _key("hang")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The keys that exist, with their values; one round trip when all do."""
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        if len(present) > 1:
            try:
                return dict(zip(present, self.store.multi_get(present)))
            except (AttributeError, NotImplementedError, RuntimeError):  # a store without it
                pass
        return {k: self.store.get(k) for k in present}

    def _read_records(self) -> dict[int, dict]:
        got = self._get_many([_key("rec", r) for r in range(self.world)])
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in got.items()}

    # ----- a hang: claim it, dump, report, exit -----

    def _declare(self, suspects: list[int]) -> None:
        claim = json.dumps({"dir": time.strftime("hang-%Y%m%d-%H%M%S"), "by": self.rank,
                            "suspects": suspects, "at": time.time()})
        # compare_set against "" sets the key only if no rank claimed first; it returns
        # the claim that won. With the store gone, this rank reports alone.
        won = self._safe(self.store.compare_set, _key("hang"), "", claim)
        self._respond(json.loads(won or claim))

    def _respond(self, incident: dict[str, Any]) -> None:
        """Dump this rank's stacks into the agreed folder, report, and exit; never returns,
        whatever fails on the way: a watchdog that dies here would leave the job hung."""
        self.responding = True
        atexit.register(self._hold_exit)
        # The report's files are in the run dir: where a stalled file system is the hang, writing
        # them blocks too, and the job would stay hung. Exit by a deadline, whatever was written.
        budget = self.grace_s + 2 * self.poll_s + REPORT_DEADLINE_S + self.world / 100  # 16k ranks: 160 s more
        deadline = threading.Timer(budget, self._exit_unreported)
        deadline.daemon = True
        deadline.start()
        folder, leader, fields = self.run_dir / incident["dir"], incident["by"] == self.rank, None
        try:
            self._safe(self._publish)  # a fresh record: how long this rank has been in its step now
            dump = dump_stacks(folder, self.rank, self._progress.step, self._train_thread)
            self._safe(self.store.set, _key("dumped", self.rank), json.dumps(dump))
            outcome = self._report(folder, incident, dump) if leader else self._await_report()
            fields = outcome["event"] if outcome else None
            if fields is not None and (leader or self.rank == 0):  # rank 0's events reach the disk
                self.on_event("hang", **fields)
            self._part(outcome)
        except Exception:  # noqa: BLE001 - report it, and still exit below
            traceback.print_exc()
        finally:
            self._exit(leader, incident, folder, fields)

    def _report(self, folder: Path, incident: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        dumps = self._gather_dumps(own)
        records = self._safe(self._read_records) or {self.rank: self._record(time.monotonic())}
        stopped = stopped_ranks(self.world, records, dumps)
        step, phase, limit = where_stopped(stopped, records, dumps, self._record(time.monotonic()))
        limit = limit or self.timeout
        fields = {"step": step, "phase": phase, "limit_s": limit, "stopped_ranks": stopped, "dump_dir": str(folder),
                  "detected_by": self.rank}
        ranks = {r: {**{k: v for k, v in records.get(r, {}).items() if k not in ("times", "probes", "reads")},
                     "dumped": r in dumps, **dumps.get(r, {})} for r in range(self.world)}
        # suspects: the ranks found past their limit or silent as the hang was declared (the hung one, or
        # those waiting for it inside a collective); stopped_ranks, from the stacks and records, names the hung.
        write_report(folder, {**fields, "timeout_s": self.timeout, "detected_at": incident["at"],
                              "suspects": incident["suspects"], "ranks": ranks})
        outcome = {"event": fields, "answered": sorted(dumps)}
        self._safe(self.store.set, _key("done"), json.dumps(outcome))
        return outcome

    def _gather_dumps(self, own: dict[str, Any]) -> dict[int, dict]:
        """Every live rank's dump summary, waiting up to grace_s for the slow ones."""
        dumps, deadline = {self.rank: own}, time.monotonic() + self.grace_s
        records = self._safe(self._read_records) or {}
        expected = {r for r in range(self.world) if not records.get(r, {}).get("closed")}
        while not expected <= dumps.keys() and time.monotonic() < deadline and not self._store_lost:
            got = self._safe(self._get_many, [_key("dumped", r) for r in expected - dumps.keys()]) or {}
            dumps.update({int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in got.items()})
            time.sleep(_SPIN_S)
        return dumps

    def _await_report(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.grace_s + 2 * self.poll_s
        while time.monotonic() < deadline and not self._store_lost:
            if self._safe(self.store.check, [_key("done")]):
                return self._safe(lambda: json.loads(self.store.get(_key("done"))))
            time.sleep(_SPIN_S)
        return None

    def _part(self, outcome: dict[str, Any] | None) -> None:
        """Rank 0 leaves last: it usually hosts the store the others still read the report from."""
        key = _key("gone")
        if self.rank != 0:
            self._safe(self.store.add, key, 1)
            return
        others = len(outcome["answered"]) - 1 if outcome else 0
        deadline = time.monotonic() + 2 * self.poll_s + 1.0
        while (self._safe(self.store.add, key, 0) or 0) < others and time.monotonic() < deadline:
            time.sleep(_SPIN_S)

    def _exit(self, leader: bool, incident: dict[str, Any], folder: Path, fields: dict | None) -> None:
        if leader and fields is not None:
            where = f"at step {fields['step']}" if fields["phase"] == "step" else \
                f"in {fields['phase']} (after step {fields['step']})"
            short = fields["phase"] == "step" and fields["limit_s"] == self.timeout  # (a first step: the long one)
            limit = "watchdog.timeout_s" if short else "watchdog.long_timeout_s"
            msg = (f"rank(s) {fields['stopped_ranks']} stopped {where}: no progress for {fields['limit_s']:g} s "
                   f"(hung, or slower than {limit} allows: its stacks tell which); every live rank's stacks are "
                   f"in {folder}")
        else:
            msg = f"a hang was declared by rank {incident['by']}; this rank's stacks are in {folder}"
        with contextlib.suppress(Exception):  # (a terminal or pipe gone must not keep a hung job from exiting)
            print(f"shardline watchdog (rank {self.rank}): {msg}; exiting with code {self.exit_code} "
                  "so the launcher can restart", file=sys.stderr, flush=True)
            sys.stdout.flush()
        self._before_exit()
        os._exit(self.exit_code)  # the training thread is stuck: a normal exit would wait for it

    def _exit_unreported(self) -> None:
        """The report did not finish by its deadline (its writes blocked): exit now, the run dir's
        lock freed if that does not block too (a few seconds' try)."""
        with contextlib.suppress(OSError):
            os.write(2, f"shardline watchdog (rank {self.rank}): a hang was declared but its report was not "
                        f"written in time (the run dir's storage stalled?); exiting with code {self.exit_code}\n"
                        .encode())
        release = threading.Thread(target=self._before_exit, daemon=True)
        release.start()
        release.join(timeout=5.0)
        os._exit(self.exit_code)

    def _hold_exit(self) -> None:
        # The first rank to exit breaks the collectives of the others: their training
        # threads raise and the interpreter starts to exit while this thread still
        # dumps or reports. Wait for it (it ends in os._exit), and keep our exit code.
        time.sleep(self.grace_s + 2 * self.poll_s + 5.0)
        self._before_exit()
        os._exit(self.exit_code)

    def _before_exit(self) -> None:
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception:  # exiting regardless: a lock left behind is named at the next start
                pass

    def _safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None while the store fails: a lost store must not kill the thread.

        A failure is retried at the next calls (a timeout or a reset connection passes, and a
        rank that stopped publishing would be declared dead by rank 0); after failing for the
        whole hang limit its host (usually rank 0) is taken as gone for this run, and the store
        is not tried again: each failed call would only print a C++ trace.
        """
        if self._store_lost:
            return None
        try:
            result = fn(*args)
        except (RuntimeError, OSError) as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
            now = time.monotonic()
            self._store_failing_since = self._store_failing_since or now
            if now - self._store_failing_since >= max(self.timeout, self.poll_s):
                self._store_lost = True
                if not self._stop.is_set():
                    warnings.warn(f"shardline watchdog (rank {self.rank}): the c10d store failed for "
                                  f"{now - self._store_failing_since:.0f} s: {exc}; from now on it watches this "
                                  "rank alone", stacklevel=2)
            return None
        self._store_failing_since = None
        return result
