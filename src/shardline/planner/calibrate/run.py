"""`shardline calibrate`: measure this machine, write a profile the planner uses instead of datasheets.

What is measured and how is in ops.py (compute, memory traffic, overheads)
and comm.py (gloo collectives between local processes); here the points
are fitted to the planner's curves and written as a TOML profile:

* matmul: linear forward + backward rates per dtype over GEMM shapes, fitted to
  eff_max · Π x/(x + d0) (grid search on d0, geometric mean for eff_max)
* attention: SDPA forward + backward with a document mask over sequence lengths,
  fitted the same way (attn_eff, attn_half_len)
* element-wise bandwidth (mem_bw_gbs), the loss' share of it (loss_eff), per-op
  overhead, optimizer traffic per parameter
* the resident memory of a trainer process before the model: torch, shardline and the
  default data pipeline (shipped corpus, cached tokenizer), in a subprocess
* collective latency and bandwidth ([network] intra_latency_us, intra_bw_gbs, and per
  world size 2, 4, 8: latency_by_world_us, bw_by_world_gbs)
* on a CPU, in the [cpu] table: the thread count the figures are for and the cores ranks
  share (threads, cores), the process baseline (process_baseline_gib),
  and how much busy cores slow each other (corun_matmul_eff, corun_memory_eff,
  corun_dispatch_eff; corun.py), and the host time of the TP/FSDP2 wrappers (dist.py)
* every compute figure is the median over 3 interleaved rounds of measurements

On a GPU the same code measures the GPU (the timings synchronise); the profile's
`base` names the table entry it refines. Raw points go under [measured].
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from shardline.devices import cpu_load
from shardline.errors import ConfigError, ShardlineError
from shardline.planner.calibrate import ops
from shardline.planner.calibrate.comm import measure_collectives
from shardline.planner.calibrate.corun import measure_corun
from shardline.planner.calibrate.dist import measure_wrappers
from shardline.planner.hardware import (Hardware, cpu_cores, cpu_hardware, detected_gpu, get_hardware,
                                        read_profile, to_toml, with_local_memory)

# (m tokens, n out, k in); the first eight are the quick set
GEMMS = [(4096, 256, 256), (4096, 768, 256), (4096, 256, 768), (4096, 128, 128), (2048, 64, 256), (512, 128, 128),
         (1024, 1024, 1024), (2048, 4096, 256), (2048, 512, 512), (4096, 4096, 128), (2048, 2048, 2048)]
ATTENTION = [(8, 8, 128, 32), (4, 8, 256, 32), (2, 8, 512, 32), (1, 8, 1024, 32)]  # b, heads, s, head_dim


def fit_curve(points: list[tuple[float, tuple[float, ...]]], d0: float | None = None) -> tuple[float, float]:
    """Fit efficiencies e_i ~ e_max · Π_j x_ij/(x_ij + d0): returns (e_max, d0).

    d0 is chosen on a log grid to make the implied e_max of the points most alike (least
    variance of their logs), unless given; e_max is then their geometric mean.
    """
    best = (math.inf, 1.0, 1.0)
    for half in [d0] if d0 is not None else [2 ** (k / 4) for k in range(37)]:  # 1 .. 512
        implied = [math.log(e / math.prod(x / (x + half) for x in dims)) for e, dims in points]
        spread = statistics.pvariance(implied) if len(implied) > 1 else 0.0
        if spread < best[0]:
            best = (spread, math.exp(statistics.fmean(implied)), half)
    return best[1], best[2]


def measure_baseline_gib(overrides: list[str] = ()) -> float:
    """Peak RSS of a process that imports the trainer and builds the data of a config (GiB).

    Without overrides that is the default data: the shipped corpus and its tokenizer.
    """
    # VmHWM, the peak of this process image: ru_maxrss would start from the parent's RSS
    # (Linux carries it across fork + exec), and the parent here is a big Python.
    code = ("import resource, re; import shardline.trainer; from shardline.config import load_config; "
            f"from shardline.data import build_data; build_data(load_config(None, {list(overrides)!r})); "
            "m = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()); "
            "print(m.group(1) if m else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    from shardline.config import load_config
    from shardline.data import build_data

    # Built here first: a first build may train and cache the tokenizer, which a training run
    # (and so the measured process) then only loads.
    build_data(load_config(None, list(overrides)))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    except (subprocess.SubprocessError, OSError) as e:
        raise ShardlineError(f"calibrate: could not measure the process baseline: {e}") from None
    return int(out.stdout.strip().splitlines()[-1]) / 2**20


ROUNDS = 3  # every compute figure: the median over interleaved rounds


def _one_round(device: torch.device, hw: Hardware, dtypes, gemms, attn, clock) -> dict:
    """Every compute measurement once: raw efficiencies and rates, fitted later."""
    pts: dict = {}
    for dtype in dtypes:
        peak = hw.peak(dtype)
        pts[f"linear_{dtype}"] = [p["eff"] for p in ops.measure_linear(dtype, device, peak, gemms, clock)]
        pts[f"attention_{dtype}"] = [p["eff"] for p in ops.measure_attention(dtype, device, peak, attn, clock)]
        pts[f"elementwise_{dtype}"] = ops.measure_elementwise(device, dtype, clock=clock)
    pts["stream"] = ops.measure_bandwidth(device, clock=clock)
    # At a unit bandwidth these return rates (loss GB/s, optimizer seconds x 1e9 per parameter);
    # they become shares of the median element-wise rate once all rounds are in.
    pts["loss_gbs"] = ops.measure_loss_eff(device, 1.0, clock=clock)
    pts["optimizer_ns_per_param"] = ops.measure_optimizer(device, 1.0, clock=clock)
    pts["op_overhead_us"] = ops.measure_op_overhead(device, clock=clock)
    return pts


def _median_rounds(rounds: list):
    """Element-wise median of same-shaped measurements (numbers, lists, dicts)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: _median_rounds([r[k] for r in rounds]) for k in first}
    if isinstance(first, list):
        return [_median_rounds([r[i] for r in rounds]) for i in range(len(first))]
    return statistics.median(rounds)


