"""What `shardline comm-bench` (cluster.py) makes of its points: the planner's links fitted to them,
the planner's price for each, and the report.

The fit (fit_network): each link's alpha and B from all-gather and reduce-scatter, as rings
(calibrate/comm.py's least squares; NCCL_ALGO=Ring pins them where a recent NCCL would run them
otherwise): the node tier's give the intra fields, smaller groups' tiers their own entries by
size, the rail tier's the inter fields; then each op's factor inside a node over the planner's
own price for it (all-reduce may run as a tree, or in the switch); bw_efficiency 1, since a
measured rate is what the library reached. The world tier is not fitted: the planner's
prediction of it from the fitted profile, printed beside each point, is a check of the
two-level model on this cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from shardline.planner import comm
from shardline.planner.calibrate.comm import MIN_SECONDS_PER_BYTE, fit_alpha_beta, op_factors, seconds_per_byte
from shardline.planner.hardware import Network

LINK_OPS = ("all_gather", "reduce_scatter")  # the links are fitted to these, as rings
FACTORED = ("all_reduce", "all_gather", "reduce_scatter")  # the ops the planner scales by op_factor in a node


@dataclass(frozen=True)
class Point:
    tier: str
    op: str
    ranks: int  # in each group of the tier
    per_node: int  # of a group's ranks on one node
    nbytes: int
    seconds: float  # the median round's time per call, of the slowest rank

    @property
    def algbw_gbs(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw_gbs(self) -> float:
        return self.algbw_gbs * bus_factor(self.op, self.ranks)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for a group of n."""
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def fit_links(points: list[Point], base: Network, nodes: int, per_node: int,
              whole_nodes: bool = True) -> tuple[dict, list[str]]:
    """The [network] fields the points give (module doc), and a line per fit saying what it used.

    Each link's alpha and B come from all-gather and reduce-scatter, fitted as rings (all-reduce
    may run as a tree, or in the switch). Groups smaller than a node (tiers node2, node4, ...) add
    their own fits by size (latency_by_world_us, bw_by_world_gbs) beside the whole node's. Each
    op's factor inside a node is its median time over the planner's price for it under those fits
    (every group size inside a node pooled), all-reduce's choice of ring or tree included. Links
    not measured keep the base's effective rate (its bandwidth times bw_efficiency, which becomes
    1 here); a measured inter rate is multiplied by the base's oversubscription, which the planner
    divides by again, so the profile predicts what was measured at this job's size.
    gpus_per_node is written only from several nodes all of whose devices ran (`whole_nodes`): a
    node run in part would tell the planner smaller nodes.
    """
    fields: dict = {"bw_efficiency": 1.0, "intra_bw_gbs": base.intra_bw_gbs * base.bw_efficiency,
                    "inter_bw_gbs": base.inter_bw_gbs * base.bw_efficiency}
    notes = []
    if nodes > 1 and per_node > 1 and whole_nodes:
        fields["gpus_per_node"] = per_node
    else:
        notes.append(f"gpus_per_node: not written (one node, one rank a node, or nodes in part): the base's "
                     f"{base.gpus_per_node} kept")
    intra = "node" if nodes > 1 and per_node > 1 else ("world" if nodes == 1 else None)
    inter = "rail" if nodes > 1 and per_node > 1 else ("world" if per_node == 1 else None)
    inside = sorted({p.tier for p in points if is_subnode(p.tier)}, key=lambda t: int(t[4:])) + [intra]
    fits = {}  # group size inside a node -> (alpha s, B bytes/s)
    for tier in inside:
        fit = _fit_tier(points, tier, "intra", notes)
        if fit:
            fits[fit[0]] = fit[1:]
    if intra and per_node in fits:  # the whole node (on one node, the world)
        alpha, bw = fits[per_node]
        fields.update(intra_latency_us=alpha * 1e6, intra_bw_gbs=bw / 1e9,
                      latency_by_world_us={str(n): a * 1e6 for n, (a, _) in fits.items()},
                      bw_by_world_gbs={str(n): b / 1e9 for n, (_, b) in fits.items()})
        # Pooled over every group size inside a node, each under its own fit: the planner
        # multiplies the factor into any group that stays inside one.
        fields["op_factor"] = op_factors([{"op": p.op, "world": p.ranks, "bytes": p.nbytes, "seconds": p.seconds}
                                          for p in points if p.tier in inside and p.op in FACTORED
                                          and p.ranks in fits], fits)  # (a tier whose fit was refused: none)
    fit = _fit_tier(points, inter, "inter", notes)
    if fit:
        fields.update(inter_latency_us=fit[1] * 1e6, inter_bw_gbs=fit[2] / 1e9 * base.oversubscription)
    return fields, notes


