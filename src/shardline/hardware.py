"""Peak dense FLOP/s of accelerators: the denominator of MFU.

The figures live in one table, `shardline.planner.hardware` (which also holds memory
and interconnect figures for the planner); this module reads the peak of the device
the trainer runs on from it. `metrics.peak_tflops` overrides it.
"""

from __future__ import annotations

import torch

from shardline.planner.hardware import GPUS, cpu_peak_tflops

# name: (substring of torch.cuda.get_device_name(), {dtype: TFLOP/s}), derived from the table.
PEAK_TFLOPS: dict[str, tuple[str, dict[str, float]]] = {
    name: (hw.marker, dict(hw.peak_tflops)) for name, hw in GPUS.items()
}

__all__ = ["PEAK_TFLOPS", "cpu_peak_tflops", "peak_tflops"]


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """Peak TFLOP/s of one device for the compute dtype, or None if unknown."""
    if device.type == "cpu":
        return cpu_peak_tflops()
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[precision]
    # Longest marker first, so that a name containing two markers picks the specific one.
    for marker, table in sorted(PEAK_TFLOPS.values(), key=lambda mt: -len(mt[0])):
        if marker and marker in name:
            return table.get(dtype)
    return None
