"""Failure model: unexpected interruptions by root cause, plus planned maintenance.

Defaults come from the Llama 3 paper (Dubey et al. 2024, arXiv:2407.21783, §3.3.4 and
Table 5): a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (Grand
Teton servers, 8 GPUs each) saw 466 job interruptions, 47 planned and 419 unexpected.
Each Table 5 count becomes a rate per unit-hour:

    rate = count / (54 days * 24 h * units),  units = 16,384 GPUs or 2,048 nodes

so that a job of G GPUs on G/gpus_per_node nodes sees `rate * units` interruptions per
hour. GPU and software causes scale with GPUs, host and network causes with nodes.
(Table 5 prints 30.1% for "Faulty GPU" although 148/419 = 35.3%; the counts sum to 419,
so we use the counts.)

`memory_ok` says whether an in-memory checkpoint (held in host RAM and replicated to a
peer node, outside the training process) survives the failure: true for failures that
take out one node or only the training processes; false for network switches (a ToR
switch serves two servers) and for silent data corruption (the snapshot may be bad).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardline.config import reader
from shardline.errors import ConfigError

LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16384
LLAMA3_GPUS_PER_NODE = 8
LLAMA3_PLANNED = 47


@dataclass(frozen=True)
class Cause:
    name: str
    label: str  # the paper's component name
    count: int  # Llama 3 Table 5 count in 54 days
    unit: str  # "gpu" or "node": what the rate is counted per
    memory_ok: bool  # an in-memory checkpoint on a peer survives it
    hardware: bool  # confirmed or suspected hardware (the paper's ~78%)


# Llama 3 Table 5, in the paper's order.
LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("faulty_gpu", "Faulty GPU", 148, "gpu", True, True),
    Cause("gpu_hbm3", "GPU HBM3 memory", 72, "gpu", True, True),
    Cause("software_bug", "Software bug", 54, "gpu", True, False),
    Cause("network", "Network switch/cable", 35, "node", False, False),
    Cause("host_maintenance", "Host maintenance (unplanned)", 32, "node", True, True),
    Cause("gpu_sram", "GPU SRAM memory", 19, "gpu", True, True),
    Cause("gpu_system_processor", "GPU system processor", 17, "gpu", True, True),
    Cause("nic", "NIC", 7, "node", True, True),
    Cause("nccl_watchdog", "NCCL watchdog timeouts", 7, "gpu", True, False),
    Cause("silent_data_corruption", "Silent data corruption", 6, "gpu", False, True),
    Cause("gpu_thermal", "GPU thermal interface + sensor", 6, "gpu", True, True),
    Cause("ssd", "SSD", 3, "node", True, True),
    Cause("power_supply", "Power supply", 3, "node", True, True),
    Cause("server_chassis", "Server chassis", 2, "node", True, True),
    Cause("io_expansion_board", "IO expansion board", 2, "node", True, True),
    Cause("dependency", "Dependency", 2, "gpu", True, False),
    Cause("cpu", "CPU", 2, "node", True, True),
    Cause("system_memory", "System memory", 2, "node", True, True),
)


def _llama3_rate(cause: Cause) -> float:
    units = LLAMA3_GPUS if cause.unit == "gpu" else LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE
    return cause.count / (LLAMA3_DAYS * 24.0 * units)


@dataclass(frozen=True)
class FailureModel:
    """Rates per unit-hour by cause (unit: GPU or node), a global scale, planned events."""

    rates: dict[str, float] = field(default_factory=lambda: {c.name: _llama3_rate(c) for c in LLAMA3_CAUSES})
    scale: float = 1.0  # multiplies every unexpected rate (what-if: a flakier cluster)
    planned_per_day: float = LLAMA3_PLANNED / LLAMA3_DAYS  # job-level, not scaled by size

    def causes(self) -> tuple[Cause, ...]:
        return LLAMA3_CAUSES

    def job_rates_per_hour(self, gpus: int, gpus_per_node: int) -> dict[str, float]:
        """Interruptions per hour of this job, by cause."""
        nodes = gpus // gpus_per_node
        return {c.name: self.scale * self.rates[c.name] * (gpus if c.unit == "gpu" else nodes)
                for c in LLAMA3_CAUSES}

    def per_gpu_hour(self, gpus_per_node: int) -> float:
        """All unexpected causes as one rate per GPU-hour (node causes spread over its GPUs)."""
        return sum(self.scale * self.rates[c.name] / (1 if c.unit == "gpu" else gpus_per_node)
                   for c in LLAMA3_CAUSES)

    def with_updates(self, table: dict[str, Any], where: str) -> FailureModel:
        """Apply a `[failures]` table: `scale`, `planned_per_day`, or a cause name = rate.

        Cause names sit at the table's top level (`faulty_gpu = 0`) for brevity; they go to `rates`.
        """
        valid = ["scale", "planned_per_day", *self.rates]
        for key, value in table.items():
            if key not in valid:
                raise ConfigError(f"{where}.{key} is not a failure setting; valid keys: {', '.join(valid)}")
            _non_negative(value, f"{where}.{key}")
        rates = {k: v for k, v in table.items() if k in self.rates}
        return reader.updated(self, {**{k: v for k, v in table.items() if k not in rates}, "rates": rates}, where)


def _non_negative(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} must be a number (a rate per unit-hour, or a factor)")
    if value < 0:
        raise ConfigError(f"{key}={value} must be >= 0")
    return float(value)
