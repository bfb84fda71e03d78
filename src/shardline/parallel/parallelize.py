"""What laying out a model gives the trainer, and how sharded parameters get their values.

Each model family applies its own plan (e.g. models/llama/parallelize.py) from the
blocks of this package; parameters are initialised after sharding, each rank writing
only its shard, with the same values the single-process model would get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

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
    """Store a full (unsharded) value into a parameter, keeping only this rank's shard. Every
    rank holds the same full value (made on the host), so each slices its own shard there and
    only that crosses to the device: no collective, and no full copy of each parameter in device
    memory (distribute_tensor moves the whole tensor to the mesh's device first: a stacked expert
    weight of a large MoE is gigabytes)."""
    if isinstance(param, DTensor):
        # The shard's place in the whole tensor, as DCP computes it for sharded saves.
        shape, offset = compute_local_shape_and_global_offset(value.shape, param.device_mesh, param.placements)
        param.to_local().copy_(value[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        return
    param.copy_(value)
