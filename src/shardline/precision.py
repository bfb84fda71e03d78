"""Mixed precision: autocast for bf16/fp16, dynamic loss scaling for fp16.

fp8 autocasts to bf16 and has no loss scaler, exactly as bf16: its float8 matmuls
(parallel/float8.py) scale their own operands, and bf16's exponent range needs no scaling.

Parameters and optimizer states stay fp32 in every mode; autocast runs the matmuls
in the low-precision dtype.

With several ranks each one sees only part of the gradients (FSDP and TP shards,
pipeline stages), so an overflow is a verdict of all of them: the scaler's found-inf
flag is all-reduced (max) over every rank before any rank steps or skips, and DTensor
gradients are unscaled shard by shard. torch's ShardedGradScaler does the same for
FSDP1's flat parameters; FSDP2 and TP hold DTensors, and pipeline stages need the
verdict across stages too, hence the small subclass here.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # fp8: Linear layers cast to float8 themselves; the rest is bf16


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class AgreedGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow verdict every rank shares (see the module doc)."""

    def __init__(self, device: torch.device, agree: bool, **kwargs):
        super().__init__(device.type, **kwargs)
        self.agree, self.device = agree, device

    def unscale_(self, optimizer) -> None:
        if self.is_enabled() and self._scale is None:
            # A pipeline rank without the last stage never scales a loss; it still
            # unscales, checks and votes, so it creates its scale here.
            self._lazy_init_scale_growth_tracker(self.device)
        super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16 and not allow_fp16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # shares storage
                by_kind[(grad.device, grad.dtype)].append(grad)
        with torch.no_grad():
            for (device, _), grads in by_kind.items():
                found = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
                found_inf.add_(found.to(found_inf.device))
            if self.agree:  # every rank, even one whose own shards are all finite, gets the verdict
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
            found_inf.clamp_(max=1.0)
        return {found_inf.device: found_inf}


class LossScaler:
    """fp16 dynamic loss scaling (GradScaler) with skipped steps counted.

    Disabled for fp32 and bf16, whose exponent range needs no scaling. `agree`:
    several ranks, which all-reduce the overflow verdict. Data-parallel gradients are
    summed where they are reduced (parallel/data_parallel.py), so the fp16 backward of
    each rank sees exactly the values of one process: the same roundings and the same
    overflows, hence the same skipped steps in every layout.
    """

    def __init__(self, device: torch.device, precision: str, agree: bool = False):
        self.enabled = precision == "fp16"
        self.scaler = AgreedGradScaler(device, agree, enabled=self.enabled)
        self.skipped_steps = 0
        # this launch's steps the scaler closed and those it skipped (skipped_steps is the run's, read back from a
        # checkpoint; the steps a rollback computed again are counted again, as their skips are)
        self.launch_steps = self.launch_skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on: the loss share x the loss scale (fp16), else the share itself."""
        return self.scaler.scale(loss) if self.enabled else loss

    def unscaled(self, value: torch.Tensor) -> torch.Tensor:
        """The loss share behind a value that scale() returned."""
        if not self.enabled:
            return value
        if self.scaler._scale is None:  # nothing was scaled yet (a pipeline rank without the last stage)
            return value
        return value / self.scaler._scale.to(value.device)  # no host sync, unlike get_scale()

    def unscale_(self, opt: torch.optim.Optimizer) -> None:
        if self.enabled:
            self.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """Apply the update unless the gradients overflowed; True when it was skipped."""
        if not self.enabled:
            opt.step()
            return False
        before = self.scaler.get_scale()
        self.launch_steps += 1
        self.scaler.step(opt)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before  # the scale only drops on overflow
        self.skipped_steps += skipped
        self.launch_skipped += skipped
        return skipped

    def overflow_warning(self) -> str | None:
        """The line for a launch whose steps were mostly skipped by overflow (None otherwise): such a
        run ends "complete" with weights that barely moved, or not at all, and a loss that looks held."""
        steps = self.launch_steps
        if not self.enabled or steps <= 0 or 2 * self.launch_skipped <= steps:
            return None
        every = self.launch_skipped == steps
        said = "the one step this launch ran was" if steps == 1 else \
            f"{'all' if every else f'{self.launch_skipped} of the'} {steps} steps this launch ran were"
        moved = "did not change" if every else "barely moved"
        return (f"{said} skipped by the fp16 loss scaler (gradients overflowed; "
                f"the scale is now {self.scaler.get_scale():g}): the weights {moved}. Gradients beyond fp16's range: "
                "try train.precision=bf16 or a lower optim.lr")

    def skip(self) -> None:
        """Drop this step's update (an anomaly); the scaler still closes its step."""
        if self.enabled:
            self.launch_steps += 1
            self.scaler.update()  # unscale_ recorded the overflow check update() needs

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
