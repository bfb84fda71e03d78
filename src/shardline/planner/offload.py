"""Where offloaded state lives, and what the SSD tier costs a step.

CPU offload (`memory.cpu_offload`) moves a rank's sharded weights, gradients and AdamW states to
its node's host memory, which must hold every rank's (`host_fits`). With `memory.ssd_offload_dir`
AdamW's moments (8 bytes a parameter, fp32 m and v) go on to files on the node's SSDs, mapped
into the host (shardline/optim/ssd_offload.py): they leave the memory a host must have, and the
page cache keeps them while they fit in the host memory nothing else holds. Once they do not,
every step misses throughout: the optimizer sweeps the moments in the same order each step, and
a page cache that evicts the least recently used page evicts, in a sweep larger than itself,
the page wanted next. So a step then reads every moment, a window ahead, so the reads overlap
the host's AdamW: the optimizer takes the longer of the two.

Every step dirties every moment page, cached or not, and every dirty page is written back
before the next step dirties it again (measured: benchmarks/ssd_pressure.py). The kernel's
flusher writes in the background once dirty pages pass vm.dirty_background_ratio of the memory
it could reclaim (free and cache pages, not the pinned or anonymous memory the other states
take), and it makes a writer wait halfway to vm.dirty_ratio (10% and 20% by default). So the
moments past 15% of that memory are written back within the optimizer step; the rest in the
background, under the next forward and backward.
"""

from __future__ import annotations

from shardline.errors import ConfigError
from shardline.layout import Layout
from shardline.optim import ssd_offload
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload

GiB = 2**30
MOMENT_BYTES = 8.0  # AdamW's m and v in fp32, per parameter
HOST_USABLE = 0.9  # share of a node's host memory the states and the page cache may take
OUTSIDE_DEVICE = ("total", "host_offload", "ssd_offload")  # memory terms not on the device
OFFLOADED = (("host_offload", "host"), ("ssd_offload", "SSD"))  # those off it, and where they are


def on_ssd(work: Workload, layout: Layout, hw: Hardware) -> bool:
    """Whether this layout puts the moments on the SSD: a folder given, and a layout that can
    (ssd_offload.usable: AdamW stepping on the host, not ZeRO-1's)."""
    return bool(work.ssd_offload_dir) and ssd_offload.usable(layout.zero, layout.cpu_offload, hw.name != "cpu")


def offloaded(states: dict[str, float], layout: Layout, work: Workload, hw: Hardware, stage: int,
              shard_params: float) -> tuple[dict[str, float], float, float]:
    """(what stays on the device, bytes on the host, bytes on the SSD) of one rank's model states
    (`stage`: what the layout shards, as a ZeRO stage; `shard_params`: the parameters whose AdamW
    states this rank keeps). CPU offload moves every sharded state; below stage 3 the weights the
    forward reads stay on the device."""
    keep, host = states, 0.0
    if layout.cpu_offload:
        keep = {k: (v if k == "params" and stage < 3 else 0.0) for k, v in states.items()}
        host = sum(states.values()) - sum(keep.values())
    if not on_ssd(work, layout, hw):
        return keep, host, 0.0
    ssd = min(MOMENT_BYTES * shard_params, states["optimizer"])
    if layout.cpu_offload:
        return keep, host - ssd, ssd
    return {**keep, "optimizer": keep["optimizer"] - ssd}, host, ssd


def node_ranks(layout: Layout, hw: Hardware) -> int:
    return min(layout.world, hw.network.gpus_per_node)


def host_fits(memory: dict[str, float], layout: Layout, hw: Hardware) -> bool:
    """Whether what one node's ranks hold in its host memory fits it (90% usable): their offloaded
    states, and on a CPU device all they hold (four ranks of a host each "fitting" its whole memory
    do not fit it together)."""
    return _host_held(memory, hw) * node_ranks(layout, hw) <= HOST_USABLE * hw.network.host_mem_gib * GiB


def _host_held(memory: dict[str, float], hw: Hardware) -> float:
    """Bytes of host memory one rank's other states hold: the offloaded ones (on a CPU device, the
    rank's whole memory, which is host memory)."""
    return memory.get("host_offload", 0.0) + (memory["total"] if hw.name == "cpu" else 0.0)


def reclaimable(memory: dict[str, float], layout: Layout, hw: Hardware) -> float:
    """Bytes of one node's host memory the other states leave: free, or page cache. All of it, not
    the planner's 90%: the kernel's dirty limits are shares of what it could reclaim, headroom
    included."""
    return max(0.0, hw.network.host_mem_gib * GiB - node_ranks(layout, hw) * _host_held(memory, hw))


def ssd_spill(memory: dict[str, float], layout: Layout, hw: Hardware) -> float:
    """Bytes of one node's SSD-held moments read back each step: all of them where the page cache
    cannot keep them all (in the usable host memory the other states leave), else none. (All are
    written back each step either way: ssd_exposed.)"""
    cache = max(0.0, HOST_USABLE * hw.network.host_mem_gib * GiB - node_ranks(layout, hw) * _host_held(memory, hw))
    moments = node_ranks(layout, hw) * memory.get("ssd_offload", 0.0)
    return moments if moments > cache else 0.0


DIRTY_SHARE = 0.15  # of reclaimable memory: where Linux starts to throttle a writer ((10% + 20%) / 2 by default)


def ssd_exposed(memory: dict[str, float], layout: Layout, hw: Hardware, optimizer_s: float, rest_s: float) -> float:
    """Seconds a step waits for the SSD (module docstring): the reads where the page cache cannot
    keep the moments and the write-back past the dirty limit beyond the host AdamW they overlap
    (`optimizer_s`), and the rest of the write-back beyond the rest of the step (`rest_s`)."""
    moments = node_ranks(layout, hw) * memory.get("ssd_offload", 0.0)
    if moments <= 0:
        return 0.0
    read_gbs, write_gbs = hw.network.ssd_read_gbs, hw.network.ssd_write_gbs
    if read_gbs <= 0 or write_gbs <= 0:
        raise ConfigError(f"[network] ssd_read_gbs={read_gbs} and ssd_write_gbs={write_gbs} must both be > 0 "
                          "to price memory.ssd_offload_dir")
    spill = ssd_spill(memory, layout, hw)
    background = min(moments, DIRTY_SHARE * reclaimable(memory, layout, hw))
    blocking = spill / (read_gbs * 1e9) + (moments - background) / (write_gbs * 1e9)
    return max(0.0, blocking - optimizer_s) + max(0.0, background / (write_gbs * 1e9) - rest_s)
