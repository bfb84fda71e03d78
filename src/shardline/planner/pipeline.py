"""Pipeline schedules: bubble fraction, in-flight micro-batches, virtual stages.

Times are in units of one stage's forward F = 1 for one micro-batch; its full
backward is B = 2 (input gradient 1 + weight gradient W = 1), so one micro-batch
costs F + B = 3 of useful work per stage and a step m·3. The idle time per rank is
(DeepSeek-V3 report, table 2, and the schedules' papers):

    gpipe, 1f1b        (p-1)(F+B)            -> bubble fraction (p-1)/m
    interleaved_1f1b   (p-1)(F+B)/v          -> (p-1)/(v·m)          (Narayanan et al. 2021)
    zbv                (p-1)(F+B-2W)/2       -> (p-1)/(6m)           (Qi et al. 2024: ZB1P's idle
                                                                       time, in chunks of half a stage)
    dualpipev          (p-1)(F&B+B-3W)/2     -> (p-1)/(3m)           (F&B = F+B: no overlap gain
                                                                       assumed for a dense model)

Activations in flight on the busiest rank (the first), in micro-batches of one
stage's layers: GPipe keeps all m; 1F1B keeps p; interleaved keeps p + (p-1)/v
(Megatron's warm-up of 2(p-1) + (v-1)p chunks, plus one, of L/(p·v) layers each —
Korthikanti's L(1 + (p-1)/(p·v)) for the whole stage; torch's rounds hold m // (m // p)
micro-batches instead of p where p does not divide m); ZB-V keeps p, like 1F1B;
DualPipeV p + 1.
"""

from __future__ import annotations

from shardline.errors import ConfigError

# Stages per rank the search tries for each schedule (the trainer runs any v >= 2 interleaved).
VIRTUAL_STAGES = {"gpipe": (1,), "1f1b": (1,), "interleaved_1f1b": (2, 4), "zbv": (2,), "dualpipev": (2,)}


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time of a rank over its useful compute time, for p stages and m micro-batches."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    if schedule == "zbv":
        return (p - 1) / (6 * m)
    if schedule == "dualpipev":
        return (p - 1) / (3 * m)
    raise ConfigError(f"unknown pipeline schedule {schedule!r}")


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first rank holds at its peak, in whole-stage units."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p, m))
    if schedule == "interleaved_1f1b":
        # torch's warm-up: (v-1) rounds of micro-batches, 2 more per hop from the last stage.
        # A round is p micro-batches when p divides m; else m // (m // p) of them (m = 7, p = 4: 7).
        per_round = m // max(1, m // p)
        chunks = min(m * v, 2 * (p - 1) + (v - 1) * per_round + 1)
        return chunks / v
    if schedule == "zbv":
        return float(min(p, m))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    raise ConfigError(f"unknown pipeline schedule {schedule!r}")


# Which layers each pipeline rank runs is shardline.layout's (pipeline_ranks, RankStages):
# the trainer cuts the model by it and the planner charges each rank what it holds.


def inflight_on_rank(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches in flight on pipeline rank `rank`: 1F1B's rank r warms up p - r of them.

    The other schedules are charged their first rank's figure on every rank (a bound).
    """
    if schedule == "1f1b" and p > 1:
        return float(min(p - rank, m))
    return inflight_microbatches(schedule, p, m, v)
