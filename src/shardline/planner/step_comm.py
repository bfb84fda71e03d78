"""Communication once per step, after the last backward: DDP's or ZeRO-1's gradient reduction
and parameter all-gather (or FSDP's total, for the report), the tied embedding's gradient,
and the scalar all-reduces.

Split from estimate.py, which adds these to the micro-batches' time (its docstring says
which of them overlap with compute); the per-micro-batch communication is microbatch_comm.py's.
"""

from __future__ import annotations

from shardline.layout import Layout, RankStages
from shardline.layout.degrees import V_SHAPED
from shardline.planner import comm
from shardline.planner import compute as cmp
from shardline.planner.activations import dtype_bytes, fsdp_gather_bytes
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload
from shardline.planner.host import fsdp_passes
from shardline.planner.memory import (
    DDP_BUCKET_BYTES,
    distinct_ranks,
    expert_layer_params,
    layer_params,
    layers_per_rank,
    stage_params,
    zero1_ep_away,
)


def dp_tail(work: Workload, layout: Layout, hw: Hardware, slow: dict[str, float]) -> tuple[float, float, dict]:
    """(exposed seconds after the last backward, total seconds, algorithms) of DDP / ZeRO-1;
    under FSDP the total only, for the report (microbatch_comm prices what is exposed)."""
    mode = layout.dp_mode
    if layout.zero1_scatters and work.runtime.zero1 != "deepspeed_bf16":
        return _zero1_scatter_tail(work, layout, hw)
    if mode in ("ddp", "zero1"):
        return _wrapped_tail(work, layout, hw, slow)
    if mode in ("fsdp", "zero2", "hsdp"):
        return _fsdp_total(work, layout, hw)
    return 0.0, 0.0, {}


def _wrapped_tail(work: Workload, layout: Layout, hw: Hardware, slow: dict[str, float]) -> tuple[float, float, dict]:
    """DDP's all-reduce, bucketed under the last backward, or ZeRO-1 under the DDP wrapper: the
    gradients reduced over dp x cp like DDP's, then the updated slices all-gathered over the
    ranks the states are cut over (dp_shard x cp; each replica gathers its own copy), exposed.
    DeepSpeed's BF16_Optimizer is priced apart (_deepspeed_bf16_dp)."""
    mode, net = layout.dp_mode, hw.network
    psi = max(stage_params(work, layout, r) - zero1_ep_away(work, layout, r) for r in distinct_ranks(work, layout))
    hide = 0.0 if cmp.saturated(hw, layout) else 1.0
    g = comm.group(layout.dp * layout.cp, layout.tp, net.gpus_per_node)  # cp ranks reduce too (zero1)
    # ZeRO-1 under the wrapper all-reduces as DDP does (the trainer's DDP wrapper; each rank
    # then steps its slice), so it pays DDP's bytes, not a reduce-scatter's half: the
    # program's gradient bytes (fp32 here, Megatron's in the compute dtype).
    grads = work.runtime.grad_bytes * psi
    total, algo = comm.all_reduce(grads, g, net)
    bucket = comm.all_reduce(min(DDP_BUCKET_BYTES, grads), g, net)[0]
    exposed = max(0.0, total - hide * slow["compute"] * 2 / 3) + hide * bucket
    if mode == "zero1" and work.runtime.zero1 == "deepspeed_bf16":
        return (*_deepspeed_bf16_dp(work, g, net, psi), {"dp": algo})
    if mode == "zero1":
        cut = comm.group(layout.shard_degree, layout.tp, net.gpus_per_node)
        gather, _ = comm.all_gather(4 * psi, cut, net)  # the updated fp32 parameters, not gradients
        exposed, total = exposed + gather, total + gather
    return exposed, total, {"dp": algo}


def _zero1_scatter_tail(work: Workload, layout: Layout, hw: Hardware) -> tuple[float, float, dict]:
    """ZeRO-1 under tp, pp or ep, all exposed: after the last backward the optimizer reduces the
    gradients itself, and after its step all-gathers the updated slices (parallel/zero1.py)."""
    costs = [_zero1_cuts(work, layout, hw, r) for r in distinct_ranks(work, layout)]
    reduce, gather, algo = max(costs, key=lambda c: c[0] + c[1])
    return reduce + gather, reduce + gather, {"dp": algo}


def _zero1_cuts(work: Workload, layout: Layout, hw: Hardware, stage: RankStages) -> tuple[float, float, str]:
    """(reduce s, gather s, the dense reduce-scatter's algorithm) of one rank's ZeRO-1 cuts.

    Each cut reduce-scatters its gradients over its own ranks, all-reduces the received slice
    over dp_replicate (the replicas hold the same slices) and all-gathers the updated slices
    over its ranks again. The dense parameters are cut over dp_shard x cp; under ep the rank's
    ep-th of the routed experts over efsdp (dp_shard x cp / ep ranks holding the same experts),
    a smaller group: fewer ring steps, but a larger slice per rank to all-reduce over the replicas.
    """
    net, gpn = hw.network, hw.network.gpus_per_node
    experts = stage.layers * expert_layer_params(work, layout.tp) if layout.ep > 1 else 0.0
    dense = stage_params(work, layout, stage) - experts
    replicas = comm.group(layout.dp_replicate, layout.tp * layout.shard_degree, gpn)
    cuts = [(dense, comm.group(layout.shard_degree, layout.tp, gpn))]
    if experts:
        efsdp = comm.group(layout.shard_degree // layout.ep, layout.tp * layout.ep, gpn)
        cuts.append((experts / layout.ep, efsdp))
    reduce = gather = 0.0
    grad = work.runtime.grad_bytes  # the gradients reduced; the slices gathered are fp32 parameters
    for params, g in cuts:
        reduce += (comm.reduce_scatter(grad * params, g, net)[0]
                   + comm.all_reduce(grad * params / g.size, replicas, net)[0])
        gather += comm.all_gather(4 * params, g, net)[0]
    return reduce, gather, comm.reduce_scatter(grad * dense, cuts[0][1], net)[1]


def _fsdp_total(work: Workload, layout: Layout, hw: Hardware) -> tuple[float, float, dict]:
    """FSDP's gathers and reduce-scatters of a whole step, for the report: nothing is left after
    the last backward (microbatch_comm.fsdp_exposed prices the exposed part per micro-batch,
    and says what pp changes)."""
    net = hw.network
    g = comm.group(layout.shard_degree, layout.tp, net.gpus_per_node)
    per_layer = layer_params(work, layout.tp)
    n_micro = layout.micro_batches(work.global_batch)
    gather, algo = comm.all_gather(fsdp_gather_bytes(work) * per_layer, g, net)
    scatter, _ = comm.reduce_scatter(work.runtime.grad_bytes * per_layer, g, net)
    gathers, scatters = fsdp_passes(layout, n_micro)
    return 0.0, (gathers * gather + scatters * scatter) * layers_per_rank(work, layout), {"fsdp": algo}


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
    if layout.pp == 1 or not work.model.tie_embeddings or layout.pp_schedule in V_SHAPED:
        return 0.0  # a V-shaped schedule puts both ends on pp rank 0: one weight, nothing sent
    m, net = work.model, hw.network
    width = 4 if work.runtime.zero1 == "deepspeed_bf16" else work.runtime.grad_bytes
    shard = layout.shard_degree if layout.dp_mode in ("fsdp", "zero2", "hsdp") else 1  # sharded gradients
    size = width * m.vocab_size * m.dim / (layout.tp * shard)
    crosses = (layout.pp - 1) * (layout.world // layout.pp) >= net.gpus_per_node  # first and last stage's ranks
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
