"""Event-level simulation of one training run: failures, restarts, checkpoints, stragglers.

The run alternates between *stretches* of training and *events*. Unexpected failures
(a Poisson process per cause) and planned stops (a Poisson process) arrive in wall-clock
time. Between two events the job trains in checkpoint segments:

    [ compute: interval_steps steps (+ straggler slowdown) ][ wait for previous write ][ stall ]

The stall is the full persistent save (sync) or the device-to-host snapshot (async,
memory), after which a background write of write_s seconds makes the checkpoint
durable. Every segment boundary is an in-memory checkpoint; every persist_every-th one
starts a persistent write (async: every one). A snapshot that would start a new write
while the previous is still running waits for it. A stretch is simulated in bulk with
numpy (one draw per segment), so a run costs O(events) Python work, not O(steps).

On a failure the job is down for detection + restart + checkpoint load; a failure
during that downtime starts the recovery again (Daly's model). It resumes from the
newest in-memory checkpoint (memory mode, and only if every failure in the chain left
a peer copy), else from the newest durable one. Planned stops save first (no lost work).

Every wall-clock second of the run lands in exactly one bucket of the Ledger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

_CHUNK = 1 << 16  # segments drawn at once
BUCKETS = ("useful", "recompute", "checkpoint", "detection", "restart", "stragglers", "planned")


@dataclass(frozen=True)
class Policy:
    mode: str  # sync | async | memory
    interval_steps: int
    stall_s: float  # per checkpoint: the save (sync) or the snapshot (async, memory)
    write_s: float  # background persistent write after the stall (0 for sync)
    persist_every: int  # checkpoints per persistent write (1 unless memory mode)


@dataclass(frozen=True)
class Scenario:
    duration_s: float
    step_s: float
    cause_rates: tuple[float, ...]  # job-level failures per second, by cause
    cause_memory_ok: tuple[bool, ...]
    planned_rate: float  # planned stops per second
    detection_s: float
    restart_s: float
    load_s: float
    memory_load_s: float
    planned_downtime_s: float
    straggler_step_prob: float  # probability that a given step is slowed (whole job)
    straggler_slowdown: float
    policy: Policy


@dataclass
class Ledger:
    interruptions: np.ndarray  # unexpected, by cause
    lost_by_cause: np.ndarray  # seconds lost to each cause (rolled-back work + downtime)
    planned: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


class _Run:
    def __init__(self, sc: Scenario, seed: int):
        self.sc, self.pol = sc, sc.policy
        streams = np.random.SeedSequence(seed).spawn(4)
        # Separate streams keep failure and planned times identical across policies
        # (common random numbers), so policy comparisons are not drowned in noise.
        self.rng_fail, self.rng_cause, self.rng_plan, self.rng_slow = (np.random.default_rng(s) for s in streams)
        self.rate = float(sum(sc.cause_rates))
        self.cum = np.cumsum(sc.cause_rates)
        n = len(sc.cause_rates)
        self.led = Ledger(np.zeros(n, dtype=np.int64), np.zeros(n))
        self.t = self.progress = self.durable = self.memory = self.computed = 0.0
        self.phase = 0  # checkpoints since the last persistent save, on the restored timeline
        self.next_fail = self._draw(self.rng_fail, self.rate, 0.0)
        self.next_plan = self._draw(self.rng_plan, sc.planned_rate, 0.0)

    @staticmethod
    def _draw(rng: np.random.Generator, rate: float, after: float) -> float:
        return after + rng.exponential(1.0 / rate) if rate > 0 else math.inf

    def run(self) -> Ledger:
        end = self.sc.duration_s
        while self.t < end:
            t_stop = min(self.next_fail, self.next_plan, end)
            if t_stop > self.t:
                self._stretch(t_stop)
            if t_stop >= end:
                break
            if self.next_fail <= self.next_plan:
                self._failure()
            else:
                self._planned()
            if self.next_plan < self.t:  # a planned stop due while the job was down is absorbed
                self.next_plan = self._draw(self.rng_plan, self.sc.planned_rate, self.t)
        self.led.seconds["useful"] = self.progress
        self.led.seconds["recompute"] = self.computed - self.progress
        return self.led

    # -- training ---------------------------------------------------------------------

    def _stretch(self, t_stop: float) -> None:
        """Train from self.t to t_stop; the stretch starts with no write in flight."""
        pol, c = self.pol, self.pol.interval_steps * self.sc.step_s
        k, first_write = pol.persist_every, True
        # The persistent saves fall on the checkpoint count of the restored timeline (a real run
        # saves on step numbers): the first chunk runs up to the next one, then whole groups.
        lead = (k - self.phase) % k
        while self.t < t_stop:
            if lead:
                n, lead = lead, 0
            else:
                n = min(math.ceil((t_stop - self.t) / (c + pol.stall_s)) + 1, _CHUNK)
                n = -(-n // k) * k  # whole persist groups, so write back-pressure stays in one chunk
            comp = c + self._slowdown(n)
            persist = np.flatnonzero((self.phase + np.arange(n)) % k == k - 1)
            wait = np.zeros(n)
            if pol.write_s > 0 and persist.size:
                # Time from the previous write's start to this snapshot: k computes, k-1 stalls.
                ends_of = np.concatenate([[0.0], np.cumsum(comp)])
                since = ends_of[persist + 1] - ends_of[np.maximum(persist + 1 - k, 0)] + (k - 1) * pol.stall_s
                wait[persist] = np.maximum(0.0, pol.write_s - since)
                if first_write:
                    wait[persist[0]] = 0.0
            ends = self.t + np.cumsum(comp + wait + pol.stall_s)
            done = int(np.searchsorted(ends, t_stop, side="right"))
            self._account(comp, wait, done)
            self.phase = (self.phase + done) % k
            start = self.progress
            if done:
                self.memory = start + done * c
                written = persist[persist < done]
                durable = written[ends[written] + pol.write_s <= t_stop]
                if durable.size:
                    self.durable = start + (durable[-1] + 1) * c
                first_write = first_write and not written.size
            if done < n:
                nominal = self._partial(comp[done], t_stop - (ends[done - 1] if done else self.t), c)
                self.progress = start + done * c + nominal
                self.t = t_stop
            else:
                self.progress = start + n * c
                self.t = float(ends[-1])

    def _slowdown(self, n: int) -> np.ndarray:
        p = self.sc.straggler_step_prob
        if p <= 0:
            return np.zeros(n)
        slow = self.rng_slow.binomial(self.pol.interval_steps, p, size=n)
        return slow * (self.sc.straggler_slowdown - 1.0) * self.sc.step_s

    def _account(self, comp: np.ndarray, wait: np.ndarray, done: int) -> None:
        c = self.pol.interval_steps * self.sc.step_s
        self.computed += done * c
        self.led.seconds["stragglers"] += float(comp[:done].sum()) - done * c
        self.led.seconds["checkpoint"] += float(wait[:done].sum()) + done * self.pol.stall_s

    def _partial(self, comp: float, elapsed: float, c: float) -> float:
        """The segment cut by the next event (compute first, then wait + stall): its progress."""
        running = min(elapsed, comp)
        nominal = running * c / comp
        self.computed += nominal
        self.led.seconds["stragglers"] += running - nominal
        self.led.seconds["checkpoint"] += elapsed - running
        return nominal

    # -- events -----------------------------------------------------------------------

    def _cause(self) -> int:
        i = int(np.searchsorted(self.cum, self.rng_cause.random() * self.cum[-1], side="right"))
        return min(i, len(self.cum) - 1)

    def _failure(self) -> None:
        sc, end = self.sc, self.sc.duration_s
        t_fail, first = self.next_fail, None
        from_memory = self.pol.mode == "memory"
        while True:
            cause = self._cause()
            first = cause if first is None else first
            self.led.interruptions[cause] += 1
            from_memory = from_memory and sc.cause_memory_ok[cause]
            back_at = t_fail + sc.detection_s + sc.restart_s + (sc.memory_load_s if from_memory else sc.load_s)
            nxt = self._draw(self.rng_fail, self.rate, t_fail)
            if nxt >= back_at or nxt >= end:
                break
            self._downtime(t_fail, nxt, cause)  # failed again while recovering: start over
            t_fail = nxt
        self._downtime(t_fail, min(back_at, end), cause)
        restore = self.memory if from_memory else self.durable
        self.led.lost_by_cause[first] += self.progress - restore
        self.progress = self.memory = restore
        if not from_memory:
            self.phase = 0  # back at a persistent save
        self.next_fail, self.t = nxt, back_at

    def _downtime(self, start: float, stop: float, cause: int) -> None:
        span = stop - start
        detect = min(span, self.sc.detection_s)
        self.led.seconds["detection"] += detect
        self.led.seconds["restart"] += span - detect
        self.led.lost_by_cause[cause] += span

    def _planned(self) -> None:
        """Save (waiting for the write), stop, restart: no work is lost."""
        sc, end = self.sc, self.sc.duration_s
        save = self.pol.stall_s + self.pol.write_s
        t0 = self.next_plan
        saved, back = min(end, t0 + save), min(end, t0 + save + sc.planned_downtime_s)
        self.led.seconds["checkpoint"] += saved - t0
        self.led.seconds["planned"] += back - saved
        self.led.planned += 1
        self.durable = self.memory = self.progress
        self.phase = 0
        self.t = t0 + save + sc.planned_downtime_s
        self.next_plan = self._draw(self.rng_plan, sc.planned_rate, self.t)
        if self.next_fail < self.t:  # hardware that broke while the job was stopped is replaced at restart
            self.next_fail = self._draw(self.rng_fail, self.rate, self.t)


def simulate_once(scenario: Scenario, seed: int) -> Ledger:
    """One seeded run; every second of scenario.duration_s is in exactly one bucket."""
    return _Run(scenario, seed).run()
