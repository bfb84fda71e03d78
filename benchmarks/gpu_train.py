#!/usr/bin/env python
"""Training throughput of shardline next to HF transformers on the same model shape.

Default: the `llama3.2-1b` preset (1.236 B params, tied embeddings) at sequence 4096,
batch 4 (16,384 tokens per step), fp32 master weights with bf16 autocast, fused
AdamW, gradient clipping at 1.0, on one CUDA device. Variants, run one after the
other in one process, memory freed in between:

* shardline-compile  the trainer's step (`Trainer.train_step()`, as
                     `Trainer.train()` takes it) with train.compile=true (what
                     `shardline train` runs), on batches from shardline's own data pipeline
                     (the shipped corpus, packed; causal attention, no document mask)
* shardline-eager    the same with train.compile=false (not in the default set on GPU)
* shardline-fp8      shardline-compile with train.precision=fp8 (torchao float8 training,
                     [fp8] recipe; needs compute capability >= 8.9)
* shardline-cudnn    shardline-compile (eager where --no-compile) with SDPA trying cuDNN's
                     attention kernel before flash (torch.nn.attention.sdpa_kernel, set before
                     the compiling step): is cuDNN faster at this shape? (On one H200 with torch
                     2.11, no: SDPA picks cuDNN's kernel there already.)
* shardline-flex-docs, shardline-varlen-docs
                     shardline-compile (eager where --no-compile) with packed documents
                     (train.document_mask=true) through FlexAttention or varlen flash
                     attention: what documents cost, and whether the two agree (the same
                     weights and first batch: their first losses must match to bf16 noise)
* hf-eager           `transformers.LlamaForCausalLM` built from a LlamaConfig of the
                     same shape, random init, attn_implementation="sdpa", loss from
                     `labels=`; synthetic random token batches (token values do not
                     change the cost of a dense step)
* hf-compile         the same under torch.compile

Reported per variant: tokens/s, its ratio to hf-compile's and to shardline-compile's
(when those ran in the same invocation), over the measured steps (after warm-up, which
includes compilation), MFU = tokens/s x flops_per_token(args, seq) / peak, where
peak is shardline.devices.peak_tflops (989 TFLOP/s bf16 on H100/H200) or
--peak-tflops, and the peak allocated GPU memory of the variant; for shardline's, the
planner's step time and allocated peak for the same config on this device beside them
(`shardline estimate`, the hardware table's entry, uncalibrated). A variant that
runs out of memory is reported as "oom" and the others still run.

    python benchmarks/gpu_train.py                  # GPU, default shape and variants
    python benchmarks/gpu_train.py --json out.json
    python benchmarks/gpu_train.py --tiny           # CPU smoke run: dim 64, 2 layers, seq 64

Needs torch >= 2.11; transformers only for the hf-* variants.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback

import torch

from shardline.config import load_config
from shardline.devices import peak_tflops
from shardline.models import flops_per_token, get_preset, num_params
from shardline.interop.model_shape import model_shape
from shardline.models.llama import ModelArgs

ALL_VARIANTS = ("shardline-compile", "shardline-eager", "shardline-fp8", "hf-eager", "hf-compile", "shardline-cudnn",
                "shardline-flex-docs", "shardline-varlen-docs")
COMPILED_WITH_ARGS = ("shardline-cudnn", "shardline-flex-docs", "shardline-varlen-docs")  # compiled unless --no-compile
TINY_SHAPE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128"]


class InjectedOOM(torch.cuda.OutOfMemoryError):
    """Raised by --inject-oom to exercise the out-of-memory path without a GPU."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="tiny shape (dim 64, 2 layers, seq 64, batch 4, 5 steps) that runs on a CPU in seconds")
    p.add_argument("--preset", default=None, help="model preset (default llama3.2-1b; tiny with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (64 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per variant (default 10; 5 with --tiny)")
    p.add_argument("--warmup", type=int, default=None,
                   help="unmeasured steps first, compilation included (default 3; 2 with --tiny)")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="autocast dtype: auto = bf16 on GPU, fp32 on CPU")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the compiled variants (default: yes on GPU, no on CPU)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {', '.join(ALL_VARIANTS)} (default: shardline-compile, "
                        "hf-eager, hf-compile when compiling; shardline-eager, hf-eager otherwise)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s for MFU (default: shardline.devices.peak_tflops of the device)")
    p.add_argument("--document-mask", action="store_true",
                   help="shardline attends within packed documents (default off: plain causal, like HF)")
    p.add_argument("--data", default="", help="data.path for shardline (default: the shipped corpus)")
    p.add_argument("--attention", default="auto", help="train.attention for shardline (auto, sdpa, flex, varlen)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra shardline config override for the shardline-* variants (repeatable), "
                        "e.g. --set train.loss_chunk_tokens=8192")
    p.add_argument("--profile", default="", metavar="DIR",
                   help="after measuring each shardline-* variant, profile 2 more steps and write where the "
                        "device time goes (by kind of kernel, top kernels) to DIR/profile-<variant>.txt")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH, or to stdout with no PATH (the table then "
                        "goes to stderr)")
    p.add_argument("--inject-oom", default="", metavar="VARIANT", help=argparse.SUPPRESS)  # for the tests
    p.add_argument("--inject-interrupt", default="", metavar="VARIANT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                               else "cpu" if args.device == "auto" else args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device} but torch sees no CUDA device")
    if args.device.type == "cpu" and not args.tiny and args.preset in (None, "llama3.2-1b"):
        p.error("no CUDA device: the llama3.2-1b shape is a GPU benchmark; use --tiny for the CPU smoke run "
                "(or --preset tiny for a small CPU measurement)")
    args.preset = args.preset or ("tiny" if args.tiny else "llama3.2-1b")
    args.seq_len = args.seq_len or (64 if args.tiny else 4096)
    args.batch = args.batch or 4
    args.steps = args.steps or (5 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 3)
    if args.precision == "auto":
        args.precision = "bf16" if args.device.type == "cuda" else "fp32"
    if args.compile is None:
        args.compile = args.device.type == "cuda"
    if args.variants is None:
        chosen = ["shardline-compile", "hf-eager", "hf-compile"] if args.compile else ["shardline-eager", "hf-eager"]
    else:
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in ALL_VARIANTS]
        if unknown:
            p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(ALL_VARIANTS)}")
    args.variants = chosen
    return args


