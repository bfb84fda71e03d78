"""A rank's compute speed, timed alone every `watchdog.probe_interval` steps.

Step times cannot name a rank whose GPU computes slowly (thermal throttling, a bad clock,
a degraded card): its peers wait for it inside the step's gradient collectives, so every
rank's step takes the same time. A fixed GEMM timed on each rank between steps, where no
collective runs, measures the device itself; rank 0's watchdog compares the ranks' times
like step times (resilience/stragglers.py) and reports a rank slower than
`watchdog.straggler_factor` x the others' median for `straggler_steps` probes in a row.

The GEMMs of a round run back to back between two device syncs: one GEMM of the GPU size
takes tens of microseconds, about a sync's own cost. The operands are made for each probe and freed after
it (24 MiB on a GPU), so a run near its memory limit holds nothing for it between probes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# size x size GEMMs in the device's training dtype: a round of 10 takes ~0.4 ms at an H100's bf16
# peak for the GPU size, a few ms on one CPU core for the CPU's (fp32).
SIZES = {"cuda": 2048, "cpu": 128}
REPEATS = 10
ROUNDS = 3


def probe_seconds(device: torch.device, slowed: Callable[[float], float] = lambda s: s) -> float:
    """Seconds of REPEATS GEMMs on `device` back to back, the median of ROUNDS (a preempted
    thread or a stray host task must not make a rank look slow). `slowed`: the slow-rank drill's
    hook ([faults] slow_in="compute"), which sleeps the extra time and returns it added."""
    size = SIZES.get(device.type, SIZES["cpu"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.ones(size, size, device=device, dtype=dtype)
    b = torch.full((size, size), 1.0 / size, device=device, dtype=dtype)
    rounds = []
    for _ in range(ROUNDS):
        _sync(device)
        begin = time.perf_counter()
        for _ in range(REPEATS):
            a = a @ b  # stays all ones: no overflow, no denormals to slow a rank down
        _sync(device)
        rounds.append(time.perf_counter() - begin)
    return slowed(statistics.median(rounds))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
