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
4. prints predicted, measured and the relative error; `--json PATH` writes all of it (with
   the quick calibration's fields, to price the same runs again with another planner);
   `--results FILE` rewrites this script's section of a results file (RESULTS.md).

Everything runs on one thread (`--threads`, default 1): calibration timed with the
thread's CPU clock, training with OMP_NUM_THREADS=1. On an idle machine a step's CPU
time equals its wall time; on a shared one (this 2-core machine rarely is idle) other
processes stretch wall time but not CPU time, so the error against the median per-step
CPU time is the model's error, and the wall-clock median is reported beside it with
the load average before and after.

Multi-rank layouts (world sizes 2-8: DDP, FSDP, HSDP, TP, PP, FSDP x TP; planner_multirank.py)
run under torchrun, one thread per rank, all ranks sharing this machine's cores; the
quick calibration then also measures gloo collectives at their world sizes. Their
measured step time is rank 0's `step_time_s` (wall) and, beside it, the CPU time of all
ranks per step divided by the cores they can use (min(ranks x threads, cores)): what the
step would take if the ranks had the cores to themselves. `peak_mem_gib` is the maximum
over ranks. `--configs` and `--layouts` choose the two sets (`none` skips one).

    .venv/bin/python benchmarks/planner_validation.py                    # 10 + 12 runs, ~10 min on 2 cores
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
from pathlib import Path

import torch

from shardline.config import load_config
from shardline.planner.calibrate import measure, measure_baseline_gib
from shardline.planner.cli import _config_model
from shardline.planner.estimate import estimate
from shardline.planner.hardware import apply_overrides, cpu_hardware, get_hardware
from shardline.layout import resolve
from shardline.planner.layout import Workload
from shardline.planner.memory import GiB

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_multirank import LAYOUTS, measure_torchrun  # noqa: E402

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
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="single-process configs, comma-separated (or none): " + ", ".join(CONFIGS))
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="multi-rank torchrun layouts, comma-separated (or none): " + ", ".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=8,
                   help="training steps per config (default 8; the first 2 are warm-up)")
    p.add_argument("--profile", help="hardware profile from `shardline calibrate` (default: calibrate quickly now)")
    p.add_argument("--data", default="", help="training data (default: the shipped corpus)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE size trained on the data (default 4096)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every config this many times, in whole passes; the run of median step time counts")
    p.add_argument("--threads", type=int, default=1, help="torch threads for calibration and training (default 1)")
    p.add_argument("--json", help="write every figure as JSON to this file")
    p.add_argument("--results", help="rewrite this script's section of a results markdown file")
    args = p.parse_args(argv)
    args.configs = _names(p, args.configs, CONFIGS, "config")
    args.layouts = _names(p, args.layouts, LAYOUTS, "layout")
    return args


def data_overrides(args: argparse.Namespace) -> list[str]:
    return [f"data.path={args.data}", f"data.vocab_size={args.vocab_size}"]


def machine_profile(args: argparse.Namespace, names: list[str], layouts: list[str]):
    """The planner's view of this machine: a calibrated profile plus this run's process baseline;
    and the quick calibration's fields (None with --profile), kept in the JSON so a later
    planner can be checked against this run's measurements on the same profile."""
    fields = None
    if args.profile:
        hw = get_hardware("cpu", args.profile)
    else:
        bf16 = any("train.precision=bf16" in CONFIGS[n] for n in names)
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        worlds = tuple(sorted({LAYOUTS[n][0] for n in layouts}))  # gloo at the world sizes to be run
        fields, _ = measure(quick=True, comm=bool(worlds), dtypes=("fp32", "bf16") if bf16 else ("fp32",),
                            baseline=False, clock=clock, comm_worlds=worlds)
        hw = apply_overrides(cpu_hardware(), fields, "quick calibration")
    # The data pipeline of these runs (not the default one) sets the resident baseline.
    return hw.with_cpu(process_baseline_gib=measure_baseline_gib(data_overrides(args))), fields


def predict(overrides: list[str], hw, world: int = 1) -> dict:
    cfg = load_config(None, overrides)
    cfg.train.settle_precision(on_gpu=False)  # (these runs are this machine's CPU ranks)
    work = Workload.from_config(cfg, _config_model(cfg))
    e = estimate(work, resolve(cfg, world), hw)
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


