#!/usr/bin/env python
"""Training-visible stall of a checkpoint: sync vs async vs in-memory, side by side.

For each model size (Llama shapes from ~10 M parameters up; fp32 weights plus AdamW
moments, i.e. 12 bytes per parameter of state) the script builds the model and its
optimizer state once, then in rounds (sync, async, memory in turn, so machine noise
hits all three alike) measures what the training loop waits for:

* sync:   `Checkpointer.save` (DCP write, fsync-free rename, sha256 manifest)
* async:  `AsyncSaver.save` returns after the host snapshot; the background write's
          time is reported beside it (the next save waits for it)
* memory: `MemoryTier.save` (serialise into /dev/shm; with --world > 1 plus the peer
          replica or XOR parity over gloo)
* memory async: the same in the background (checkpoint.mode = async): the stall is
          the host copy; the background time is reported beside it

Reported: medians over the rounds and each as a ratio to the sync save. Disk saves go
to --dir (default: a fresh temporary folder, removed after; give a folder on the disk to
measure, not a tmpfs such as /dev/shm, and check where the system's /tmp lives).

    .venv/bin/python benchmarks/checkpoint_stall.py                          # 10M..150M, ~3 min
    .venv/bin/python benchmarks/checkpoint_stall.py --sizes 10M,50M --world 2 --redundancy xor
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _env import environment, header
from shardline.models.factory import build_meta_model
from shardline.models.flops import num_params
from shardline.models.llama import ModelArgs
from shardline.optim import init_optimizer_state
from shardline.resilience.async_checkpoint import AsyncSaver
from shardline.resilience.checkpoint import Checkpointer
from shardline.resilience.memory_tier import MemoryTier, run_root

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # name -> (dim, layers, heads, ffn, vocab)
    "tiny": (64, 2, 4, 128, 512),  # for the test that the script runs
    "10M": (256, 6, 4, 1024, 8192),
    "50M": (512, 10, 8, 1536, 16384),
    "150M": (768, 14, 12, 2560, 32000),
    "400M": (1024, 22, 16, 3584, 32000),
    "1B": (2048, 16, 32, 8192, 128256),  # the llama3.2-1b shape; needs ~50 GB of RAM for all three
}


def build(name: str):
    dim, layers, heads, ffn, vocab = SHAPES[name]
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=heads, vocab_size=vocab, ffn_dim=ffn)
    model = build_meta_model(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    init_optimizer_state(opt)
    return args, model, opt


def measure(name: str, rounds: int, disk: Path, redundancy: str, rank: int, world: int) -> dict:
    args, model, opt = build(name)
    (disk / name).mkdir(parents=True, exist_ok=True)  # (a run's saves make checkpoints/, not its run dir)
    ckpt = Checkpointer(disk / name, keep=1, rank=rank, is_writer=rank == 0)
    saver = AsyncSaver(ckpt, dist.new_group(backend="gloo") if world > 1 else None)
    tier = MemoryTier(run_root(disk / name), rank, world, world, redundancy, fingerprint=name)
    times = {"sync": [], "async": [], "async_background": [], "memory": [], "memory_async": [],
             "memory_background": []}
    try:
        _rounds(rounds, model, opt, ckpt, saver, tier, times)
    finally:  # snapshots live in RAM (/dev/shm): never leave them behind
        tier.clear()
        shutil.rmtree(disk / name, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": name, "params": num_params(args), "state_gib": num_params(args) * 12 / 2**30, **med}


def _rounds(rounds: int, model, opt, ckpt, saver, tier, times: dict) -> None:
    """A discarded warm-up round (DCP's set-up, the saver's thread, the first touch of
    /dev/shm), then `rounds` rounds of the four saves, their order rotated each round so that
    none always follows another's write-back."""
    def sync(step):
        return {"sync": [ckpt.save(step, model, opt, {"step": step}, {})[1]]}

    def in_background(step):
        stall = saver.save(step + 1000, model, opt, {"step": step}, {})[1]
        return {"async": [stall], "async_background": [d["background_s"] for d in saver.wait()]}

    def memory(step):
        stall = tier.save(step, model, opt, {"step": step})["stall_s"]
        tier.clear()  # RAM: one snapshot at a time, or the larger sizes do not fit this machine
        return {"memory": [stall]}

    def memory_in_background(step):
        stall = tier.save(step, model, opt, {"step": step}, background=True)["stall_s"]
        done = [d["background_s"] for d in tier.wait()]
        tier.clear()
        return {"memory_async": [stall], "memory_background": done}

    saves = [sync, in_background, memory, memory_in_background]
    for step in range(rounds + 1):
        for i in range(len(saves)):
            got = saves[(i + step) % len(saves)](step + 1)
            if step:  # round 0 is the warm-up
                for key, values in got.items():
                    times[key] += values


def _worker(rank: int, world: int, port: int, opts, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name in opts.sizes.split(","):
        row = measure(name, opts.rounds, Path(opts.dir), opts.redundancy, rank, world)
        if rank == 0:
            queue.put(row)
    dist.destroy_process_group()


def run(opts) -> list[dict]:
    if opts.world == 1:
        return [measure(n, opts.rounds, Path(opts.dir), opts.redundancy, 0, 1) for n in opts.sizes.split(",")]
    from tests.ports import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(opts.world, free_port(), opts, queue), nprocs=opts.world,
                       start_method="spawn")
    return [queue.get() for _ in opts.sizes.split(",")]


def table(rows: list[dict], opts) -> str:
    folder = f" --dir {opts.dir}" if opts.dir else ""
    head = (f"`.venv/bin/python benchmarks/checkpoint_stall.py --sizes {opts.sizes} --rounds {opts.rounds} "
            f"--world {opts.world} --redundancy {opts.redundancy}{folder}`; "
            f"medians of {opts.rounds} rounds; state = fp32 weights + AdamW moments per rank.\n\n")
    lines = ["| size | params | state GiB | sync s | async stall s (background) | memory stall s "
             "| memory async stall s (background) | async / sync | memory / sync | memory async / sync |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['state_gib']:.2f} | {r['sync']:.3f} | "
                     f"{r['async']:.3f} ({r['async_background']:.3f}) | {r['memory']:.3f} | "
                     f"{r['memory_async']:.3f} ({r['memory_background']:.3f}) | {r['async'] / r['sync']:.3f} | "
                     f"{r['memory'] / r['sync']:.3f} | {r['memory_async'] / r['sync']:.3f} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10M,50M,150M", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=1, help="gloo processes (>1 adds replica/parity exchange)")
    p.add_argument("--redundancy", choices=("replica", "xor"), default="replica")
    p.add_argument("--dir", default="", help="where the disk saves go (default: a temporary folder, removed after)")
    opts = p.parse_args(argv)
    unknown = [s for s in opts.sizes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown size(s) {unknown}; choose from {', '.join(SHAPES)}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.world))
    print(header(environment()), flush=True)  # the load before the saves: what else shares the machine
    with tempfile.TemporaryDirectory(prefix="shardline-ckpt-bench-") as tmp:
        rows = run(argparse.Namespace(**{**vars(opts), "dir": opts.dir or tmp}))
    print(table(rows, opts))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
