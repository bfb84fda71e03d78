"""Collective costs: the alpha-beta model on a two-level (node, network) topology.

A message of S bytes over a link costs alpha + S/beta. For n ranks (the ring algorithms' volumes):

    ring all-reduce        2(n-1)·alpha + 2(n-1)/n · S/B
    tree all-reduce        2·ceil(log2 n)·alpha + 2·S/B          (NCCL's pipelined double binary tree)
    hierarchical           reduce-scatter in the node, all-reduce of S/k across nodes
                           (each of the k local ranks over its own NIC), all-gather in the node
    ring all-gather / reduce-scatter   (n-1)·alpha + (n-1)/n · S/B   (S = the full, gathered size)
    all-to-all             (n-1)·alpha + the intra- and inter-node shares of S at their own bandwidths
    point-to-point         alpha + S/B

B is the slowest link the group crosses: the device's NVLink share inside a node;
across nodes, the NIC shares (divided by the fabric's oversubscription) of the group's
members on one node, pooled because the library runs one ring per NIC (an 8-GPU node
of 400 Gb/s NICs moves ~400 GB/s, as nccl-tests' multi-node bus bandwidth shows);
times the bandwidth efficiency a collective library reaches. The planner takes the fastest
algorithm for each call, as NCCL's tuner does, and reports which. A calibrated profile
may scale each intra-node op (Network.op_factor: its measured time over this model's price
for it under the fitted links).

Where a group sits follows the device mesh, outermost first: pp, dp_replicate,
dp_shard, cp, tp (tp innermost: consecutive ranks, so it stays inside a node when it
fits). A dimension of degree d whose inner dimensions multiply to `stride` has
min(d, gpus_per_node / stride) of its members on one node.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from shardline.planner.hardware import Network


@dataclass(frozen=True)
class Group:
    size: int
    per_node: int  # members of the group on one node

    @functools.cached_property
    def nodes(self) -> int:
        """Nodes the group spans; cached, as every collective over the group asks several times."""
        return math.ceil(self.size / self.per_node)


@functools.lru_cache(maxsize=4096)
def group(size: int, stride: int, gpus_per_node: int) -> Group:
    """Placement of a mesh dimension of `size` whose members are `stride` ranks apart.

    Cached (a search asks for the same few groups per layout), so the Group, and its nodes, are reused.
    """
    per_node = 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))
    return Group(size, per_node)


def _intra_fit(net: Network, n: int) -> tuple[float, float]:
    """(alpha us, B GB/s) inside a node for a group of n: the calibrated entry of n, else of the
    largest smaller size measured, else the smallest measured; the scalar fields without entries."""
    if not net.latency_by_world_us or not net.bw_by_world_gbs:
        return net.intra_latency_us, net.intra_bw_gbs
    sizes = sorted(int(k) for k in net.latency_by_world_us if str(k) in net.bw_by_world_gbs)
    below = [s for s in sizes if s <= n]
    key = str(below[-1] if below else sizes[0])
    return net.latency_by_world_us[key], net.bw_by_world_gbs[key]


def _links(net: Network, n: int = 2) -> tuple[tuple[float, float], tuple[float, float]]:
    """((alpha, B) inside a node, (alpha, B) across nodes) for a group of n, seconds and bytes/s."""
    alpha_us, bw_gbs = _intra_fit(net, n)
    intra = (alpha_us * 1e-6, bw_gbs * 1e9 * net.bw_efficiency)
    inter = (net.inter_latency_us * 1e-6, net.inter_bw_gbs * 1e9 * net.bw_efficiency / net.oversubscription)
    return intra, inter


def _link(g: Group, net: Network) -> tuple[float, float]:
    """(alpha, B) of a flat ring or tree over the group.

    Across nodes, a collective library runs one ring per NIC, so the group's members on
    one node pool their NICs: B = min(NVLink share, members per node x NIC share).
    """
    intra, inter = _links(net, g.size if g.nodes == 1 else g.per_node)
    if g.nodes == 1:
        return intra
    return inter[0], min(intra[1], g.per_node * inter[1])


def _calibrated(op: str, g: Group, net: Network, result: tuple[float, str]) -> tuple[float, str]:
    """An intra-node collective's time times its calibrated factor (Network.op_factor)."""
    if g.nodes > 1:
        return result
    return result[0] * net.op_factor.get(op, 1.0), result[1]


def all_reduce(nbytes: float, g: Group, net: Network) -> tuple[float, str]:
    """(seconds, algorithm) of the fastest all-reduce of `nbytes` per rank."""
    return _calibrated("all_reduce", g, net, _all_reduce(nbytes, g, net))


def all_gather(nbytes: float, g: Group, net: Network) -> tuple[float, str]:
    """(seconds, algorithm) to gather `nbytes` in total (each rank contributes nbytes/n)."""
    return _calibrated("all_gather", g, net, _all_gather(nbytes, g, net))


def reduce_scatter(nbytes: float, g: Group, net: Network) -> tuple[float, str]:
    """Same volume and steps as all-gather, in reverse: `nbytes` is the full input."""
    return _calibrated("reduce_scatter", g, net, _all_gather(nbytes, g, net))


def _all_reduce(nbytes: float, g: Group, net: Network) -> tuple[float, str]:
    n = g.size
    if n == 1 or nbytes <= 0:
        return 0.0, "none"
    alpha, bw = _link(g, net)
    options = {"ring": 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw,
               "tree": 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw}
    if g.nodes > 1 and g.per_node > 1:
        (a_in, b_in), (a_out, b_out) = _links(net, g.per_node)
        k, nodes = g.per_node, g.nodes
        inside = 2 * ((k - 1) * a_in + (k - 1) / k * nbytes / b_in)
        across = 2 * (nodes - 1) * a_out + 2 * (nodes - 1) / nodes * (nbytes / k) / b_out
        options["hierarchical"] = inside + across
    algo = min(options, key=options.get)
    return options[algo], algo


def _all_gather(nbytes: float, g: Group, net: Network) -> tuple[float, str]:
    n = g.size
    if n == 1 or nbytes <= 0:
        return 0.0, "none"
    alpha, bw = _link(g, net)
    options = {"ring": (n - 1) * alpha + (n - 1) / n * nbytes / bw}
    if g.nodes > 1 and g.per_node > 1:
        (a_in, b_in), (a_out, b_out) = _links(net, g.per_node)
        k, nodes = g.per_node, g.nodes
        options["hierarchical"] = ((nodes - 1) * a_out + (nodes - 1) / nodes * (nbytes / k) / b_out
                                   + (k - 1) * a_in + (k - 1) / k * nbytes / b_in)
    algo = min(options, key=options.get)
    return options[algo], algo


def all_to_all(nbytes: float, g: Group, net: Network) -> tuple[float, str]:
    """Each rank sends nbytes/n to every other rank: the in-node and cross-node shares in parallel."""
    n = g.size
    if n == 1 or nbytes <= 0:
        return 0.0, "none"
    (a_in, b_in), (a_out, b_out) = _links(net, min(g.per_node, n))
    k = min(g.per_node, n)
    inside = (k - 1) / n * nbytes / b_in
    across = (n - k) / n * nbytes / b_out if g.nodes > 1 else 0.0
    alpha = a_out if g.nodes > 1 else a_in
    return (n - 1) * alpha + max(inside, across), "pairwise"


def p2p(nbytes: float, crosses_nodes: bool, net: Network) -> float:
    intra, inter = _links(net)
    alpha, bw = inter if crosses_nodes else intra
    return alpha + nbytes / bw if nbytes > 0 else 0.0
