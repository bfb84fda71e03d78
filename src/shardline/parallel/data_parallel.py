"""Data parallelism: DDP for plain replication; FSDP2 (ZeRO-2/3, HSDP) for sharding.

Gradients are averaged over data-parallel ranks by both DDP and FSDP, while the
trainer's loss is already the mean over the whole global batch: the trainer
multiplies its loss by the data-parallel degree so the average becomes the sum
that one process would compute (see Trainer.forward_backward).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from shardline.parallel.dims import ParallelDims

# fp16 gathers fp32 parameters and lets autocast cast for the matmuls, as one process
# does: fp16's narrow range needs the residual stream, norms and embedding in fp32.
_PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": None}


def apply_ddp(model: nn.Module, dims: ParallelDims, device: torch.device) -> nn.Module:
    """Wrap for DDP: bucketed all-reduce overlapped with backward. Returns the wrapper.

    The reduce spans every data-parallel rank: the replicas, and under ZeRO-1 also the
    dp_shard ranks (which shard only optimizer states).
    """
    # gradient_as_bucket_view: gradients live in the all-reduce buckets, not in a copy.
    return DistributedDataParallel(model, process_group=dims.submesh("dp").get_group(), gradient_as_bucket_view=True,
                                   device_ids=[device.index] if device.type == "cuda" else None)


def apply_fsdp(model: nn.Module, roots: list[nn.Module], dims: ParallelDims, precision: str,
               cpu_offload: bool) -> None:
    """Shard each block, then each root (the model, or each pipeline stage), over the
    data-parallel mesh (in place).

    zero=3 frees the gathered parameters after forward (gathers them again in backward);
    zero=2 keeps them until backward. Both shard gradients and optimizer states.
    With dp_replicate > 1 the mesh is 2-D, which FSDP2 runs as HSDP: shard within a
    group, all-reduce across groups.
    """
    mesh = dims.submesh("dp_replicate", "dp_shard") if dims.dp_replicate > 1 else dims.submesh("dp_shard")
    mp = MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES[precision], reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=dims.zero == 3, **kwargs)
    # A root keeps embedding, final norm and output; they are used last in forward and
    # first in backward, so resharding them after forward would only cost a gather.
    for root in roots:
        fully_shard(root, reshard_after_forward=False, **kwargs)


def gradient_sync(wrapped: nn.Module, enabled: bool):
    """Skip the DDP all-reduce on non-final micro-batches of an accumulation step.

    `wrapped` is the module the trainer calls (a compiled one holds its DDP wrapper as
    `_orig_mod`). FSDP reduce-scatters every micro-batch: holding unsharded gradients
    instead would cost the memory that sharding saves.
    """
    wrapped = getattr(wrapped, "_orig_mod", wrapped)
    if isinstance(wrapped, DistributedDataParallel) and not enabled:
        return wrapped.no_sync()
    return contextlib.nullcontext()


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)
