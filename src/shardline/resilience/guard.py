"""RunGuard: what keeps a run alive around its steps, behind one object.

Fault drills, the hang and straggler watchdog, goodput accounting and the state
tiers (checkpoints on disk and in memory). The trainer calls `begin_step` before a
step, reads the step's batch through `reads`, calls `step_done` once its update is
settled, `end_step` after the step's saves and evaluation, and `timed` around those;
it saves and restores through `tiers`.

The guard is built before the run dir is opened, since a resume needs the tiers.
`watch` starts the watchdog as soon as the run dir is locked, so a hang while
restoring is caught too (work outside steps runs inside `phase`, under the watchdog's
long limit); `open` starts goodput once the metrics log exists. Events emitted before
that are held and logged by `open`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardline.config import Config
from shardline.errors import CheckpointError, on_every_rank
from shardline.metrics import append_event
from shardline.parallel.dims import ParallelDims
from shardline.parallel.distributed import ProcessInfo
from shardline.resilience.checkpoint import Checkpointer
from shardline.resilience.compute_probe import probe_due, probe_seconds
from shardline.resilience.faults import FaultInjector
from shardline.resilience.goodput import Goodput
from shardline.resilience.preemption import StopRequests
from shardline.resilience.tiers import StateTiers, memory_rank_dir
from shardline.resilience.watchdog import Watchdog

WATCHDOG_EXIT = 4  # a hang: distinct from 2 (bad input) and 3 (anomaly halt) so a launcher can tell
WRITING_PHASES = ("save", "snapshot", "drain", "halt")  # a second Ctrl-C lets them finish (preemption.py)


class RunGuard:
    def __init__(self, cfg: Config, proc: ProcessInfo, dims: ParallelDims, checkpointer: Checkpointer,
                 fingerprint: str, started: float, device: torch.device):
        """fingerprint: what in-memory snapshots are valid for; started: the process start time;
        device: where the compute probe runs."""
        self.cfg, self.proc, self.started, self.device = cfg, proc, started, device
        self.faults = FaultInjector(cfg.faults, proc.rank, memory_rank_dir(cfg, proc.rank))
        self.tiers = StateTiers(cfg, proc, dims, checkpointer, fingerprint, self.faults, log=self.event)
        self.stops = StopRequests(dims.control_group)
        self.goodput: Goodput | None = None
        limit = cfg.watchdog.long_limit_s
        self.watchdog = Watchdog(cfg.watchdog, Path(cfg.run.dir), proc.rank, proc.world_size, proc.store,
                                 on_event=self.event, exit_code=WATCHDOG_EXIT,
                                 first_step_timeout_s=limit, phase_timeout_s=limit)
        self._log: Callable[..., None] | None = None
        self._held: list[tuple[str, dict[str, Any]]] = []
        self._read_s = 0.0  # this step's time in reads()
        self._step_s, self._step = 0.0, 0  # this step's own time and number, taken in step_done
        self._lock_lost: Callable[[], str] = str  # (see watch)
        self._first_step: tuple | None = None  # this launch's first step (number, seconds) under compile; () done
        self._compared_s = 0.0  # the same time, until the next stop request compares it with the other ranks

    def event(self, name: str, **fields: Any) -> None:
        """An event for the metrics log (held until open(); a hang's, whose exit comes first, is
        appended to the run dir's log at once: a requeue script reads it there)."""
        if self._log is None and name == "hang":
            if self.proc.is_main:
                append_event(Path(self.cfg.run.dir), name, **fields)
        elif self._log is None:
            self._held.append((name, fields))
        else:
            self._log(name, **fields)

    def watch(self, before_exit: Callable[[], None] | None = None,
              lock_lost: Callable[[], str] | None = None) -> None:
        """The run dir is locked: the watchdog starts (a hang from here on ends with a report).
        `before_exit`: what a hang's exit does first (it skips atexit handlers), e.g. free the lock;
        progress.json's last word, phase "failed", comes before it (it read "train" after the exit).
        `lock_lost`: who took the run dir's lock over, in words (rank 0's; "" while it is held): from
        then on nothing is saved there (a save in flight is not sealed) and the run stops at the next
        stop request, on every rank (see _stop_for_lost_lock)."""
        if lock_lost is not None:
            self._lock_lost = lock_lost
            self.stops.lock_lost, self.tiers.taken_by = lambda: bool(lock_lost()), lock_lost
        def leave() -> None:
            with suppress(Exception):  # (a write that blocks is the watchdog deadline's to cut)
                if self.goodput is not None:  # (the main thread may be writing it: waited for a little)
                    self.goodput.fail(wait_s=2.0, exit_code=self.watchdog.exit_code)
            if before_exit is not None:
                before_exit()

        self.watchdog.before_exit = leave
        self.watchdog.start()

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Long work outside a step ("restore", "drain"), watched under watchdog.long_timeout_s."""
        self.watchdog.phase_begin(name, step)
        writing = self.stops.writing  # (a phase inside another: restored as it ends)
        self.stops.writing = writing or name in WRITING_PHASES
        outer = self.goodput.phase if self.goodput else ""
        try:
            if self.goodput:
                self.goodput.enter(name)
            self.faults.in_phase(name, step)
            yield
        finally:
            self.stops.writing = writing
            if self.goodput:
                self.goodput.enter(outer)
            self.watchdog.phase_end()

    def open(self, run_dir: Path, log: Callable[..., None], fresh: bool = False, trains: dict | None = None) -> None:
        """Start goodput accounting in the opened run dir (`fresh`: nothing resumed, not a restart:
        a new account after a finished run or before another run, see Goodput); log held events."""
        self.goodput = Goodput(run_dir, self.proc.is_main, self.started, fresh, trains)
        self.goodput.unowned = lambda: self.stops.lock_lost()  # (its lock taken over: the account is the taker's)
        self._log, self._said_unwritten = log, False
        for name, fields in self._held:
            log(name, **fields)
        self._held = []
        self.tiers.report_stale_memory()

    def start(self, nothing_to_train: bool = False, step: int = 0) -> None:
        """Training begins at `step`: the start-up time is accounted (not for a launch with
        `nothing_to_train`, left out of the run's account) and stop signals are caught."""
        if nothing_to_train:
            self.goodput.leave_out_this_launch()
        else:
            self.goodput.add("startup", time.time() - self.started)
            self.goodput.begin(step)
        self.watchdog.start()
        self.stops.install()

    def begin_step(self, step: int) -> float:
        """Tell the watchdog a step begins; returns the clock this rank's step time runs from.

        Comparing ranks needs each one's own work, not the time it waited for a slow
        peer inside a collective; with the watchdog on and several ranks, a barrier
        gives every rank the same start, so waiting lands before the clock starts (one
        small collective per step: the price of straggler detection).
        """
        self.watchdog.step_begin(step)
        self.faults.before_step(step)  # a killed or hung rank stops here, outside any collective
        if self.cfg.watchdog.timeout_s and self.proc.world_size > 1:
            waited = time.perf_counter()
            dist.barrier()
            self.goodput.add("peer_wait", time.perf_counter() - waited)  # a straggler's cost, named
        self._read_s, self._compared_s = 0.0, 0.0  # (a step rolled back has no time of its own to compare)
        started = time.perf_counter()
        self.faults.inside_step()  # the slow-device drill: on the step's clock
        return started

    def reads(self, read: Callable[..., Any]) -> Callable[..., Any]:
        """`read` (a batch read) timed into this step's reading time, which tells a rank slow to
        read its batches (its peers wait for it in the step's collectives: step times agree)."""
        def timed(*args: Any) -> Any:
            begin = time.perf_counter()
            try:
                self.faults.in_read()  # the slow-reader drill
                return read(*args)
            finally:
                self._read_s += time.perf_counter() - begin
        return timed

    def step_done(self, step: int, started: float, outcome: str) -> None:
        """The step's update is settled ("updated", "overflow", "anomaly"): account its time, this
        rank's own. Taken here, before the collectives that follow (logging's, the stop request's),
        where the peers of a rank slow in its host work after the step's last collective (an
        optimizer step on the host) wait for it: taken after them, every rank's time was the same.
        The slow-host drill sleeps here, as such work would."""
        self.faults.after_step(time.perf_counter() - started)
        self._step_s = self._compared_s = seconds = time.perf_counter() - started
        self._step = step
        self.goodput.step(step, seconds, outcome)
        self._count_compilation(step, seconds)
        if self.goodput.unwritten and not self._said_unwritten:  # once: the run goes on (a full disk, say)
            self._said_unwritten = True
            self._log("progress_not_written", step=step, error=self.goodput.unwritten)
        self.faults.step_computed(seconds)

    def _count_compilation(self, step: int, seconds: float) -> None:
        """Under train.compile a launch's first step compiles the model: its excess over the next step's
        time is start-up, not useful training (a short run read a goodput of half)."""
        if self._first_step is None and self.cfg.train.compile:
            self._first_step = (step, seconds)
        elif self._first_step and self._first_step[0] == step - 1:
            self.goodput.move_within(step - 1, 0.0, "startup", keep=seconds)  # (less what went to peer_wait)
            self._first_step = ()
        else:
            self._first_step = ()  # (a rollback between them: nothing to compare)

    def end_step(self, step: int) -> None:
        """The step and its saves are over: the watchdog's record (the step's own time, from
        step_done) and the compute probe when due (not training: on no step's clock)."""
        w = self.cfg.watchdog
        due = w.timeout_s and self.proc.world_size > 1 and probe_due(step, w.probe_interval)
        probe_s = probe_seconds(self.device, self.faults.slow_compute_probe) if due else None
        self.watchdog.step_end(step, self._step_s, probe_s, self._read_s)
        self.tiers.say_landed()  # an async save's write finished: said now, not at the next save

    def timed(self, category: str, work: Callable[[], Any]) -> Any:
        """Run `work`, its time accounted to goodput `category` (eval, checkpoint, recovery)."""
        begin = time.perf_counter()
        result = work()
        self.goodput.add(category, time.perf_counter() - begin)
        return result

    def watched(self, name: str, step: int, category: str, work: Callable[[], Any]) -> Any:
        """`work` as the phase `name` (evaluations, saves: long work outside a step, watched under
        watchdog.long_timeout_s), its time accounted to goodput `category`."""
        with self.phase(name, step):
            return self.timed(category, work)

    def stop_requested(self) -> str | None:
        """A stop signal any rank received (the same answer on every rank; one tiny host collective).
        Its time is the wait for the slowest peer's step (a rank slow in its host work after the step's
        last collective arrives here last): goodput's peer_wait, not "other"."""
        begin = time.perf_counter()
        try:
            request = self.stops.agreed(self._compared_s)
            if request == "LOCK_LOST":
                self._stop_for_lost_lock()
            return request
        finally:
            self.goodput.add("peer_wait", time.perf_counter() - begin)
            if self.stops.fastest_s is not None and self._compared_s:  # this rank the straggler: its excess
                self.goodput.waited_within(self._step, self._compared_s - self.stops.fastest_s)  # is peer_wait
            self._compared_s = 0.0  # (once: a step's evaluation and save ask again, every rank alike)

    def asked_to_stop(self) -> bool:
        """stop_requested() inside longer work (an evaluation's micro-batches): the stop's own time
        is that work's; a lost lock stops the run there too."""
        request = self.stops.agreed()
        if request == "LOCK_LOST":
            self._stop_for_lost_lock()
        return request is not None

    def _stop_for_lost_lock(self) -> None:
        """Another launch took the run dir over: this one stops now, on every rank (rank 0's line names
        who), beside the run that now owns the dir; its log and progress.json took nothing since."""
        line = self._lock_lost() or f"another launch took over the lock of run.dir={self.cfg.run.dir!r}"
        raise on_every_rank(CheckpointError(f"{line}: this launch stops, writing nothing more there; that launch "
                                            "goes on with the run"))

    def stop_watching(self, failed: bool = False) -> None:
        """The watchdog thread ends and the stop signals get their previous handlers (idempotent);
        `failed`: the run raised here (the watchdog names this rank if its peers hang for it)."""
        try:  # a last report that fails to write must not leave this process's stop handlers installed
            self.watchdog.close(failed)
        finally:
            self.stops.restore()

    def drain(self, step: int) -> None:
        """Wait for the saves in flight, watched: a save that never lands ends with a report."""
        with self.phase("drain", step):
            self.tiers.drain()

    def finish(self, step: int, complete: bool = True, last: bool = True, exit_code: int = 0) -> dict:
        """The run is over: saves drained (watched), the memory tier's RAM freed, the watchdog
        stopped; returns goodput's summary. Not `complete` (stopped by a signal, to be rerun):
        the time until the rerun starts counts as a restart gap, and snapshots newer than the
        newest checkpoint on disk are kept for it; so they are where this launch ends before the
        run's `last` step (train.stop_at_step: a later launch goes on). progress.json's `finished`:
        the launch ended as planned (no restart gap before the next); `run_complete`: the run trained
        to its last step and no save of it was refused (nothing left to requeue)."""
        with self.phase("drain", step):
            self.timed("checkpoint", lambda: self.tiers.finish(complete and last))
        self.stop_watching()
        now = time.time()
        ended = complete and not self.tiers.unsaved_end
        self.goodput.end(ended, now, run_complete=ended and last, exit_code=exit_code)
        return self.goodput.summary(now)
