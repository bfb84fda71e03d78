"""Rank 0's verdicts on its peers: stragglers, and watchdogs gone silent (pure logic).

A rank is a straggler at a step when its step time exceeds `factor` x the median of
the *other* ranks' times at that step. Leaving the rank itself out of the median
matters for small worlds: with two ranks the median of both is their mean, so a rank
can never be more than 2x "the median" however slow it is; for large worlds the two
medians are the same. A straggler is reported once per streak, when its streak of
slow steps reaches `steps`; a normal step ends the streak.

What the times must mean: in synchronous training every rank waits for the slowest
at each collective, so wall-clock step times come out equal on all ranks and name
nobody. The times fed here must be each rank's own work, without the time spent
waiting for peers: step times from a common barrier hold that for work after the step's
last collective (the optimizer step, logging, saves), not for work before its first (a
rank's data loading, which its peers wait for there). A rank slow *inside* the step (a slow GPU)
makes its peers wait in the step's collectives, so step times miss it: the compute
probe (compute_probe.py) times each rank alone between steps, judged the same way
(measure "compute"; step times are measure "step"). A rank slow before the step's first
collective, reading its batch from a slow disk or file system, is named by the time its
own reads took (measure "data"). Reads of memory-mapped tokens take microseconds, so
their ratios alone are noise: a rank's reads count as slow only when they also exceed
the others' median by DATA_FLOOR of the step's median time, below which its peers lose
little to them; the step's time there is the median over the recent steps, which leaves
out the rare steps that also evaluate or save. On a GPU the host may read a later
micro-batch while queued kernels run, which hides that read; the step's first read (under
pp its only one) waits on nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from shardline.config.resilience import WatchdogConfig

DATA_FLOOR = 0.05  # a rank's reads are slow only when they exceed the others' by this share of the step


@dataclass(frozen=True)
class Straggler:
    step: int
    rank: int
    factor: float  # this rank's time over the median of the others
    step_time_s: float  # this rank's time by the measure: its step, its compute probe, or its reads
    median_s: float
    measure: str = "step"  # "step" (step times), "compute" (compute probes) or "data" (batch reads)


def median_without(ordered: list[float], i: int) -> float:
    """Median of the sorted list `ordered` with element i removed, in O(1)."""
    n = len(ordered) - 1

    def at(j: int) -> float:  # index into the list as if element i were gone
        return ordered[j if j < i else j + 1]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


class StragglerTracker:
    def __init__(self, factor: float, steps: int, measure: str = "step"):
        self.factor, self.steps, self.measure = factor, steps, measure
        self.streaks: dict[int, int] = {}  # rank -> consecutive slow steps so far

    def observe(self, step: int, times: dict[int, float], floor_s: float = 0.0) -> list[Straggler]:
        """Judge one step given every rank's time for it; return the newly reported stragglers.
        floor_s: how far past the others' median a time must also be to count as slow."""
        if len(times) < 2:
            return []
        order = sorted(times, key=times.__getitem__)
        ordered = [times[r] for r in order]
        found = []
        for i, rank in enumerate(order):
            median = median_without(ordered, i)
            factor = ordered[i] / median if median > 0 else 0.0
            slow = factor > self.factor and ordered[i] - median >= floor_s
            streak = self.streaks.get(rank, 0) + 1 if slow else 0
            self.streaks[rank] = streak
            if streak == self.steps:
                found.append(Straggler(step, rank, factor, ordered[i], median, self.measure))
        return sorted(found, key=lambda s: s.rank)


class PeerWatch:
    """Rank 0's view of all ranks: watchdogs gone silent, and stragglers."""

    def __init__(self, cfg: WatchdogConfig):
        self.timeout = cfg.timeout_s
        self.beats: dict[int, tuple[int, float]] = {}  # rank -> (beat, when it last moved)
        # per measure (the record's list of (step, seconds)): its tracker, and the newest step judged
        self.trackers = {key: StragglerTracker(cfg.straggler_factor, cfg.straggler_steps, measure)
                         for key, measure in (("times", "step"), ("probes", "compute"), ("reads", "data"))}
        self.judged = dict.fromkeys(self.trackers, 0)

    def silent(self, records: dict[int, dict], now: float) -> list[int]:
        out = []
        for rank, rec in records.items():
            last = self.beats.get(rank)
            if last is None or last[0] != rec["beat"]:
                self.beats[rank] = (rec["beat"], now)
            elif self.timeout > 0 and not rec["closed"] and now - last[1] > self.timeout:
                out.append(rank)
        return out

    def stragglers(self, records: dict[int, dict]) -> list[Straggler]:
        """The stragglers newly found by step times, compute probes and batch reads, judged at
        the steps every open rank has measured (reads: once some step times are published)."""
        found = []
        measured = {key: self._common(records, key) for key in self.trackers}
        for key, tracker in self.trackers.items():
            floor = 0.0
            if key == "reads":
                if not measured["times"]:
                    continue
                # a share of a typical step: the median over the recent steps (the rare evaluation
                # and save steps, timed with their step, left out)
                floor = DATA_FLOOR * statistics.median(statistics.median(t.values())
                                                       for t in measured["times"].values())
            for step in sorted(s for s in measured[key] if s > self.judged[key]):
                found += tracker.observe(step, measured[key][step], floor)
                self.judged[key] = step
        return found

    @staticmethod
    def _common(records: dict[int, dict], key: str) -> dict[int, dict[int, float]]:
        """{step: {rank: seconds}} of measure `key` at the steps every open rank has published
        (none with fewer than two open ranks)."""
        times = {r: dict(rec.get(key, ())) for r, rec in records.items() if not rec["closed"]}
        if len(times) < 2:
            return {}
        common = set.intersection(*(set(t) for t in times.values()))
        return {step: {r: t[step] for r, t in times.items()} for step in common}