def is_subnode(tier: str) -> bool:
    """A tier of groups smaller than a node: node2, node4, ..."""
    return tier.startswith("node") and tier[4:].isdigit()


def _fit_tier(points: list[Point], tier: str | None, link: str, notes: list[str]
              ) -> tuple[int, float, float] | None:
    """(group size, alpha s, B bytes/s) of a tier's all-gather and reduce-scatter points, with a line
    in `notes` saying what was fitted, or why nothing was."""
    if tier is None:
        notes.append(f"{link}: not measured here ({'one node' if link == 'inter' else 'one rank a node'}); "
                     "the base's figures kept")
        return None
    chosen = [p for p in points if p.tier == tier and p.op in LINK_OPS]
    if len({p.nbytes for p in chosen}) < 2:
        notes.append(f"{link}: not measured (needs all-gather or reduce-scatter in the {tier} tier at two sizes "
                     "or more); the base's figures kept")
        return None
    measured = [{"op": p.op, "world": p.ranks, "bytes": p.nbytes, "seconds": p.seconds} for p in chosen]
    if seconds_per_byte(measured) <= MIN_SECONDS_PER_BYTE:  # (a fit would give its ceiling, and the profile say so)
        notes.append(f"{link}: not fitted: the {tier} tier's times do not grow with the message size (noise: "
                     "more --rounds, or a larger --max-size); the base's figures kept")
        return None
    alpha, bw = fit_alpha_beta(measured)
    largest = max(p.nbytes for p in chosen)
    small = (f"; its largest message, {human(largest)}, is mostly latency: give --max-size {human(BANDWIDTH_SIZE)} "
             "or more for a bandwidth to plan with") if largest < BANDWIDTH_SIZE else ""
    notes.append(f"{link}: {alpha * 1e6:.2f} us + {bw / 1e9:.5g} GB/s from the {tier} tier "
                 f"({len(chosen)} points of {', '.join(sorted({p.op for p in chosen}))}){small}")
    return chosen[0].ranks, alpha, bw


BANDWIDTH_SIZE = 1 << 20  # a fit whose largest message is smaller says its bandwidth is mostly latency's


def predict(point: Point, net: Network) -> float:
    """The planner's time (seconds) for a measured point under `net`."""
    return getattr(comm, point.op)(point.nbytes, comm.Group(point.ranks, point.per_node), net)[0]


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes} B"


def report(points: list[Point], notes: list[str], fitted: Network, base: tuple[str, Network],
           head: str) -> str:
    """The table of points with the fitted model's time beside each, and the summary lines."""
    lines = [head, f"{'tier':<6} {'ranks':>5}  {'op':<15} {'size':>10} {'time us':>10} {'algbw GB/s':>11} "
                   f"{'busbw GB/s':>11} {'model us':>10} {'error':>7}"]
    for p in points:
        model = predict(p, fitted)
        lines.append(f"{p.tier:<6} {p.ranks:>5}  {p.op:<15} {human(p.nbytes):>10} {p.seconds * 1e6:>10.1f} "
                     f"{p.algbw_gbs:>11.4g} {p.busbw_gbs:>11.4g} {model * 1e6:>10.1f} {model / p.seconds - 1:>+7.0%}")
    lines += [f"fit {note}" for note in notes]
    world = [p for p in points if p.tier == "world"]
    if world and any(p.tier == "node" for p in points):
        lines.append(f"world tier (not fitted) against the fitted model: median |error| "
                     f"{_median_error(world, fitted):.0%} over {len(world)} points")
    name, net = base
    lines.append(f"the {name} table's network (before this profile) against these points: median |error| "
                 f"{_median_error(points, net):.0%}")
    return "\n".join(lines)


def _median_error(points: list[Point], net: Network) -> float:
    return statistics.median(abs(predict(p, net) / p.seconds - 1) for p in points)


def measured_table(points: list[Point]) -> dict:
    """[measured]: per tier and op, [ranks, bytes, microseconds] of each point (the planner ignores it)."""
    out: dict = {}
    for p in points:
        out.setdefault(f"{p.tier}_{p.op}", []).append([p.ranks, p.nbytes, round(p.seconds * 1e6, 2)])
    return out
