#!/usr/bin/env python
"""AdamW on the host, and optimizer states on an SSD (`memory.ssd_offload_dir`): what a window at
a time buys the step, what mapped moments cost it, and what they take off the host's RAM.

One AdamW step (foreach, as on the host under CPU offload) over the same parameters, five ways,
in alternating blocks in one process so machine noise hits each alike; only `optimizer.step()` is
timed (the gradients are made before the timer, `zero_grad` after it):

* plain: torch's AdamW, its moments in RAM;
* windowed: WindowedAdamW (what the trainer steps on the host), its moments in RAM: torch's
  arithmetic a cache-sized window at a time;
* warm: SSDAdamW, its moments' pages in the page cache (states that fit in RAM);
* cold: SSDAdamW with every moment page written back and pushed out to the disk before each
  step (msync, then madvise MADV_PAGEOUT): states that do not fit in RAM, read again every step
  a window at a time, the next window asked of the disk while this one computes;
* cold_whole: the same, stepped as one window (every tensor at once, no read-ahead hint: how
  SSDAdamW stepped before its windows).

The write-back before a cold step is timed apart (`writeback_s`): under real memory pressure the
kernel writes pages back in the background, so the step is what the read side costs. The disk
is the folder's (`--folder`; a local SSD is what the option is for).

Then the memory each holds, each variant in a fresh process: anonymous and file-backed resident
memory once the states exist (RssAnon, RssFile of /proc/self/status; anonymous memory is what
the host must have, file-backed pages are cache the kernel may evict), and how far the resident
set rose during one step over what it held before (VmHWM, reset first): the gradients, AdamW's
temporaries, and in a cold step the pages read back.

    python benchmarks/ssd_offload.py                    # ~1 min on 2 CPU cores, 64 M parameters
    python benchmarks/ssd_offload.py --params 256e6 --folder /nvme/tmp --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _env import environment, header
from shardline.optim.ssd_offload import SSDAdamW
from shardline.optim.windowed import WINDOW, WindowedAdamW

MADV_PAGEOUT = 21  # linux/mman.h: reclaim these pages now (clean ones only from a process: msync first)
MS_SYNC = 4
VARIANTS = ("plain", "windowed", "warm", "cold", "cold_whole")
COLD = ("cold", "cold_whole")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=64e6, help="parameters (default 64e6: 512 MB, 0.48 GiB, of moments)")
    p.add_argument("--tensors", type=int, default=32, help="tensors they are split into (default 32)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per variant (default 8)")
    p.add_argument("--window", type=int, default=WINDOW, help=f"the window in elements (default {WINDOW})")
    p.add_argument("--folder", default="", help="where the moments are mapped (default: a temporary folder)")
    p.add_argument("--json", default="", help="write the results here too")
    p.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's job
    args = p.parse_args(argv)
    if min(args.tensors, args.steps, args.window) < 1:  # a window of 0 steps nothing: ratios of noise
        p.error(f"--tensors {args.tensors}, --steps {args.steps}, --window {args.window}: each must be at least 1")
    if not math.isfinite(args.params) or int(args.params) < args.tensors:
        p.error(f"--params {args.params:g}: must be at least --tensors ({args.tensors}), one element a tensor")
    return args


def build(variant: str, args, folder: str) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    size = int(args.params) // args.tensors
    params = [torch.nn.Parameter(torch.randn(size) * 0.02) for _ in range(args.tensors)]
    hyper = {"lr": 1e-3, "foreach": True}
    if variant in ("plain", "windowed"):
        return params, (torch.optim.AdamW if variant == "plain" else WindowedAdamW)(params, **hyper)
    return params, SSDAdamW(params, folder, 0, **hyper)


def fill_grads(params) -> None:
    """Gradients for the next step: made before a timed step, so that the timer holds AdamW only."""
    for p in params:
        p.grad = torch.full_like(p, 1e-3)


def step(params, opt) -> None:
    """A whole step, gradients included (what the resident set's rise in a step counts)."""
    fill_grads(params)
    opt.step()
    opt.zero_grad(set_to_none=True)


def page_out(opt: SSDAdamW) -> None:
    """Write every mapped moment back to its file (msync) and drop its pages from RAM (madvise):
    the kernel reclaims only clean file pages at a process's request."""
    libc = ctypes.CDLL(None, use_errno=True)
    for files in opt.mapped.values():
        for t in files.values():
            span = (ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel() * t.element_size()))
            if libc.msync(*span, MS_SYNC) != 0 or libc.madvise(*span, MADV_PAGEOUT) != 0:
                raise OSError(ctypes.get_errno(), "msync or madvise(MADV_PAGEOUT) failed (Linux >= 5.4 needed)")


def io_counters() -> dict[str, int]:
    """This process's major page faults (pages read from a file), bytes it read from storage and
    bytes of file pages it dirtied, which the kernel counts as written when they are dirtied
    (/proc/self/io: absent in some containers, or not kept, then 0)."""
    counts = {"major_faults": int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])}
    try:
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        counts.update(read_bytes=int(io["read_bytes"]), write_bytes=int(io["write_bytes"]))
    except (OSError, KeyError, ValueError):
        counts.update(read_bytes=0, write_bytes=0)
    return counts