# ---- shape and bookkeeping ----------------------------------------------------------

def data_vocab(args) -> int:
    """data.vocab_size of the tokenizer shardline trains for its variants."""
    return 512 if args.tiny else 4096


def shape_overrides(args) -> list[str]:
    out = [f"model.preset={args.preset}", *(TINY_SHAPE if args.tiny else [])]
    if not get_preset(args.preset).vocab_size:
        # Presets sized by the tokenizer (tiny) get its size fixed here, so the HF
        # variants know the shape without training a tokenizer.
        out.append(f"model.vocab_size={data_vocab(args)}")
    return out


def model_args(args) -> ModelArgs:
    """The shape every variant trains: the preset (+ tiny overrides), as shardline resolves it."""
    return model_shape(load_config(None, shape_overrides(args)).model, tokenizer_vocab=0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def autocast(args):
    if args.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=args.device.type, dtype=torch.bfloat16)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW as shardline builds it (optim.build_optimizer, implementation=auto): decay on matrices only, the
    fused kernel wherever the parameters share one kind of device (a GPU, or the host: about half foreach's time
    there), foreach only across kinds."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    kinds = {p.device.type for p in decay + no_decay}
    kernel = {"fused": True} if len(kinds) <= 1 else {"foreach": True}
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **kernel)


def step_times(step_fn, device: torch.device, n: int) -> tuple[list[float], list]:
    """Each of n steps' seconds, and their losses (as the steps returned them, read later):
    on CUDA from events recorded between steps on the stream (read once at the end: no sync
    between steps, so the host may run ahead as in training), elsewhere from the host clock."""
    losses = []
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        marks[0].record()
        for mark in marks[1:]:
            losses.append(step_fn())
            mark.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])], losses
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        losses.append(step_fn())
        times.append(time.perf_counter() - t0)
    return times, losses


def measure(step_fn, args, name: str) -> dict:
    """Warm-up (compilation included), then the measured steps, each timed: tokens/s is
    the median step's (a stray slow step, a late recompile, does not move it); the window's
    mean and the quartiles are kept beside it."""
    device = args.device
    if args.inject_oom == name:
        raise InjectedOOM(f"CUDA out of memory (injected by --inject-oom {name})")
    if args.inject_interrupt == name:
        raise KeyboardInterrupt  # as a time budget's SIGINT or SIGTERM arrives
    t0 = time.perf_counter()
    warmup_losses = [step_fn() for _ in range(args.warmup)]
    sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    times, losses = step_times(step_fn, device, args.steps)
    seconds = time.perf_counter() - t0
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    # Every step's loss, warm-up included: the first is the same initial weights on the same
    # batch in every bf16 shardline variant (the hf-* ones have their own data and weights).
    losses = [float(x) for x in warmup_losses + losses]
    return {"warmup_s": warmup_s, "seconds": seconds, "step_s": median, "step_s_quartiles": [q1, q3],
            "tokens_per_s": args.batch * args.seq_len / median,
            "window_tokens_per_s": args.steps * args.batch * args.seq_len / seconds, "loss": losses[-1],
            "losses": losses}