def measure(quick: bool = False, comm: bool = True, dtypes: tuple[str, ...] = ("fp32", "bf16"),
            baseline: bool = True, clock=time.perf_counter, comm_worlds: tuple[int, ...] = (),
            rounds: int = ROUNDS) -> tuple[dict, dict]:
    """(profile fields, raw measurements) for this machine.

    The compute measurements run `rounds` times, one after another, and each point is the
    median of its rounds before the curves are fitted: a busy second on a shared machine
    then shifts one round of one point, not the fit.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hw: Hardware = cpu_hardware() if device.type == "cpu" else _gpu_entry()
    gemms, attn = (GEMMS[:8], ATTENTION[:3]) if quick else (GEMMS, ATTENTION)
    pts = _median_rounds([_one_round(device, hw, dtypes, gemms, attn, clock) for _ in range(rounds)])
    fields: dict = {"base": hw.name, "matmul_eff_max": {}, "attn_eff": {}, "elementwise_eff": {}}
    if device.type == "cpu":  # the efficiencies are relative to this host's assumed peak: kept with them, so they
        fields["peak_tflops"] = dict(hw.peak_tflops)  # mean the same FLOP/s where another assumes another
    raw: dict = {}
    d0 = s0 = None  # the shape curves are fitted on the first dtype (fp32, training's) and shared
    for dtype in dtypes:
        peak = hw.peak(dtype)
        fields["matmul_eff_max"][dtype], d0 = fit_curve([(e, g) for e, g in zip(pts[f"linear_{dtype}"], gemms)], d0)
        fields["attn_eff"][dtype], s0 = fit_curve([(e, (a[2], a[2])) for e, a in zip(pts[f"attention_{dtype}"], attn)],
                                                  s0)
        raw[f"linear_{dtype}_tflops"] = [round(e * peak / 1e12, 5) for e in pts[f"linear_{dtype}"]]
        raw[f"attention_{dtype}_eff"] = [round(e, 5) for e in pts[f"attention_{dtype}"]]
        fields["elementwise_eff"][dtype] = pts[f"elementwise_{dtype}"]
    fields["matmul_half_dim"], fields["attn_half_len"] = d0, s0
    raw.update({f"stream_{k}_gbs": round(v, 3) for k, v in pts["stream"].items()})
    # mem_bw_gbs is the fp32 element-wise rate; each dtype's rate is expressed as a share of it.
    fields["mem_bw_gbs"] = fields["elementwise_eff"].get("fp32") or next(iter(fields["elementwise_eff"].values()))
    fields["elementwise_eff"] = {k: v / fields["mem_bw_gbs"] for k, v in fields["elementwise_eff"].items()}
    fields["loss_eff"] = pts["loss_gbs"] / fields["mem_bw_gbs"]
    fields["op_overhead_us"] = pts["op_overhead_us"]
    fields["optimizer_bytes_per_param"] = pts["optimizer_ns_per_param"] * fields["mem_bw_gbs"]
    cpu: dict = {}  # the profile's [cpu] table (CpuRanks): figures only CPU ranks need
    if device.type == "cpu" and baseline:
        cpu["process_baseline_gib"] = measure_baseline_gib()
    if comm:
        net, points = measure_collectives(world_sizes=comm_worlds or ((2,) if quick else (2, 4, 8)))
        fields["network"] = net
        raw["collectives"] = points
        if device.type == "cpu":
            wrappers, raw["wrappers"] = measure_wrappers()
            cpu.update(wrappers)
            # Ranks share the node's cores: how much each slows the others (corun.py).
            cpu.update({f"corun_{k}_eff": v for k, v in measure_corun(cpu_cores()).items()})
    if cpu:
        fields["cpu"] = cpu
    return fields, raw


def _gpu_entry() -> Hardware:
    return with_local_memory(get_hardware(detected_gpu()))


def calibrate(out: str | Path, quick: bool = False, comm: bool = True, threads: int | None = None) -> dict:
    """Measure, write the profile to `out`, print it. CPU: `threads` torch threads (default:
    torch's), the caller's count restored after."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _calibrate(out, quick, comm)
    finally:
        torch.set_num_threads(before)


def _calibrate(out: str | Path, quick: bool, comm: bool) -> dict:
    on_cpu = not torch.cuda.is_available()
    # One thread on a CPU: time with the thread's CPU clock, which other processes do not stretch.
    clock = time.thread_time if on_cpu and torch.get_num_threads() == 1 else time.perf_counter
    load = cpu_load()
    start = time.perf_counter()
    fields, raw = measure(quick=quick, comm=comm, clock=clock)
    if on_cpu:  # (measure keeps the peak of this thread count with the efficiencies)
        host = cpu_hardware()
        fields["cpu"] = {**fields.get("cpu", {}), "threads": host.cpu.threads, "cores": host.cpu.cores}
    busy = (f"\nWARNING: the machine was busy (load average {load:.1f} on {os.cpu_count()} CPUs): multi-threaded "
            "timings are inflated; calibrate on an idle machine, or with --threads 1") if (
        on_cpu and load > 0.5 * (os.cpu_count() or 1) and torch.get_num_threads() > 1) else ""
    comment = (f"shardline hardware profile, written by `shardline calibrate` in {time.perf_counter() - start:.0f} s\n"
               f"host {platform.node()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads, load average {load:.1f}\nuse: shardline plan|estimate ... "
               f"--gpu {fields['base']} --profile {out}  (train with the same number of threads)\n"
               f"[measured] holds the raw points; the planner ignores it{busy}")
    text = to_toml({**fields, "measured": _flat(raw)}, comment)
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as e:
        raise ShardlineError(f"calibrate: cannot write {out}: {e}") from None
    print(text)
    _check_readable(out)
    return fields


def _check_readable(out: str | Path) -> None:
    """Read the written profile back as `plan --profile` will, so a figure it refuses is said now,
    not at the first plan. The file stays: its [measured] points are what a look needs."""
    try:
        profile = read_profile(out)
        get_hardware(profile["base"], out)
    except ConfigError as e:
        raise ShardlineError(f"calibrate: the profile it wrote is not usable ({e}); {out} keeps the "
                             "measurements ([measured]) for a look; calibrate again on an idle machine") from None


def _flat(raw: dict) -> dict:
    """[measured] as one TOML table: lists of numbers, and nested dicts flattened into keys."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out
