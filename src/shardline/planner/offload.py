"""Where offloaded state lives, and what the SSD tier costs a step.

CPU offload (`memory.cpu_offload`) moves a rank's sharded weights, gradients and AdamW states to
its node's host memory, which must hold every rank's (`host_fits`). With `memory.ssd_offload_dir`
AdamW's moments (8 bytes a parameter, fp32 m and v) go on to files on the node's SSDs, mapped
into the host (shardline/optim/ssd_offload.py): they leave the memory a host must have, and the
page cache keeps what fits in the host memory nothing else holds. Moments beyond that are read
from the SSDs in every optimizer step (a window ahead, so the reads overlap the host's AdamW:
the optimizer takes the longer of the two) and written back after it, in the background while
the next forward and backward run (exposed where that writing takes longer).
"""

from __future__ import annotations

from shardline.layout import Layout
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload

GiB = 2**30
MOMENT_BYTES = 8.0  # AdamW's m and v in fp32, per parameter
HOST_USABLE = 0.9  # share of a node's host memory the states and the page cache may take
OUTSIDE_DEVICE = ("total", "host_offload", "ssd_offload")  # memory terms not on the device


def on_ssd(work: Workload, layout: Layout, hw: Hardware) -> bool:
    """Whether this layout puts the moments on the SSD: a folder given, AdamW stepping on the host
    (CPU offload on a GPU; a CPU device), and not ZeRO-1 (its own sliced states: refused)."""
    return bool(work.ssd_offload_dir) and layout.zero != 1 and (layout.cpu_offload or hw.name == "cpu")


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
    """Whether the offloaded states of one node's ranks fit its host memory (90% usable)."""
    return memory.get("host_offload", 0.0) * node_ranks(layout, hw) <= HOST_USABLE * hw.network.host_mem_gib * GiB


def ssd_spill(memory: dict[str, float], layout: Layout, hw: Hardware) -> float:
    """Bytes of one node's SSD-held moments that its page cache cannot keep: the host memory
    nothing else holds (on a CPU device the ranks' own memory is host memory too)."""
    ranks = node_ranks(layout, hw)
    held = memory.get("host_offload", 0.0) + (memory["total"] if hw.name == "cpu" else 0.0)
    cache = max(0.0, HOST_USABLE * hw.network.host_mem_gib * GiB - ranks * held)
    return max(0.0, ranks * memory.get("ssd_offload", 0.0) - cache)


def ssd_exposed(memory: dict[str, float], layout: Layout, hw: Hardware, optimizer_s: float, rest_s: float) -> float:
    """Seconds a step waits for the SSD: the reads beyond the host AdamW they overlap
    (`optimizer_s`), and the write-back beyond the rest of the step it runs under (`rest_s`)."""
    spill = ssd_spill(memory, layout, hw)
    if spill <= 0:
        return 0.0
    read, write = spill / (hw.network.ssd_read_gbs * 1e9), spill / (hw.network.ssd_write_gbs * 1e9)
    return max(0.0, read - optimizer_s) + max(0.0, write - rest_s)