# Kinds of kernel by name, first match wins: attention before GEMM (flash kernels carry cutlass
# names), compiled before GEMM (inductor names a fused kernel after its ops: triton_..._scaled_mm_...).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("compiled (triton)", ("triton",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "splitk", "scaled_mm")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm", "norm_kernel")),
    ("nccl", ("nccl",)),
    ("copies", ("memcpy", "memset", "copy_kernel", "cat_")),
    ("aten elementwise/reduce", ("elementwise", "vectorized", "reduce", "unrolled")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_steps(step_fn, args, name: str, n: int = 2) -> str:
    """--profile: n more steps under torch.profiler, summarised as text (a trace of a 1B step is
    too large to carry back from a lent machine): the device's busy time per step against the
    step's wall time (a gap means the GPU waited on the host), device time by kind of kernel,
    and the top kernels. Without CUDA (the CPU smoke run) the top operators by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.type == "cuda"
    sync(args.device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step_fn()
        sync(args.device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / n
    averages = prof.key_averages()
    # Kernels are the device-side events apart from user annotations (the optimizer's
    # "Optimizer.step#AdamW.step" range spans kernels counted already), as torch's own table sums them.
    kernels = [e for e in averages if cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    lines = [f"profile of {name}: {n} steps after the measured ones; wall {wall_ms:.1f} ms/step"]
    if kernels:
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / n
        lines.append(f"device busy {busy:.1f} ms/step ({100 * busy / wall_ms:.1f}% of wall; the rest the GPU idled)")
        by_kind: dict[str, float] = {}
        for e in kernels:
            kind = kernel_kind(e.key)
            by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3 / n
        lines += ["", f"{'kind':<26}{'ms/step':>9}{'% busy':>8}"]
        lines += [f"{k:<26}{v:>9.2f}{100 * v / busy:>8.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]
        lines += ["", f"{'ms/step':>8}{'calls':>7}  kernel (top 40 by device time)"]
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]:
            lines.append(f"{e.self_device_time_total / 1e3 / n:>8.2f}{e.count // n:>7}  {e.key[:150]}")
    else:
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        lines += [f"no kernel events apart (a CPU run, or another profiler layout): top operators by {sort}", "",
                  averages.table(sort_by=sort, row_limit=40)]
    text = "\n".join(lines) + "\n"
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"profile-{name}.txt"), "w") as f:
        f.write(text)
    print(f"[gpu_train] {name}: profile in {args.profile}/profile-{name}.txt", flush=True)
    return text


# ---- variants -----------------------------------------------------------------------

def run_shardline(args, compiled: bool, name: str) -> dict:
    from shardline.trainer import Trainer

    precision = "fp8" if name == "shardline-fp8" else args.precision

    with tempfile.TemporaryDirectory(prefix="shardline-gpu-bench-") as run_dir:
        overrides = [
            *shape_overrides(args),
            f"train.seq_len={args.seq_len}", f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.batch}", f"train.steps={args.warmup + args.steps}",
            f"train.precision={precision}", f"train.compile={'true' if compiled else 'false'}",
            *attention_overrides(args, name), f"train.seed={args.seed}",
            "train.eval_interval=0", "checkpoint.interval=0", "metrics.progress=none", "metrics.tensorboard=false",
            f"data.path={args.data}", f"run.device={args.device}", f"run.dir={run_dir}",
            f"data.vocab_size={data_vocab(args)}", *args.set,
        ]
        trainer = Trainer(load_config(None, overrides)).build()
        try:
            with sdpa_priority(name):
                out = measure(shardline_step_fn(trainer), args, name)
                if args.device.type == "cuda":
                    out["peak_mem_gib"] = torch.cuda.max_memory_allocated(args.device) / 2**30
                if args.profile:
                    try:  # a profiler problem must not cost the measurement
                        profile_steps(shardline_step_fn(trainer), args, name)
                    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
                        print(f"[gpu_train] {name}: profile failed: {type(e).__name__}: {e}", flush=True)
        finally:  # the watchdog thread and the run-dir lock end here, not in train()
            trainer.metrics.close()
            trainer.guard.stop_watching()
            trainer.lock.release()
        out["params"] = sum(p.numel() for p in trainer.model.parameters())
        out["data"] = "shardline pipeline (" + (args.data or "shipped corpus") + ")"
        try:  # the planner's figures must not cost the measurement
            out.update(planned(trainer, args.device))
        except Exception as e:  # noqa: BLE001 - reported in the JSON and the table, and the run goes on
            out["planned_error"] = f"{type(e).__name__}: {e}"
            print(f"[gpu_train] {name}: planner estimate failed: {out['planned_error']}", flush=True)
        return out


def planned(trainer, device: torch.device) -> dict:
    """The planner's step time and allocated peak for this variant's config on this device (the
    hardware table's entry for this GPU, uncalibrated; on the CPU its rough profile), beside the
    measured ones: every GPU run checks the planner. Empty for a GPU the table lacks. The
    document length is unknown to it here (raw text), so flex and varlen are priced at one
    document per sequence: an upper bound on their attention work."""
    from shardline.devices import local_datasheet
    from shardline.planner.estimate import estimate
    from shardline.planner.hardware import get_hardware
    from shardline.planner.layout import Workload

    name = "cpu"
    if device.type == "cuda":
        sheet = local_datasheet(torch.cuda.get_device_name(device))
        if sheet is None:
            return {}
        name = sheet.name
    e = estimate(Workload.from_config(trainer.cfg, trainer.model_args), trainer.dims.layout, get_hardware(name))
    allocated = e.memory["total"] - e.memory["fragmentation"] - e.memory["reserved"]
    return {"planned_step_s": e.step_time_s, "planned_alloc_gib": allocated / 2**30, "planned_on": name}


def attention_overrides(args, name: str) -> list[str]:
    """train.attention and train.document_mask: the -docs variants' own, else --attention and --document-mask."""
    if name.endswith("-docs"):
        return [f"train.attention={name.split('-')[1]}", "train.document_mask=true"]
    return [f"train.attention={args.attention}", f"train.document_mask={'true' if args.document_mask else 'false'}"]


@contextlib.contextmanager
def sdpa_priority(name: str):
    """shardline-cudnn: SDPA tries cuDNN's attention, then flash, then the others. The choice is
    made as a compiled graph is traced, so it covers the warm-up (compiling) steps too; the
    compile caches' key is tagged, or shardline-compile's cached flash graph would be reused."""
    if name != "shardline-cudnn":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    tag = ",".join(filter(None, [torch.compiler.config.cache_key_tag, "sdpa-cudnn-first"]))
    with torch.compiler.config.patch(cache_key_tag=tag), sdpa_kernel(order, set_priority=True):
        yield


def shardline_step_fn(trainer):
    """One step exactly as `Trainer.train()` takes it (anomaly check included)."""
    def step():
        return trainer.train_step()[0]
    return step


def hf_config(a: ModelArgs):
    import transformers
    from transformers import LlamaConfig

    rope = {"rope_theta": a.rope_theta}
    if a.rope_scaling is not None:
        rope.update({"rope_type": "llama3", **dict(a.rope_scaling)})
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    else:
        rope["rope_type"] = "default"
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope_kwargs = {"rope_parameters": rope}
    else:  # transformers 4.x: rope_theta plus a rope_scaling dict
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if a.rope_scaling is not None else None
        rope_kwargs = {"rope_theta": a.rope_theta, "rope_scaling": scaling}
    return LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads, head_dim=a.head_size,
        rms_norm_eps=a.norm_eps, max_position_embeddings=a.max_seq_len, tie_word_embeddings=a.tie_embeddings,
        use_cache=False, attn_implementation="sdpa", **rope_kwargs)


def run_hf(args, shape: ModelArgs, compiled: bool, name: str) -> dict:
    from transformers import LlamaForCausalLM

    device = args.device
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(shape))
    model.train()
    opt = adamw(model)
    forward = torch.compile(model) if compiled else model
    gen = torch.Generator(device).manual_seed(args.seed)
    # A few synthetic batches, cycled; labels = inputs (HF shifts them inside).
    pool = [torch.randint(0, shape.vocab_size, (args.batch, args.seq_len), device=device, generator=gen)
            for _ in range(4)]
    state = {"i": 0}

    def step():
        x = pool[state["i"] % len(pool)]
        state["i"] += 1
        with autocast(args):
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    out = measure(step, args, name)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["data"] = "synthetic random tokens"
    return out


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_variant(args, shape: ModelArgs, name: str) -> dict:
    compiled = name.endswith("-compile") or name == "shardline-fp8" or (name in COMPILED_WITH_ARGS and args.compile)
    if name.startswith("hf-"):
        if importlib.util.find_spec("transformers") is None:
            return {"status": "skipped", "error": "transformers is not installed"}
        return run_hf(args, shape, compiled, name)
    return run_shardline(args, compiled, name)


