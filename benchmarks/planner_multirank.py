"""Multi-rank layouts for planner_validation.py: real `torchrun ... -m shardline train` runs on CPU (gloo).

Each layout is a set of config overrides and a world size. The run is started as

    torchrun --standalone --nproc_per_node=N --rdzv_backend=c10d -m shardline train ...

with one torch thread per rank (OMP_NUM_THREADS=1), so N ranks share the machine's
cores; the planner's `cpu` profile models that (Hardware.cpu.cores, .threads) and the gloo
collectives measured by `shardline calibrate` at world sizes 2, 4 and 8.

Measured: `step_time_s` of rank 0's metrics.jsonl (every step is a collective, so all
ranks agree), median over the steps after the first two, and `peak_mem_gib`, already
the maximum over ranks (the trainer all-reduces it).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Model variants (overrides of the tiny preset) and shared batch settings.
TINY = ["model.preset=tiny", "train.seq_len=128", "train.global_batch_size=8"]
SMALL = ["model.preset=tiny", "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.n_kv_heads=2",
         "model.ffn_dim=1024", "train.seq_len=128", "train.global_batch_size=8"]

# name: (world size, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tiny-ddp2": (2, [*TINY, "train.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "tiny-fsdp2": (2, [*TINY, "train.micro_batch_size=4", "parallel.dp_shard=2"]),
    "tiny-fsdp4": (4, [*TINY, "train.micro_batch_size=2", "parallel.dp_shard=4"]),
    "tiny-hsdp2x2": (4, [*TINY, "train.micro_batch_size=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tiny-tp2": (2, [*TINY, "train.micro_batch_size=8", "parallel.tp=2", "parallel.dp_shard=1"]),
    "tiny-pp2-1f1b": (2, [*TINY, "train.micro_batch_size=2", "parallel.pp=2", "parallel.dp_shard=1",
                          "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=4"]),
    "tiny-fsdp2-pp2": (4, [*TINY, "model.n_layers=4", "train.micro_batch_size=1", "parallel.dp_shard=2",
                           "parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "tiny-zero2-pp2": (4, [*TINY, "model.n_layers=4", "train.micro_batch_size=1", "parallel.dp_shard=2",
                           "parallel.zero=2", "parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "tiny-fsdp2-tp2": (4, [*TINY, "train.micro_batch_size=4", "parallel.dp_shard=2", "parallel.tp=2"]),
    "tiny-fsdp8": (8, [*TINY, "train.micro_batch_size=1", "parallel.dp_shard=8"]),
    "small-fsdp2": (2, [*SMALL, "train.micro_batch_size=4", "parallel.dp_shard=2"]),
    "small-tp2": (2, [*SMALL, "train.micro_batch_size=8", "parallel.tp=2", "parallel.dp_shard=1"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(world: int, overrides: list[str], run_keys: list[str], run_dir: Path, steps: int) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_free_port()}"]
    return [*launcher, "-m", "shardline", "train", *run_keys, f"--run.dir={run_dir}", f"--train.steps={steps}",
            *(f"--{o}" for o in overrides)]


def measure_torchrun(name: str, world: int, overrides: list[str], run_keys: list[str], steps: int, tmp: Path,
                     threads: int = 1) -> dict:
    """Run one layout under torchrun; step time and peak memory from rank 0's metrics.jsonl."""
    run_dir = tmp / name
    argv = torchrun_argv(world, overrides, run_keys, run_dir, steps)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    # Through a small shell, like the single-process runs: the ranks' ru_maxrss then starts from
    # torchrun's resident size (carried across fork + exec), not from this process' larger one.
    proc = subprocess.Popen(["/bin/sh", "-c", shlex.join(argv) + "; exit $?"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpu_at_step = follow_ranks_cpu(proc, run_dir / "metrics.jsonl", world)
    _, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: torchrun failed (rc {proc.returncode}):\n{err[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    times = [r["step_time_s"] for r in train[2:]] or [r["step_time_s"] for r in train]
    cpu = [b - a for a, b in zip(cpu_at_step, cpu_at_step[1:])][1:]  # from step 3 on, like `times`
    return {"step_time_s": statistics.median(times), "fastest_step_s": min(times), "step_times_s": times,
            "ranks_cpu_step_s": statistics.median(cpu) if cpu else None, "ranks_cpu_step_times_s": cpu,
            "peak_gib": max(r["peak_mem_gib"] for r in train), "world": world,
            "load_before": load, "load_after": os.getloadavg()[0], "run_s": time.perf_counter() - start}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _cpu_s(pid: int, tick: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def _is_rank(pid: int) -> bool:
    try:
        return b"shardline" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def follow_ranks_cpu(proc: subprocess.Popen, metrics: Path, world: int) -> list[float]:
    """CPU seconds (user + system) of all ranks together, each time rank 0 logs a train record.

    The ranks are the children of torchrun (itself the shell's child) running shardline;
    all `world` of them are found before the first record. A rank's gloo threads count
    too: they run on the same cores.
    """
    tick = os.sysconf("SC_CLK_TCK")
    seen, marks, ranks, size = 0, [], [], -1
    while proc.poll() is None:
        time.sleep(0.01)
        try:
            if len(ranks) < world:
                ranks = [r for t in _children(proc.pid) for r in _children(t) if _is_rank(r)]
                continue
            # The ranks keep every core busy: read the log only when it grew, so this loop
            # takes as little CPU from them as it can.
            if not metrics.exists() or metrics.stat().st_size == size:
                continue
            size = metrics.stat().st_size
            count = metrics.read_text().count('"kind": "train"')
            if count > seen:
                seen = count
                marks.append(sum(_cpu_s(r, tick) for r in ranks))
        except (OSError, IndexError, ValueError):
            continue
    return marks


if __name__ == "__main__":
    # A library of layouts, not a benchmark of its own: a run (or --help) says where it is used.
    print("planner_multirank.py is a library: run its layouts through `benchmarks/planner_validation.py "
          f"--layouts NAME,...` ({', '.join(LAYOUTS)})")
    sys.exit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
