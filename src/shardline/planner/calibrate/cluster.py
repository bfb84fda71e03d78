"""`shardline comm-bench`: the job's collectives measured where they run (under torchrun).

The planner prices every collective with an alpha-beta model over two links: inside a node
([network] intra_latency_us, intra_bw_gbs) and across nodes (each device's share of its node's
network: inter_latency_us, inter_bw_gbs). Its table holds datasheet guesses; this measures the
cluster a job was given and writes the figures as a profile `plan` and `estimate` take.

Every rank takes part. Groups come in tiers, all groups of a tier timed at once, as a job runs them:
* node:  the ranks of one node, every node at once: the link inside a node;
* rail:  one rank of each node, of the same local index, every index at once: each device's share
         of its node's network while every device uses it (what inter_bw_gbs means);
* world: every rank: the two-level path a job-wide all-reduce takes.
On one node the world is the node tier; with one rank per node it is the rail tier.

A point (tier, op, size) is `rounds` rounds of `iters` back-to-back calls between two device
syncs, each round begun at a barrier of the whole job. A round takes as long as its slowest rank
(a collective ends when its last rank does); the point is the median round. Sizes and bandwidths
are nccl-tests': the size is a rank's buffer for all-reduce and all-to-all and the whole gathered
buffer for all-gather and reduce-scatter; algbw = size / time; busbw = algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for the others: the rate a link ran at, comparable across group sizes.
Each op's result is checked on known values (int32, sums bounded: exact at any world size) at
the smallest and the largest size: a wrong one names the tier, op, size and ranks (exit code 6,
as `shardline check`).

Slow groups (slow_groups): per tier, a group whose time at the tier's largest size is over
--slow-factor x the median of the tier's groups is named (a round of a group lasts as long as its
slowest member): a slow link inside a node shows in its node tiers, a slow network port in its
rail; a rank both in the smallest slow group inside its node and in a slow rail is named as likely
the rank itself. Said in the report; the exit code stays.

The points are fitted to the planner's links and reported by cluster_fit.py.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline.devices import synchronize
from shardline.errors import ConfigError
from shardline.planner.calibrate.cluster_fit import Point, fit_links, human, is_subnode, measured_table, report
from shardline.planner.hardware import Network
from shardline.resilience.health import CHECK_FAILED_EXIT

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
WARMUP = 2  # calls before a point's rounds (NCCL sets up a group's channels on first use)
# torch 2.13 renamed these two (the old names warn there); 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def node_key() -> str:
    """This rank's node: torchrun's node rank (GROUP_RANK; one host may run several agents), else
    Slurm's node id, else the host name."""
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return socket.gethostname()


