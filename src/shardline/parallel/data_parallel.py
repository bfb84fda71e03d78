"""Data parallelism: DDP for plain replication; FSDP2 (ZeRO-2/3, HSDP) for sharding.

Each rank's loss is its share of the mean over the whole global batch, so the
gradient one process would compute is the *sum* of the ranks' gradients. Both
wrappers are set to sum (DDP through a comm hook, FSDP2 with a divide factor of 1
and sum-only collectives) instead of their default average: no factor of dp appears
anywhere else, and the fp16 backward sees exactly the values of one process.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
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
# fp8 gathers as bf16, except weights gathered already in float8 (fp8.fsdp_all_gather).
_PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": None, "fp8": torch.bfloat16}


def apply_ddp(model: nn.Module, dims: ParallelDims, device: torch.device) -> nn.Module:
    """Wrap for DDP: bucketed all-reduce overlapped with backward. Returns the wrapper.

    The reduce spans every rank holding other tokens of the step: the replicas, and under
    ZeRO-1 also the dp_shard ranks (which shard only optimizer states) and the cp ranks
    (which hold other parts of the same sequences).
    """
    # gradient_as_bucket_view: gradients live in the all-reduce buckets, not in a copy.
    group = dims.submesh(dims.batch_dim).get_group()
    ddp = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=True,
                                  device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(group, _all_reduce_sum)
    return ddp


def _all_reduce_sum(group, bucket):
    """DDP's all-reduce without its division by the world size (see the module doc).

    (No annotations: DDP inspects them, and this module's are strings.)"""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def apply_fsdp(model: nn.Module, roots: list[nn.Module], dims: ParallelDims, precision: str,
               cpu_offload: bool) -> None:
    """Shard each block, then each root (the model, or each pipeline stage), over the
    data-parallel mesh (in place).

    zero=3 frees the gathered parameters after forward (gathers them again in backward);
    zero=2 keeps them until backward. Both shard gradients and optimizer states.
    With dp_replicate > 1 the mesh is 2-D, which FSDP2 runs as HSDP: shard within a
    group, all-reduce across groups. Context-parallel ranks shard too (dp_shard x cp).
    Under CPU offload the shard dimension may have size 1 (one GPU; Layout.offload_fsdp).
    """
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    mesh = dims.submesh("dp_replicate", shard) if dims.dp_replicate > 1 else dims.submesh(shard)
    kwargs = fsdp_policies(mesh, precision, cpu_offload)
    for block in model.layers.values():
        sum_gradients(fully_shard(block, reshard_after_forward=dims.zero == 3, **kwargs))
    # A root keeps embedding, final norm and output; they are used last in forward and
    # first in backward, so resharding them after forward would only cost a gather.
    for root in roots:
        sum_gradients(fully_shard(root, reshard_after_forward=False, **kwargs))


def fsdp_policies(mesh: DeviceMesh, precision: str, cpu_offload: bool) -> dict:
    """fully_shard's keyword arguments for every unit: the mesh, the precision policy and,
    under offload, host-resident shards (pinned memory needs an accelerator: torch refuses it
    on a CPU-only machine, where offload runs only as a check of the path, preflight.check_device)."""
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision(precision)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    return kwargs


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: gather parameters in the compute dtype where that is safe, reduce in fp32."""
    return MixedPrecisionPolicy(param_dtype=gather_dtype(precision), reduce_dtype=torch.float32)


def gather_dtype(precision: str) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in under train.precision (None: their own, fp32); the
    planner prices the gathers and the autocast copies by it."""
    return _PARAM_DTYPES[precision]


def sum_gradients(module: FSDPModule) -> None:
    """Reduce-scatter (and HSDP's all-reduce) sum instead of average (see the module doc).

    Sum-only collectives: gloo has no pre-multiplied sum, and a divide factor of 1 alone
    would ask for one.
    """
    module.set_gradient_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


def gradient_sync(wrapped: nn.Module, enabled: bool):
    """Skip the DDP all-reduce on non-final micro-batches of an accumulation step.

    `wrapped` is the module the trainer calls (compilation is per block, inside it). FSDP
    reduce-scatters every micro-batch: holding unsharded gradients instead would cost the
    memory that sharding saves.
    """
    if isinstance(wrapped, DistributedDataParallel) and not enabled:
        return wrapped.no_sync()
    return contextlib.nullcontext()
