"""What `shardline simulate` prints: a JSON document and a human-readable summary."""

from __future__ import annotations

import math
from typing import Any

from shardline.simulator.failures import LLAMA3_CAUSES
from shardline.simulator.job import state_bytes
from shardline.simulator.montecarlo import Setup

_BUCKET_LABELS = {
    "recompute": "recompute since last checkpoint",
    "checkpoint": "checkpoint stalls",
    "detection": "failure detection",
    "restart": "restart + checkpoint load",
    "stragglers": "stragglers",
    "planned": "planned maintenance",
}


def _finite(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def build_report(setup: Setup, summary: dict, seeds: int, sweeps: dict[str, list] | None = None,
                 simulated_optimum_s: float | None = None) -> dict[str, Any]:
    """The `--json` document. Scalars for the keys scripts rely on; details beside them."""
    job, pol, s = setup.job, setup.policy, setup.settings
    mode = pol.mode
    expected_unexpected = job.duration_s / setup.mtbf_s
    report: dict[str, Any] = {
        "model": job.model_name, "gpu": job.gpu, "gpus": job.gpus, "gpus_per_node": job.gpus_per_node,
        "nodes": job.nodes, "days": job.days, "seeds": seeds,
        "step_time_s": setup.step_s, "step_time_source": setup.step_source,
        "checkpoint": {"mode": mode, "interval_steps": pol.interval_steps,
                       "interval_s": pol.interval_steps * setup.step_s, "stall_s": pol.stall_s,
                       "save_s": setup.save_s, "snapshot_s": setup.snapshot_s,
                       "persist_every": pol.persist_every, "priced_from": _checkpoint_pricing(setup)},
        "mtbf_hours": _finite(setup.mtbf_s / 3600.0),
        "failure_rate_per_gpu_hour": s.failures.per_gpu_hour(job.gpus_per_node),
        "expected_interruptions": {"unexpected": expected_unexpected,
                                   "planned": s.failures.planned_per_day * job.days},
        "interruptions": summary["total"]["mean"],
        "interruptions_std": summary["total"]["std"],
        "interruptions_unexpected": summary["unexpected"]["mean"],
        "interruptions_planned": summary["planned"]["mean"],
        "interruptions_by_cause": summary["by_cause"],
        "interruptions_hardware_share": _hardware_share(summary["by_cause"]),
        "goodput": summary["goodput"]["mean"],
        "goodput_std": summary["goodput"]["std"],
        "goodput_min": summary["goodput"]["min"],
        "goodput_max": summary["goodput"]["max"],
        "gpu_hours": summary["gpu_hours"],
        "lost_gpu_hours": sum(summary["lost_gpu_hours"].values()),
        "lost_gpu_hours_by_bucket": summary["lost_gpu_hours"],  # where the hours went (rollback, restart, ...)
        "lost_gpu_hours_by_cause": summary["lost_gpu_hours"],  # its older, misleading name, kept for scripts
        "lost_gpu_hours_by_failure": summary["lost_gpu_hours_by_failure"],
        "optimal_checkpoint_interval_s": _finite(setup.optimal_s(mode)),
        "optimal_checkpoint_interval_steps": (None if math.isinf(setup.optimal_s(mode))  # (null as its seconds)
                                              else setup.steps_for(setup.optimal_s(mode))),
        "young_interval_s": _finite(setup.young_s(mode)),
        "daly_interval_s": _finite(setup.daly_s(mode)),
    }
    if sweeps:
        report["sweep"] = sweeps
        report["simulated_optimum_interval_s"] = simulated_optimum_s
    return report


def _hardware_share(by_cause: dict[str, float]) -> float | None:
    """Share of unexpected interruptions from confirmed or suspected hardware (the paper's ~78%)."""
    total = sum(by_cause.values())
    return sum(by_cause[c.name] for c in LLAMA3_CAUSES if c.hardware) / total if total else None


def _secs(x: float | None) -> str:
    if x is None:
        return "none"
    return f"{x:,.0f} s" if x >= 999.5 else f"{x:.3g} s"  # (1,950 s, not 1.95e+03 s; 999.7 s rounds to 1,000)


def _optimal_line(r: dict[str, Any]) -> str:
    optimal, ck = r["optimal_checkpoint_interval_s"], r["checkpoint"]
    if optimal is None:
        return "optimal         none: no failures to recover from (each checkpoint costs its stall, and saves nothing)"
    held = (" (async: held at the write time, a snapshot waits for the last write)"
            if ck["mode"] == "async" and r["daly_interval_s"] is not None and optimal > r["daly_interval_s"] else "")
    steps = r["optimal_checkpoint_interval_steps"]  # (whole steps: their seconds near, not at, the optimum)
    return (f"optimal         {_secs(optimal)} ~ {steps:,} steps ({_secs(steps * r['step_time_s'])}) "
            f"(Young {_secs(r['young_interval_s'])}, Daly {_secs(r['daly_interval_s'])}){held}")


def _checkpoint_pricing(setup: Setup) -> str:
    """What the save and stall times rest on, with the keys that change them: their sizes and speeds
    are assumptions (the Llama 3 store's 2 TB/s), which a measured --save-time or --snapshot-time replaces.
    A sync save's stall is its write; async and memory saves stall for the copy to the host."""
    job, s, mode = setup.job, setup.settings, setup.policy.mode
    size = state_bytes(job, s)
    write = ("--save-time, given" if s.save_s is not None else
             f"{s.save_overhead_s:g} s + {size / 1e12:.3g} TB ({s.state_bytes_per_param:g} B a parameter) at "
             f"{min(job.nodes * s.storage_gbps_per_node, s.storage_gbps_total):,.4g} GB/s (min of "
             f"{s.storage_gbps_per_node:g} a node, {s.storage_gbps_total:,g} in all)")
    keys = [] if s.save_s is not None else ["storage_gbps_per_node", "storage_gbps_total", "save_overhead_s"]
    if mode == "sync":
        text = f"write (the stall) {write}"
    else:
        stall = ("--snapshot-time, given" if s.snapshot_s is not None else
                 f"{s.snapshot_overhead_s:g} s + {size / job.gpus / 1e9:.3g} GB a GPU at {s.host_copy_gbps:g} GB/s "
                 "to host")
        keys += [] if s.snapshot_s is not None else ["host_copy_gbps", "snapshot_overhead_s"]
        text = f"write {write}; stall {stall}"
    keys = ["state_bytes_per_param"] * bool(keys) + keys  # (the size: in any term priced, not given)
    priced = (s.save_s is None) + (mode != "sync" and s.snapshot_s is None)  # (the terms the keys price)
    return text + (f"; --simulate.{', '.join(keys)} change {'them' if priced > 1 else 'it'}" if keys else "")


def _hours(hours: float, total: float) -> str:
    """GPU-hours as the job's size reads them: whole hours, with decimals for a job of few."""
    return f"{hours:,.0f}" if total >= 100 else f"{hours:,.3g}"


def _flat_around_best(points: list[dict], seeds: int) -> str:
    """Where the sweep's mean goodput is within two standard errors of its best (its seeds' spread): the
    best is one point of a flat top, which a few seeds place anywhere on it."""
    top = max(points, key=lambda p: p["goodput"])
    margin = 2 * top["goodput_std"] / math.sqrt(seeds)
    flat = [p["interval_s"] for p in points if p["goodput"] >= top["goodput"] - margin]
    if len(flat) < 2:
        return ""
    return (f"; goodput within two standard errors of it, {margin:.4f}, from {_secs(min(flat))} to "
            f"{_secs(max(flat))}: more --seeds narrows that")


def format_text(r: dict[str, Any]) -> str:
    ck, total = r["checkpoint"], r["gpu_hours"]
    mtbf = "no unexpected failures" if r["mtbf_hours"] is None else f"job MTBF {r['mtbf_hours']:.3g} h"
    write = "" if ck["mode"] == "sync" else f", persistent write {_secs(ck['save_s'])}"
    if ck["mode"] == "memory":
        write += f" every {ck['persist_every']} snapshot(s)"
    expected = r["expected_interruptions"]
    lines = [
        (f"{r['model']} on {r['gpus']:,} {r['gpu']} ({r['nodes']:,} nodes x {r['gpus_per_node']}), "
         f"{r['days']:g} days, {r['seeds']} seeds"),
        f"step time       {_secs(r['step_time_s'])} ({r['step_time_source']})",
        (f"failures        {mtbf} ({r['failure_rate_per_gpu_hour']:.3g} per GPU-hour; "
         f"{expected['unexpected']:.1f} unexpected + {expected['planned']:.1f} planned expected: planned stops "
         f"{expected['planned'] / r['days']:.2f} a day whatever the job's size, --failures.planned_per_day)"),
        (f"checkpoint      {ck['mode']} every {ck['interval_steps']:,} steps ({_secs(ck['interval_s'])}): "
         f"stall {_secs(ck['stall_s'])}{write}"),
        f"                priced from: {ck['priced_from']}",
        _optimal_line(r),
    ]
    mtbf_s = None if r["mtbf_hours"] is None else 3600 * r["mtbf_hours"]
    if mtbf_s is not None and ck["save_s"] >= mtbf_s:
        lines.append(f"note            one checkpoint write ({_secs(ck['save_s'])}) takes longer than the job's MTBF "
                     f"({_secs(mtbf_s)}): most of the run is recovery; a faster store, or --checkpoint-mode memory")
    if "simulated_optimum_interval_s" in r:
        lines.append(f"simulated best  {_secs(r['simulated_optimum_interval_s'])} (sweep of {ck['mode']}"
                     f"{_flat_around_best(r['sweep'][ck['mode']], r['seeds'])})")
    lines += [
        "",
        (f"goodput         {r['goodput']:.4f} ± {r['goodput_std']:.4f} "
         f"(min {r['goodput_min']:.4f}, max {r['goodput_max']:.4f})"),
        (f"interruptions   {r['interruptions']:.1f} ± {r['interruptions_std']:.1f} "
         f"({r['interruptions_unexpected']:.1f} unexpected, {r['interruptions_planned']:.1f} planned"
         + ("; below the expected: a failure while a planned stop has the job down is no interruption"
            if r["interruptions_planned"] and expected["unexpected"] - r["interruptions_unexpected"]
            > 2 * r["interruptions_std"] / math.sqrt(r["seeds"]) else "") + ")"),  # (past the seeds' own spread)
        f"lost GPU-hours  {_hours(r['lost_gpu_hours'], total)} of {_hours(total, total)} "
        f"({100 * r['lost_gpu_hours'] / total:.1f}%)",
    ]
    for key, label in _BUCKET_LABELS.items():
        hours = max(r["lost_gpu_hours_by_bucket"][key], 0.0)  # (a sum that cancels to -1e-21: no time)
        lines.append(f"  {label:<34}{_hours(hours, total):>12} {100 * hours / total:5.1f}%")
    lines.append(f"top failure causes {'interruptions':>30} {'GPU-hours lost':>15}")
    top = sorted(LLAMA3_CAUSES, key=lambda c: -r["lost_gpu_hours_by_failure"][c.name])[:5]
    for c in top:
        lines.append(f"  {c.label:<34}{r['interruptions_by_cause'][c.name]:>14.1f} "
                     f"{r['lost_gpu_hours_by_failure'][c.name]:>15,.0f}")
    return "\n".join(lines)