def tiers(keys: list[str]) -> dict[str, list[list[int]]]:
    """The groups of each tier (lists of ranks) from every rank's node key, in rank order: first
    "node2", "node4", ...: groups of that many neighbouring ranks inside each node, for every power
    of two below the node's rank count that divides it (the tp and small groups the planner
    prices by their size: latency_by_world_us), then node, rail and world (module doc)."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    groups = list(nodes.values())
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        raise ConfigError(f"nodes run different numbers of ranks ({', '.join(map(str, sizes))}): the planner's "
                          "model has equal nodes; launch the same --nproc_per_node on every node")
    out, k = {}, 2
    while k < sizes[0]:
        if sizes[0] % k == 0:
            out[f"node{k}"] = [g[i:i + k] for g in groups for i in range(0, len(g), k)]
        k *= 2
    if len(groups) > 1 and sizes[0] > 1:
        out["node"] = groups
        out["rail"] = [[g[i] for g in groups] for i in range(sizes[0])]
    out["world"] = [list(range(len(keys)))]
    return out


@dataclass(frozen=True)
class Measured:
    points: list[Point]
    wrong: list[str]  # a line per collective that gave a wrong result
    nodes: int
    per_node: int
    every: torch.Tensor  # [rank, point, round] seconds a call
    layout: dict[str, list[list[int]]]  # the groups of each tier


def bench(device: torch.device, sizes: list[int], ops: list[str], rounds: int, iters: int,
          drill: tuple[int, float] | None = None, subnode: bool = True) -> Measured:
    """Measure every tier, op and size (every rank calls it, in a process group of >= 2 ranks);
    every rank gets the same result. `drill` (rank, seconds): that rank waits so long before each
    timed call, as a slow device or link would hold its groups (to see the report name it).
    `subnode`: also the groups smaller than a node (node2, node4, ...)."""
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, node_key())
    layout = {t: g for t, g in tiers(keys).items() if subnode or not is_subnode(t)}
    nodes = len(set(keys))
    per_node = len(keys) // nodes
    rank, plan, checks = dist.get_rank(), [], []
    delay = drill[1] if drill and drill[0] == rank else 0.0
    for name, lists in layout.items():
        group = None if name == "world" else dist.new_subgroups_by_enumeration(lists)[0]
        mine = next(g for g in lists if rank in g)
        n, me = len(mine), mine.index(rank)
        for op in ops:
            for nbytes in sizes:
                numel = max(n, nbytes // 4 // n * n)
                fn = _call(op, numel, n, device, group)
                on_node = 1 if name == "rail" else (per_node if name == "world" else n)  # a group's on one node
                plan.append((name, op, n, on_node, 4 * numel, _time(fn, device, rounds, iters, delay)))
            for nbytes in sorted({sizes[0], sizes[-1]}):
                numel = max(n, nbytes // 4 // n * n)
                checks.append((f"{name} {op} at {4 * numel} bytes", _verify(op, numel, n, me, device, group)))
    mine_t = torch.tensor([p[-1] for p in plan], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine_t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine_t)
    every = torch.stack(every).view(dist.get_world_size(), len(plan), rounds).cpu()  # [rank, point, round]
    slowest = every.max(dim=0).values.tolist()  # each round: its slowest rank
    points = [Point(*p[:-1], statistics.median(t)) for p, t in zip(plan, slowest)]
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, [ok for _, ok in checks])
    wrong = [f"{what}: wrong result on rank(s) {', '.join(str(r) for r, v in enumerate(verdicts) if not v[i])}"
             for i, (what, _) in enumerate(checks) if not all(v[i] for v in verdicts)]
    return Measured(points, wrong, nodes, per_node, every, layout)


def slow_groups(points: list[Point], every: torch.Tensor, layout: dict[str, list[list[int]]],
                factor: float) -> list[str]:
    """Groups whose time at their tier's largest size is over `factor` x the median of the tier's
    groups (of the other one, where a tier has two): a round of a group lasts as long as its
    slowest member. Then the ranks both in the smallest slow group inside a node and in a slow
    rail: the rank itself (its GPU or host) rather than one link, which a slow group of one kind
    alone points at (NVLink or PCIe inside the node, the network port across nodes)."""
    if not factor:
        return []
    lines, inside, across = [], [], set()
    for i, p in enumerate(points):
        groups = layout[p.tier]
        if len(groups) < 2 or p.nbytes != max(q.nbytes for q in points if q.tier == p.tier):
            continue
        times = [statistics.median(every[g, i, :].max(dim=0).values.tolist()) for g in groups]
        typical = statistics.median(times)
        for j, t in enumerate(times):
            others = times[1 - j] if len(times) == 2 else typical
            if t > factor * others:
                lines.append(f"slow: {p.tier} group of ranks {_ranks(groups[j])}: {p.op} at {human(p.nbytes)} "
                             f"took {t / others:.1f}x the median of the tier's groups")
                if p.tier == "rail":
                    across.update(groups[j])
                elif p.tier.startswith("node"):
                    inside.append(groups[j])
    smallest = min(map(len, inside), default=0)
    both = sorted({r for g in inside if len(g) == smallest for r in g} & across)
    if both:
        lines.append(f"slow: rank(s) {_ranks(both)} in a slow group inside its node and in a slow rail: the rank "
                     "itself (its GPU or host) more likely than one link")
    return lines


def _ranks(ranks: list[int]) -> str:
    """0-7 for a run of ranks, else 0,8,16 (the first 8, then how many more)."""
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    head = ",".join(map(str, ranks[:8]))
    return head + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")


def _call(op: str, numel: int, n: int, device: torch.device, group):
    """The timed call of `op` on buffers of `numel` elements (zeros: sums stay finite and normal)."""
    inp = torch.zeros(numel // n if op == "all_gather" else numel, device=device)
    out = inp if op == "all_reduce" else torch.zeros(numel // n if op == "reduce_scatter" else numel, device=device)
    return lambda: _collective(op, out, inp, group)


def _collective(op: str, out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """One call of `op` from `inp` into `out` (an all-reduce in place: `out` is `inp`)."""
    if op == "all_reduce":
        dist.all_reduce(inp, group=group)
    elif op == "all_gather":
        _ALL_GATHER(out, inp, group=group)
    elif op == "reduce_scatter":
        _REDUCE_SCATTER(out, inp, group=group)
    else:
        dist.all_to_all_single(out, inp, group=group)


def _time(fn, device: torch.device, rounds: int, iters: int, delay: float = 0.0) -> list[float]:
    """Seconds per call of each round (module doc); `delay`: the drill's wait before each call."""
    for _ in range(WARMUP):
        fn()
    synchronize(device)
    out = []
    for _ in range(rounds):
        dist.barrier()  # the whole job's: every group of the tier starts together
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            if delay:
                time.sleep(delay)
            fn()
        synchronize(device)
        out.append((time.perf_counter() - start) / iters)
    return out


