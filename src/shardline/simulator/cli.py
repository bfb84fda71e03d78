"""`shardline simulate`: goodput of a training run at cluster scale under failures.

Example: shardline simulate --model llama3-405b --gpu h100-sxm --gpus 16384 --days 54
"""

from __future__ import annotations

import argparse
import json
import math

from shardline.errors import ConfigError
from shardline.config.reader import OnlyOnce
from shardline.simulator import montecarlo
from shardline.simulator.job import GPU_TYPES, make_job
from shardline.simulator.settings import MODES, apply_table, check_mode_keys, load_settings

# CLI flag dest -> [simulate] key
_FLAG_KEYS = {
    "checkpoint_interval": "checkpoint_interval", "checkpoint_mode": "checkpoint_mode",
    "step_time": "step_time_s", "save_time": "save_s", "snapshot_time": "snapshot_s",
    "detection_time": "detection_s", "restart_time": "restart_s", "persist_every": "persist_every",
    "straggler_prob": "straggler_prob", "straggler_slowdown": "straggler_slowdown",
    "seq_len": "seq_len", "global_batch": "global_batch", "global_batch_tokens": "global_batch_tokens", "mfu": "mfu",
    "fix": "fix",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        description=__doc__.splitlines()[0],
        epilog="settings can also come from --config FILE.toml ([simulate], [failures]) or "
               "--simulate.KEY=VALUE / --failures.CAUSE=RATE overrides; see docs/simulator.md in the source tree")
    p.add_argument("--model", required=True, help="model preset or HF model folder")
    p.add_argument("--gpu", required=True, help=f"accelerator: {', '.join(GPU_TYPES)}")
    p.add_argument("--gpus", required=True, type=int, help="GPUs in the job")
    p.add_argument("--days", required=True, type=float, help="wall-clock length of the run")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the --profile's, else 8")
    p.add_argument("--profile", metavar="FILE",
                   help="hardware profile for the planner's step time (from `shardline calibrate` or `comm-bench`)")
    p.add_argument("--checkpoint-interval", metavar="STEPS|optimal",
                   help="steps between persistent saves (the report says it in seconds too); default: optimal, "
                        "Daly's interval from the save's stall and the job's MTBF of unexpected failures (planned "
                        "stops, which a save precedes, excluded)")
    p.add_argument("--checkpoint-mode", choices=MODES, help="default: async")
    p.add_argument("--step-time", type=float, metavar="S",
                   help="seconds per step (default: the planner's best layout; where none runs, give this or --mfu)")
    p.add_argument("--fix", metavar="KEY=V,...", help="pin planner layout keys for the step time (as plan --fix)")
    p.add_argument("--seeds", type=int, default=8,
                   help="Monte Carlo runs (default 8; --sweep's best moves with few: 64 narrows it)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    p.add_argument("--plot", metavar="FILE",
                   help="write a plot of goodput vs checkpoint interval (all modes); FILE ends in .png, .svg or .pdf")
    p.add_argument("--sweep", action="store_true", help="also sweep the interval and report the simulated optimum")
    p.add_argument("--config", action=OnlyOnce, metavar="FILE",
                   help="TOML with [simulate] settings and [failures] rates")
    p.add_argument("--save-time", type=float, metavar="S",
                   help="seconds: a measured persistent save (a run's `checkpoint` events' stall_s in sync mode, "
                        "checkpoint_persisted's background_s in async; default: priced from the state's size and "
                        "the store's speed)")
    p.add_argument("--snapshot-time", type=float, metavar="S",
                   help="seconds: a measured async snapshot's stall (the copy to host: an async `checkpoint` "
                        "event's stall_s)")
    p.add_argument("--detection-time", type=float, metavar="S",
                   help="seconds from a fault to its detection (default 120; a hang's: watchdog.timeout_s)")
    p.add_argument("--restart-time", type=float, metavar="S",
                   help="seconds to relaunch, excluding the checkpoint load (default 300)")
    p.add_argument("--persist-every", type=int, metavar="N", help="memory mode: snapshots per persistent save")
    p.add_argument("--failure-scale", type=float, metavar="X",
                   help="multiply every failure rate (Llama 3's table, per GPU-hour or node-hour by cause: "
                        "docs/simulator.md; --failures.CAUSE=RATE sets one): how a job's MTBF is set")
    p.add_argument("--straggler-prob", type=float, metavar="P", help="per GPU per step (default 5e-7)")
    p.add_argument("--straggler-slowdown", type=float, metavar="F", help="slowed step time factor (default 2)")
    p.add_argument("--seq-len", type=int, help="for the step-time estimate (default min(max_seq_len, 8192))")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, metavar="SEQS", help="sequences a step, for the step-time estimate "
                       "(default one per GPU, at most 2048)")
    batch.add_argument("--global-batch-tokens", type=int, metavar="T",
                       help="or tokens a step (--global-batch x --seq-len)")
    p.add_argument("--mfu", type=float, help="where the planner has no plan (the job does not fit, say): simulate it "
                   "anyway, the step time from FLOPs at this MFU (e.g. 0.4)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if not 1 <= args.seeds <= 10_000:
        raise ConfigError(f"--seeds {args.seeds} must be between 1 and 10000")
    if args.plot:
        from shardline.simulator.plot import check_plot_path

        check_plot_path(args.plot)
    shaping = (("--fix", args.fix), ("--mfu", args.mfu), ("--seq-len", args.seq_len),
               ("--global-batch", args.global_batch), ("--global-batch-tokens", args.global_batch_tokens),
               ("--profile", args.profile))
    unused = [flag for flag, value in shaping if value is not None]
    if args.step_time is not None and unused:
        verb = "shapes" if len(unused) == 1 else "shape"
        raise ConfigError(f"{', '.join(unused)} {verb} the step-time estimate, which --step-time replaces; "
                          "give one or the other")
    job = make_job(args.model, args.gpu, args.gpus, args.gpus_per_node, args.days, args.profile)
    settings = load_settings(args.config, overrides, {v: getattr(args, k) for k, v in _FLAG_KEYS.items()})
    if args.profile is not None and settings.step_time_s is not None:  # from --config or an override
        raise ConfigError("--profile shapes the step-time estimate, which simulate.step_time_s replaces; "
                          "give one or the other")
    if args.failure_scale is not None:
        if not (math.isfinite(args.failure_scale) and args.failure_scale >= 0):
            raise ConfigError(f"--failure-scale {args.failure_scale} must be a finite number >= 0")
        settings = apply_table(settings, "failures", {"scale": args.failure_scale}, "--failure-scale")
    report = simulate(job, settings, args.seeds, sweep=args.sweep, plot=args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from shardline.simulator.report import format_text

        print(format_text(report))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def simulate(job, settings, seeds: int, sweep: bool = False, plot: str | None = None) -> dict:
    """Run the Monte Carlo (and the sweeps a plot or --sweep needs); return the report."""
    from shardline.simulator.report import build_report

    check_mode_keys(settings, MODES if plot else (settings.checkpoint_mode,))  # a plot simulates every mode
    setup = montecarlo.prepare(job, settings)
    summary = montecarlo.summarize(setup, montecarlo.run_seeds(setup, setup.policy, seeds))
    mode = setup.policy.mode
    modes = MODES if plot else (mode,) if sweep else ()
    grid = montecarlo.interval_grid(setup, modes) if modes else []
    sweeps = {m: montecarlo.sweep(setup, m, seeds, grid) for m in modes}
    best = montecarlo.simulated_optimum_s(sweeps[mode]) if sweeps else None
    if plot:
        from shardline.simulator.plot import plot_sweeps

        plot_sweeps(plot, setup, sweeps)
    return build_report(setup, summary, seeds, sweeps or None, None if best is None or math.isinf(best) else best)
