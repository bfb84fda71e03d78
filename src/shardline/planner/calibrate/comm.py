"""Collective bandwidth and latency of the active backend (gloo on CPU) between local processes.

Spawns `world` processes with torch.multiprocessing, each joining a gloo group over
127.0.0.1 (a fresh TCP port per world size); rank 0 times all-reduce and all-gather
at 4 KiB - 4 MiB (all-reduce, all-gather and reduce-scatter, the calls DDP and FSDP2 make)
and writes, per point, the median over 3 sweeps of the fastest of 5 repetitions to a
file the parent reads. The points are
fitted to the ring model of planner/comm.py,

    all_reduce: t = 2(n-1)·alpha + 2(n-1)/n · S/B      all_gather, reduce_scatter: t = (n-1)·alpha + (n-1)/n · S/B

by least squares on (steps, bytes moved) -> seconds, giving the profile's
intra_latency_us (alpha) and intra_bw_gbs (B, with bw_efficiency = 1), over all world
sizes and per world size (latency_by_world_us, bw_by_world_gbs; planner/comm.py uses the entry of
a group's size, or of the nearest smaller world size measured). One fit serves all three
ops, which gloo does not run equally well (its reduce-scatter is the slow one), so each
op also gets op_factor: the median over its points of measured time over the planner's price
under the fit of its world size (which for an all-reduce takes the faster of ring and tree).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardline.errors import ShardlineError
from shardline.planner import comm
from shardline.planner.hardware import Network

SIZES = (4096, 65536, 1 << 20, 4 << 20)
REPS, ROUNDS = 5, 3  # each point: the median over ROUNDS sweeps of the fastest of REPS calls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    # all_gather_into_tensor warns of a rename in newer torch; the name works on 2.11 and 2.13.
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        timings: dict = {}
        for _ in range(ROUNDS):  # whole sweeps, so a busy moment hits one round of a few points
            for nbytes in SIZES:
                x = torch.ones(nbytes // 4)
                gathered = torch.empty(world * (nbytes // 4 // world))
                piece = torch.ones(nbytes // 4 // world)
                for name, fn, args in (("all_reduce", dist.all_reduce, (x,)),
                                       ("all_gather", dist.all_gather_into_tensor, (gathered, piece)),
                                       ("reduce_scatter", dist.reduce_scatter_tensor, (piece, gathered))):
                    timings.setdefault((name, nbytes), []).append(_fastest(fn, args))
        results = [{"op": name, "world": world, "bytes": nbytes, "seconds": statistics.median(times)}
                   for (name, nbytes), times in timings.items()]
        if rank == 0:
            Path(out).write_text(json.dumps(results), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def _fastest(fn, args: tuple) -> float:
    """Fastest of REPS calls after a warm-up, each started together by a barrier."""
    fn(*args)
    times = []
    for _ in range(REPS):
        dist.barrier()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def _run(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "points.json")
        try:
            mp.spawn(_worker, args=(world, _free_port(), out), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException, RuntimeError, OSError) as e:
            raise ShardlineError(f"calibrate: gloo measurement with {world} processes failed: {e}") from None
        return json.loads(Path(out).read_text(encoding="utf-8"))


def _ring_terms(p: dict) -> tuple[float, float]:
    """(latency steps, bytes moved per rank) of one measured point in the ring model."""
    n, k = p["world"], 2 if p["op"] == "all_reduce" else 1
    return k * (n - 1), k * (n - 1) / n * p["bytes"]


def fit_alpha_beta(points: list[dict]) -> tuple[float, float]:
    """Least squares of t = steps·alpha + volume/B over the points: (alpha s, B bytes/s), each held
    to a floor (a time that does not grow with size gives 1e12 B/s: see seconds_per_byte)."""
    alpha, inv_bw = _least_squares(points)
    return max(alpha, 1e-7), 1.0 / max(inv_bw, MIN_SECONDS_PER_BYTE)


MIN_SECONDS_PER_BYTE = 1e-12  # the fit's floor: 1000 GB/s, past any link's


def seconds_per_byte(points: list[dict]) -> float:
    """The fit's 1/B before its floor (MIN_SECONDS_PER_BYTE or below where the times do not grow
    with the size: noise)."""
    return _least_squares(points)[1]


def _least_squares(points: list[dict]) -> tuple[float, float]:
    rows = [(*_ring_terms(p), p["seconds"]) for p in points]
    # Normal equations of the 2-parameter model, weighted by 1/t so small messages count.
    saa = sum(a * a / t ** 2 for a, _, t in rows)
    sab = sum(a * b / t ** 2 for a, b, t in rows)
    sbb = sum(b * b / t ** 2 for _, b, t in rows)
    sat = sum(a / t for a, _, t in rows)
    sbt = sum(b / t for _, b, t in rows)
    det = saa * sbb - sab * sab
    return (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det


def measure_collectives(world_sizes=(2, 4)) -> tuple[dict, dict]:
    """([network] fields for the profile, the raw points by op: [world, bytes, microseconds]).

    Besides one fit over all world sizes (intra_latency_us, intra_bw_gbs), each world size
    gets its own (latency_by_world_us, bw_by_world_gbs): CPU processes that outnumber the
    cores wait to be scheduled at every ring step, so alpha grows with the world size
    faster than the model's (n-1) steps alone.
    """
    points = [p for world in world_sizes for p in _run(world)]
    raw = {op: [[p["world"], p["bytes"], round(p["seconds"] * 1e6, 1)] for p in points if p["op"] == op]
           for op in ("all_reduce", "all_gather", "reduce_scatter")}
    return network_fields(points), raw


def network_fields(points: list[dict]) -> dict:
    """The [network] fields of measured points (dicts of op, world, bytes, seconds): the shared fit,
    each world size's, and each op's factor: the median of its time over the planner's own price
    under its world size's fit, which the planner multiplies (for an all-reduce the faster of ring
    and tree, not the ring alone)."""
    alpha, bw = fit_alpha_beta(points)
    network = {"intra_latency_us": alpha * 1e6, "intra_bw_gbs": bw / 1e9, "bw_efficiency": 1.0,
               "latency_by_world_us": {}, "bw_by_world_gbs": {}}
    fits = {}
    for world in sorted({p["world"] for p in points}):
        fits[world] = fit_alpha_beta([p for p in points if p["world"] == world])
        network["latency_by_world_us"][str(world)] = fits[world][0] * 1e6
        network["bw_by_world_gbs"][str(world)] = fits[world][1] / 1e9
    network["op_factor"] = op_factors(points, fits)
    return network


def op_factors(points: list[dict], fits: dict[int, tuple[float, float]]) -> dict[str, float]:
    """Each op's median time over the planner's price for it under its world size's (alpha s, B
    bytes/s) fit."""
    ratios: dict[str, list[float]] = {}
    for p in points:
        a, b = fits[p["world"]]
        fitted = Network(intra_latency_us=a * 1e6, intra_bw_gbs=b / 1e9, bw_efficiency=1.0)
        price = getattr(comm, p["op"])(p["bytes"], comm.Group(p["world"], p["world"]), fitted)[0]
        ratios.setdefault(p["op"], []).append(p["seconds"] / price)
    return {op: statistics.median(r) for op, r in ratios.items()}