def expected(op: str, numel: int, n: int, me: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """What `op` leaves on group rank `me` from the values `inputs` gives every rank."""
    chunk = numel // n
    index = torch.arange(n, dtype=torch.int32, device=device)
    if op == "all_reduce":
        return torch.full((numel,), sum(r % 7 + 1 for r in range(n)), dtype=torch.int32, device=device)
    if op == "all_gather":
        return index.repeat_interleave(chunk)
    if op == "reduce_scatter":
        return torch.full((chunk,), sum((me + r) % 7 for r in range(n)), dtype=torch.int32, device=device)
    return (index * n + me).repeat_interleave(chunk)  # all_to_all: chunk i came from rank i


def inputs(op: str, numel: int, n: int, me: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Group rank `me`'s input to `op`: int32, and sums bounded by 7 a rank, so exact at any world size
    (rank ids themselves only where nothing is summed)."""
    chunk = numel // n
    index = torch.arange(n, dtype=torch.int32, device=device)
    if op == "all_reduce":
        return torch.full((numel,), me % 7 + 1, dtype=torch.int32, device=device)
    if op == "all_gather":
        return torch.full((chunk,), me, dtype=torch.int32, device=device)
    if op == "reduce_scatter":
        return ((index + me) % 7).repeat_interleave(chunk)  # chunk j goes to rank j
    return (me * n + index).repeat_interleave(chunk)  # all_to_all: chunk j goes to rank j


def _verify(op: str, numel: int, n: int, me: int, device: torch.device, group) -> bool:
    """One call of `op` on known values; whether this rank got what it should."""
    x = inputs(op, numel, n, me, device)
    want = expected(op, numel, n, me, device)
    out = x if op == "all_reduce" else torch.empty_like(want)
    _collective(op, out, x, group)
    return bool(torch.equal(out, want))


def parse_size(text: str, what: str) -> int:
    """Bytes from "4096", "64K", "1M" or "2G" (powers of 1024); ConfigError naming `what` otherwise."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    body, unit = (text[:-1], units[text[-1].upper()]) if text[-1:].upper() in units else (text, 1)
    try:
        value = int(body) * unit
    except ValueError:
        value = 0
    if value < 4:
        raise ConfigError(f"{what} {text!r} is not a size in bytes of at least 4 (e.g. 4096, 64K, 1M, 2G)")
    return value


def sizes_between(low: int, high: int, factor: int) -> list[int]:
    """low, low x factor, ... up to high (and high itself)."""
    if low > high:
        raise ConfigError(f"--min-size {low} is above --max-size {high}")
    if factor < 2:
        raise ConfigError(f"--factor {factor} must be >= 2")
    out = [low]
    while out[-1] * factor <= high:
        out.append(out[-1] * factor)
    return out if out[-1] == high else [*out, high]


def run(device: torch.device, sizes: list[int], ops: list[str], rounds: int, iters: int, *,
        base: tuple[str, Network], slow_factor: float = 1.5, drill: tuple[int, float] | None = None,
        subnode: bool = True) -> tuple[int, dict | None, str | None]:
    """Measure (every rank), then on rank 0 fit and word the report: (exit code, the profile's
    [network] and [measured] tables, the report); other ranks get (exit code, None, None)."""
    m = bench(device, sizes, ops, rounds, iters, drill, subnode)
    code = CHECK_FAILED_EXIT if m.wrong else 0
    if dist.get_rank() != 0:
        return code, None, None
    whole = device.type != "cuda" or m.per_node == torch.cuda.device_count()  # every GPU of a node ran
    fields, notes = fit_links(m.points, base[1], m.nodes, m.per_node, whole_nodes=whole)
    head = (f"shardline comm-bench: {m.nodes * m.per_node} ranks, {m.nodes} node(s) x {m.per_node} "
            f"({dist.get_backend()}, {device.type}), float32, a point the median of {rounds} rounds of {iters} calls, "
            "each round its slowest rank's")
    slow = slow_groups(m.points, m.every, m.layout, slow_factor)
    text = "\n".join([report(m.points, notes, dataclasses.replace(base[1], **fields), base, head), *slow])
    if m.wrong:
        text += "\nFAILED: " + "; ".join(m.wrong)
    return code, {"network": fields, "measured": measured_table(m.points)}, text
