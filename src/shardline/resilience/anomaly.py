"""Anomaly detection: non-finite loss or gradient norm, and loss spikes.

Two checks with one interface: `gate(step, loss, grad_norm)` judges a step and
records a healthy loss, `drain()` returns the anomalies not yet reported, and
`on_device` says which kind it is. AnomalyDetector (here) reads the values on the host
and answers at once; DeviceAnomalyCheck (device_anomaly.py) keeps the verdict on the
device, where it gates the optimizer, and reports when drained. `build_anomaly_check`
picks one.

A spike is a loss whose robust z-score against the recent healthy losses exceeds
anomaly.spike_zscore: (loss - median) / (1.4826 * MAD), the median absolute deviation
scaled to match a standard deviation for normal data (floored at 1e-3 x |median|: a flat
history would make every wiggle a spike). Median and MAD ignore the
outliers they are meant to find, unlike a mean and standard deviation. Only upward
jumps count: a sudden drop in loss is not an anomaly.
"""

from __future__ import annotations

import math
from collections import deque

from shardline.config.resilience import AnomalyConfig
from shardline.errors import ConfigError
from shardline.resilience.device_anomaly import DeviceAnomalyCheck


class AnomalyDetector:
    on_device = False

    def __init__(self, cfg: AnomalyConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)

    def check(self, loss: float, grad_norm: float) -> tuple[str, float] | None:
        """(kind, value) of the anomaly in this step, or None when the step is healthy."""
        if not math.isfinite(loss):
            return "nonfinite_loss", loss
        if not math.isfinite(grad_norm):
            return "nonfinite_grad_norm", grad_norm
        z = self.zscore(loss)
        if self.cfg.spike_zscore and z is not None and z > self.cfg.spike_zscore:
            return "loss_spike", z
        return None

    def gate(self, step: int, loss: float, grad_norm: float) -> tuple[str, float] | None:
        """check(), and a healthy loss joins the history; the caller acts on the anomaly at once."""
        found = self.check(loss, grad_norm)
        if found is None:
            self.accept(loss)
        return found

    def drain(self) -> list[dict]:
        """Nothing is pending: the host check reports each anomaly when gate() returns it."""
        return []

    def zscore(self, loss: float) -> float | None:
        if len(self.history) < self.cfg.min_history:
            return None
        values = sorted(self.history)
        median = _median(values)
        mad = _median(sorted(abs(v - median) for v in values))
        # A floor on the spread: a perfectly flat history would make every wiggle a spike.
        scale = max(1.4826 * mad, 1e-3 * abs(median), 1e-8)
        return (loss - median) / scale

    def accept(self, loss: float) -> None:
        """Record a healthy step's loss."""
        self.history.append(loss)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state.get("history", []), maxlen=self.cfg.window)


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


def build_anomaly_check(cfg, layout, optimizer, device):
    """The check this run uses: on the device when possible and wanted, else on the host."""
    if check_on_device(cfg, layout, bool(optimizer.defaults.get("fused")), device.type == "cuda"):
        return DeviceAnomalyCheck(cfg.anomaly, device)
    return AnomalyDetector(cfg.anomaly)


def check_on_device(cfg, layout, fused: bool, on_cuda: bool) -> bool:
    """Whether to check on the device (see device_anomaly.py); ConfigError when asked for and impossible.

    The verdict gates the update through the fused AdamW kernel, so it needs: action
    skip, the fused optimizer, no fp16 loss scaler (it owns that gate), and plain
    tensors (DTensor parameters of FSDP2 / TP are not gated that way yet). `auto`
    takes it on GPUs, where a host sync per step costs throughput.
    """
    a = cfg.anomaly
    blockers = [why for why, blocked in (
        ("anomaly.action is not skip", a.action != "skip"),
        ("the optimizer is not fused (optim.implementation)", not fused),
        ("train.precision=fp16 (its loss scaler gates the update)", cfg.train.precision == "fp16"),
        ("parameters are DTensors (dp_shard x cp > 1 with zero >= 2, CPU offload, or tp)",
         (layout.dp_shard * layout.cp > 1 and layout.zero >= 2) or layout.offload_fsdp or layout.tp > 1),
    ) if blocked]
    if a.check_on == "device" and blockers:
        raise ConfigError("anomaly.check_on='device' is not possible here: " + "; ".join(blockers))
    return a.check_on == "device" or (a.check_on == "auto" and not blockers and on_cuda)
