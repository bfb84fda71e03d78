"""`shardline plan --emit-config FILE`: the best plan the trainer can run, as a config file.

Its header says what the plan assumed that the file cannot hold (the cluster's network and the
data's documents, which `train --dry-run` prices at the table's defaults), how to launch it, and
which training settings are still the tiny run's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardline.config import Config, to_toml
from shardline.errors import ConfigError, ShardlineError
from shardline.planner.layout import Workload, to_config

EMITTED = "# written by: shardline plan"  # the first line of an emitted config


def emit_config(path: str, work: Workload, candidates: list, base: Config, args: argparse.Namespace,
                gpus_per_node: int) -> None:
    """Write the best of `candidates` that the trainer runs into `path` (only over a file a plan wrote)."""
    from shardline.planner.search import runnable_problem

    for rank, e in enumerate(candidates, 1):
        if runnable_problem(work, e.layout) is None:
            break
    else:
        raise ConfigError("no plan that fits is one `shardline train` can run yet; nothing written "
                          "(see the table's * notes)")
    target = Path(path)
    if target.exists() and (not target.is_file()
                            or not target.read_text(encoding="utf-8", errors="replace").startswith(EMITTED)):
        raise ConfigError(f"--emit-config {path} exists and was not written by shardline plan; choose another "
                          "file (a plan replaces only its own)")
    cfg = to_config(e.layout, work, base, on_cpu=args.gpu == "cpu")
    per_node = min(e.layout.world, gpus_per_node)  # the hardware's (a CPU host: all ranks on one)
    nodes = -(-e.layout.world // per_node)
    # several nodes: one torchrun per node, meeting at a rendezvous on the first
    launch = (f"on each of the {nodes} nodes: torchrun --nnodes {nodes} --nproc-per-node {per_node} "
              "--rdzv-backend c10d --rdzv-endpoint HEAD_NODE:29500 --rdzv-id JOB" if nodes > 1 else
              f"e.g. torchrun --nproc-per-node {per_node}")
    priced = _pricing_flags(args)  # (what train --dry-run cannot be told)
    # (this plan's step time given: simulate's own search would price its default layout and precision)
    simulate = (f"shardline simulate --model {args.model} --gpu {args.gpu} --gpus {args.gpus} --gpus-per-node "
                f"{per_node} --step-time {e.step_time_s:.4g} --days D")
    header = (f"{EMITTED} --model {args.model} --gpu {args.gpu} --gpus {args.gpus} "
              f"--seq-len {args.seq_len}{priced} ...\n# plan #{rank}: {e.layout.describe()}; predicted "
              f"{e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}%, "
              f"{e.memory['total'] / 2**30:.1f} GiB per device\n"
              + (f"# priced with{priced}, which train --dry-run does not take (it prices the table's network and "
                 f"the data's documents): shardline estimate --config {path} --gpu {args.gpu} --gpus {args.gpus}"
                 f"{priced} prices it so\n" if priced else "")
              + f"# run it on {e.layout.world} device(s), {launch} -m shardline train --config {path}\n"
              + _left_at_defaults(cfg, simulate))
    try:
        Path(path).write_text(header + to_toml(cfg), encoding="utf-8")
    except OSError as err:
        raise ShardlineError(f"cannot write --emit-config {path}: {err}") from None


def _pricing_flags(args: argparse.Namespace) -> str:
    """The plan's flags that moved its figures and that the emitted config cannot hold ("" for none)."""
    given = [("--gpus-per-node", args.gpus_per_node), ("--profile", args.profile),
             ("--inter-bw-gbs", args.inter_bw_gbs), ("--oversubscription", args.oversubscription),
             ("--mean-doc-tokens", args.mean_doc_tokens or None)]
    return "".join(f" {flag} {value:g}" if isinstance(value, float) else f" {flag} {value}"
                   for flag, value in given if value is not None)


def _left_at_defaults(cfg: Config, simulate: str) -> str:
    """Header lines naming the training settings the plan left as the tiny run has them: a config
    that runs as is, but on the sample text at a learning rate made for a 5M-parameter model, and
    saving as a one-GPU run would (`simulate`: the command that prices the cluster's interval)."""
    default = Config()
    keys = [("data.path", cfg.data.path, default.data.path, "the shipped sample text"),
            ("data.tokenizer", cfg.data.tokenizer, default.data.tokenizer, "a small BPE trained on it"),
            ("optim.lr", cfg.optim.lr, default.optim.lr, "the tiny preset's"),
            ("optim.warmup_steps", cfg.optim.warmup_steps, default.optim.warmup_steps, ""),
            ("train.steps", cfg.train.steps, default.train.steps, ""),
            ("watchdog.timeout_s", cfg.watchdog.timeout_s, default.watchdog.timeout_s, "hang detection off"),
            ("checkpoint.interval", cfg.checkpoint.interval, default.checkpoint.interval, f"steps; {simulate} "
             "prices an interval and checkpoint.mode for this cluster's failures")]
    left = [f"{key} = {value!r}{f' ({why})' if why else ''}" for key, value, was, why in keys if value == was]
    return f"# set before a real run (left at the defaults): {'; '.join(left)}\n" if left else ""
