#!/usr/bin/env python
"""Gradient clipping on the host: its multiply folded into the windowed AdamW, against a pass of its own.

A host optimizer step (a CPU run, or a GPU run whose states are offloaded) is clipping, then AdamW.
Clipping is two passes over every gradient: the norm (reads them) and the multiply by the clip
scale (reads and writes them). Stepped apart, the multiply streams every gradient through memory
once more before AdamW streams them again; folded (`clip_grad_norm(..., defer_to=optimizer)`, what
the trainer does on the host) WindowedAdamW multiplies each window's gradients while that window is
in cache. Seven ways, alternating step by step in one process so machine noise hits each alike
(each step starts one variant further along the list, so none always runs first or after the same
one):

* torch: torch.nn.utils.clip_grad_norm_, then torch's AdamW (foreach);
* torch_fused: torch.nn.utils.clip_grad_norm_, then torch's fused AdamW: the like-for-like torch
  baseline of the fused-kernel variants below (before 2026-12-06 they were compared with `torch`);
* apart: shardline's clip_grad_norm multiplying in place, then WindowedAdamW;
* folded: shardline's clip_grad_norm handing the scale to WindowedAdamW (foreach);
* folded_fused: WindowedAdamW on torch's fused CPU kernel, the clip's scale inside it as its
  grad_scale (optim.implementation auto's choice on the host since 2026-12-05);
* fused_apart: shardline's clip_grad_norm multiplying in place, then torch's fused AdamW (the GPU
  trainer's optimizer before its clip went into the kernel);
* fused_in_kernel: the scale handed to FusedAdamW, which divides by its reciprocal as the fused
  kernel loads each gradient (what the trainer does on a GPU; here torch's fused CPU kernel, a proxy:
  both kernels take the same grad_scale input).

Every step clips: the gradients are standard normal, so their norm (about the square root of the
parameter count) is far above max_norm 1. Only clip + AdamW is timed: the gradients are made
before the timer. The parameters of `apart` and `folded` are checked equal bit for bit at the
end, those of the two fused ones to 1e-6 (a division by the reciprocal).

    python benchmarks/clip_fold.py                 # ~60 s on 2 CPU cores, 64 M parameters
    python benchmarks/clip_fold.py --params 256e6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from _env import environment, header
from shardline.layout import Layout
from shardline.optim.fused import FusedAdamW
from shardline.optim.windowed import WindowedAdamW
from shardline.parallel.collectives import clip_grad_norm
from shardline.parallel.dims import ParallelDims

VARIANTS = ("torch", "torch_fused", "apart", "folded", "folded_fused", "fused_apart", "fused_in_kernel")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=64e6, help="parameters (default 64e6)")
    p.add_argument("--tensors", type=int, default=32, help="tensors they are split into (default 32)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant (default 10)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.tensors < 1 or args.steps < 1:
        p.error(f"--tensors {args.tensors}, --steps {args.steps}: each must be at least 1")
    if not math.isfinite(args.params) or int(args.params) < args.tensors:  # else empty tensors, ratios of noise
        p.error(f"--params {args.params:g}: must be at least --tensors ({args.tensors}), one element a tensor")
    return args


def build(variant: str, args) -> tuple[torch.nn.ParameterList, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(0)
    size = int(args.params) // args.tensors
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(size, generator=gen))
                                    for _ in range(args.tensors)])
    opt = {"torch": lambda: torch.optim.AdamW(model, lr=1e-3, foreach=True),
           "torch_fused": lambda: torch.optim.AdamW(model, lr=1e-3, fused=True),
           "fused_apart": lambda: torch.optim.AdamW(model, lr=1e-3, fused=True),
           "fused_in_kernel": lambda: FusedAdamW(model, lr=1e-3),
           "folded_fused": lambda: WindowedAdamW(model, lr=1e-3, fused=True)}.get(
        variant, lambda: WindowedAdamW(model, lr=1e-3, foreach=True))()
    return model, opt


def step(variant: str, model: torch.nn.ParameterList, opt: torch.optim.Optimizer, dims: ParallelDims,
         seed: int) -> float:
    """One clipped step on fresh standard-normal gradients; seconds of clip + AdamW."""
    gen = torch.Generator().manual_seed(seed)
    for p in model:
        p.grad = torch.randn(p.shape, generator=gen)
    start = time.perf_counter()
    if variant in ("torch", "torch_fused"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    else:
        clip_grad_norm(model, 1.0, dims, defer_to=None if variant in ("apart", "fused_apart") else opt)
    opt.step()
    return time.perf_counter() - start


def rotated(variants: tuple[str, ...], i: int) -> tuple[str, ...]:
    """The variants starting at the i-th: over the steps each runs in every position alike (a fixed
    order would hand one of them, every step, the caches and the machine as another left them)."""
    k = i % len(variants)
    return variants[k:] + variants[:k]


def main(argv=None) -> dict:
    args = parse_args(argv)
    env = environment()
    print(header(env), flush=True)
    dims = ParallelDims(Layout())
    runs = {v: build(v, args) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.steps + 1):  # the first step of each allocates AdamW's moments: not timed
        for v in rotated(VARIANTS, i):
            seconds = step(v, *runs[v], dims, seed=i)
            if i:
                times[v].append(seconds)
    same = all(torch.equal(a, b) for a, b in zip(runs["apart"][0], runs["folded"][0]))
    close = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(runs["fused_apart"][0],
                                                                        runs["fused_in_kernel"][0]))
    median = {v: statistics.median(t) for v, t in times.items()}
    out = {"env": env, "params": int(args.params), "tensors": args.tensors, "steps": args.steps,
           "threads": torch.get_num_threads(),
           "median_ms": {v: round(m * 1e3, 1) for v, m in median.items()},
           "vs_torch": {v: round(median[v] / median["torch"], 3) for v in VARIANTS},
           "vs_torch_fused": {v: round(median[v] / median["torch_fused"], 3) for v in VARIANTS},
           "folded_vs_apart": round(median["folded"] / median["apart"], 3), "apart_equals_folded": same,
           "fused_in_kernel_vs_apart": round(median["fused_in_kernel"] / median["fused_apart"], 3),
           "fused_close": close, "folded_fused_vs_folded": round(median["folded_fused"] / median["folded"], 3)}
    print(f"{int(args.params):,} parameters in {args.tensors} tensors, {torch.get_num_threads()} threads, "
          f"median of {args.steps} clipped steps")
    for v in VARIANTS:
        print(f"  {v:<16} {out['median_ms'][v]:>8.1f} ms   {out['vs_torch'][v]:.2f}x torch (foreach)   "
              f"{out['vs_torch_fused'][v]:.2f}x torch_fused")
    print(f"  folded / apart: {out['folded_vs_apart']:.3f}; parameters bit for bit equal: {same}")
    print(f"  fused_in_kernel / fused_apart: {out['fused_in_kernel_vs_apart']:.3f}; parameters within 1e-6: {close}")
    print(f"  folded_fused / folded (the fused kernel against foreach, windowed): {out['folded_fused_vs_folded']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
