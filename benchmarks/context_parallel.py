"""Activation memory per rank and tokens/s of one long sequence under cp = 1, 2, 4.

Each cp degree runs on its own set of gloo processes through the trainer users run
(`Trainer.build`, then the forward and backward of `loss_sum` on one micro-batch of
the shipped corpus). Activation memory is what autograd keeps for the backward: the
bytes of the tensors saved during the forward (parameters excluded), counted by a
saved-tensors hook on each rank; its max over ranks is reported, with the ratio to
cp1. Times are medians of the repeats. Every cp degree gets the same torch threads in
all (`--threads`, split over its ranks: cp1 is not given fewer cores than cp4); on a
2-core machine the ranks share the cores, so tokens/s ranks the modes' overheads rather
than showing a speed-up.

Document masking is off here: with it, one process would run the dense-mask SDPA,
whose score matrix (s x s per head) is the very memory context parallelism removes,
and the comparison would flatter cp.

    python benchmarks/context_parallel.py [--seq-len 8192] [--repeats 3] [--threads 4] [--max-cp 2|4] [--json]

`--json` prints {"env": the machine, "rows": one per run} instead of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _env import environment, header

RUNS = {"cp1": [], "cp2 ring": ["parallel.cp=2"], "cp4 ring": ["parallel.cp=4"],
        "cp4 ring (no zigzag)": ["parallel.cp=4", "parallel.cp_balance=none"],
        "cp4 ulysses": ["parallel.cp=4", "parallel.cp_mode=ulysses"],
        "cp4 hybrid 2x2": ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _saved_bytes(trainer, batch, n_tokens: int) -> tuple[int, float]:
    """(bytes autograd saved in the forward, seconds of forward + backward)."""
    params = {p.data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.runner.loss_sum(batch) / n_tokens
    loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return sum(seen.values()), time.perf_counter() - started


def _worker(rank: int, world: int, port: int, overrides: list[str], repeats: int, out: str, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads // world)  # the same threads in all for every cp degree
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardline.config import load_config
    from shardline.parallel.distributed import shutdown_distributed
    from shardline.trainer import Trainer

    trainer = Trainer(load_config(None, overrides)).build()
    batch = trainer.data.train.batch(np.arange(1))
    n_tokens = int((batch["labels"] != -100).sum())
    results = [_saved_bytes(trainer, batch, n_tokens) for _ in range(repeats + 1)][1:]  # the first warms up
    saved = max(b for b, _ in results)
    seconds = statistics.median(s for _, s in results)
    trainer.lock.release()
    if world > 1:
        both = torch.tensor([float(saved), seconds])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        saved, seconds = int(both[0]), float(both[1])
        shutdown_distributed()
    if rank == 0:
        Path(out).write_text(json.dumps({"saved_bytes": saved, "seconds": seconds}))


def measure(name: str, extra: list[str], seq_len: int, repeats: int, root: Path, threads: int) -> dict:
    cp = next((int(o.split("=")[1]) for o in extra if o.startswith("parallel.cp=")), 1)
    overrides = ["model.preset=tiny", f"train.seq_len={seq_len}", "train.global_batch_size=1",
                 "train.micro_batch_size=1", "train.document_mask=false", "checkpoint.interval=0",
                 "train.eval_interval=0", "metrics.progress=none", "metrics.tensorboard=false",
                 f"run.dir={root / name.replace(' ', '_')}",
                 *extra]
    out = root / f"{name.replace(' ', '_')}.json"
    mp.start_processes(_worker, args=(cp, free_port(), overrides, repeats, str(out), threads), nprocs=cp,
                       start_method="spawn")
    got = json.loads(out.read_text())
    return {"run": name, "cp": cp, "activation_mib_per_rank": got["saved_bytes"] / 2**20,
            "step_s": got["seconds"], "tokens_per_s": seq_len / got["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-cp", type=int, default=4, choices=(2, 4),
                    help="the largest cp degree run: 2 runs cp1 and cp2 alone, on 2 processes at most")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each run in all (a multiple of --max-cp; default --max-cp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.threads = args.threads or args.max_cp
    if args.threads < args.max_cp or args.threads % args.max_cp:
        ap.error(f"--threads={args.threads} must be a positive multiple of {args.max_cp} (split evenly over the "
                 f"ranks of cp{args.max_cp})")
    runs = {name: extra for name, extra in RUNS.items() if int(name.split()[0][2:]) <= args.max_cp}
    env = environment()  # before the runs: the load of what else shares the cores
    if not args.json:
        print(header(env), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, extra, args.seq_len, args.repeats, Path(tmp), args.threads)
                for name, extra in runs.items()]
    base = rows[0]["activation_mib_per_rank"]
    for r in rows:
        r["activation_vs_cp1"] = r["activation_mib_per_rank"] / base
    if args.json:
        print(json.dumps({"env": env, "rows": rows}, indent=1))
        return
    print(f"tiny model, one sequence of {args.seq_len} tokens, fp32, CPU/gloo, {args.threads} threads a run; "
          f"medians of {args.repeats}")
    print(f"{'run':<22}{'activations MiB/rank':>22}{'vs cp1':>9}{'step s':>9}{'tokens/s':>10}")
    for r in rows:
        print(f"{r['run']:<22}{r['activation_mib_per_rank']:>22.1f}{r['activation_vs_cp1']:>9.2f}"
              f"{r['step_s']:>9.2f}{r['tokens_per_s']:>10.0f}")


if __name__ == "__main__":
    main()
