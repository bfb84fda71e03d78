"""Optimal checkpoint intervals: Young (1974) and Daly (2006).

delta is the time the job stalls per checkpoint, M the job's mean time between
(unexpected) failures; both return the compute time between checkpoints.

    Young:  tau = sqrt(2 delta M)
    Daly:   tau = sqrt(2 delta M) [1 + 1/3 sqrt(delta / 2M) + 1/9 (delta / 2M)] - delta,  delta < 2M
            tau = M,                                                                    delta >= 2M
"""

from __future__ import annotations

import math


def young_interval_s(delta_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    if math.isinf(mtbf_s):
        return math.inf
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def optimal_interval_s(mode: str, stall_s: float, write_s: float, mtbf_s: float) -> float:
    """Daly's optimum for the stall of this mode.

    An async checkpoint cannot usefully come more often than its background write
    takes (the next snapshot would wait for it), so async is held at >= write_s.
    Memory mode persists only every few snapshots, so it is not held back.
    """
    tau = daly_interval_s(stall_s, mtbf_s)
    return max(tau, write_s) if mode == "async" else tau
