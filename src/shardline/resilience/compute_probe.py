"""A rank's compute speed, timed alone every `watchdog.probe_interval` steps.

Step times cannot name a rank whose GPU computes slowly (thermal throttling, a bad clock,
a degraded card): its peers wait for it inside the step's gradient collectives, so every
rank's step takes the same time. A fixed GEMM timed on each rank between steps, where no
collective runs, measures the device itself; rank 0's watchdog compares the ranks' times
like step times (resilience/stragglers.py) and reports a rank slower than
`watchdog.straggler_factor` x the others' median for `straggler_steps` probes in a row.

The GEMMs of a round run back to back between two device syncs: one GEMM of the GPU size
takes tens of microseconds, about a sync's own cost. A rank's time is its fastest round:
a preempted thread, or a background save holding the interpreter, slows some rounds of a
healthy device, while a slow device is slow in every round. The operands are made for each
probe (24 MiB on a GPU, returned to the caching allocator after it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shardline.devices import synchronize

# size x size GEMMs, bf16 on a GPU whatever train.precision is (the same work on every rank is
# what matters): a round of 10 takes ~0.4 ms at an H100's bf16 peak; fp32 on a CPU, a few ms a
# round on one core.
SIZES = {"cuda": 2048, "cpu": 128}
REPEATS = 10
ROUNDS = 3


def probe_due(step: int, interval: int) -> bool:
    """Halfway between multiples of the interval: the default save and evaluation steps (every
    50) are multiples, and a background save they start must not be timed with the GEMMs."""
    return interval > 0 and step % interval == interval // 2


def probe_seconds(device: torch.device, delay: Callable[[float], None] = lambda s: None) -> float:
    """Seconds of REPEATS GEMMs on `device` back to back, the fastest of ROUNDS. `delay`: the
    slow-rank drill's hook ([faults] slow_in="compute"), called inside each timed round with
    the seconds it took so far, as a slower device would take longer."""
    size = SIZES.get(device.type, SIZES["cpu"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.ones(size, size, device=device, dtype=dtype)
    b = torch.full((size, size), 1.0 / size, device=device, dtype=dtype)
    rounds = []
    for _ in range(ROUNDS):
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(REPEATS):
            a = a @ b  # stays all ones: no overflow, no denormals to slow a rank down
        synchronize(device)
        delay(time.perf_counter() - begin)
        rounds.append(time.perf_counter() - begin)
    return min(rounds)
