"""`shardline check`: a short test of every rank before a long job spends hours on a bad one.

Each rank multiplies the same seeded matrices and times it, then all ranks run one
all-reduce of known values and time it. Rank 0 gathers the results and names:

* faulty ranks: a product that differs from the other ranks' (bad memory or compute
  units give wrong numbers before they crash), or a wrong all-reduce sum;
* slow ranks: GEMM throughput below the other ranks' median / `slow_factor` (thermal throttling,
  a bad clock, a noisy neighbour).

Run it on its own (`torchrun ... -m shardline check`) or before training in the same
allocation. The fault drills of `[faults]` apply (slow_rank, slow_factor), so the check
can be shown to catch what it is for.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline.config import Config
from shardline.devices import synchronize
from shardline.parallel.distributed import init_distributed, pick_device

CHECK_FAILED_EXIT = 6  # a rank is faulty or slow


@dataclass
class RankResult:
    rank: int
    host: str
    tflops: float
    checksum: float
    allreduce_ok: bool
    allreduce_ms: float


def check(cfg: Config, size: int = 512, repeats: int = 5, slow_factor: float = 1.5) -> tuple[str, bool]:
    """(report, all ranks healthy) of this job's ranks; every rank calls it."""
    device = pick_device(cfg.run.device)
    proc = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", proc.local_rank)
    mine = _measure(proc.rank, device, size, repeats, cfg)
    results = [mine]
    if proc.world_size > 1:
        results = [None] * proc.world_size
        dist.all_gather_object(results, mine)
    return _verdict(results, slow_factor)


def _measure(rank: int, device: torch.device, size: int, repeats: int, cfg: Config) -> RankResult:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)  # the same matrices on every rank
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    product = a @ b  # warm-up, and the value every rank must agree on
    times = []
    for _ in range(repeats):
        synchronize(device)
        begin = time.perf_counter()
        product = a @ b
        synchronize(device)
        seconds = time.perf_counter() - begin
        if rank == cfg.faults.slow_rank and cfg.faults.slow_factor > 1:  # the drill of [faults]
            time.sleep(seconds * (cfg.faults.slow_factor - 1))
            seconds *= cfg.faults.slow_factor
        times.append(seconds)
    tflops = 2 * size**3 / statistics.median(times) / 1e12
    ok, ms = _allreduce(rank, device)
    return RankResult(rank, socket.gethostname(), tflops, float(product.float().sum()), ok, ms)


def _allreduce(rank: int, device: torch.device) -> tuple[bool, float]:
    if not dist.is_initialized():
        return True, 0.0
    world = dist.get_world_size()
    t = torch.full((1 << 18,), float(rank + 1), device=device)  # 1 MB of known values
    synchronize(device)
    begin = time.perf_counter()
    dist.all_reduce(t)
    synchronize(device)
    ms = 1e3 * (time.perf_counter() - begin)
    return bool((t == world * (world + 1) / 2).all()), ms



def _verdict(results: list[RankResult], slow_factor: float) -> tuple[str, bool]:
    """Each rank against the others: its GEMM result against the majority's (a tie names no
    culprit: every rank off a shared top count is wrong-or-right, said as such), its speed
    against the median of the other ranks (with itself in it, a slow rank of two would
    have to be twice as slow as `slow_factor` says)."""
    counts = Counter(r.checksum for r in results)
    (majority, top), *rest = counts.most_common()
    tied = bool(rest) and rest[0][1] == top
    lines = [f"{'rank':>4}  {'host':<20} {'GEMM TFLOP/s':>12} {'all-reduce ms':>13}  verdict"]
    healthy = True
    for r in results:
        problems = []
        if tied and counts[r.checksum] == top:
            problems.append(f"GEMM results disagree with no majority ({r.checksum:.6g} here): one of the tied "
                            "ranks is wrong")
        elif r.checksum != majority:
            problems.append(f"wrong GEMM result ({r.checksum:.6g}, the others {majority:.6g})")
        if not r.allreduce_ok:
            problems.append("wrong all-reduce sum")
        others = [o.tflops for o in results if o is not r]
        median = statistics.median(others) if others else r.tflops
        if r.tflops < median / slow_factor:
            problems.append(f"slow: {r.tflops / median:.2f}x the median GEMM throughput of the other ranks")
        healthy = healthy and not problems
        lines.append(f"{r.rank:>4}  {r.host:<20} {r.tflops:>12.3f} {r.allreduce_ms:>13.2f}  "
                     + ("; ".join(problems) or "ok"))
    summary = "all ranks ok" if healthy else "FAILED: " + ", ".join(
        f"rank {r.rank}" for r, line in zip(results, lines[1:]) if not line.endswith("ok"))
    return "\n".join([f"shardline check: {len(results)} rank(s), {summary}", *lines]), healthy
