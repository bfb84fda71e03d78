"""Host CPU time of the distributed wrappers (calibrate/dist.py measures it on CPU ranks).

DTensor dispatch of a tensor-parallel block and FSDP2's per-block hooks and copies, per
micro-batch; where the profile times TP's blocks and ends in wall time (host work,
collectives and waits together), those replace TP's part. Zero on GPUs, whose host runs
ahead of the kernels.
"""

from __future__ import annotations

from shardline.layout import Layout
from shardline.planner.compute import share
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload
from shardline.planner.memory import layer_params


def _fsdp(layout: Layout) -> bool:
    return layout.dp_mode in ("fsdp", "zero2", "hsdp")


def fsdp_passes(layout: Layout, n_micro: int) -> tuple[int, int]:
    """(gather, reduce-scatter) passes over a rank's blocks per step under FSDP
    (microbatch_comm.fsdp_exposed says why): without pp each micro-batch gathers (twice at
    zero 3) and reduce-scatters; under pp the stage reduce-scatters once, and gathers once
    (zero 2) or per micro-batch plus the warm-up's pp - 1 (zero 3)."""
    if layout.pp == 1:
        return n_micro * (2 if layout.zero == 3 else 1), n_micro
    return (n_micro + layout.pp - 1 if layout.zero == 3 else 1), 1


def copy_share(layout: Layout, work: Workload, root: bool = False) -> float:
    """The share of FSDP's calibrated buffer copies a block (or the root module) pays per
    micro-batch. The calibration times a ZeRO-3 block's forward and backward, 2 gathers and 1
    reduce-scatter, and its size-dependent part is their copies; the block's copies follow its
    passes (fsdp_passes), while its hooks run every micro-batch. The root gathers and reduce-
    scatters once per micro-batch (never resharded after forward), once per step under pp.
    Under pp the passes were counted with one stage per rank (pp 2, 1F1B)."""
    n = max(1, layout.micro_batches(work.global_batch))
    if root:
        gathers = scatters = 1 if layout.pp > 1 else n
    else:
        gathers, scatters = fsdp_passes(layout, n)
    return (gathers + scatters) / (3 * n)


def tp_wall_calibrated(hw: Hardware, layout: Layout) -> bool:
    """TP on CPU ranks whose profile times TP's blocks and ends in wall time (calibrate/dist.py)."""
    return layout.tp > 1 and hw.cpu.shared_compute and hw.cpu.tp_layer_wall_us > 0


def tp_block_wall(hw: Hardware, layout: Layout, work: Workload) -> float | None:
    """CPU ranks with a wall-time TP calibration: one TP block's extra seconds per micro-batch
    (host work, collectives and waits together; forward + backward), else None."""
    if not tp_wall_calibrated(hw, layout):
        return None
    activations_mb = 4e-6 * layout.micro_batch_size * work.seq_len / layout.cp * work.model.dim
    return (hw.cpu.tp_layer_wall_us + hw.cpu.tp_layer_wall_us_per_mb * activations_mb) * 1e-6 / share(hw, layout)


def tp_ends_wall(hw: Hardware, layout: Layout, work: Workload, first: bool, last: bool) -> float | None:
    """CPU ranks with a wall-time TP calibration: seconds of TP's ends per micro-batch (the fixed
    part half to each end, the logits' part to the last stage), else None."""
    if not tp_wall_calibrated(hw, layout):
        return None
    logits_mb = 4e-6 * layout.micro_batch_size * work.seq_len / layout.cp * work.model.vocab_size / layout.tp
    us = hw.cpu.tp_head_wall_us * (0.5 * first + 0.5 * last) + hw.cpu.tp_head_wall_us_per_mb * logits_mb * last
    return us * 1e-6 / share(hw, layout)


def wrapper_overhead(hw: Hardware, layout: Layout, work: Workload) -> float:
    """Host seconds of the TP (DTensor) and FSDP2 wrappers per block per micro-batch (forward + backward):
    FSDP's hooks every micro-batch, its copies by its passes (copy_share).

    TP's part is left to tp_block_wall where that is calibrated.
    """
    us = 0.0
    if layout.tp > 1 and not tp_wall_calibrated(hw, layout):
        us += hw.cpu.tp_layer_overhead_us
    if _fsdp(layout):
        cpu = hw.cpu
        copies = cpu.fsdp_layer_overhead_us_per_mb * 4e-6 * layer_params(work, layout.tp) * copy_share(layout, work)
        us += cpu.fsdp_layer_overhead_us + copies
    return us * 1e-6 / share(hw, layout)


def ends_overhead(hw: Hardware, layout: Layout, first: bool, last: bool, work: Workload) -> float:
    """Host seconds of the wrappers around the model's ends per micro-batch, half to each end.

    FSDP's size-dependent part counts each end's weight (embedding, output), by the root's passes.
    """
    ends = 0.5 * first + 0.5 * last
    us = 0.0
    if layout.tp > 1 and not tp_wall_calibrated(hw, layout):  # else in the ends' wall time
        us += hw.cpu.tp_head_overhead_us * ends
    if _fsdp(layout):
        embed_mb = 4e-6 * work.model.vocab_size * work.model.dim / layout.tp
        copies = hw.cpu.fsdp_layer_overhead_us_per_mb * embed_mb * 2 * ends * copy_share(layout, work, root=True)
        us += hw.cpu.fsdp_root_overhead_us * ends + copies
    return us * 1e-6 / share(hw, layout)
