#!/usr/bin/env python
"""Planner predicted vs measured: step time and peak memory of real `shardline train` runs on CPU.

For each configuration (single process; the tiny preset and shape variants: width,
depth, heads, sequence, micro-batching, precision, activation checkpointing) the script

1. predicts step time and peak memory with the planner (`shardline estimate`'s code
   path) on a profile of this machine: `--profile FILE` from `shardline calibrate`, or
   a quick calibration run first (fp32 matmuls, attention, bandwidth, per-op overhead,
   optimizer; ~10 s);
2. measures the process baseline (import torch + shardline, build the run's data) in
   a subprocess, since the trainer's CPU peak memory is the process' peak RSS;
3. runs `python -m shardline train` for `--steps` steps with per-step logging and reads
   `step_time_s` (median over the steps after the first two) and `peak_mem_gib` (the
   last record: ru_maxrss) from `<run_dir>/metrics.jsonl`; while it runs, it also reads
   the process' CPU time (/proc/PID/stat) each time a step's record appears;
4. prints predicted, measured and the relative error; `--json PATH` writes all of it;
   `--results FILE` rewrites this script's section of a results file (RESULTS.md).

Everything runs on one thread (`--threads`, default 1): calibration timed with the
thread's CPU clock, training with OMP_NUM_THREADS=1. On an idle machine a step's CPU
time equals its wall time; on a shared one (this 2-core machine rarely is idle) other
processes stretch wall time but not CPU time, so the error against the median per-step
CPU time is the model's error, and the wall-clock median is reported beside it with
the load average before and after.

Only world size 1 is validated: multi-rank layouts wait for the parallel trainer.

    .venv/bin/python benchmarks/planner_validation.py                    # 10 configs, ~7 min on 2 cores
    .venv/bin/python benchmarks/planner_validation.py --profile calibration.toml --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from shardline.config import load_config
from shardline.planner.calibrate import measure, measure_baseline_gib
from shardline.planner.cli import _config_model
from shardline.planner.estimate import estimate
from shardline.planner.hardware import apply_overrides, cpu_hardware, get_hardware
from shardline.planner.layout import Workload, from_config
from shardline.planner.memory import GiB

REPO = Path(__file__).resolve().parents[1]

RUN_KEYS = ["--metrics.log_interval=1", "--metrics.progress=none", "--metrics.tensorboard=false",
            "--checkpoint.interval=0", "--train.eval_interval=0", "--run.device=cpu"]
# name: config overrides on top of the tiny preset (dim 256, 4 layers, 8 heads / 4 kv, ffn 768).
CONFIGS: dict[str, list[str]] = {
    "tiny-s256-b8x2": ["train.seq_len=256", "train.global_batch_size=16", "train.micro_batch_size=8"],
    "tiny-s128-b16": ["train.seq_len=128", "train.global_batch_size=16", "train.micro_batch_size=16"],
    "tiny-s512-b4": ["train.seq_len=512", "train.global_batch_size=4", "train.micro_batch_size=4"],
    "tiny-s256-b2x4": ["train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=2"],
    "narrow-d128-L2-s512": ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                            "model.ffn_dim=384", "train.seq_len=512", "train.global_batch_size=8",
                            "train.micro_batch_size=8"],
    "wide-d512-L4-s256": ["model.dim=512", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=1536",
                          "train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=8"],
    "deep-d384-L8-s128": ["model.dim=384", "model.n_layers=8", "model.n_heads=6", "model.n_kv_heads=2",
                          "model.ffn_dim=1024", "train.seq_len=128", "train.global_batch_size=16",
                          "train.micro_batch_size=8"],
    "tiny-bf16-s256-b8": ["train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=8",
                          "train.precision=bf16"],
    "tiny-acfull-s512-b8": ["train.seq_len=512", "train.global_batch_size=8", "train.micro_batch_size=8",
                            "memory.activation_checkpoint=full"],
    "tiny-acop-s512-b8": ["train.seq_len=512", "train.global_batch_size=8", "train.micro_batch_size=8",
                          "memory.activation_checkpoint=op"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--steps", type=int, default=8,
                   help="training steps per config (default 8; the first 2 are warm-up)")
    p.add_argument("--profile", help="hardware profile from `shardline calibrate` (default: calibrate quickly now)")
    p.add_argument("--data", default="", help="training data (default: the shipped corpus)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE size trained on the data (default 4096)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for calibration and training (default 1)")
    p.add_argument("--json", help="write every figure as JSON to this file")
    p.add_argument("--results", help="rewrite this script's section of a results markdown file")
    return p.parse_args(argv)


def data_overrides(args: argparse.Namespace) -> list[str]:
    return [f"data.path={args.data}", f"data.vocab_size={args.vocab_size}"]


def machine_profile(args: argparse.Namespace, names: list[str]):
    """The planner's view of this machine: a calibrated profile plus this run's process baseline."""
    if args.profile:
        hw = get_hardware("cpu", args.profile)
    else:
        bf16 = any("train.precision=bf16" in CONFIGS[n] for n in names)
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        fields, _ = measure(quick=True, comm=False, dtypes=("fp32", "bf16") if bf16 else ("fp32",), baseline=False,
                            clock=clock)
        hw = apply_overrides(cpu_hardware(), fields, "quick calibration")
    # The data pipeline of these runs (not the default one) sets the resident baseline.
    return replace(hw, process_baseline_gib=measure_baseline_gib(data_overrides(args)))


def predict(overrides: list[str], hw) -> dict:
    cfg = load_config(None, overrides)
    work = Workload(_config_model(cfg), cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.precision,
                    cfg.train.document_mask, cfg.model.preset)
    e = estimate(work, from_config(cfg, 1), hw)
    return {"step_time_s": e.step_time_s, "peak_gib": e.memory["total"] / GiB,
            "breakdown_s": e.breakdown, "memory_gib": {k: v / GiB for k, v in e.memory.items()}}


def measure_run(name: str, overrides: list[str], steps: int, tmp: Path, threads: int) -> dict:
    run_dir = tmp / name
    argv = [sys.executable, "-m", "shardline", "train", *RUN_KEYS, f"--run.dir={run_dir}",
            f"--train.steps={steps}", *(f"--{o}" for o in overrides)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    # Started by a small shell, not by this process: Linux carries the parent's resident size
    # into a child's ru_maxrss (the trainer's CPU peak memory) across fork + exec, and this
    # process holds torch and the calibration's tensors. `; exit $?` keeps the shell from
    # exec-ing the trainer in its own place.
    shell = ["/bin/sh", "-c", shlex.join(argv) + "; exit $?"]
    proc = subprocess.Popen(shell, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cpu_at_step = _follow_cpu_time(proc, run_dir / "metrics.jsonl")
    _, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: shardline train failed:\n{err[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    times = [r["step_time_s"] for r in train[2:]] or [r["step_time_s"] for r in train]
    cpu = [b - a for a, b in itertools.pairwise(cpu_at_step)][1:]  # from step 3 on, like `times`
    return {"step_time_s": statistics.median(times), "fastest_step_s": min(times), "step_times_s": times,
            "cpu_step_s": statistics.median(cpu) if cpu else None, "cpu_step_times_s": cpu,
            "peak_gib": train[-1]["peak_mem_gib"]}


def _follow_cpu_time(proc: subprocess.Popen, metrics: Path) -> list[float]:
    """The trainer's CPU seconds (user + system) each time a train record appears in `metrics`.

    The trainer is the shell's child: /proc/<shell>/task/<shell>/children names it.
    """
    tick = os.sysconf("SC_CLK_TCK")
    seen, marks, pid = 0, [], None
    while proc.poll() is None:
        time.sleep(0.01)
        try:
            pid = pid or int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            text = metrics.read_text() if metrics.exists() else ""
        except (OSError, IndexError, ValueError):
            continue
        count = text.count('"kind": "train"')
        if count > seen:
            seen = count
            marks.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return marks


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def run(args: argparse.Namespace) -> dict:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {', '.join(unknown)}; valid: {', '.join(CONFIGS)}")
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)  # the profile's peak and fits are for this many threads
    hw = machine_profile(args, names)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            overrides = ["model.preset=tiny", *data_overrides(args), *CONFIGS[name]]
            pred = predict(overrides, hw)
            meas = measure_run(name, overrides, args.steps, Path(tmp), args.threads)
            rows[name] = {"overrides": CONFIGS[name], "predicted": pred, "measured": meas,
                          "wall_error_pct": error_pct(pred["step_time_s"], meas["step_time_s"]),
                          "time_error_pct": error_pct(pred["step_time_s"], meas["cpu_step_s"] or meas["step_time_s"]),
                          "memory_error_pct": error_pct(pred["peak_gib"], meas["peak_gib"])}
            print(_row(name, rows[name]), flush=True)
    return {"configs": rows, "profile": args.profile or "quick calibration",
            "process_baseline_gib": hw.process_baseline_gib,
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_before": load_before,
                        "load_after": os.getloadavg(), "python": platform.python_version()},
            "date": datetime.date.today().isoformat(), "steps": args.steps, "threads": args.threads,
            "median_abs_time_error_pct": statistics.median(abs(r["time_error_pct"]) for r in rows.values()),
            "median_abs_wall_error_pct": statistics.median(abs(r["wall_error_pct"]) for r in rows.values()),
            "median_abs_memory_error_pct": statistics.median(abs(r["memory_error_pct"]) for r in rows.values())}


def _row(name: str, r: dict) -> str:
    p, m = r["predicted"], r["measured"]
    cpu = m["cpu_step_s"] or float("nan")
    return (f"| {name} | {p['step_time_s']:.3f} | {cpu:.3f} | {r['time_error_pct']:+.1f}% | {m['step_time_s']:.3f} | "
            f"{r['wall_error_pct']:+.1f}% | {p['peak_gib']:.3f} | {m['peak_gib']:.3f} | "
            f"{r['memory_error_pct']:+.1f}% |")


HEADER = ("| config | predicted s/step | measured CPU s/step | error | measured wall s/step | error | "
          "predicted peak GiB | measured peak GiB | error |\n|---|---|---|---|---|---|---|---|---|")
START, END = "<!-- planner-validation:start -->", "<!-- planner-validation:end -->"


def markdown(res: dict, argv: list[str]) -> str:
    m = res["machine"]
    shared = " (the machine was shared with other sessions' work)" if m["load_before"][0] > 1 else ""
    if "--json" in argv:  # where the JSON went is not part of the result
        i = argv.index("--json")
        argv = argv[:i] + argv[i + 2:]
    setting = (f"`.venv/bin/python benchmarks/planner_validation.py {' '.join(argv)}` on {res['date']}: host "
               f"{m['host']} ({m['cpus']} CPUs), {res['threads']} torch thread(s), hardware profile: "
               f"{res['profile']} (run first, ~10 s), {res['steps']} training steps per config, medians of "
               f"steps 3 on. Load average {m['load_before'][0]:.1f} before / {m['load_after'][0]:.1f} after"
               f"{shared}.")
    legend = ("Configs are overrides of the `tiny` preset (dim 256, 4 layers, 8 heads / 4 kv heads, ffn "
              "768, vocab 4096), listed in the script's CONFIGS: sequence length, micro-batch x "
              "accumulation, width, depth, heads, bf16 autocast, activation checkpointing (full, op); "
              "shipped corpus, fp32 unless noted. "
              "*Measured CPU* is the trainer process' CPU time per step (one thread: equal to wall time "
              "on an idle machine, and not stretched by other processes); *measured wall* is the "
              "trainer's own `step_time_s`. Peak memory is the trainer's `peak_mem_gib` (peak RSS); "
              "the predicted one includes the process baseline (torch, shardline, tokenizer, dataset), "
              f"measured separately at {res['process_baseline_gib']:.3f} GiB.")
    summary = (f"Median absolute error: step time {res['median_abs_time_error_pct']:.1f}% against CPU time "
               f"({res['median_abs_wall_error_pct']:.1f}% against wall time), peak memory "
               f"{res['median_abs_memory_error_pct']:.1f}%. Not validated yet: multi-rank layouts (DDP, "
               "FSDP, TP, PP: the planner's predictions for them have no measured counterpart here) and GPUs.")
    rows = [_row(n, r) for n, r in res["configs"].items()]
    return "\n".join([START, "## Planner: predicted vs measured (CPU, world size 1)", "", setting, "", legend, "",
                      HEADER, *rows, "", summary, END])


def write_results(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(HEADER, flush=True)
    res = run(args)
    print(f"\nmedian |error|: time {res['median_abs_time_error_pct']:.1f}% (CPU), "
          f"{res['median_abs_wall_error_pct']:.1f}% (wall), memory "
          f"{res['median_abs_memory_error_pct']:.1f}%; load {res['machine']['load_before'][0]:.1f} -> "
          f"{res['machine']['load_after'][0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.results:
        write_results(Path(args.results), markdown(res, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
