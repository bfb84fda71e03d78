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
Korthikanti's L(1 + (p-1)/(p·v)) for the whole stage); ZB-V keeps p, like 1F1B;
DualPipeV p + 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardline.errors import ConfigError

VIRTUAL_STAGES = {"gpipe": (1,), "1f1b": (1,), "interleaved_1f1b": (2, 3, 4, 8), "zbv": (2,), "dualpipev": (2,)}


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
        chunks = min(m * v, 2 * (p - 1) + (v - 1) * p + 1)
        return chunks / v
    if schedule == "zbv":
        return float(min(p, m))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    raise ConfigError(f"unknown pipeline schedule {schedule!r}")


def schedule_problem(schedule: str, p: int, m: int, v: int, n_layers: int) -> str | None:
    """Why this schedule cannot run this way, or None."""
    if p == 1:
        return None
    if v not in VIRTUAL_STAGES[schedule]:
        return f"{schedule} runs {' or '.join(map(str, VIRTUAL_STAGES[schedule]))} stage(s) per rank, not {v}"
    if p * v > n_layers:
        return f"pp x virtual stages = {p * v} exceeds the model's {n_layers} layers"
    if m < p:
        return f"{m} micro-batches cannot fill {p} stages (need at least {p})"
    if schedule == "interleaved_1f1b" and m % p:
        return f"interleaved 1F1B needs micro-batches ({m}) divisible by pp ({p})"
    return None


# --- Which layers each pipeline rank runs: the trainer's split (parallel/pipeline.py), restated ---
#
# The trainer balances stages by parameters, not by layer count: the output projection
# (vocab x dim) counts as head_cost blocks on the last stage, which then gets fewer
# blocks (tiny, 4 layers on 2 stages: 3 + 1, not 2 + 2). The planner follows the same
# rule so its slowest stage and its fullest rank are the trainer's. A test holds the two
# implementations equal.

V_SHAPED = ("zbv", "dualpipev")


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds: its index, its blocks, and which ends of the model."""

    rank: int
    layers: int
    first: bool  # the embedding
    last: bool  # final norm, output projection, loss

    @property
    def label(self) -> str:
        return {(True, True): "both", (True, False): "first", (False, True): "last"}.get((self.first, self.last),
                                                                                          "middle")


def head_cost(model) -> float:
    """The output projection's parameters in units of one block's matmul parameters."""
    d = model.dim
    block = 2 * d * model.n_heads * model.head_size + 2 * d * model.kv_heads * model.head_size + 3 * d * model.ffn_dim
    return model.vocab_size * d / block


@functools.lru_cache(maxsize=4096)
def split_layers(n_layers: int, n_stages: int, head: float) -> tuple[int, ...]:
    """Blocks per stage: each further block goes to the lightest stage (head counted on the last)."""
    counts = [1] * n_stages
    for _ in range(n_layers - n_stages):
        loads = [c + (head if i == n_stages - 1 else 0) for i, c in enumerate(counts)]
        counts[loads.index(min(loads))] += 1
    return tuple(counts)


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


@functools.lru_cache(maxsize=4096)
def pipeline_ranks(model, pp: int, virtual: int, schedule: str) -> tuple[RankStages, ...]:
    """RankStages of every pipeline rank (one entry holding the whole model without pipelining)."""
    if pp == 1:
        return (RankStages(0, model.n_layers, True, True),)
    n_stages = pp * (2 if schedule in V_SHAPED else virtual)
    counts = split_layers(model.n_layers, n_stages, head_cost(model))
    out = []
    for r in range(pp):
        ids = stages_of_rank(r, pp, virtual, schedule)
        out.append(RankStages(r, sum(counts[s] for s in ids), 0 in ids, n_stages - 1 in ids))
    return tuple(out)


def inflight_on_rank(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches in flight on pipeline rank `rank`: 1F1B's rank r warms up p - r of them.

    The other schedules are charged their first rank's figure on every rank (a bound).
    """
    if schedule == "1f1b" and p > 1:
        return float(min(p - rank, m))
    return inflight_microbatches(schedule, p, m, v)
