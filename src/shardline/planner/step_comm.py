"""Communication once per step, after the last backward: DDP's or ZeRO-1's gradient reduction
and parameter all-gather (or FSDP's total, for the report), the tied embedding's gradient,
and the scalar all-reduces.

Split from estimate.py, which adds these to the micro-batches' time (its docstring says
which of them overlap with compute); the per-micro-batch communication is microbatch_comm.py's.
"""

from __future__ import annotations

from shardline.layout import Layout
from shardline.planner import comm
from shardline.planner import compute as cmp
from shardline.planner.activations import dtype_bytes
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload
from shardline.planner.memory import (
    DDP_BUCKET_BYTES,
    distinct_ranks,
    layer_params,
    layers_per_rank,
    stage_params,
    zero1_ep_away,
)


def dp_tail(work: Workload, layout: Layout, hw: Hardware, slow: dict[str, float]) -> tuple[float, float, dict]:
    """(exposed seconds after the last backward, total seconds, algorithms) of DDP / ZeRO-1."""
    mode, net = layout.dp_mode, hw.network
    psi = max(stage_params(work, layout, r) - zero1_ep_away(work, layout, r) for r in distinct_ranks(work, layout))
    hide = 0.0 if cmp.saturated(hw, layout) else 1.0
    if mode in ("ddp", "zero1"):
        g = comm.group(layout.dp * layout.cp, layout.tp, net.gpus_per_node)  # cp ranks reduce too (zero1)
        op = comm.all_reduce if mode == "ddp" else comm.reduce_scatter
        total, algo = op(4 * psi, g, net)
        bucket = op(min(DDP_BUCKET_BYTES, 4 * psi), g, net)[0]
        exposed = max(0.0, total - hide * slow["compute"] * 2 / 3) + hide * bucket
        if mode == "zero1" and (layout.tp > 1 or layout.pp > 1 or layout.ep > 1):
            exposed = total  # no DDP wrapper there: the optimizer reduce-scatters after the last backward
        if mode == "zero1" and work.runtime.zero1 == "deepspeed_bf16":
            return (*_deepspeed_bf16_dp(work, g, net, psi), {"dp": algo})
        if mode == "zero1":
            gather, _ = comm.all_gather(4 * psi, g, net)
            exposed, total = exposed + gather, total + gather
        return exposed, total, {"dp": algo}
    if mode in ("fsdp", "zero2", "hsdp"):
        g = comm.group(layout.shard_degree, layout.tp, net.gpus_per_node)
        per_layer = layer_params(work, layout.tp)
        n_micro = layout.micro_batches(work.global_batch)
        gather, algo = comm.all_gather(dtype_bytes(work.precision) * per_layer, g, net)
        scatter, _ = comm.reduce_scatter(4 * per_layer, g, net)
        gathers = 2 if layout.zero == 3 else 1
        layers = layers_per_rank(work, layout)
        return 0.0, (gathers * gather + scatter) * layers * n_micro, {"fsdp": algo}
    return 0.0, 0.0, {}


def _deepspeed_bf16_dp(work: Workload, g, net, psi: float) -> tuple[float, float]:
    """(exposed, total) of DeepSpeed's BF16_Optimizer under its pipeline engine: the whole fp32
    gradient buffer all-reduced after the last backward (pipe/engine.py `_bf16_reduce_grads`,
    not a reduce-scatter), then each rank's updated 16-bit shard all-gathered; nothing overlaps."""
    reduce = comm.all_reduce(4 * psi, g, net)[0]
    gather = comm.all_gather(dtype_bytes(work.precision) * psi, g, net)[0]
    return reduce + gather, reduce + gather


def _deepspeed_bf16_dp(work: Workload, g, net, psi: float) -> tuple[float, float]:
    """(exposed, total) of DeepSpeed's BF16_Optimizer under its pipeline engine: the whole fp32
    gradient buffer all-reduced after the last backward (pipe/engine.py `_bf16_reduce_grads`,
    not a reduce-scatter), then each rank's updated 16-bit shard all-gathered; nothing overlaps."""
    reduce = comm.all_reduce(4 * psi, g, net)[0]
    gather = comm.all_gather(dtype_bytes(work.precision) * psi, g, net)[0]
    return reduce + gather, reduce + gather


def tied_grads(work: Workload, layout: Layout, hw: Hardware) -> float:
    """The tied embedding's gradient summed over the first and last pipeline ranks (Megatron's
    embedding group, DeepSpeed's ReduceTiedGrads, shardline's sync_tied_gradient): an all-reduce
    of two ranks after the last backward, exposed. fp32 under DeepSpeed's BF16_Optimizer (its
    gradients live in the fp32 buffer), else the program's gradient bytes."""
    if layout.pp == 1 or not work.model.tie_embeddings:
        return 0.0
    m, net = work.model, hw.network
    width = 4 if work.runtime.zero1 == "deepspeed_bf16" else work.runtime.grad_bytes
    shard = layout.shard_degree if layout.dp_mode in ("fsdp", "zero2", "hsdp") else 1  # sharded gradients
    size = width * m.vocab_size * m.dim / (layout.tp * shard)
    crosses = layout.world // layout.pp >= net.gpus_per_node
    return comm.p2p(size, crosses, net)  # a two-rank all-reduce moves each half once each way: S/B


def sync(work: Workload, layout: Layout, hw: Hardware) -> float:
    """Scalar all-reduces of every step, on the critical path (parallel/collectives.py):

    the loss over dp (and pp); the gradient norm, one reduction per group of DTensor
    gradients with the same mesh and placements per sharded mesh dimension (FSDP's shard
    group, TP's group): one group under FSDP alone, three with TP (column-sharded,
    row-sharded, replicated norms; the last reduced over the shard group only); and over pp.
    """
    net, gpn = hw.network, hw.network.gpus_per_node
    one = lambda size, stride: comm.all_reduce(4, comm.group(size, stride, gpn), net)[0]  # noqa: E731
    shard = one(layout.shard_degree, layout.tp) if layout.shard_degree > 1 else 0.0
    tp = one(layout.tp, 1) if layout.tp > 1 else 0.0
    norms = 3 * shard + 2 * tp if layout.tp > 1 else shard
    pp = 2 * one(layout.pp, layout.world // layout.pp) if layout.pp > 1 else 0.0
    return one(layout.dp, layout.tp * layout.cp) + norms + pp
