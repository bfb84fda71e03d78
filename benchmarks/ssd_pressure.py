#!/usr/bin/env python
"""Optimizer states on an SSD under memory pressure: SSDAdamW's step when the page cache cannot
keep the moments, stepped whole (every tensor at once) and a window at a time, side by side.

A second process (the hog) takes all the host memory but `--leave-gib` (beyond what this
process's gradients need), so the moments compete for what is left. Needs a host without swap
(else the kernel swaps the hog out instead) and a folder on a disk: per step the script reports
the median step time and what the folder's disk read and wrote (/proc/diskstats: the whole
device, so keep the host otherwise idle). It fills the host's memory on purpose: run it by hand,
on a machine nothing else needs, never in the test suite at its default size.

    python benchmarks/ssd_pressure.py                       # 256 M parameters (1.9 GiB of moments)
    python benchmarks/ssd_pressure.py --leave-gib 0.5 --folder /nvme/tmp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shardline.optim.ssd_offload import SSDAdamW
from shardline.optim.windowed import WINDOW

VARIANTS = {"whole": 1 << 62, "windowed": WINDOW}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=256e6, help="parameters (default 256e6: 1.9 GiB of moments)")
    p.add_argument("--leave-gib", type=float, default=0.0,
                   help="memory the hog leaves beside this process's gradients and 0.6 GiB of slack (default 0)")
    p.add_argument("--hog-gib", type=float, default=None, help="the hog's size instead (0: no hog; the test's)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant and round (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the variants, alternating (default 2)")
    p.add_argument("--folder", default="", help="where the moments are mapped (default: a temporary folder)")
    p.add_argument("--json", default="", help="write the results here too")
    return p.parse_args(argv)


def available_gib() -> float:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["MemAvailable"].split()[0]) / 2**20


def disk_bytes(folder: str) -> tuple[int, int] | None:
    """(bytes read, bytes written) so far by the disk (or partition) holding `folder` (fields 6
    and 10 of /proc/diskstats: 512-byte sectors), or None where it lists no such device (an
    overlay, a network file system)."""
    dev = os.stat(folder).st_dev
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return int(f[5]) * 512, int(f[9]) * 512
    return None


def start_hog(gib: float) -> subprocess.Popen | None:
    """A process holding `gib` of touched anonymous memory until its stdin closes: when this
    process ends, however it ends, the pipe closes and the hog exits."""
    if gib <= 0:
        return None
    code = f"import sys, torch; t = torch.ones({int(gib * 2**28)}); print('up', flush=True); sys.stdin.read()"
    hog = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if hog.stdout.readline().strip() != "up":
        hog.wait()
        raise RuntimeError("the hog process did not start (out of memory?)")
    return hog


def stop_hog(hog: subprocess.Popen | None) -> None:
    if hog is not None:
        hog.kill()
        hog.wait()


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(int(args.params) // 16) * 0.02) for _ in range(16)]
    with tempfile.TemporaryDirectory(dir=args.folder or None) as folder:
        opt = SSDAdamW(params, folder, 0, lr=1e-3, foreach=True)

        def step() -> None:
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        grads_gib = 4 * int(args.params) / 2**30
        hog_gib = args.hog_gib if args.hog_gib is not None else available_gib() - grads_gib - 0.6 - args.leave_gib
        hog = start_hog(hog_gib)
        left = available_gib()
        runs: dict[str, list[tuple[float, int, int]]] = {v: [] for v in VARIANTS}
        disk = disk_bytes(folder) is not None
        try:
            for _ in range(args.rounds):
                for variant, window in VARIANTS.items():
                    opt.window = window
                    step()  # settle into this variant's pattern
                    for _ in range(args.steps):
                        (r0, w0), begin = disk_bytes(folder) or (0, 0), time.perf_counter()
                        step()
                        seconds, (r1, w1) = time.perf_counter() - begin, disk_bytes(folder) or (0, 0)
                        runs[variant].append((seconds, r1 - r0, w1 - w0))
                if hog is not None and hog.poll() is not None:
                    raise RuntimeError("the hog process died (the OOM killer?): these steps ran without pressure")
        finally:
            stop_hog(hog)
    moments = 8 * int(args.params) / 2**30

    def gib(values) -> float | None:
        return round(statistics.median(values) / 2**30, 3) if disk else None

    result = {"params": int(args.params), "moments_gib": round(moments, 3), "hog_gib": round(max(hog_gib, 0), 2),
              "available_gib_with_hog": round(left, 2), "disk_counted": disk,
              "variants": {v: {"step_s": round(statistics.median(r[0] for r in rs), 3),
                               "read_gib": gib(r[1] for r in rs), "written_gib": gib(r[2] for r in rs)}
                           for v, rs in runs.items()}}
    print(f"{moments:.2f} GiB of moments, {left:.2f} GiB available beside a {max(hog_gib, 0):.1f} GiB hog; "
          f"medians of {args.steps * args.rounds} steps:")
    for v, r in result["variants"].items():
        io = (f"read {r['read_gib']:.2f} GiB   written {r['written_gib']:.2f} GiB" if disk
              else "(the folder's disk is not in /proc/diskstats: no I/O counted)")
        print(f"  {v:9s} {r['step_s']:8.3f} s   {io}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
