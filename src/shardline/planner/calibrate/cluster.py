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

The fit (fit_network): each link's alpha and B from all-gather and reduce-scatter, as rings
(calibrate/comm.py's least squares; NCCL_ALGO=Ring pins them where a recent NCCL would run them
otherwise): the node tier's give the intra fields, the rail
tier's the inter ones; then each op's factor inside a node over the planner's own price for it
(all-reduce may run as a tree, or in the switch); bw_efficiency 1, since a measured rate is what
the library reached. The world tier is not fitted: the planner's prediction of it from the fitted
profile, printed beside each point, is a check of the two-level model on this cluster.
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
from shardline.planner import comm
from shardline.planner.calibrate.comm import fit_alpha_beta
from shardline.planner.hardware import Network

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
LINK_OPS = ("all_gather", "reduce_scatter")  # the links are fitted to these, as rings
FACTORED = ("all_reduce", "all_gather", "reduce_scatter")  # the ops the planner scales by op_factor in a node
BENCH_FAILED_EXIT = 6  # a collective gave a wrong result
WARMUP = 2  # calls before a point's rounds (NCCL sets up a group's channels on first use)
# torch 2.13 renamed these two (the old names warn there); 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


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


def bench(device: torch.device, sizes: list[int], ops: list[str], rounds: int, iters: int
          ) -> tuple[list[Point], list[str], int, int]:
    """Measure every tier, op and size (every rank calls it, in a process group of >= 2 ranks).

    Returns (the points, the wrong results found: one line each, nodes, ranks per node); every
    rank gets the same.
    """
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, node_key())
    layout = tiers(keys)
    nodes = len(set(keys))
    per_node = len(keys) // nodes
    rank, plan, checks = dist.get_rank(), [], []
    for name, lists in layout.items():
        group = None if name == "world" else dist.new_subgroups_by_enumeration(lists)[0]
        mine = next(g for g in lists if rank in g)
        n, me = len(mine), mine.index(rank)
        for op in ops:
            for nbytes in sizes:
                numel = max(n, nbytes // 4 // n * n)
                fn = _call(op, numel, n, device, group)
                on_node = 1 if name == "rail" else (per_node if name == "world" else n)  # a group's on one node
                plan.append((name, op, n, on_node, 4 * numel, _time(fn, device, rounds, iters)))
            for nbytes in sorted({sizes[0], sizes[-1]}):
                numel = max(n, nbytes // 4 // n * n)
                checks.append((f"{name} {op} at {4 * numel} bytes", _verify(op, numel, n, me, device, group)))
    times = torch.tensor([p[-1] for p in plan], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each round: its slowest rank
    points = [Point(*p[:-1], statistics.median(t)) for p, t in zip(plan, times.cpu().tolist())]
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, [ok for _, ok in checks])
    wrong = [f"{what}: wrong result on rank(s) {', '.join(str(r) for r, v in enumerate(verdicts) if not v[i])}"
             for i, (what, _) in enumerate(checks) if not all(v[i] for v in verdicts)]
    return points, wrong, nodes, per_node


def _call(op: str, numel: int, n: int, device: torch.device, group):
    """The timed call of `op` on buffers of `numel` elements (zeros: sums stay finite and normal)."""
    if op == "all_reduce":
        x = torch.zeros(numel, device=device)
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        out, piece = torch.zeros(numel, device=device), torch.zeros(numel // n, device=device)
        return lambda: _ALL_GATHER(out, piece, group=group)
    if op == "reduce_scatter":
        inp, out = torch.zeros(numel, device=device), torch.zeros(numel // n, device=device)
        return lambda: _REDUCE_SCATTER(out, inp, group=group)
    inp, out = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def _time(fn, device: torch.device, rounds: int, iters: int) -> list[float]:
    """Seconds per call of each round (module doc)."""
    for _ in range(WARMUP):
        fn()
    synchronize(device)
    out = []
    for _ in range(rounds):
        dist.barrier()  # the whole job's: every group of the tier starts together
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
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
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        _ALL_GATHER(out, x, group=group)
    elif op == "reduce_scatter":
        _REDUCE_SCATTER(out, x, group=group)
    else:
        dist.all_to_all_single(out, x, group=group)
    return bool(torch.equal(out, want))


def fit_network(points: list[Point], base: Network, nodes: int, per_node: int,
                whole_nodes: bool = True) -> tuple[dict, list[str]]:
    """The [network] fields the points give (module doc), and a line per fit saying what it used.
    Groups smaller than a node (tiers node2, node4, ...) add their own fits by size
    (latency_by_world_us, bw_by_world_gbs), beside the whole node's.

    Each link's alpha and B come from all-gather and reduce-scatter, fitted as rings (all-reduce
    may run as a tree, or in the switch); then each op's factor inside a
    node is its median time over the planner's for it under those links, all-reduce's choice of
    ring or tree included. Links not measured keep the base's effective rate (its bandwidth times
    bw_efficiency, which becomes 1 here); a measured inter rate is multiplied by the base's
    oversubscription, which the planner divides by again, so the profile predicts what was
    measured at this job's size. gpus_per_node is written only from several nodes all of whose
    devices ran (`whole_nodes`): a node run in part would tell the planner smaller nodes.
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
    smaller = sorted({p.tier for p in points if p.tier[4:].isdigit()}, key=lambda t: int(t[4:]))  # node2, ...
    by_world: dict[str, tuple[float, float]] = {}
    for link, tier in (*(("intra", t) for t in smaller), ("intra", intra), ("inter", inter)):
        chosen = [p for p in points if p.tier == tier and p.op in LINK_OPS]
        if len({p.nbytes for p in chosen}) < 2:
            notes.append(f"{link}: not measured (needs all-gather or reduce-scatter in the {tier or 'missing'} "
                         "tier at two sizes or more); the base's figures kept")
            continue
        alpha, bw = fit_alpha_beta([{"op": p.op, "world": p.ranks, "bytes": p.nbytes, "seconds": p.seconds}
                                    for p in chosen])
        notes.append(f"{link}: {alpha * 1e6:.2f} us + {bw / 1e9:.5g} GB/s from the {tier} tier "
                     f"({len(chosen)} points of {', '.join(sorted({p.op for p in chosen}))})")
        if link == "intra":
            by_world[str(chosen[0].ranks)] = (alpha * 1e6, bw / 1e9)  # the planner's fit for groups of this size
            if tier in smaller:
                continue
            fields["latency_by_world_us"] = {k: v[0] for k, v in by_world.items()}
            fields["bw_by_world_gbs"] = {k: v[1] for k, v in by_world.items()}
        fields[f"{link}_latency_us"], fields[f"{link}_bw_gbs"] = alpha * 1e6, bw / 1e9
        if link == "intra":
            plain = dataclasses.replace(base, **fields, op_factor={})
            factored = [p for p in points if p.tier == tier and p.op in FACTORED]
            fields["op_factor"] = {op: statistics.median(p.seconds / predict(p, plain) for p in factored if p.op == op)
                                   for op in FACTORED if any(p.op == op for p in factored)}
        else:
            fields["inter_bw_gbs"] *= base.oversubscription
    return fields, notes


def predict(point: Point, net: Network) -> float:
    """The planner's time (seconds) for a measured point under `net`."""
    return getattr(comm, point.op)(point.nbytes, comm.Group(point.ranks, point.per_node), net)[0]


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
                     f"{p.algbw_gbs:>11.3f} {p.busbw_gbs:>11.3f} {model * 1e6:>10.1f} {model / p.seconds - 1:>+7.0%}")
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


def run(device: torch.device, sizes: list[int], ops: list[str], rounds: int, iters: int,
        base: tuple[str, Network]) -> tuple[int, dict | None, str | None]:
    """Measure (every rank), then on rank 0 fit and word the report: (exit code, the profile's
    [network] and [measured] tables, the report); other ranks get (exit code, None, None)."""
    points, wrong, nodes, per_node = bench(device, sizes, ops, rounds, iters)
    code = BENCH_FAILED_EXIT if wrong else 0
    if dist.get_rank() != 0:
        return code, None, None
    whole = device.type != "cuda" or per_node == torch.cuda.device_count()  # every GPU of a node ran
    fields, notes = fit_network(points, base[1], nodes, per_node, whole_nodes=whole)
    head = (f"shardline comm-bench: {nodes * per_node} ranks, {nodes} node(s) x {per_node} ({dist.get_backend()}, "
            f"{device.type}), float32, a point the median of {rounds} rounds of {iters} calls, each round its "
            "slowest rank's")
    text = report(points, notes, dataclasses.replace(base[1], **fields), base, head)
    if wrong:
        text += "\nFAILED: " + "; ".join(wrong)
    return code, {"network": fields, "measured": measured_table(points)}, text