def _names(p: argparse.ArgumentParser, text: str, valid: dict, what: str) -> list[str]:
    """The names chosen, each known: refused while parsing, before the table's header is printed."""
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in valid]
    if unknown:
        p.error(f"unknown {what}(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return names


def _compare(pred: dict, meas: dict, cores: float, threads: int) -> dict:
    """Errors against wall time and against CPU time (per rank-core: see the docstring)."""
    world = meas.get("world", 1)
    total = meas["cpu_step_s"] if world == 1 else meas["ranks_cpu_step_s"]  # summed over threads (and ranks)
    cpu = total / min(world * threads, cores) if total else None
    meas["cpu_equiv_step_s"] = cpu
    return {"wall_error_pct": error_pct(pred["step_time_s"], meas["step_time_s"]),
            "time_error_pct": error_pct(pred["step_time_s"], cpu or meas["step_time_s"]),
            "memory_error_pct": error_pct(pred["peak_gib"], meas["peak_gib"])}


def _result(pred: dict, runs: list[dict], overrides: list[str], world: int, cores: float, threads: int) -> dict:
    """One config's row: the run of median step time among its repeats, and the spread of the repeats."""
    meas = dict(sorted(runs, key=lambda m: m["step_time_s"])[(len(runs) - 1) // 2])
    meas["repeat_step_times_s"] = [m["step_time_s"] for m in runs]
    return {"overrides": overrides, "world": world, "predicted": pred, "measured": meas,
            **_compare(pred, meas, cores, threads)}


def run(args: argparse.Namespace) -> dict:
    names, layouts = args.configs, args.layouts  # (lists of known names: parse_args)
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)  # the profile's peak and fits are for this many threads
    hw, calibration = machine_profile(args, names, layouts)
    preds = {name: predict(["model.preset=tiny", *data_overrides(args), *CONFIGS[name]], hw) for name in names}
    preds.update({name: predict([*data_overrides(args), *LAYOUTS[name][1]], hw, LAYOUTS[name][0]) for name in layouts})
    runs: dict[str, list[dict]] = {name: [] for name in (*names, *layouts)}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):  # whole passes: a busy minute lands on one run of a few configs
            for name in names:
                load = os.getloadavg()[0]
                meas = measure_run(name, ["model.preset=tiny", *data_overrides(args), *CONFIGS[name]], args.steps,
                                   Path(tmp) / f"pass{rep}", args.threads)
                runs[name].append({**meas, "world": 1, "load_before": load})
                row = _result(preds[name], runs[name][-1:], CONFIGS[name], 1, hw.cpu.cores, args.threads)
                print(_row(name, row), flush=True)
            for name in layouts:
                world, overrides = LAYOUTS[name]
                meas = measure_torchrun(name, world, [*data_overrides(args), *overrides], RUN_KEYS, args.steps,
                                        Path(tmp) / f"pass{rep}", args.threads)
                runs[name].append(meas)
                row = _result(preds[name], runs[name][-1:], overrides, world, hw.cpu.cores, args.threads)
                print(_row(name, row), flush=True)
    rows = {name: _result(preds[name], runs[name], (CONFIGS.get(name) or LAYOUTS[name][1]),
                          LAYOUTS[name][0] if name in LAYOUTS else 1, hw.cpu.cores, args.threads) for name in runs}
    med = lambda key, sel=None: statistics.median(  # noqa: E731
        abs(r[key]) for r in rows.values() if sel is None or (r["world"] > 1) == sel)
    multi = any(r["world"] > 1 for r in rows.values())
    single = any(r["world"] == 1 for r in rows.values())
    return {"configs": rows, "profile": args.profile or "quick calibration", "calibration": calibration,
            "process_baseline_gib": hw.cpu.process_baseline_gib, "cores": hw.cpu.cores, "network": vars(hw.network),
            "corun": {k: getattr(hw.cpu, f"corun_{k}_eff") for k in ("matmul", "memory", "dispatch")},
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_before": load_before,
                        "load_after": os.getloadavg(), "python": platform.python_version()},
            "date": datetime.date.today().isoformat(), "steps": args.steps, "threads": args.threads,
            "repeat": args.repeat,
            "median_abs_time_error_pct": med("time_error_pct"),
            "median_abs_wall_error_pct": med("wall_error_pct"),
            "median_abs_memory_error_pct": med("memory_error_pct"),
            "by_world": {k: {e: med(e, k == "multi") for e in ("time_error_pct", "wall_error_pct", "memory_error_pct")}
                         for k, present in (("single", single), ("multi", multi)) if present}}


def _row(name: str, r: dict) -> str:
    p, m = r["predicted"], r["measured"]
    cpu = m.get("cpu_equiv_step_s") or float("nan")
    load = m.get("load_before")
    load = f"{load:.1f}" if load is not None else "-"
    reps = m.get("repeat_step_times_s", [])
    spread = f"{100 * (max(reps) - min(reps)) / statistics.median(reps):.0f}%" if len(reps) > 1 else "-"
    return (f"| {name} | {r['world']} | {p['step_time_s']:.3f} | {m['step_time_s']:.3f} | "
            f"{r['wall_error_pct']:+.1f}% | {spread} | {cpu:.3f} | {r['time_error_pct']:+.1f}% | {p['peak_gib']:.3f} | "
            f"{m['peak_gib']:.3f} | "
            f"{r['memory_error_pct']:+.1f}% | {load} |")


