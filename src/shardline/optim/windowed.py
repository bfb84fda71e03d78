"""AdamW on the host, stepped a cache-sized window of elements at a time.

torch's foreach AdamW makes each of its passes over every tensor before the next pass starts:
exp_avg's lerp over all of it, then exp_avg_sq's multiply, its addcmul, a square root into a
temporary as large as the moments, a divide, an add, then the update of the weights. Where the
states live in host RAM (a CPU run, a GPU run with CPU offload) each pass streams the whole state
through memory again, and the temporary costs 4 bytes a parameter. WindowedAdamW runs all the
passes over one window (WINDOW elements: the weights, gradients, moments and temporaries of one
window fit a CPU's last-level cache) before the next, calling torch's own functional adam on
views: the same arithmetic element for element, so the same bits, with the memory read about
once a step and a window's temporaries. The for-loop implementation finishes one tensor before
the next, so windows help it only inside large tensors; the fused kernel (optim.implementation
auto's choice, about twice foreach's speed here) makes one pass per element already, so in RAM
it steps all tensors in one call (FUSED_IN_WINDOWS), windows only where an SSD holds the states.

torch's fused kernel walks each tensor's memory, not its strides: a weight laid out unlike its
gradient (transposed, or with gaps) would pair the wrong elements, so such a tensor (a window of
its own) steps through plain copies that are then written back. And it copies an fp16 scaler's
or the anomaly check's verdict from a GPU without waiting: step() copies it to the host and waits.

Gradient clipping's multiply runs here too, window by window, when the clip hands its scale over
(`clip_scale`, parallel/collectives.clip_grad_norm's `defer_to`): the same multiply of the same
gradients, while they are in cache, instead of a pass of its own over all of them (measured in
benchmarks/clip_fold.py); under the fused kernel, inside it, as its grad_scale (fused.py's way:
a division by the reciprocal, the same update to within a rounding of the gradient).

Optimizer states on an SSD (ssd_offload.py) step the same way, and ask the disk for the next
window while this one computes: `_prefetch`, a no-op here.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from shardline.errors import ConfigError
from shardline.parallel.collectives import scale_grads

WINDOW = 1 << 20  # elements a window: 4 MiB of each fp32 tensor, ~20 MiB with the temporaries
ALIGN = 4096  # windows are whole multiples of this many elements: AdamW's vector loops then split
# every tensor as one pass over it would (fused AdamW's last bits differ where a window cuts a vector)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or t: the attribute itself, not zero1.local's to_local(), which runs an
    autograd Function per call; this one runs for every tensor of every window of every step."""
    return t._local_tensor if isinstance(t, DTensor) else t


class WindowedAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped a window at a time (module docstring): states, state dicts and results
    are AdamW's own. Plain AdamW only: amsgrad, capturable and differentiable keep other state or
    run on a device, where windows buy nothing."""

    PLAIN_ONLY = "the host's windowed AdamW steps plain AdamW"  # what refusing the others says
    # The fused kernel makes one pass per element: in RAM, windows only add calls (whole tensors, one call,
    # measured ~15% faster at 64 M parameters); states on an SSD keep them for the next window's prefetch.
    FUSED_IN_WINDOWS = False

    def __init__(self, params, **hyper):
        super().__init__(params, **hyper)
        unsupported = [k for k in ("amsgrad", "capturable", "differentiable") if self.defaults.get(k)]
        if unsupported:
            raise ConfigError(f"{self.PLAIN_ONLY}; not with {', '.join(unsupported)}")
        self.window = WINDOW
        self.clip_scale: torch.Tensor | None = None  # set by the clip for the next step (module doc)

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW's update a window at a time (`self.window` elements, rounded down to a multiple of
        ALIGN; small tensors together, every group's in order; the fused kernel's in RAM, a group's
        tensors at once: FUSED_IN_WINDOWS), the next window prefetched first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        size = max(ALIGN, self.window - self.window % ALIGN)
        clip, self.clip_scale = self.clip_scale, None  # for this step only
        first = next((p for group in self.param_groups for p in group["params"]), None)
        if clip is not None and first is not None:  # to the states' device once, not once a window
            clip = clip.to(first.device)
        # An fp16 scaler's tensors, to the states' device once and with a wait: torch's fused AdamW
        # copies them per device with non_blocking=True, and a host kernel then reads a GPU's found_inf
        # before its copy lands (CPU offload under fp16).
        scale = {k: _waited_to(getattr(self, k, None), local(first).device if first is not None else None)
                 for k in ("grad_scale", "found_inf")}
        in_kernel = dict(scale)  # the fused kernel divides each gradient by grad_scale as it loads it: the
        if clip is not None:     # clip's multiply goes there, as on a GPU (fused.py), in no pass of its own
            in_kernel["grad_scale"] = 1.0 / clip if scale["grad_scale"] is None else scale["grad_scale"] / clip
        work = []  # (group, has_complex, window)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
            cut = size if self.FUSED_IN_WINDOWS or not group["fused"] else sys.maxsize
            work += [(group, has_complex, w) for w in _windows(params, grads, exp_avgs, exp_avg_sqs, steps, cut)]
        for i, (group, has_complex, window) in enumerate(work):
            if i + 1 < len(work):
                self._prefetch(work[i + 1][2])
            p, g, m, v, s, _ = (list(t) for t in zip(*window))
            if clip is not None and not group["fused"]:
                scale_grads(g, clip)
            strided = [p, g, m, v] if group["fused"] and not all(local(t).is_contiguous() for t in p + g + m + v) \
                else None  # only a window of one whole tensor can be; fused kernels read memory, not strides
            if strided:
                p, g, m, v = ([t.contiguous() for t in ts] for ts in strided)
            beta1, beta2 = group["betas"]
            adam(p, g, m, v, [], s, foreach=group["foreach"], fused=group["fused"], has_complex=has_complex,
                 **(in_kernel if group["fused"] else scale),
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
            if strided:  # the update (and a scaler's unscaled gradient) back into the tensors themselves
                for olds, news in zip(strided, (p, g, m, v)):
                    for old, new in zip(olds, news):
                        if new is not old:
                            old.copy_(new)
        for step, new in _new_steps(window for _, _, window in work).items():
            step.copy_(new)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients and the clip scale computed from them: a step skipped (an fp16
        overflow, an anomaly) must not leave it to a later step on other gradients (torch's
        distributed state dict, for one, steps zero gradients at lr 0 to create missing states)."""
        self.clip_scale = None
        super().zero_grad(set_to_none)

    def _prefetch(self, window: list[tuple]) -> None:
        """Called with the next window before this one steps: states in RAM need nothing."""


