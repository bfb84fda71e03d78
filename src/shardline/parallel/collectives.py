"""The few reductions the training loop needs across ranks (no-ops in one process): gradient
clipping (`clip_grad_norm`: the global norm over every shard, and its scale, applied here or handed
to an optimizer that multiplies inside its own pass), the loss and its token count."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardline.config import ParallelConfig
from shardline.parallel.dims import ParallelDims

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def reduce_over(dims: ParallelDims, dim: str | None, value: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce `value` over mesh dimension `dim` (None: every rank); a copy is returned."""
    value = value.detach().clone()
    if dims.mesh is None:
        return value
    value = value.to(dims.mesh.device_type)
    group = dims.submesh(dim).get_group() if dim else None
    dist.all_reduce(value, op=_OPS[op], group=group)
    return value


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, dims: ParallelDims,
                   counted_elsewhere: torch.Tensor | None = None, defer_to=None) -> torch.Tensor:
    """Clip the global gradient norm (0 = measure only); returns the norm before clipping.

    `defer_to`: an optimizer with a `clip_scale` attribute, which scales each gradient as it steps
    it instead of a pass of its own over every gradient here: the host's windowed AdamW multiplies
    while its window is in cache (the same multiply, so the same bits), the GPU's fused AdamW
    divides by the reciprocal inside its kernel (optim/fused.py). It gets the scale (None when
    nothing is clipped) and the gradients are clipped once it steps.

    Plain gradients contribute their norms. DTensor gradients are grouped by mesh and
    placements: each group's squared norm is summed over the local shards and reduced
    over the mesh dimensions it is sharded on (not those it is replicated on), one
    small all-reduce per group and dimension instead of one per tensor. So a model
    mixing sharded and plain or replicated parameters (FSDP x TP, HSDP) gets the
    single-process norm. Pipeline ranks add their squared norms. `counted_elsewhere`
    (a tied weight's copy on the last pipeline stage, whose gradient equals the
    first stage's) is clipped but left out of the norm, so the weight counts once.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    measured = [p.grad for p in params if p is not counted_elsewhere]
    plain = [g for g in measured if not isinstance(g, DTensor)]
    norms = list(torch._foreach_norm(plain)) if plain else []  # one kernel per group, not one per tensor
    apart = []  # ZeRO-1 under ep: the routed experts' squares, whose slices are spread over efsdp
    groups: dict[tuple, list[DTensor]] = {}
    for g in measured:
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
    for (mesh, placements), members in groups.items():
        if any(p.is_partial() for p in placements):  # a replicated weight's pending sum (tp's q/k norms)
            norms += [local_value(torch.linalg.vector_norm(g)) for g in members]
            continue
        local = [g.to_local() for g in members]  # (one foreach kernel: FSDP makes every gradient a DTensor)
        squares = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32)).square().sum()
        squares = squares.to(mesh.device_type)  # offloaded gradients are on the host; NCCL reduces on the GPU
        for dim, placement in enumerate(placements):
            # Any sharding (FSDP's strided shard on top of TP is not an is_shard() Shard).
            if not placement.is_replicate():
                dist.all_reduce(squares, group=mesh.get_group(dim))
        if dims.zero1 and dims.zero1_cut_dim(mesh.mesh_dim_names or ()) == "efsdp":
            apart.append(squares)  # summed over ep above; over the shard dim (which holds ep) they would count ep times
        else:
            norms.append(squares.sqrt())
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if dims.zero1:  # each rank of the shard dim holds the summed gradient of its slices only (zero1.py)
        total = reduce_over(dims, dims.zero1_shard_dim, total.square(), "sum")
        if dims.ep > 1:  # all ranks call it, a stage without experts with 0
            experts = sum((s.to(total.device) for s in apart), torch.zeros((), device=total.device))
            total = total + reduce_over(dims, "efsdp", experts, "sum").to(total.device)
        total = total.sqrt()
    if dims.pp > 1:  # each pipeline rank holds other parameters: add the squares
        total = reduce_over(dims, "pp", total.square(), "sum").sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0) if max_norm else None
    if "clip_scale" in getattr(defer_to, "__dict__", {}):  # its own attribute, not one a wrapper forwards
        defer_to.clip_scale = scale
    elif scale is not None:
        scale_grads(grads, scale)
    return total


def scale_grads(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply gradients by the clip's scale in place: a DTensor with its own multiply, plain ones
    one foreach call per device. The one multiply the clip makes, wherever it runs (here, or
    window by window in the host's AdamW), so both give the same bits."""
    for g in grads:
        if isinstance(g, DTensor):
            g.mul_(scale.to(g.device))
    for device_grads in _plain_by_device(grads):
        torch._foreach_mul_(device_grads, scale.to(device_grads[0].device))


def _plain_by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The plain (not DTensor) tensors grouped by device, for foreach ops (offloaded gradients
    sit on the host)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if not isinstance(t, DTensor):
            groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def loss_context(dims: ParallelDims, p: ParallelConfig):
    """Cross-entropy on vocab-sharded logits when tensor parallel uses loss parallelism."""
    return loss_parallel() if dims.tp > 1 and p.loss_parallel else contextlib.nullcontext()


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a (replicated) DTensor result such as a loss-parallel loss."""
    return value.full_tensor() if isinstance(value, DTensor) else value