# ---- driver -------------------------------------------------------------------------

def run(args, progress=lambda report: None) -> tuple[dict, bool]:
    """Every variant, one after the other; returns the report and whether one failed (not by
    running out of memory). `progress(report)` is called after each variant, so a run cut
    short (SIGINT or SIGTERM: a time budget) keeps the figures of those that finished; the
    cut one and those after it are reported as "cut"."""
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = model_args(args)
    fpt = flops_per_token(shape, args.seq_len)
    peak = args.peak_tflops or peak_tflops(args.device, args.precision)
    from _env import cpu_model  # (as below: the tests load this file without benchmarks/ on sys.path)

    device_name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else cpu_model()
    results = {}
    report = _report(args, shape, fpt, peak, device_name, results)
    try:
        failed = _run_variants(args, shape, fpt, peak, results, lambda: progress(report))
    except KeyboardInterrupt:  # wherever it lands: in a variant, between two, or while reporting
        cut = [name for name in args.variants if results.get(name, {}).get("status") in (None, "running")]
        for name in cut:
            results[name] = {"status": "cut", "error": "stopped before it finished (SIGINT/SIGTERM: a time budget?)"}
        print(f"[gpu_train] stopped; cut: {', '.join(cut) or 'none'}", file=sys.stderr, flush=True)
        add_ratios(results)
        return report, True
    free_memory(args.device)
    return report, failed


