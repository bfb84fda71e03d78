"""Peak dense FLOP/s of accelerators: the denominator of MFU.

Datasheet figures for dense (not sparse) math, per device, in TFLOP/s. The planner
(issue 4) extends this table with memory and interconnect figures; the trainer only
needs the peak. `metrics.peak_tflops` overrides it.
"""

from __future__ import annotations

import os

import torch

# name: (substring of torch.cuda.get_device_name(), {dtype: TFLOP/s})
PEAK_TFLOPS: dict[str, tuple[str, dict[str, float]]] = {
    "h200": ("H200", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    "h100-sxm": ("H100", {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0}),
    "a100-80gb": ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    "b200": ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 80.0}),
    "mi300x": ("MI300X", {"bf16": 1307.0, "fp16": 1307.0, "fp8": 2615.0, "fp32": 163.4}),
}

# A CPU has no datasheet peak we can read; assume 3 GHz x 32 fp32 FLOP/cycle per core
# (two AVX2 FMA units) over the threads torch uses. It makes CPU MFU comparable
# between runs on one machine, not with GPUs.
_CPU_FLOP_PER_CYCLE, _CPU_HZ = 32, 3.0e9


def cpu_peak_tflops() -> float:
    threads = torch.get_num_threads() or os.cpu_count() or 1
    return threads * _CPU_FLOP_PER_CYCLE * _CPU_HZ / 1e12


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """Peak TFLOP/s of one device for the compute dtype, or None if unknown."""
    if device.type == "cpu":
        return cpu_peak_tflops()
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[precision]
    for marker, table in PEAK_TFLOPS.values():
        if marker in name:
            return table.get(dtype)
    return None
