"""RunGuard: what keeps a run alive around its steps, behind one object.

Fault drills, the hang and straggler watchdog, goodput accounting and the state
tiers (checkpoints on disk and in memory). The trainer calls `begin_step` before a
step, `step_done` once its update is settled, `end_step` after the step's saves and
evaluation, and `timed` around those; it saves and restores through `tiers`.

The guard is built before the run dir is opened, since a resume needs the tiers;
`open` starts the parts that write into the run dir (goodput, the watchdog) once the
metrics log exists. Events the tiers emit before that are held and logged by `open`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from shardline.config import Config
from shardline.parallel.dims import ParallelDims
from shardline.parallel.distributed import ProcessInfo
from shardline.resilience.checkpoint import Checkpointer
from shardline.resilience.faults import FaultInjector
from shardline.resilience.goodput import Goodput
from shardline.resilience.preemption import StopRequests
from shardline.resilience.tiers import StateTiers, memory_rank_dir
from shardline.resilience.watchdog import Watchdog

WATCHDOG_EXIT = 4  # a hang: distinct from 2 (bad input) and 3 (anomaly halt) so a launcher can tell


class RunGuard:
    def __init__(self, cfg: Config, proc: ProcessInfo, dims: ParallelDims, checkpointer: Checkpointer,
                 fingerprint: str, started: float):
        """fingerprint: what in-memory snapshots are valid for; started: the process start time."""
        self.cfg, self.proc, self.started = cfg, proc, started
        self.faults = FaultInjector(cfg.faults, proc.rank, memory_rank_dir(cfg, proc.rank))
        self.tiers = StateTiers(cfg, proc, dims, checkpointer, fingerprint, self.faults, log=self.event)
        self.stops = StopRequests(dims.control_group)
        self.goodput: Goodput | None = None
        self.watchdog: Watchdog | None = None
        self._log: Callable[..., None] | None = None
        self._held: list[tuple[str, dict[str, Any]]] = []

    def event(self, name: str, **fields: Any) -> None:
        """An event for the metrics log (held until open())."""
        if self._log is None:
            self._held.append((name, fields))
        else:
            self._log(name, **fields)

    def open(self, run_dir: Path, log: Callable[..., None]) -> None:
        """Start goodput accounting and the watchdog in the opened run dir; log held events."""
        self.goodput = Goodput(run_dir, self.proc.is_main, self.started)
        self._log = log
        for name, fields in self._held:
            log(name, **fields)
        self._held = []
        self.tiers.report_stale_memory()
        self.watchdog = Watchdog(self.cfg.watchdog, run_dir, self.proc.rank, self.proc.world_size,
                                 self.proc.store, on_event=log, exit_code=WATCHDOG_EXIT)

    def start(self) -> None:
        """Training begins: the start-up time is accounted and the watchdog runs."""
        self.goodput.add("startup", time.time() - self.started)
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
            dist.barrier()
        return time.perf_counter()

    def step_done(self, step: int, started: float, outcome: str) -> None:
        """The step's update is settled ("updated", "overflow", "anomaly"): account its time."""
        self.goodput.step(step, time.perf_counter() - started, outcome)

    def end_step(self, step: int, started: float) -> None:
        """The step and its saves are over: the slow-rank drill, then the watchdog's record."""
        self.faults.after_step(time.perf_counter() - started)
        self.watchdog.step_end(step, time.perf_counter() - started)

    def timed(self, category: str, work: Callable[[], Any]) -> Any:
        """Run `work`, its time accounted to goodput `category` (eval, checkpoint, recovery)."""
        begin = time.perf_counter()
        result = work()
        self.goodput.add(category, time.perf_counter() - begin)
        return result

    def stop_requested(self) -> str | None:
        """A stop signal any rank received (the same answer on every rank; one tiny host collective)."""
        return self.stops.agreed()

    def stop_watching(self) -> None:
        """The watchdog thread ends and the stop signals get their previous handlers (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.close()
        self.stops.restore()

    def finish(self) -> dict:
        """The run is over: saves drained, the memory tier's RAM freed; returns goodput's summary."""
        self.timed("checkpoint", self.tiers.finish)
        self.goodput.persist(finished=True)
        return self.goodput.summary()
