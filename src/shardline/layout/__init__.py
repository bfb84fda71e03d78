"""Parallel layouts: the degrees, what follows from them, every rule they must obey,
and which pipeline rank runs which layers.

This module is the one authority on what a layout is. The trainer accepts a layout
exactly when `first_problem(..., runnable=True)` finds nothing; `shardline train
--dry-run` asks the same (through shardline.preflight, as a launch does) and so does
the planner's `--runnable-only`, so the three cannot disagree. The planner's wider
search drops only the rules of what the trainer does not build yet (`NOT_BUILT`). It
needs no torch, so a 512-GPU layout is checked on a laptop in microseconds.

World size = dp_replicate x dp_shard x cp x tp x pp. Data-parallel ranks
(dp = dp_replicate x dp_shard) each take a different slice of the global batch; the
cp ranks of one group share a sequence and the tp ranks share a micro-batch. Expert
parallelism borrows its ranks from dp_shard x cp (as torchtitan and Megatron do), so it
adds no factor to the world size.

Batches: `global_batch` sequences per optimizer step; each dp rank takes
global_batch / dp of them in micro-batches of `micro_batch_size`. Under pp those
micro-batches are exactly one pipeline round (`pp_microbatches`).

The package: `degrees` (Layout, resolve), `rules` (first_problem, check, NOT_BUILT) and
`stages` (which pipeline rank runs which layers).
"""

from shardline.layout.degrees import (IDLE_AT_DEGREE_ONE, SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED, Layout, ModelShape,
                                      Problem, resolve)
from shardline.layout.rules import NOT_BUILT, RULES, Job, check, first_problem, model_parallel_hint
from shardline.layout.stages import (RankStages, head_cost, pipeline_ranks, split_layers, stage_layer_counts,
                                     stages_of_rank)

__all__ = ["IDLE_AT_DEGREE_ONE", "NOT_BUILT", "RULES", "SINGLE_STAGE", "SPLIT_BACKWARD", "V_SHAPED", "Job", "Layout",
           "model_parallel_hint",
           "ModelShape", "Problem", "RankStages", "check", "first_problem", "head_cost", "pipeline_ranks", "resolve",
           "split_layers", "stage_layer_counts", "stages_of_rank"]
