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
(measure "compute"; step times are measure "step").
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.config.resilience import WatchdogConfig


@dataclass(frozen=True)
class Straggler:
    step: int
    rank: int
    factor: float  # this rank's time over the median of the others
    step_time_s: float  # this rank's time by the measure: its step, or its compute probe
    median_s: float
    measure: str = "step"  # "step" (step times) or "compute" (compute probes)


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

    def observe(self, step: int, times: dict[int, float]) -> list[Straggler]:
        """Judge one step given every rank's time for it; return the newly reported stragglers."""
        if len(times) < 2:
            return []
        order = sorted(times, key=times.__getitem__)
        ordered = [times[r] for r in order]
        found = []
        for i, rank in enumerate(order):
            median = median_without(ordered, i)
            factor = ordered[i] / median if median > 0 else 0.0
            streak = self.streaks.get(rank, 0) + 1 if factor > self.factor else 0
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
                         for key, measure in (("times", "step"), ("probes", "compute"))}
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
        """The stragglers newly found by step times and by compute probes, judged at the steps
        every open rank has measured."""
        found = []
        for key, tracker in self.trackers.items():
            times = {r: dict(rec.get(key, ())) for r, rec in records.items() if not rec["closed"]}
            if len(times) < 2:
                continue
            common = set.intersection(*(set(t) for t in times.values()))
            for step in sorted(s for s in common if s > self.judged[key]):
                found += tracker.observe(step, {r: t[step] for r, t in times.items()})
                self.judged[key] = step
        return found
