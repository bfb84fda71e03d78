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
    ZeRO-1              gradient all-reduce like DDP (the trainer's DDP wrapper); the
                        parameter all-gather after the optimizer step is exposed. Under tp, pp or ep (no DDP wrapper)
                        all exposed, each cut over its own ranks (step_comm._zero1_cuts)
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
    SSD offload         the moments' reads (where the page cache cannot keep them all) and their
                        write-back past the dirty limit (every step) beyond the host's AdamW, the
                        rest of the write-back beyond the rest of the step (offload.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.devices import mfu_peak_dtype
from shardline.errors import ConfigError
from shardline.models.flops import flops_per_token
from shardline.layout import Layout, RankStages
from shardline.metrics import mfu
from shardline.planner import compute as cmp
from shardline.planner import host
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload, layout_problem
from shardline.planner.memory import (
    GiB,
    distinct_ranks,
    memory_breakdown,
    params_per_rank,
    ranks,
    stage_tensors,
)
from shardline.planner.microbatch_comm import (
    cp_layer,
    ep_layer,
    fsdp_block,
    fsdp_exposed,
    offload_copies,
    pp_p2p,
    tp_block,
    tp_head,
    tp_head_collectives,
)
from shardline.planner.offload import host_fits, ssd_exposed
from shardline.planner.pipeline import bubble_fraction
from shardline.planner.step_comm import dp_tail, sync, tied_grads

CPU_ADAM_BYTES_PER_S = 40e9  # host-side AdamW with offload: 28 B per parameter (read the weight, gradient
# and moments, write the weight and moments) at this rate; the trainer's host AdamW (the fused kernel) ran at
# 44.9 GB/s so counted, foreach windows at 14.9, on a 2-core VM (benchmarks/RESULTS.md); a server host: unmeasured
CPU_ADAM_FOREACH_BYTES_PER_S = 15e9  # the same with optim.implementation foreach (or for-loop)


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

    @property
    def bubble_share(self) -> float:
        """The pipeline bubble's share of the step (0 without a pipeline)."""
        return self.breakdown.get("pp_bubble", 0) / self.step_time_s if self.step_time_s else 0.0

    def reasons(self) -> str:
        """Why this layout ranks where it does: memory headroom, bubble, exposed communication."""
        t = self.step_time_s
        comm_parts = {k.removesuffix("_comm"): v for k, v in self.breakdown.items() if k.endswith("_comm") and v > 0}
        parts = [f"mem {self.memory['total'] / GiB:.1f}/{self.capacity / GiB:.0f} GiB"]
        if self.bubble_share > 0:
            parts.append(f"bubble {100 * self.bubble_share:.1f}%")
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
    _idle_stages_lend_cores(work, layout, hw, per_mb, n_micro, bubble, breakdown)
    tail, dp_total, algos = dp_tail(work, layout, hw, slow)
    breakdown["dp_comm"] = breakdown.get("dp_comm", 0.0) + tail
    breakdown["optimizer"] = _optimizer(work, layout, hw)
    breakdown["sync_comm"] = sync(work, layout, hw)
    breakdown["tied_comm"] = tied_grads(work, layout, hw)
    rest = sum(v for k, v in breakdown.items() if k != "optimizer")
    breakdown["ssd_io"] = ssd_exposed(memory, layout, hw, breakdown["optimizer"], rest)
    breakdown = {k: v for k, v in breakdown.items() if v > 0 or k in ("compute", "dp_comm")}
    step = sum(breakdown.values())
    tokens_per_s = work.tokens / step
    peak = hw.peak(mfu_peak_dtype(work.precision)) * layout.world * _peak_share(hw, layout)  # fp8: the bf16 peak
    utilisation = mfu(tokens_per_s, flops_per_token(work.model, work.seq_len), peak / 1e12, 1)
    info = {"bubble_fraction": round(bubble, 5), "micro_batches_per_step": n_micro,
            "dp_comm_total_s": round(dp_total, 6), "algorithms": algos}
    if layout.pp > 1:
        info["layers_per_stage"] = [r.layers for r in ranks(work, layout)]
    return Estimate(layout, step, tokens_per_s, utilisation, memory, hw.mem_gib * GiB, breakdown, info,
                    host_fits(memory, layout, hw))


def _idle_stages_lend_cores(work: Workload, layout: Layout, hw: Hardware, per_mb: dict, n_micro: int,
                            bubble: float, breakdown: dict) -> None:
    """CPU ranks sharing a node's cores under pp: the micro-batch terms and the bubble, scaled
    (in place) to the larger of two bounds, when that is shorter than the busiest stage at its share.

    A stage waiting for its neighbour (the bubble, or a lighter stage) sleeps in a receive and
    frees its core for the busy ones, so the slowest stage does not run at its share of the cores
    the whole step. The step takes at least all the ranks' work spread over the node's cores
    (the stages' mean micro-batch at the share) and at least the critical path at a whole rank's
    speed (the slowest stage's micro-batches and the bubble: the other stages' micro-batches).
    The CPU share of a micro-batch's compute is `share` x its time; exposed communication
    counts in full. Only stages on one node share cores; GPUs are not shared: nothing changes
    there.
    """
    sh = cmp.share(hw, layout)
    if layout.pp == 1 or not hw.cpu.shared_compute or sh >= 1.0 or layout.world > hw.network.gpus_per_node:
        return

    def cpu(mb: dict[str, float]) -> float:  # a micro-batch's CPU seconds on one rank
        computed = mb["compute"] + mb["recompute"]
        return computed * sh + sum(mb.values()) - computed

    stages = [cpu(per_mb[(r.layers, r.label)]) for r in ranks(work, layout)]  # every pipeline rank
    keys = [*next(iter(per_mb.values())), "pp_bubble"]
    old = sum(breakdown.get(k, 0.0) for k in keys)
    slowest, others = max(stages), list(stages)
    others.remove(slowest)
    spread = n_micro * sum(stages) / len(stages) / sh
    critical = n_micro * slowest + bubble * n_micro * sum(others) / len(others)
    new = max(spread, critical)
    if 0 < new < old:
        for k in keys:
            if k in breakdown:
                breakdown[k] *= new / old


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
    tp_head: tuple[float, float]  # tp_head_collectives


def _block_costs(work: Workload, layout: Layout, hw: Hardware) -> _BlockCosts:
    """The rank-independent parts of _microbatch (see _BlockCosts)."""
    lt = cmp.layer_times(work, layout, hw)
    rec_mm, rec_el = cmp.recompute_fraction(layout.activation_checkpoint, layout.ac_every)
    recompute = rec_mm * (lt.matmul + lt.attention) + rec_el * (lt.elementwise + lt.overhead)
    return _BlockCosts(lt, recompute, host.wrapper_overhead(hw, layout, work), tp_block(work, layout, hw, rec_el),
                       cp_layer(work, layout, hw, lt), ep_layer(work, layout, hw, lt, rec_el), pp_p2p(work, layout, hw),
                       offload_copies(work, layout, hw), fsdp_block(work, layout, hw),
                       tp_head_collectives(work, layout, hw))


def _microbatch(work: Workload, layout: Layout, hw: Hardware, stage: RankStages,
                block: _BlockCosts | None = None) -> dict[str, float]:
    """Seconds of one micro-batch on one rank of pipeline rank `stage`, by component
    (block: the layout's _block_costs, when the caller prices several ranks)."""
    block = block or _block_costs(work, layout, hw)
    lt, layers = block.lt, stage.layers
    head_f, head_b = cmp.head_times(work, layout, hw, stage.label)
    wrappers = layers * block.wrapper + host.ends_overhead(hw, layout, stage.first, stage.last, work)
    return {"compute": layers * (lt.forward + lt.backward) + head_f + head_b + wrappers,
            "recompute": layers * block.recompute + cmp.loss_recompute_time(work, layout, hw, stage.label),
            "tp_comm": layers * block.tp + tp_head(work, layout, hw, stage, block.tp_head),
            "cp_comm": layers * block.cp,
            "ep_comm": layers * block.ep,
            "fsdp_comm": fsdp_exposed(work, layout, hw, lt, stage, block.fsdp),
            "pp_comm": block.pp,
            "offload": block.offload}


def _peak_share(hw: Hardware, layout: Layout) -> float:
    """Each rank's share of the peak its MFU is read against, as the trainer's log reads it
    (devices.cpu_peak_tflops): CPU ranks sharing a node's cores get cores / ranks of a process's
    peak, which is already no more than the cores; 1 on a GPU."""
    capped = hw.with_cpu(threads=hw.cpu.cores) if 0 < hw.cpu.cores < hw.cpu.threads else hw
    return cmp.share(capped, layout)


def _optimizer(work: Workload, layout: Layout, hw: Hardware) -> float:
    params = params_per_rank(work, layout)
    if layout.cpu_offload:
        return params * 28 / (CPU_ADAM_BYTES_PER_S if work.host_adam_fused else CPU_ADAM_FOREACH_BYTES_PER_S)
    tensors = max(stage_tensors(work, r) for r in distinct_ranks(work, layout))
    return cmp.optimizer_time(params, hw, layout, tensors, work.runtime.clip_in_optimizer)
