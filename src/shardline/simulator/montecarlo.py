"""From a job and settings to scenarios; Monte Carlo over seeds; interval sweeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from shardline.errors import ConfigError
from shardline.simulator import job as jobs
from shardline.simulator.engine import BUCKETS, Ledger, Policy, Scenario, simulate_once
from shardline.simulator.failures import LLAMA3_CAUSES
from shardline.simulator.interval import (
    daly_interval_s,
    optimal_interval_s,
    young_interval_s,
)
from shardline.simulator.settings import Settings

MAX_SEGMENTS = 20_000_000  # checkpoints per simulated run; beyond this a run takes too long
MAX_FAILURES = 100_000  # expected failures per simulated run (Llama 3 405B's 54 days: 419); each is simulated


@dataclass(frozen=True)
class Setup:
    """Everything a run needs, resolved once: step time, costs, rates, the chosen policy."""

    job: jobs.Job
    settings: Settings
    step_s: float
    step_source: str
    save_s: float
    snapshot_s: float
    job_rates_per_hour: dict[str, float]
    mtbf_s: float  # unexpected failures only
    policy: Policy

    def stall_s(self, mode: str) -> float:
        return self.save_s if mode == "sync" else self.snapshot_s

    def write_s(self, mode: str) -> float:
        return 0.0 if mode == "sync" else self.save_s

    def young_s(self, mode: str) -> float:
        return young_interval_s(self.stall_s(mode), self.mtbf_s)

    def daly_s(self, mode: str) -> float:
        return daly_interval_s(self.stall_s(mode), self.mtbf_s)

    def optimal_s(self, mode: str) -> float:
        return optimal_interval_s(mode, self.stall_s(mode), self.write_s(mode), self.mtbf_s)

    def steps_for(self, seconds: float) -> int:
        longest = max(1, math.ceil(self.job.duration_s / self.step_s))
        return longest if math.isinf(seconds) else min(longest, max(1, round(seconds / self.step_s)))


def prepare(job: jobs.Job, settings: Settings) -> Setup:
    step_s, source = jobs.step_time_s(job, settings)
    rates = settings.failures.job_rates_per_hour(job.gpus, job.gpus_per_node)
    total = sum(rates.values())
    expected = total * job.duration_s / 3600
    if expected > MAX_FAILURES:  # (1e10 x the rates ran for minutes, in silence, to report nonsense)
        raise ConfigError(f"the failure rates give {expected:,.0f} expected failures in {job.days:g} days on "
                          f"{job.gpus:,} GPUs, one every {3600 / total:.3g} s; a simulation takes up to "
                          f"{MAX_FAILURES:,}: lower --failure-scale or the [failures] rates")
    setup = Setup(job, settings, step_s, source, jobs.save_cost_s(job, settings), jobs.snapshot_cost_s(job, settings),
                  rates, 3600.0 / total if total > 0 else math.inf, policy=None)  # set just below
    mode, interval = settings.checkpoint_mode, settings.checkpoint_interval
    steps = setup.steps_for(setup.optimal_s(mode)) if interval == "optimal" else interval
    return replace(setup, policy=policy(setup, mode, steps))


def policy(setup: Setup, mode: str, steps: int) -> Policy:
    interval_s = steps * setup.step_s
    if setup.job.duration_s / interval_s > MAX_SEGMENTS:
        shortest = math.ceil(setup.job.duration_s / MAX_SEGMENTS / setup.step_s)
        raise ConfigError(f"checkpoint interval of {steps} steps ({interval_s:.3g} s) means "
                          f"{setup.job.duration_s / interval_s:,.0f} checkpoints in {setup.job.days:g} days; "
                          f"use an interval of at least {shortest} steps")
    every = 1
    if mode == "memory":
        every = setup.settings.persist_every or _persist_every(setup, interval_s)
    return Policy(mode, steps, setup.stall_s(mode), setup.write_s(mode), every)


def _persist_every(setup: Setup, interval_s: float) -> int:
    """Memory mode: snapshots per persistent save; never faster than the write itself."""
    by_write = math.ceil(setup.save_s / interval_s)
    wanted = setup.settings.persist_interval_s
    return max(1, by_write, round(wanted / interval_s) if wanted else 1)


def scenario(setup: Setup, pol: Policy) -> Scenario:
    s, job = setup.settings, setup.job
    load = jobs.load_cost_s(job, s)
    q = s.straggler_prob
    step_prob = -math.expm1(job.gpus * math.log1p(-q)) if q < 1 else 1.0
    return Scenario(
        duration_s=job.duration_s, step_s=setup.step_s,
        cause_rates=tuple(setup.job_rates_per_hour[c.name] / 3600.0 for c in LLAMA3_CAUSES),
        cause_memory_ok=tuple(c.memory_ok for c in LLAMA3_CAUSES),
        planned_rate=s.failures.planned_per_day / 86400.0, detection_s=s.detection_s, restart_s=s.restart_s,
        load_s=load, memory_load_s=jobs.memory_load_cost_s(job, s),
        planned_downtime_s=s.planned_downtime_s if s.planned_downtime_s is not None else s.restart_s + load,
        straggler_step_prob=step_prob, straggler_slowdown=s.straggler_slowdown, policy=pol)


def run_seeds(setup: Setup, pol: Policy, seeds: int) -> list[Ledger]:
    sc = scenario(setup, pol)
    return [simulate_once(sc, seed) for seed in range(seeds)]


def _stats(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "min": float(values.min()), "max": float(values.max())}


def summarize(setup: Setup, ledgers: list[Ledger]) -> dict:
    """Means over seeds; GPU-hours are seconds x GPUs / 3600."""
    duration, gpu_h = setup.job.duration_s, setup.job.gpus / 3600.0
    goodput = np.array([led.seconds["useful"] / duration for led in ledgers])
    unexpected = np.array([led.interruptions.sum() for led in ledgers], dtype=float)
    planned = np.array([led.planned for led in ledgers], dtype=float)
    by_cause = np.mean([led.interruptions for led in ledgers], axis=0)
    lost_cause = np.mean([led.lost_by_cause for led in ledgers], axis=0) * gpu_h
    lost = {b: float(np.mean([led.seconds[b] for led in ledgers])) * gpu_h for b in BUCKETS if b != "useful"}
    return {
        "goodput": _stats(goodput), "unexpected": _stats(unexpected), "planned": _stats(planned),
        "total": _stats(unexpected + planned),
        "by_cause": {c.name: float(n) for c, n in zip(LLAMA3_CAUSES, by_cause, strict=True)},
        "lost_gpu_hours": lost,
        "lost_gpu_hours_by_failure": {c.name: float(h) for c, h in zip(LLAMA3_CAUSES, lost_cause, strict=True)},
        "gpu_hours": duration * gpu_h,
    }


def interval_grid(setup: Setup, modes: tuple[str, ...], span: float = 10.0, points: int = 17) -> list[float]:
    """Intervals (s) log-spaced from the smallest optimum / span to the largest x span."""
    optima = [setup.optimal_s(m) for m in modes]
    optima = [o for o in optima if not math.isinf(o)] or [setup.job.duration_s / 10]
    low, high = max(min(optima) / span, setup.step_s), max(optima) * span
    return [float(x) for x in np.geomspace(low, max(high, low), points)]


def sweep(setup: Setup, mode: str, seeds: int, intervals_s: list[float] | None = None) -> list[dict[str, float]]:
    """Mean goodput over seeds at each checkpoint interval (default: around this mode's optimum)."""
    steps = sorted({setup.steps_for(s) for s in intervals_s or interval_grid(setup, (mode,))})
    out = []
    for n in steps:
        useful = np.array([led.seconds["useful"] for led in run_seeds(setup, policy(setup, mode, n), seeds)])
        goodput = useful / setup.job.duration_s
        out.append({"interval_steps": n, "interval_s": n * setup.step_s,
                    "goodput": float(goodput.mean()),
                    "goodput_std": float(goodput.std(ddof=1)) if len(goodput) > 1 else 0.0})  # as _stats
    return out


def simulated_optimum_s(points: list[dict[str, float]]) -> float:
    """The interval of highest mean goodput, refined by a parabola through its neighbours in log-interval."""
    g = [p["goodput"] for p in points]
    i = int(np.argmax(g))
    if i == 0 or i == len(points) - 1:
        return points[i]["interval_s"]
    x = np.log([points[j]["interval_s"] for j in (i - 1, i, i + 1)])
    a, b, _ = np.polyfit(x, [g[i - 1], g[i], g[i + 1]], 2)
    return float(np.exp(-b / (2 * a))) if a < 0 else points[i]["interval_s"]
