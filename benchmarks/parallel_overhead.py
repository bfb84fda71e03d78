"""Tokens/s and peak memory per rank of each parallel layout at world size 4, vs DDP.

Every layout is launched as a user would (`torchrun -m shardline train`) on CPU with
gloo, on the same model, data and global batch; step times are medians over the steps
after warm-up, read from each run's metrics.jsonl (peak memory there is the max over
ranks of the process peak RSS). The layouts run in rounds (every layout once per round,
`--repeat` rounds), so a drift of the machine's speed reaches all of them; a layout's
figures are the medians over the rounds, its ratio to DDP the median of the per-round
ratios, and `spread` the range of its step times over the rounds. On 2 cores, 4 processes
share the CPU, so the figures rank the layouts' overheads (communication, resharding,
bubbles) rather than show speed-ups.

    python benchmarks/parallel_overhead.py [--steps 12] [--repeat 3] [--json]

`--json` prints {"env": the machine, "rows": one per layout} instead of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _env import environment, header

WARMUP = 3  # the first train records of each run, left out of its figures (warm-up)
MODEL = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_dim=384", "--data.vocab_size=2048"]
LAYOUTS = {
    "ddp": ["--parallel.dp_replicate=4", "--parallel.dp_shard=1"],
    "zero2": ["--parallel.dp_shard=4", "--parallel.zero=2"],
    "zero3": ["--parallel.dp_shard=4", "--parallel.zero=3"],
    "hsdp 2x2": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
    "fsdp2 x tp2 (sp)": ["--parallel.dp_shard=2", "--parallel.tp=2"],
    "fsdp2 x pp2 (1f1b)": ["--parallel.dp_shard=2", "--parallel.pp=2"],
    "tp2 x pp2 (interleaved)": ["--parallel.tp=2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                "--parallel.pp_virtual_stages=2"],
    "zero3 + full AC": ["--parallel.dp_shard=4", "--memory.activation_checkpoint=full"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, extra: list[str], steps: int, root: Path) -> dict:
    run = root / name.replace(" ", "_")
    run.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--master_port={free_port()}",
           "-m", "shardline", "train", *MODEL, *extra, f"--run.dir={run}", f"--train.steps={steps}",
           "--train.seq_len=128", "--train.global_batch_size=16", "--train.micro_batch_size=2",
           "--train.eval_interval=0", "--checkpoint.interval=0", "--metrics.log_interval=1",
           "--metrics.progress=none", "--metrics.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        return {"layout": name, "error": out.stderr.strip().splitlines()[-1]}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"][WARMUP:]
    step_s = statistics.median(r["step_time_s"] for r in train)
    return {"layout": name, "step_time_s": step_s, "tokens_per_s": 16 * 128 / step_s,
            "peak_mem_gib_per_rank": max(r["peak_mem_gib"] for r in train), "final_loss": train[-1]["loss"]}


def summarize(name: str, runs: list[dict], base: list[dict] | None) -> dict:
    """One layout's figures over the rounds (medians; vs_ddp from each round's pair)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    times = [r["step_time_s"] for r in runs]
    step_s = statistics.median(times)
    row = {"layout": name, "step_time_s": step_s, "tokens_per_s": 16 * 128 / step_s, "rounds": len(runs),
           "step_times_s": times, "spread": (max(times) - min(times)) / step_s,
           "peak_mem_gib_per_rank": statistics.median(r["peak_mem_gib_per_rank"] for r in runs),
           "final_loss": runs[0]["final_loss"]}
    if base and not any("error" in b for b in base):
        row["vs_ddp"] = statistics.median(b["step_time_s"] / r["step_time_s"] for b, r in zip(base, runs))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help=f"per run, the first {WARMUP} not counted")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all layouts (medians are reported)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: must be at least 1")
    if args.steps <= WARMUP:  # no step left to count: found only after every torchrun had finished
        parser.error(f"--steps {args.steps}: must be at least {WARMUP + 1} (the first {WARMUP} are warm-up)")
    env = environment()  # before the runs: the load of what else shares the cores
    if not args.json:
        print(header(env), flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for name, extra in LAYOUTS.items():
                runs[name].append(run_layout(name, extra, args.steps, Path(tmp) / f"round{i}"))
    rows = [summarize(name, r, runs["ddp"]) for name, r in runs.items()]
    if args.json:
        print(json.dumps({"env": env, "rows": rows}, indent=1))
        return
    print(f"medians over {args.repeat} rounds")
    print(f"{'layout':26s} {'tokens/s':>9s} {'vs DDP':>7s} {'step s':>7s} {'spread':>7s} {'peak GiB/rank':>13s} "
          f"{'loss':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:26s} failed: {r['error']}")
            continue
        print(f"{r['layout']:26s} {r['tokens_per_s']:9.0f} {r.get('vs_ddp', 0):7.2f} {r['step_time_s']:7.3f} "
              f"{r['spread']:6.0%} {r['peak_mem_gib_per_rank']:13.3f} {r['final_loss']:7.4f}")


if __name__ == "__main__":
    main()
