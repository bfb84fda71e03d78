"""One layout -> step time, tokens/s, MFU, memory per rank, and where the time goes.

A step on the busiest rank is

    micro-batches x (compute + recompute + exposed communication per micro-batch)
    (x (1 + bubble) with pipelining, on the slowest stage)
    + the data-parallel communication left after the last backward
    + the optimizer step (+ ZeRO-1's parameter all-gather).

Which communication overlaps with compute, stated once here and used below:

    FSDP all-gather     prefetched: block i+1's gather runs under block i's compute;
                        exposed: the first gather, and any gather longer than a block
    FSDP reduce-scatter (and HSDP's all-reduce across replicas) runs under the backward
                        of the next block; exposed: the last one, and any excess
    DDP all-reduce      bucketed under the last micro-batch's backward; exposed: the
                        excess, plus one bucket at the end
    ZeRO-1              gradient reduce-scatter like DDP; the parameter all-gather after
                        the optimizer step is exposed
    (CPU ranks that keep every core busy overlap nothing: gloo copies with the CPU)
    TP collectives      exposed (on the critical path: eager DTensor, no async TP); a
                        program that overlaps backward's (Runtime.tp_backward_overlap) hides that share
    CP ring exchange    overlapped with the attention of the chunk in hand; excess exposed
    EP all-to-all       exposed (MoE models only); under DualPipeV hidden behind the paired
                        micro-batch's compute
    PP send/receive     exposed (on the critical path of each micro-batch), bubble separate
    scalar all-reduces  exposed: the loss, and the gradient norm per group of DTensor gradients
    tied embedding      the gradient all-reduce of the first and last pipeline ranks: exposed
    CPU offload copies  exposed (host<->device copies and the host-side optimizer)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.devices import mfu_peak_dtype
from shardline.errors import ConfigError
from shardline.models.flops import flops_per_token
from shardline.planner import comm
from shardline.planner import compute as cmp
from shardline.planner.activations import dtype_bytes
from shardline.planner.hardware import Hardware
from shardline.layout import Layout
from shardline.planner.layout import Workload, layout_problem
from shardline.planner.memory import (
    DDP_BUCKET_BYTES,
    GiB,
    distinct_ranks,
    expert_layer_params,
    host_fits,
    layer_params,
    layers_per_rank,
    memory_breakdown,
    zero1_ep_away,
    params_per_rank,
    ranks,
    stage_params,
    stage_tensors,
)
from shardline.layout import RankStages
from shardline.planner.pipeline import bubble_fraction

CPU_ADAM_BYTES_PER_S = 20e9  # host-side AdamW with offload: ~28 B per parameter at this rate


@dataclass
class Estimate:
    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (models/flops.py: all s² scores) / the peak of devices.mfu_peak_dtype
    memory: dict[str, float]  # bytes on the busiest rank, by component, with "total"
    capacity: float  # bytes the device offers
    breakdown: dict[str, float]  # seconds per step by component; they add up to step_time_s
    info: dict = field(default_factory=dict)  # bubble, total (not only exposed) communication, algorithms

    host_ok: bool = True  # CPU-offloaded states fit the host

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity and self.host_ok

    def reasons(self) -> str:
        """Why this layout ranks where it does: memory headroom, bubble, exposed communication."""
        t = self.step_time_s
        comm_parts = {k.removesuffix("_comm"): v for k, v in self.breakdown.items() if k.endswith("_comm") and v > 0}
        parts = [f"mem {self.memory['total'] / GiB:.1f}/{self.capacity / GiB:.0f} GiB"]
        if self.breakdown.get("pp_bubble", 0) > 0:
            parts.append(f"bubble {100 * self.breakdown['pp_bubble'] / t:.1f}%")
        if comm_parts:
            top = sorted(comm_parts.items(), key=lambda kv: -kv[1])[:2]
            parts.append("comm " + ", ".join(f"{k} {100 * v / t:.1f}%" for k, v in top))
        if self.breakdown.get("recompute", 0) > 0:
            parts.append(f"recompute {100 * self.breakdown['recompute'] / t:.1f}%")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json(), "mfu": round(self.mfu, 4),
                "tokens_per_s": round(self.tokens_per_s, 1), "step_time_s": round(self.step_time_s, 6),
                "memory_gib_per_gpu": round(self.memory["total"] / GiB, 3),
                "breakdown": {"time_s": {k: round(v, 6) for k, v in self.breakdown.items()},
                              "memory_gib": {k: round(v / GiB, 3) for k, v in self.memory.items()},
                              **self.info},
                "fits": self.fits, "reasons": self.reasons()}


def estimate(work: Workload, layout: Layout, hw: Hardware) -> Estimate:
    """Predict one layout; ConfigError if the layout cannot run the workload at all."""
    problem = layout_problem(work, layout)
    if problem:
        raise ConfigError(problem[1])
    memory = memory_breakdown(work, layout, hw)
    return timed(work, layout, hw, memory)


def timed(work: Workload, layout: Layout, hw: Hardware, memory: dict[str, float]) -> Estimate:
    n_micro = layout.micro_batches(work.global_batch)
    shapes = {(r.layers, r.label): r for r in distinct_ranks(work, layout)}  # pipeline ranks that differ
    block = _block_costs(work, layout, hw)
    per_mb = {key: _microbatch(work, layout, hw, r, block) for key, r in shapes.items()}
    totals = {key: sum(parts.values()) for key, parts in per_mb.items()}
    slow_key = max(totals, key=totals.get)
    slow = per_mb[slow_key]
    breakdown = {k: v * n_micro for k, v in slow.items()}
    bubble = bubble_fraction(layout.pp_schedule, layout.pp, layout.pp_microbatches, layout.pp_virtual_stages)
    # The bubble is the other stages' fill and drain: (p-1)/m x m x their mean micro-batch time
    # (for 1F1B with stage times t_i: (m-1)·max t + sum t, as with equal stages).
    breakdown["pp_bubble"] = bubble * n_micro * _others_mean(work, layout, totals, slow_key)
    dp_tail, dp_total, algos = _dp_tail(work, layout, hw, slow)
    breakdown["dp_comm"] = breakdown.get("dp_comm", 0.0) + dp_tail
    breakdown["optimizer"] = _optimizer(work, layout, hw)
    breakdown["sync_comm"] = _sync(work, layout, hw)
    breakdown["tied_comm"] = _tied_grads(work, layout, hw)
    breakdown = {k: v for k, v in breakdown.items() if v > 0 or k in ("compute", "dp_comm")}
    step = sum(breakdown.values())
    tokens_per_s = work.tokens / step
    peak = hw.peak(mfu_peak_dtype(work.precision)) * layout.world  # fp8: the bf16 peak, as the trainer's log
    mfu = tokens_per_s * flops_per_token(work.model, work.seq_len) / peak
    info = {"bubble_fraction": round(bubble, 5), "micro_batches_per_step": n_micro,
            "dp_comm_total_s": round(dp_total, 6), "algorithms": algos}
    if layout.pp > 1:
        info["layers_per_stage"] = [r.layers for r in ranks(work, layout)]
    return Estimate(layout, step, tokens_per_s, mfu, memory, hw.mem_gib * GiB, breakdown, info,
                    host_fits(memory, layout, hw))


def _others_mean(work: Workload, layout: Layout, totals: dict, slow_key) -> float:
    """Mean micro-batch time of the pipeline ranks other than the slowest."""
    if layout.pp == 1:
        return 0.0
    others = [totals[(r.layers, r.label)] for r in ranks(work, layout)]
    others.remove(totals[slow_key])
    return sum(others) / len(others)


@dataclass(frozen=True)
class _BlockCosts:
    """What a micro-batch costs per block, or per rank, the same on every pipeline rank of a
    layout: priced once per layout, not once per pipeline rank that differs (up to three)."""

    lt: cmp.LayerTimes
    recompute: float  # seconds per block
    wrapper: float  # seconds per block
    tp: float  # seconds per block
    cp: float  # seconds per block
    ep: float  # seconds per block
    pp: float  # seconds per micro-batch
    offload: float  # seconds per micro-batch
    fsdp: tuple | None  # (group, parameters, gather s, scatter s) of one block under FSDP/HSDP
    tp_head: tuple[float, float]  # _tp_head_collectives


def _block_costs(work: Workload, layout: Layout, hw: Hardware) -> _BlockCosts:
    """The rank-independent parts of _microbatch (see _BlockCosts)."""
    lt = cmp.layer_times(work, layout, hw)
    rec_mm, rec_el = cmp.recompute_fraction(layout.activation_checkpoint, layout.ac_every)
    recompute = rec_mm * (lt.matmul + lt.attention) + rec_el * (lt.elementwise + lt.overhead)
    return _BlockCosts(lt, recompute, cmp.wrapper_overhead(hw, layout, work), _tp_block(work, layout, hw, rec_mm),
                       _cp_layer(work, layout, hw, lt), _ep_layer(work, layout, hw, lt), _pp_p2p(work, layout, hw),
                       _offload(work, layout, hw), _fsdp_block(work, layout, hw),
                       _tp_head_collectives(work, layout, hw))


def _microbatch(work: Workload, layout: Layout, hw: Hardware, stage: RankStages,
                block: _BlockCosts | None = None) -> dict[str, float]:
    """Seconds of one micro-batch on one rank of pipeline rank `stage`, by component
    (block: the layout's _block_costs, when the caller prices several ranks)."""
    block = block or _block_costs(work, layout, hw)
    lt, layers = block.lt, stage.layers
    head_f, head_b = cmp.head_times(work, layout, hw, stage.label)
    wrappers = layers * block.wrapper + cmp.ends_overhead(hw, layout, stage.first, stage.last, work)
    return {"compute": layers * (lt.forward + lt.backward) + head_f + head_b + wrappers,
            "recompute": layers * block.recompute,
            "tp_comm": layers * block.tp + _tp_head(work, layout, hw, stage, block.tp_head),
            "cp_comm": layers * block.cp,
            "ep_comm": layers * block.ep,
            "fsdp_comm": _fsdp_exposed(work, layout, hw, lt, stage, block.fsdp),
            "pp_comm": block.pp,
            "offload": block.offload}


def _tokens(work: Workload, layout: Layout) -> int:
    return layout.micro_batch_size * work.seq_len // layout.cp


def _tp_layer(work: Workload, layout: Layout, hw: Hardware, rec_mm: float) -> float:
    """TP collectives of one block: one entering and one leaving each of attention and MLP.

    With sequence parallelism the norm output is all-gathered in fp32 (the residual
    stream and norms are fp32; autocast casts after the gather) and the row-parallel
    output, in the compute dtype, reduce-scattered; backward mirrors the two. Without,
    the outputs are all-reduced forward and the fp32 input gradients backward.
    """
    if layout.tp == 1:
        return 0.0
    g, net = comm.group(layout.tp, 1, hw.network.gpus_per_node), hw.network
    elems = _tokens(work, layout) * work.model.dim
    c, r = dtype_bytes(work.precision), work.runtime.residual_bytes
    if layout.sp:
        fwd = bwd = comm.all_gather(r * elems, g, net)[0] + comm.reduce_scatter(c * elems, g, net)[0]
    else:
        fwd, bwd = comm.all_reduce(c * elems, g, net)[0], comm.all_reduce(r * elems, g, net)[0]
    bwd *= 1.0 - work.runtime.tp_backward_overlap  # Runtime: the share hidden under weight-gradient GEMMs
    return 2 * (fwd + bwd) + 2 * rec_mm * fwd  # attention and MLP; a recomputed forward repeats its part


def _tp_block(work: Workload, layout: Layout, hw: Hardware, rec_mm: float) -> float:
    """TP communication of one block per micro-batch: the alpha-beta cost of its collectives,
    or on CPU ranks with a wall-time calibration the block's whole measured extra (the
    forward, about a third of it, once more per recomputed forward)."""
    wall = cmp.tp_block_wall(hw, layout, work)
    if wall is None:
        return _tp_layer(work, layout, hw, rec_mm)
    return wall * (1 + rec_mm / 3)


def _tp_head(work: Workload, layout: Layout, hw: Hardware, stage: RankStages,
             collectives: tuple[float, float] | None = None) -> float:
    """Vocabulary-parallel embedding (fp32 out) and output projection, each way; loss-parallel sums.

    collectives: what _tp_head_collectives returns, when the caller prices several pipeline ranks."""
    if layout.tp == 1:
        return 0.0
    wall = cmp.tp_ends_wall(hw, layout, work, stage.first, stage.last)
    if wall is not None:  # CPU ranks: the ends' calibrated wall time, collectives included
        return wall
    one, loss = collectives or _tp_head_collectives(work, layout, hw)
    heads = int(stage.first) + int(stage.last)
    return heads * 2 * one + (loss if stage.last else 0.0)


def _tp_head_collectives(work: Workload, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(one end's all-reduce, the loss-parallel sums) of _tp_head: the same on every pipeline rank."""
    if layout.tp == 1:
        return 0.0, 0.0
    g, net = comm.group(layout.tp, 1, hw.network.gpus_per_node), hw.network
    tokens = _tokens(work, layout)
    one = comm.all_reduce(work.runtime.residual_bytes * tokens * work.model.dim, g, net)[0]
    loss = 3 * comm.all_reduce(4 * tokens, g, net)[0] if layout.loss_parallel else 0.0
    return one, loss


# How the trainer runs context parallelism, as named assumptions: the ring starts each
# K/V transfer before the block's attention, forward and backward (overlapped); the
# backward's fp32 dK/dV accumulators travel while the next block computes (overlapped),
# but the last hop home has nothing left to hide behind; Ulysses' all-to-alls sit
# between the projections and attention, with nothing to hide behind.
RING_KV_OVERLAP = True
RING_GRAD_OVERLAP = True


def _cp_layer(work: Workload, layout: Layout, hw: Hardware, lt: cmp.LayerTimes) -> float:
    """Context parallelism per layer and micro-batch: the ring's K/V passes (R-1 hops forward
    and again backward, then R hops of their fp32 gradients) and Ulysses' all-to-alls (q, k,
    v and the output forward, their gradients backward)."""
    if layout.cp == 1:
        return 0.0
    m, ring, u = work.model, *layout.cp_degrees
    width = dtype_bytes(work.precision) / layout.tp
    tokens = _tokens(work, layout)  # this rank's tokens; a ring shard holds u x as many
    total = 0.0
    if u > 1:
        g = comm.group(u, layout.tp, hw.network.gpus_per_node)
        kv_heads = m.kv_heads if (m.kv_heads // layout.tp) % u == 0 else m.n_heads  # else repeated
        per_layer = tokens * (2 * m.n_heads + 2 * kv_heads) * m.head_size * width  # q, out, k, v
        total += 2 * comm.all_to_all(per_layer, g, hw.network)[0]  # forward and backward
    if ring > 1:
        g = comm.group(ring, layout.tp * u, hw.network.gpus_per_node)
        kv_bytes = 2 * tokens * u * m.kv_heads / u * m.head_size * width  # the ring shard's K/V, 1/u of heads
        hop = comm.p2p(kv_bytes, g.nodes > 1, hw.network)
        grad_hop = comm.p2p(kv_bytes * 4 / dtype_bytes(work.precision), g.nodes > 1, hw.network)
        kv_passes = (ring - 1) * hop
        if RING_KV_OVERLAP:  # hidden behind the attention forward, and its ~2.5x backward
            total += max(0.0, kv_passes - lt.attention) + max(0.0, kv_passes - 2.5 * lt.attention)
        else:
            total += 2 * kv_passes
        if RING_GRAD_OVERLAP:
            total += max(0.0, (ring - 1) * grad_hop - 2.5 * lt.attention) + grad_hop
        else:
            total += ring * grad_hop
    return total


def _ep_layer(work: Workload, layout: Layout, hw: Hardware, lt: cmp.LayerTimes) -> float:
    """Expert parallelism: dispatch and combine all-to-alls of each MoE block, forward and backward.

    Only mixture-of-experts models (a `n_experts` field, `moe_top_k` routed experts per
    token) have them; shardline's models are dense, so this is the model for when they are
    not. EP borrows dp_shard x cp ranks (stride tp). DualPipeV pairs one micro-batch's
    forward with another's backward, hiding the all-to-alls under that compute.
    """
    if layout.ep == 1 or not getattr(work.model, "n_experts", 0):
        return 0.0
    g = comm.group(layout.ep, layout.tp, hw.network.gpus_per_node)
    routed = _tokens(work, layout) * getattr(work.model, "moe_top_k", 1)
    one = comm.all_to_all(routed * work.model.dim * dtype_bytes(work.precision), g, hw.network)[0]
    total = 4 * one
    if layout.pp_schedule == "dualpipev" and layout.pp > 1:
        return max(0.0, total - (lt.forward + lt.backward))
    return total


def _fsdp_exposed(work: Workload, layout: Layout, hw: Hardware, lt: cmp.LayerTimes, stage: RankStages,
                  block: tuple | None = None) -> float:
    """Exposed FSDP/HSDP communication of one micro-batch (see the module docstring).

    Blocks overlap as described there; the root module (embedding, final norm, output)
    is gathered before the first block and reduce-scattered after the last: exposed.
    On saturated CPU ranks nothing overlaps (cmp.saturated). block: _fsdp_block's, if known.
    """
    block = block or _fsdp_block(work, layout, hw)
    if block is None:
        return 0.0
    g, per_layer, gather, scatter = block
    net, layers = hw.network, stage.layers
    hide = 0.0 if cmp.saturated(hw, layout) else 1.0
    bwd_gather = gather if layout.zero == 3 or layout.dp_mode == "hsdp" else 0.0
    fwd = gather + (layers - 1) * max(0.0, gather - hide * lt.forward)
    bwd = bwd_gather + scatter + (layers - 1) * max(0.0, bwd_gather + scatter - hide * lt.backward)
    root = stage_params(work, layout, stage, per_layer) - layers * per_layer
    root_comm = (comm.all_gather(dtype_bytes(work.precision) * root, g, net)[0]
                 + comm.reduce_scatter(4 * root, g, net)[0])
    return fwd + bwd + root_comm


def _fsdp_block(work: Workload, layout: Layout, hw: Hardware) -> tuple | None:
    """(shard group, parameters, gather s, scatter s) of one block under FSDP/HSDP, else None:
    the same on every pipeline rank, so _microbatch's callers price it once per layout."""
    if layout.dp_mode not in ("fsdp", "zero2", "hsdp"):
        return None
    net, shard = hw.network, layout.shard_degree
    g = comm.group(shard, layout.tp, net.gpus_per_node)
    per_layer = layer_params(work, layout.tp)
    gather, scatter = _block_gather_scatter(work, layout, hw, g, per_layer)
    if layout.dp_replicate > 1:
        rg = comm.group(layout.dp_replicate, layout.tp * shard, net.gpus_per_node)
        scatter += comm.all_reduce(4 * per_layer / shard, rg, net)[0]
    return g, per_layer, gather, scatter


def _block_gather_scatter(work: Workload, layout: Layout, hw: Hardware, g, per_layer: float) -> tuple[float, float]:
    """FSDP's all-gather and reduce-scatter seconds of one block's parameters.

    Under expert parallelism a rank gathers only its ep-th of the routed experts, and over
    the efsdp ranks (the shard group / ep) that hold the same experts: EP shrinks the
    experts' FSDP traffic by ep, what it pays for with its all-to-alls.
    """
    net, c = hw.network, dtype_bytes(work.precision)
    experts = expert_layer_params(work, layout.tp) if layout.ep > 1 else 0.0
    dense = per_layer - experts
    gather = comm.all_gather(c * dense, g, net)[0]
    scatter = comm.reduce_scatter(4 * dense, g, net)[0]
    if experts:
        eg = comm.group(layout.shard_degree // layout.ep, layout.tp * layout.ep, net.gpus_per_node)
        gather += comm.all_gather(c * experts / layout.ep, eg, net)[0]
        scatter += comm.reduce_scatter(4 * experts / layout.ep, eg, net)[0]
    return gather, scatter


def _pp_p2p(work: Workload, layout: Layout, hw: Hardware) -> float:
    """Send the residual stream (fp32 here) forward and its gradient back, per virtual stage.

    With Runtime.pp_scatter_gather (Megatron) each TP rank sends only its 1/tp slice and
    the receiving stage all-gathers it over NVLink; sequence parallelism has it sliced already.
    """
    if layout.pp == 1:
        return 0.0
    size = work.runtime.residual_bytes * _tokens(work, layout) * work.model.dim / (layout.tp if layout.sp else 1)
    crosses = layout.world // layout.pp >= hw.network.gpus_per_node
    gather = 0.0
    if work.runtime.pp_scatter_gather and layout.tp > 1 and not layout.sp:
        gather = comm.all_gather(size, comm.group(layout.tp, 1, hw.network.gpus_per_node), hw.network)[0]
        size /= layout.tp
    return 2 * layout.pp_virtual_stages * (comm.p2p(size, crosses, hw.network) + gather)


def _offload(work: Workload, layout: Layout, hw: Hardware) -> float:
    """Host<->device copies per micro-batch: sharded weights in (twice at zero=3), gradients out."""
    if not layout.cpu_offload:
        return 0.0
    shard_params = params_per_rank(work, layout)
    copies = (2 if layout.zero == 3 else 1) * 4 * shard_params + 4 * shard_params
    return copies / (hw.network.host_bw_gbs * 1e9)


def _dp_tail(work: Workload, layout: Layout, hw: Hardware, slow: dict[str, float]) -> tuple[float, float, dict]:
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


def _tied_grads(work: Workload, layout: Layout, hw: Hardware) -> float:
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


def _optimizer(work: Workload, layout: Layout, hw: Hardware) -> float:
    params = params_per_rank(work, layout)
    if layout.cpu_offload:
        return params * 28 / CPU_ADAM_BYTES_PER_S
    tensors = max(stage_tensors(work, r) for r in distinct_ranks(work, layout))
    return cmp.optimizer_time(params, hw, layout, tensors)


def _sync(work: Workload, layout: Layout, hw: Hardware) -> float:
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
