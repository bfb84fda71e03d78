"""What a zero-bubble schedule's split backward costs a block, eager and compiled, side by side.

zbv and dualpipev run each micro-batch's backward in two passes: input gradients first,
weight gradients later (torch.distributed.pipelining's stage_backward_input and
stage_backward_weight, which the schedules call). Eager, the two passes add up to about
one backward. A compiled block is one autograd node whose backward computes all its
gradients at once, so both passes run all of it. `train.compile` under those schedules
keeps the Linear layers out of the compiled regions (parallel/compile.py); this measures
the three ways on one transformer block:

- eager: no compile;
- whole: the block compiled as one region (what train.compile does under 1F1B);
- shardline: apply_compile(split_backward=True), the Linear layers eager between regions.

For each: forward, one backward, and the split backward (input pass + weight pass), as
medians; `split/one` is the split backward over one backward, and `vs eager` the forward
plus split backward against eager's. Each variant's gradients are compared with eager's
(`grad error`, relative to each tensor's largest entry; past 1e-4 in fp32 or 5e-2 in bf16
the script stops: that variant computes something else). Needs torch >= 2.13, the first
whose split backward runs over compiled code.

    .venv/bin/python benchmarks/split_backward.py                   # CPU, fp32, ~30 s on 2 cores
    python benchmarks/split_backward.py --dim 2048 --heads 32 --kv-heads 8 --ffn 8192 --seq 4096 --batch 2
                                                                    # CUDA, bf16: the 1B shape's block
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from _env import environment, header
from shardline.models.factory import build_model_on
from shardline.models.llama import ModelArgs
from shardline.parallel.compile import apply_compile, config_problem

VARIANTS = ("eager", "whole", "shardline")


def _block(args: ModelArgs, variant: str, device: torch.device, dtype: torch.dtype):
    model = build_model_on(args, "cpu")
    model.init_weights(seed=0)
    model.to(device=device, dtype=dtype)
    if variant != "eager":
        apply_compile(model, split_backward=variant == "shardline")
    return model, model.layers["0"]


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args: ModelArgs, seq: int, batch: int, device: torch.device, dtype: torch.dtype,
            repeats: int, variants: tuple[str, ...] = VARIANTS) -> dict[str, dict[str, float]]:
    """Median seconds of forward, one backward and the split backward per variant (eager's
    first: the others' gradients are compared with its)."""
    x0 = torch.randn(batch, seq, args.dim, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    results, reference = {}, None
    for variant in ("eager", *(v for v in variants if v != "eager")):
        model, block = _block(args, variant, device, dtype)
        cos, sin = model.rotary(torch.arange(seq, device=device), device)
        cos, sin = cos.to(dtype), sin.to(dtype)
        times = {"forward": [], "one": [], "split": []}
        for i in range(repeats + 2):  # two warm-up rounds: compilation, allocator
            x = x0.clone().requires_grad_()
            box = {}
            forward = _timed(lambda: box.__setitem__("out", block(x, cos, sin, None)), device)
            one = _timed(lambda: box["out"].backward(torch.ones_like(box["out"])), device)
            block.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            out = block(x, cos, sin, None)

            def split(out=out, x=x):
                _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
                stage_backward_weight(block.parameters(), groups)

            split_s = _timed(split, device)
            if i == 0:
                grads = [x.grad, *(p.grad for p in block.parameters())]
                reference = reference or grads
                error = grad_error(grads, reference)
            block.zero_grad(set_to_none=True)
            if i >= 2:
                for key, value in (("forward", forward), ("one", one), ("split", split_s)):
                    times[key].append(value)
        results[variant] = {**{key: statistics.median(values) for key, values in times.items()}, "grad_error": error}
        torch._dynamo.reset()
    return results


def grad_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest difference from eager's gradients, relative to each tensor's largest entry;
    past GRAD_TOLERANCE the variant computes something else and its timing means nothing."""
    error = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
                for g, r in zip(grads, reference, strict=True))
    tolerance = GRAD_TOLERANCE[grads[0].dtype == torch.float32]
    if error > tolerance:
        raise AssertionError(f"gradients differ from eager's by {error:.2e} relative (tolerance {tolerance})")
    return error


GRAD_TOLERANCE = {True: 1e-4, False: 5e-2}  # fp32; bf16 (compiled kernels round differently)


def table(results: dict[str, dict[str, float]]) -> str:
    eager = results["eager"]["forward"] + results["eager"]["split"]
    lines = [f"{'variant':<10} {'forward ms':>11} {'backward ms':>12} {'split ms':>9} {'split/one':>10} "
             f"{'fwd+split vs eager':>19} {'grad error':>11}"]
    for variant, r in results.items():
        lines.append(f"{variant:<10} {r['forward'] * 1e3:>11.1f} {r['one'] * 1e3:>12.1f} {r['split'] * 1e3:>9.1f} "
                     f"{r['split'] / r['one']:>10.2f} {(r['forward'] + r['split']) / eager:>19.2f} "
                     f"{r['grad_error']:>11.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per variant (medians)")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu or cuda")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (eager always runs: the reference)")
    p.add_argument("--json", nargs="?", const="-", help="also write the figures as JSON (to PATH, or - for stdout)")
    a = p.parse_args(argv)
    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    problem = config_problem(True, 2, "zbv")
    if problem:  # the compiled variants' weight pass fails on this torch
        print(f"split_backward: {problem}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch._functorch.config.donated_buffer = False  # the split backward retains the graph (as train.compile sets)
    args = ModelArgs(dim=a.dim, n_layers=1, n_heads=a.heads, n_kv_heads=a.kv_heads, ffn_dim=a.ffn, vocab_size=64)
    env = environment()  # before the timings: the load of what else runs here
    out = sys.stderr if a.json == "-" else sys.stdout
    print(header(env), file=out, flush=True)
    results = measure(args, a.seq, a.batch, device, dtype, a.repeats, variants)
    print(f"one block: dim {a.dim}, heads {a.heads}/{a.kv_heads}, ffn {a.ffn}, seq {a.seq}, batch {a.batch}, "
          f"{device.type} {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, medians of {a.repeats}",
          file=out)
    print(table(results), file=out)
    if a.json:
        text = json.dumps({"env": env, "shape": vars(a), "device": device.type, "torch": torch.__version__,
                           "results": results}, indent=2)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