def _waited_to(t: torch.Tensor | None, device: torch.device | None) -> torch.Tensor | None:
    """t on `device`: where it is elsewhere (a GPU's), copied and waited for, since the host reads it next."""
    if t is None or device is None or t.device == device:
        return t
    return t.to(device)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t's local elements as one flat view (complex as pairs of reals, as torch's AdamW steps them)."""
    t = local(t)
    return (torch.view_as_real(t) if t.is_complex() else t).view(-1)


def _windows(params, grads, exp_avgs, exp_avg_sqs, steps, size: int):
    """Lists of (param, grad, exp_avg, exp_avg_sq, step copy, step) of about `size` elements each,
    in order: a tensor larger than `size` in slices of it (flat views, so AdamW's in-place updates
    land in the tensors), smaller ones together. A tensor whose parameter, gradient or moments are
    not contiguous (slices would not be views) or not of one shape, or are DTensors not laid out
    alike (a gradient still partial, say), is a window of its own, whole.
    Each entry steps a copy of its tensor's step, since AdamW adds one to every step it is given
    (_new_steps writes the new value back once)."""
    window, held = [], 0
    for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        whole = None
        if isinstance(p, DTensor) and any(getattr(t, "placements", None) != p.placements
                                          or getattr(t, "device_mesh", None) != p.device_mesh for t in (g, m, v)):
            whole = (p, g, m, v)  # shards that may not line up: as DTensors, as torch's AdamW steps them
        elif not all(local(t).is_contiguous() and local(t).shape == local(p).shape for t in (g, m, v)) \
                or not local(p).is_contiguous():
            whole = (local(p), local(g), local(m), local(v))  # stepped whole (fused: contiguous copies, step)
        if whole:
            if window:
                yield window
            yield [(*whole, s.clone(), s)]
            window, held = [], 0
            continue
        flats = (_flat(p), _flat(g), _flat(m), _flat(v))
        for start in range(0, max(flats[0].numel(), 1), size):
            piece = tuple(f[start:start + size] for f in flats)
            if held and held + piece[0].numel() > size:
                yield window
                window, held = [], 0
            window.append((*piece, s.clone(), s))
            held += piece[0].numel()
    if window:
        yield window


def _new_steps(windows) -> dict[torch.Tensor, torch.Tensor]:
    """Each tensor's step (the state's tensor) -> its value after the update: what AdamW left in the
    first copy of it (every window of a tensor moved its copy alike: one more, or none where a
    gradient scaler found an inf)."""
    firsts: dict[torch.Tensor, torch.Tensor] = {}
    for window in windows:
        for *_, copy, step in window:
            firsts.setdefault(step, copy)
    return firsts