HEADER = ("| config | ranks | predicted s/step | measured wall s/step | error | spread of runs "
          "| measured CPU-equiv. s/step | error | predicted peak GiB | measured peak GiB | error | load |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
START, END = "<!-- planner-validation:start -->", "<!-- planner-validation:end -->"


def markdown(res: dict, argv: list[str]) -> str:
    m = res["machine"]
    shared = (" (the 1-minute average also counts what ran just before, and this script's own "
              "multi-rank runs)") if m["load_before"][0] > 1 else ""
    if "--json" in argv:  # where the JSON went is not part of the result
        i = argv.index("--json")
        argv = argv[:i] + argv[i + 2:]
    net = res["network"]
    gloo = ", ".join(f"{w} ranks {a:.0f} us / {net['bw_by_world_gbs'][w]:.2f} GB/s"
                     for w, a in net.get("latency_by_world_us", {}).items())
    corun = res.get("corun", {})
    corun = ("; co-run efficiency with every core busy: " + ", ".join(f"{k} {v:.2f}" for k, v in corun.items())
             if corun else "")
    setting = (f"`.venv/bin/python benchmarks/planner_validation.py {' '.join(argv)}` on {res['date']}: host "
               f"{m['host']} ({m['cpus']} CPUs; the planner's profile: {res['cores']} cores), {res['threads']} torch "
               f"thread(s) per process, hardware profile: {res['profile']} (run first"
               f"{'; gloo alpha / B: ' + gloo if gloo else ''}{corun}), {res['steps']} training steps per config, "
               f"medians of steps 3 on; every config run {res.get('repeat', 1)} time(s), in whole passes, the run "
               f"of median step time shown (of an even count, the faster middle one; *spread of runs*: "
               f"(slowest - fastest) / median of its runs' step times). "
               f"Load average {m['load_before'][0]:.1f} before / {m['load_after'][0]:.1f} "
               f"after{shared}; the *load* column is the 1-minute load average as each run started.")
    legend = ("Single-process configs (ranks 1) are overrides of the `tiny` preset (dim 256, 4 layers, 8 heads / 4 "
              "kv heads, ffn 768, vocab 4096) listed in the script's CONFIGS; multi-rank ones (planner_multirank.py "
              "LAYOUTS, `torchrun --standalone --rdzv_backend=c10d`, gloo) use tiny or `small` (dim 384, 6 layers, "
              "6 heads / 2 kv heads, ffn 1024) at sequence 128, global batch 8. "
              "*Measured wall* is the trainer's own `step_time_s` (rank 0; median). *CPU-equiv.* is CPU time per "
              "step not stretched by other processes: the trainer's for one process; for N ranks the CPU time of "
              "all ranks (gloo threads included) over min(N x threads, cores), i.e. the step if the ranks had the "
              "cores to themselves and kept them busy (it leaves out time all ranks wait idle). Peak memory is "
              "`peak_mem_gib` (peak RSS, maximum over ranks); the predicted one includes the process baseline "
              f"(torch, shardline, tokenizer, dataset), measured separately at {res['process_baseline_gib']:.3f} GiB.")
    parts = []
    for key, label in (("single", "one process"), ("multi", "multi-rank")):
        if key in res["by_world"]:
            b = res["by_world"][key]
            parts.append(f"{label}: step time {b['wall_error_pct']:.1f}% against wall time, "
                         f"{b['time_error_pct']:.1f}% against CPU-equiv. time, "
                         f"peak memory {b['memory_error_pct']:.1f}%")
    summary = "Median absolute error, " + "; ".join(parts) + "."
    rows = [_row(n, r) for n, r in res["configs"].items()]
    return "\n".join([START, "## Planner: predicted vs measured (CPU, world sizes 1-8)", "", setting, "", legend, "",
                      HEADER, *rows, "", summary, NOTES, END])


NOTES = """
What the multi-rank model knows (planner/compute.py, estimate.py, comm.py, memory.py): N
ranks of one thread share the profile's cores (each gets min(1, cores / N) of a core,
dispatcher overhead included), and busy cores slow each other's GEMMs, memory traffic and
dispatch by the calibrated co-run efficiencies (calibrate/corun.py); saturated CPU ranks
overlap no communication; gloo collectives cost the alpha / B calibrated at their group
size, times each op's calibrated factor (reduce-scatter runs about twice its ring model);
the host CPU time of the TP (DTensor) and FSDP2 wrappers per block (FSDP2's also per MB of
the block's parameters) and of the optimizer per DTensor parameter, calibrated with the
trainer's own wrappers (calibrate/dist.py); the scalar all-reduces of every step (the loss;
the gradient norm, one per group of sharded gradients, as the trainer computes it);
pipeline stages split as the trainer splits them (the head counts as blocks on the last
stage); DDP's buckets (a copy of every gradient) and FSDP's gathered root.
On CPU ranks a TP block and TP's ends are charged their calibrated wall time (host work,
collectives and the waits on the peer together: tp_layer_wall_us per block plus a part per
MB of activations, tp_head_wall_us plus a part per MB of a rank's logits), since their many
small gloo collectives wait far beyond their alpha-beta cost.
What it does not know: other processes on the machine (they stretch the wall column),
allocator growth of multi-threaded ranks, and how the co-run and wrapper costs change at
other core counts (calibrated with 2 processes on this 2-core machine). GPUs are not validated here."""


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
    print(f"\nmedian |error|: time {res['median_abs_time_error_pct']:.1f}% (CPU-equiv.), "
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
