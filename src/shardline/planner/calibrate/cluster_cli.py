"""The `shardline comm-bench` command: its options, the checks every rank makes before timing
anything, and the profile rank 0 writes (what is measured and how: cluster.py)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from shardline.errors import ConfigError, ShardlineError, on_every_rank
from shardline.planner.calibrate import cluster
from shardline.planner.hardware import detected_gpu, get_hardware, to_toml


def register(sub) -> None:
    cb = sub.add_parser("comm-bench")
    cb.add_argument("--out", type=os.path.expanduser,
                    default="comm.toml", help="profile to write on rank 0 (default comm.toml)")
    cb.add_argument("--gpu", metavar="TYPE", help="the table entry the profile refines (default: this machine's)")
    cb.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="gloo on the host or NCCL on each rank's GPU (default auto: cuda where there is one)")
    cb.add_argument("--min-size", default=None, metavar="BYTES", help="smallest message (K, M, G: powers of "
                                                                      "1024; default 8K, on a CPU 4K)")
    cb.add_argument("--max-size", default=None, metavar="BYTES", help="largest (default 256M, on a CPU 4M)")
    cb.add_argument("--factor", type=int, default=4, help="each size this many times the last (default 4)")
    cb.add_argument("--ops", default=",".join(cluster.OPS),
                    help=f"collectives to time, comma-separated (default {','.join(cluster.OPS)}); the profile's "
                         "links are fitted from all_gather and reduce_scatter: without either, none is written")
    cb.add_argument("--rounds", type=int, default=5, help="timed rounds a point (default 5; the median is kept)")
    cb.add_argument("--iters", type=int, default=None, help="calls a round (default 20, on a CPU 5)")
    cb.add_argument("--subnode", action=argparse.BooleanOptionalAction, default=True,
                    help="also groups of 2, 4, ... ranks inside a node (default: yes; their communicators take "
                         "one job-wide split each to set up: 768 at 128 nodes x 8)")
    cb.add_argument("--slow-factor", type=float, default=1.5, metavar="F",
                    help="name a group over F x the median of its tier's groups at the largest size "
                         "(default 1.5; 0: off)")
    # A drill (as `check`'s [faults]): this rank waits this long before each timed call.
    cb.add_argument("--drill-rank", type=int, default=-1, help=argparse.SUPPRESS)
    cb.add_argument("--drill-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    cb.set_defaults(func=command)


def command(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.parallel.distributed import init_distributed, shutdown_distributed

    try:
        settings = _settings(args, overrides)
    except ConfigError as e:  # the command line: alike on a node's ranks, said once there (cli._leave)
        e.node_alike = True
        raise
    name = settings["gpu"]
    device = torch.device("cpu" if settings["cpu"] else "cuda")
    proc = init_distributed(device)
    if proc.world_size < 2:
        raise ConfigError("comm-bench times collectives between ranks: launch it with torchrun, e.g. "
                          "torchrun --nproc_per_node=8 -m shardline comm-bench (on every node)")
    out = Path(args.out)
    try:  # the problems every rank shares: each says the same line, and they leave together
        _agree(proc.rank, proc.world_size, out, settings)
        if device.type == "cuda":
            device = torch.device("cuda", proc.local_rank)
        timing = {k: v for k, v in settings.items() if k not in ("gpu", "cpu")}
        code, tables, text = cluster.run(device, base=(name, get_hardware(name).network), **timing)
    except ConfigError as e:  # refused alike on every rank (_agree, cluster.run's checks): said once, by rank 0,
        raise on_every_rank(e)  # and the ranks leave the process group together (cli._leave)
    shutdown_distributed()  # not on other errors: one rank's failure leaves its peers in a collective
    if text is not None:
        print(text)
        _write(out, name, tables, proc.world_size, settings["drill"] is not None, code != 0)
    return code


def _settings(args: argparse.Namespace, overrides: list[str]) -> dict:
    """The options, checked (one line naming the option), as cluster.run's keywords plus `gpu`
    (the table entry) and `cpu`."""
    if overrides:
        raise ConfigError(f"comm-bench takes no config overrides, got {' '.join(overrides)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here; use auto or cpu")
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    sizes = cluster.sizes_between(cluster.parse_size(args.min_size or ("4K" if cpu else "8K"), "--min-size"),
                                  cluster.parse_size(args.max_size or ("4M" if cpu else "256M"), "--max-size"),
                                  args.factor)
    ops = args.ops.split(",")
    if any(op not in cluster.OPS for op in ops):
        raise ConfigError(f"--ops {args.ops!r}: give a comma-separated list of {', '.join(cluster.OPS)}")
    rounds, iters = args.rounds, args.iters if args.iters is not None else (5 if cpu else 20)
    if rounds < 1 or iters < 1:
        raise ConfigError(f"--rounds {rounds} and --iters {iters} must be >= 1")
    if not (args.slow_factor == 0 or (math.isfinite(args.slow_factor) and args.slow_factor > 1)):
        raise ConfigError(f"--slow-factor {args.slow_factor} must be a number > 1 (or 0: off)")
    if not (math.isfinite(args.drill_delay_ms) and args.drill_delay_ms >= 0) or (
            args.drill_delay_ms and args.drill_rank < 0):
        raise ConfigError(f"--drill-delay-ms {args.drill_delay_ms} must be a number >= 0, with --drill-rank R >= 0")
    name = args.gpu or ("cpu" if cpu else detected_gpu())
    get_hardware(name)  # an unknown --gpu, in one line
    drill = (args.drill_rank, args.drill_delay_ms / 1e3) if args.drill_delay_ms else None
    return {"sizes": sizes, "ops": ops, "rounds": rounds, "iters": iters, "slow_factor": args.slow_factor,
            "drill": drill, "subnode": args.subnode, "gpu": name, "cpu": cpu}


def _agree(rank: int, world: int, out: Path, settings: dict) -> None:
    """Refuse, on every rank alike, what one rank alone can see: rank 0's --out (its file system),
    nodes launched with other options (each would make other calls, and the job would hang), a
    drill of a rank the job does not have."""
    mine = (out_problem(out) if rank == 0 else None, settings)
    every = [None] * world
    dist.all_gather_object(every, mine)
    if every[0][0]:
        raise ConfigError(every[0][0])
    for other, (_, theirs) in enumerate(every):
        differ = [k for k in settings if theirs[k] != every[0][1][k]]
        if differ:
            raise ConfigError(f"rank {other} was launched with other comm-bench options than rank 0 "
                              f"({', '.join(differ)}); launch every node with the same command")
    if settings["drill"] and not 0 <= settings["drill"][0] < world:
        raise ConfigError(f"--drill-rank {settings['drill'][0]} is not a rank of this job (0 to {world - 1})")


def _write(out: Path, name: str, tables: dict, world: int, drilled: bool, failed: bool) -> None:
    """Rank 0's profile, unless nothing was fitted, or the timings are not a healthy cluster's (a
    drill slowed them, or a collective gave wrong results)."""
    if drilled or failed:
        print("no profile written: " + ("a drill (--drill-rank) slowed the timings" if drilled else
                                         "a collective gave wrong results (FAILED above)"))
        return
    if not any(f"{link}_latency_us" in tables["network"] for link in ("intra", "inter")):
        print("no profile written: no link was fitted (the `fit` lines above say why)")
        return
    comment = (f"shardline network profile, written by `shardline comm-bench` on {world} ranks\n"
               f"use: shardline plan|estimate|simulate ... --gpu {name} --profile {out}\n"
               "to keep a `shardline calibrate` profile's other figures, put this [network] table in it\n"
               "[measured] holds the points (tier_op: ranks, bytes, microseconds); the planner ignores it")
    try:
        out.write_text(to_toml({"base": name, **tables}, comment), encoding="utf-8")
    except OSError as e:
        raise ShardlineError(f"comm-bench: cannot write {out}: {e}") from None
    print(f"profile written to {out}")


PROFILE_HEADS = {"comm-bench": "# shardline network profile", "calibrate": "# shardline hardware profile"}


def out_problem(out: Path, command: str = "comm-bench") -> str | None:
    """Why `--out` cannot be written as a file (a path the file system refuses to look at counts),
    or None; for calibrate's --out too. Tried by opening it (a new file is removed again):
    permission bits say yes to root where the file system says no (/proc, a read-only mount). A file
    there that `command` did not write (a config, the other command's profile: calibrate's takes
    minutes) is not replaced."""
    try:
        existed = out.exists()
        if existed and out.is_file():
            with open(out, encoding="utf-8", errors="replace") as f:
                head = f.read(len(PROFILE_HEADS[command]))
            if head and head != PROFILE_HEADS[command]:  # (an empty file, a placeholder: nothing to lose)
                return (f"--out {out} exists and was not written by shardline {command}: it is not replaced; "
                        "give another file (or remove it)")
        if out.is_dir():
            bad = True
        else:
            with open(out, "a", encoding="utf-8"):
                pass
            bad = False
            if not existed:
                out.unlink()
    except OSError:  # permission denied on the way, a name too long, a read-only file system ...
        bad = True
    return f"--out {out} cannot be written: give a file in an existing, writable folder" if bad else None