def _run_variants(args, shape: ModelArgs, fpt: float, peak: float, results: dict, progress) -> bool:
    """Run the variants into `results` (`progress()` after each); True when one failed (not by
    running out of memory)."""
    failed = False
    for name in args.variants:
        results[name] = {"status": "running"}
        free_memory(args.device)
        print(f"[gpu_train] running {name} ...", file=sys.stderr, flush=True)
        try:
            res = {"status": "ok", **run_variant(args, shape, name)}
        except Exception as e:  # one variant failing must not lose the others' figures
            oom = is_oom(e)
            failed |= not oom
            first_line = (str(e).strip().splitlines() or [""])[0][:300]
            res = {"status": "oom" if oom else "error", "error": f"{type(e).__name__}: {first_line}"}
            if not oom:
                traceback.print_exc(file=sys.stderr)
            print(f"[gpu_train] {name}: {res['status']}: {res['error']}", file=sys.stderr, flush=True)
        if res["status"] == "ok":
            res["mfu"] = res["tokens_per_s"] * fpt / (peak * 1e12) if peak else None
            if "peak_mem_gib" not in res:  # shardline's is read before --profile's steps
                res["peak_mem_gib"] = (torch.cuda.max_memory_allocated(args.device) / 2**30
                                       if args.device.type == "cuda" else None)
            mfu = "-" if res["mfu"] is None else f"{100 * res['mfu']:.1f}%"
            print(f"[gpu_train] {name}: {res['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
                  f"warm-up {res['warmup_s']:.1f} s", file=sys.stderr, flush=True)
        results[name] = res
        add_ratios(results)
        progress()
        if name.endswith("-compile") or name == "shardline-fp8" or name in COMPILED_WITH_ARGS:
            torch._dynamo.reset()
    return failed


