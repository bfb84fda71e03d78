"""Mixed precision: autocast for bf16/fp16, dynamic loss scaling for fp16.

Parameters and optimizer states stay fp32 in every mode; autocast runs the matmuls
in the low-precision dtype.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class LossScaler:
    """fp16 dynamic loss scaling (GradScaler) with skipped steps counted.

    Disabled (a pass-through) for fp32 and bf16, whose exponent range needs no scaling.
    """

    def __init__(self, device: torch.device, precision: str):
        self.enabled = precision == "fp16"
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.enabled)
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, opt: torch.optim.Optimizer) -> None:
        if self.enabled:
            self.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """Apply the update unless the gradients overflowed; True when it was skipped."""
        if not self.enabled:
            opt.step()
            return False
        before = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before  # the scale only drops on overflow
        self.skipped_steps += skipped
        return skipped

    def skip(self) -> None:
        """Drop this step's update (an anomaly); the scaler still closes its step."""
        if self.enabled:
            self.scaler.update()  # unscale_ recorded the overflow check update() needs

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
