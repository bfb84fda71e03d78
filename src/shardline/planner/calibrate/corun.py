"""How much slower one CPU core runs while the other cores are busy too (co-run efficiency).

CPU ranks of one node share more than the core count says: the last-level cache, the
memory bandwidth and, on many cloud VMs, a physical core behind two "cores" (SMT
siblings). A single-process calibration never sees that; N training ranks on N cores
do, on every kernel. So this file times three kinds of work on this process' thread
alone, then again while `cores - 1` neighbour processes run a training-like mix
(GEMMs and streaming adds), and reports each kind's busy / alone throughput:

* corun_matmul_eff:   a 256^3 GEMM (forward and backward GEMMs, attention)
* corun_memory_eff:   a streaming add over 96 MB (norms, casts, loss, optimizer)
* corun_dispatch_eff: a chain of tiny ops (the dispatcher overhead per op)

The neighbours start once and are switched on and off by an event; alone and busy
timings alternate over a few rounds and each ratio is the median over the rounds.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import queue
import statistics
import time

import torch

from shardline.errors import ShardlineError
from shardline.planner.calibrate.ops import time_it

KINDS = ("matmul", "memory", "dispatch")


def _neighbour(busy, quit_, ready) -> None:
    """A stand-in training rank: GEMMs and streaming adds while `busy` is set."""
    torch.set_num_threads(1)
    a, big = torch.randn(384, 384), torch.randn(4 << 20)
    ready.put(True)
    while not quit_.is_set():
        if not busy.wait(0.05):
            continue
        for _ in range(4):
            a @ a
        big.add_(1.0)


def _kernels() -> dict:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x, y, out = torch.randn(8 << 20), torch.randn(8 << 20), torch.empty(8 << 20)
    tiny = torch.ones(16)

    def chain():
        t = tiny
        for _ in range(100):
            t = t * 1.0001
        return t

    return {"matmul": functools.partial(torch.mm, a, b), "memory": functools.partial(torch.add, x, y, out=out),
            "dispatch": chain}


def _wait_ready(ready, neighbours, timeout_s: float = 120.0) -> None:
    """Until each neighbour has imported torch and made its tensors; a clear error if one died."""
    deadline, waiting = time.monotonic() + timeout_s, len(neighbours)
    while waiting:
        try:
            ready.get(timeout=0.5)
            waiting -= 1
        except queue.Empty:
            dead = [p.exitcode for p in neighbours if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise ShardlineError(f"calibrate: the co-run neighbour processes did not start "
                                     f"(exit codes {dead or 'none yet'}, {timeout_s:.0f} s allowed)") from None


def measure_corun(cores: int, rounds: int = 3, clock=time.thread_time) -> dict[str, float]:
    """{kind: throughput with every core busy / throughput alone}, each at most 1.

    Timed on one thread (a rank of `threads = 1`, as the CPU validation runs); one core
    or fewer: nothing to share, every ratio is 1.
    """
    if cores <= 1:
        return dict.fromkeys(KINDS, 1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's thread; with more, thread_time would miss the pool's waits
    cpu, kernels = torch.device("cpu"), _kernels()
    ctx = mp.get_context("spawn")
    busy, quit_, ready = ctx.Event(), ctx.Event(), ctx.Queue()
    neighbours = [ctx.Process(target=_neighbour, args=(busy, quit_, ready), daemon=True) for _ in range(cores - 1)]
    for p in neighbours:
        p.start()
    ratios: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        _wait_ready(ready, neighbours)
        for _ in range(rounds):
            busy.clear()
            time.sleep(0.1)
            alone = {k: time_it(fn, cpu, budget_s=0.2, clock=clock) for k, fn in kernels.items()}
            busy.set()
            time.sleep(0.1)
            for k, fn in kernels.items():
                ratios[k].append(alone[k] / time_it(fn, cpu, budget_s=0.2, clock=clock))
    finally:
        quit_.set()
        busy.set()
        for p in neighbours:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        torch.set_num_threads(threads)
    return {k: min(1.0, statistics.median(v)) for k, v in ratios.items()}