def _report(args, shape: ModelArgs, fpt: float, peak: float, device_name: str, results: dict) -> dict:
    """The report `results` (filled in as variants finish) goes into; made before the first
    variant, so its `env` holds the load of the machine before the run."""
    from _env import environment  # here: the tests load this file without benchmarks/ on sys.path
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    return {
        "benchmark": "gpu_train",
        "date": datetime.date.today().isoformat(),
        "env": environment(),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "machine": {"device": str(args.device), "device_name": device_name, "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "transformers": hf_version, "python": platform.python_version()},
        "config": {"tiny": args.tiny, "preset": args.preset, "model_args": dataclasses.asdict(shape),
                   "params": num_params(shape), "seq_len": args.seq_len, "batch": args.batch,
                   "tokens_per_step": args.batch * args.seq_len, "precision": args.precision,
                   "compile": args.compile, "document_mask": args.document_mask, "attention": args.attention,
                   "overrides": args.set, "warmup": args.warmup,
                   "steps": args.steps, "flops_per_token": fpt, "peak_tflops": peak},
        "variants": results,
    }


def add_ratios(results: dict) -> None:
    """tokens/s of each variant over hf-compile's and shardline-compile's, measured in this same run."""
    for base in ("hf-compile", "shardline-compile"):
        ref = results.get(base, {})
        if ref.get("status") != "ok":
            continue
        for res in results.values():
            if res.get("status") == "ok":
                res[f"vs_{base}"] = res["tokens_per_s"] / ref["tokens_per_s"]


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def format_table(rep: dict) -> str:
    from _env import header

    c, m = rep["config"], rep["machine"]
    a = c["model_args"]
    lines = [
        header(rep["env"]),
        f"gpu_train: preset {c['preset']}{' (--tiny)' if c['tiny'] else ''}: dim {a['dim']}, {a['n_layers']} layers, "
        f"{a['n_heads']}/{a['n_kv_heads'] or a['n_heads']} heads, ffn {a['ffn_dim']}, vocab {a['vocab_size']} "
        f"({c['params'] / 1e6:,.1f} M params); seq {c['seq_len']} x batch {c['batch']} = "
        f"{c['tokens_per_step']:,} tokens/step; {c['precision']}",
        f"device {m['device']} ({m['device_name']}), torch {m['torch']}, transformers {m['transformers']}; "
        f"{c['warmup']} warm-up + {c['steps']} measured steps; FLOPs/token {c['flops_per_token']:.4g}; "
        f"peak {_fmt(c['peak_tflops'], '.1f', '?')} TFLOP/s",
        "",
        f"{'variant':<18} {'status':<7} {'tokens/s':>12} {'MFU':>7} {'peak GiB':>9} {'s/step':>8} "
        f"{'warm-up s':>9} {'loss 1':>7} {'loss':>7} {'vs hf-c':>8} {'vs sl-c':>8} {'plan s':>7} {'plan GiB':>8}",
    ]
    for name, r in rep["variants"].items():
        if r["status"] != "ok":
            lines.append(f"{name:<18} {r['status']:<7} {r.get('error', '')}")
            continue
        mfu = _fmt(None if r["mfu"] is None else 100 * r["mfu"], ".1f")
        lines.append(f"{name:<18} {'ok':<7} {r['tokens_per_s']:>12,.0f} {mfu + ('%' if r['mfu'] else ''):>7} "
                     f"{_fmt(r['peak_mem_gib'], '.1f', 'n/a'):>9} {r['step_s']:>8.3f} {r['warmup_s']:>9.1f} "
                     f"{r['losses'][0]:>7.3f} {r['loss']:>7.3f} {_fmt(r.get('vs_hf-compile'), '.2f'):>8} "
                     f"{_fmt(r.get('vs_shardline-compile'), '.2f'):>8} {_fmt(r.get('planned_step_s'), '.3f'):>7} "
                     f"{_fmt(r.get('planned_alloc_gib'), '.1f'):>8}")
    lines.append("")
    lines += [f"{name}: the planner's estimate failed: {r['planned_error']}"
              for name, r in rep["variants"].items() if r.get("planned_error")]
    lines.append("shardline-*: shardline's data pipeline; hf-*: synthetic random tokens (throughput only). "
                 "loss 1: the first step's (same weights and batch for the bf16 shardline-* of one mask). "
                 "plan: the planner's step and allocated peak for the variant's config (shardline estimate), "
                 "against s/step and peak GiB.")
    if m["device"] == "cpu":
        lines.append("CPU: MFU is against shardline's rough CPU peak estimate; peak memory is not measured.")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    # A time budget's SIGTERM ends the run as SIGINT does: with the finished variants reported.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def write_json(report: dict) -> None:
        """The report so far, replacing the file whole (an interrupt never leaves half a file)."""
        if args.json and args.json != "-":
            tmp = f"{args.json}.tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=2)
            os.replace(tmp, args.json)

    report, failed = run(args, progress=write_json)
    table = format_table(report)
    if args.json == "-":
        print(table, file=sys.stderr)
        print(json.dumps(report, indent=2))
    else:
        print(table)
        write_json(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