def rss() -> dict[str, float]:
    """Resident GiB, after the C allocator has given back what it holds freed (malloc_trim)."""
    ctypes.CDLL(None).malloc_trim(0)
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("RssAnon", "RssFile")}  # GiB


def memory_of(variant: str, args, folder: str) -> dict:
    step(*build(variant, argparse.Namespace(params=1024, tensors=1), folder))  # the code's pages, loaded first
    before = rss()
    params, opt = build(variant, args, folder)
    whole(opt, variant, args.window)
    step(params, opt)
    if variant in COLD:
        page_out(opt)
    after = rss()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident set now
    step(params, opt)
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    rise = (int(fields["VmHWM"].split()[0]) / 2**20) - after["RssAnon"] - after["RssFile"]
    return {**{k: round(after[k] - before[k], 3) for k in after}, "step_rise": round(rise, 3)}


def whole(opt: torch.optim.Optimizer, variant: str, window: int) -> None:
    """Set the window: every tensor at once for cold_whole, `window` otherwise."""
    if isinstance(opt, WindowedAdamW):
        opt.window = 1 << 62 if variant == "cold_whole" else window


def timings(args, folder: str) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, int]]]:
    """Median step seconds per variant, median write-back seconds before the cold ones, and the
    median I/O of their steps."""
    built = {v: build(v, args, folder) for v in ("plain", "windowed", "warm")}
    built.update({v: built["warm"] for v in COLD})  # the same mapped moments, paged out first
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    writeback: dict[str, list[float]] = {v: [] for v in COLD}
    io: dict[str, dict[str, list[int]]] = {v: {} for v in COLD}
    for v in ("plain", "windowed", "warm"):  # warm-up: every state made and touched once
        step(*built[v])
    for _ in range(args.steps):
        for v in VARIANTS:
            whole(built[v][1], v, args.window)
            if v in COLD:
                begin = time.perf_counter()
                page_out(built[v][1])
                writeback[v].append(time.perf_counter() - begin)
            params, opt = built[v]
            fill_grads(params)
            before = io_counters()
            begin = time.perf_counter()
            opt.step()
            times[v].append(time.perf_counter() - begin)
            opt.zero_grad(set_to_none=True)
            if v in COLD:
                for k, n in io_counters().items():
                    io[v].setdefault(k, []).append(n - before[k])
    return ({v: statistics.median(t) for v, t in times.items()},
            {v: statistics.median(t) for v, t in writeback.items()},
            {v: {k: int(statistics.median(n)) for k, n in c.items()} for v, c in io.items()})


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.folder and not Path(args.folder).is_dir():  # (a FileNotFoundError traceback from tempfile)
        raise SystemExit(f"ssd_offload: --folder {args.folder} is not a folder: make it first, or leave it out")
    with tempfile.TemporaryDirectory(dir=args.folder or None) as folder:
        if args.memory_of:
            print(json.dumps(memory_of(args.memory_of, args, folder)))
            return {}
        env = environment()
        print(header(env), flush=True)
        child = [sys.executable, __file__, f"--params={args.params}", f"--tensors={args.tensors}",
                 f"--window={args.window}", f"--folder={folder}"]
        memory = {v: json.loads(subprocess.run([*child, f"--memory-of={v}"], check=True, capture_output=True,
                                               text=True).stdout) for v in VARIANTS}
        median, writeback, cold_io = timings(args, folder)
    moments_gib = 8 * int(args.params) / 2**30
    result = {"env": env, "params": int(args.params), "moments_gib": round(moments_gib, 3), "steps": args.steps,
              "window": args.window, "step_s": {v: round(s, 4) for v, s in median.items()},
              "vs_plain": {v: round(median[v] / median["plain"], 2) for v in VARIANTS},
              "writeback_s": {v: round(s, 4) for v, s in writeback.items()},
              "rss_gib": memory, "cold_step_io": cold_io}
    print(f"AdamW step over {args.params:.3g} parameters ({moments_gib:.2f} GiB of moments), median of {args.steps}:")
    for v in VARIANTS:
        m = memory[v]
        back = f" (+{writeback[v] * 1e3:.0f} ms write-back before)" if v in COLD else ""
        print(f"  {v:10s} {median[v] * 1e3:8.1f} ms  x{result['vs_plain'][v]:.2f}{back}   "
              f"anonymous +{m['RssAnon']:.2f} GiB, file-backed +{m['RssFile']:.2f} GiB, "
              f"resident set rose {m['step_rise']:.2f} GiB in a step")
    for v in COLD:
        c = cold_io[v]
        print(f"  a {v} step (median): {c['major_faults']} major faults, {c['read_bytes'] / 2**30:.2f} GiB read "
              "(0 where /proc/self/io is not kept)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
