"""What laying out a model gives the trainer, and how sharded parameters get their values.

Each model family applies its own plan (e.g. models/llama/parallelize.py) from the
blocks of this package; parameters are initialised after sharding, each rank writing
only its shard, with the same values the single-process model would get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardline.models.llama import Llama
from shardline.parallel.context.attention import ContextParallel
from shardline.parallel.pipeline import Pipeline


@dataclass
class BuiltModel:
    model: Llama  # this rank's parameters (pruned to its stages under pp): optimizer, checkpoints
    forward: nn.Module | None  # the module to call (a DDP wrapper, or model); None under pp
    pipeline: Pipeline | None  # the stages and schedule under pp
    context: ContextParallel | None = None  # under cp: which tokens of each sequence this rank holds


def assign_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Store a full (unsharded) value into a parameter, keeping only this rank's shard."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so each slices its own
        # shard locally and no collective runs.
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)
