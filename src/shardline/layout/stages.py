"""Which pipeline rank runs which layers: one placement for the trainer and the planner."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardline.layout.degrees import V_SHAPED, ModelShape

# ---- pipeline stage placement ---------------------------------------------------------
#
# Stages are balanced by compute, not by layer count: the output projection (vocab x
# dim, a matmul a token) counts as `head_cost` blocks on the last stage, which then gets
# fewer blocks (tiny, 4 layers on 2 stages: 3 + 1). The embedding, a lookup, costs no
# compute and is not counted: its parameters (and their states) sit on the first stage,
# beside the most micro-batches in flight under 1F1B, so that stage is the fullest in
# memory (the dry run's figure is the busiest rank's). The trainer cuts the model this
# way and the planner charges each rank what it holds.


def head_cost(model: ModelShape) -> float:
    """The output projection's parameters in units of one block's matmul parameters."""
    d = model.dim
    block = 2 * d * model.n_heads * model.head_size + 2 * d * model.kv_heads * model.head_size + 3 * d * model.ffn_dim
    return model.vocab_size * d / block


@functools.lru_cache(maxsize=4096)
def stage_layer_counts(n_layers: int, n_stages: int, head: float) -> tuple[int, ...]:
    """Blocks per stage: each further block goes to the lightest stage (head counted on the last).

    Every stage keeps at least one block.
    """
    counts = [1] * n_stages
    for _ in range(n_layers - n_stages):
        loads = [c + (head if i == n_stages - 1 else 0) for i, c in enumerate(counts)]
        counts[loads.index(min(loads))] += 1
    return tuple(counts)


def split_layers(n_layers: int, n_stages: int, head: float) -> list[list[int]]:
    """Contiguous layer indices of each stage (see stage_layer_counts)."""
    counts = stage_layer_counts(n_layers, n_stages, head)
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n_stages)]


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Looped placement (rank r: r, r + pp, ...) or V-shaped (r and 2 pp - 1 - r)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds: its index, its stages and blocks, and which ends of the model."""

    rank: int
    layers: int
    first: bool  # the embedding
    last: bool  # final norm, output projection, loss
    stages: tuple[int, ...] = (0,)
    layer_ids: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return {(True, True): "both", (True, False): "first", (False, True): "last"}.get((self.first, self.last),
                                                                                          "middle")


@functools.lru_cache(maxsize=4096)
def pipeline_ranks(model: ModelShape, pp: int, virtual: int, schedule: str) -> tuple[RankStages, ...]:
    """RankStages of every pipeline rank (one entry holding the whole model without pipelining)."""
    if pp == 1:
        return (RankStages(0, model.n_layers, True, True, (0,), tuple(range(model.n_layers))),)
    n_stages = pp * (2 if schedule in V_SHAPED else virtual)
    split = split_layers(model.n_layers, n_stages, head_cost(model))
    out = []
    for r in range(pp):
        ids = stages_of_rank(r, pp, virtual, schedule)
        layers = tuple(i for s in sorted(ids) for i in split[s])
        out.append(RankStages(r, len(layers), 0 in ids, n_stages - 1 in ids, tuple(ids), layers))
    return tuple(out)
