"""`shardline plan`, `shardline estimate`, `shardline calibrate`.

plan      search layouts for a model on N devices; table or --json; --emit-config FILE
estimate  memory breakdown and step time of one config (world size = product of its
          degrees; with dp_shard = -1 give --gpus, else dp_shard is taken as 1)
calibrate measure this machine; write a profile that --profile FILE applies
comm-bench under torchrun: the job's collectives inside nodes and across them; a [network] profile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from shardline.config import Config, DataConfig, load_config
from shardline.config.sections import settled_precision
from shardline.config.reader import OnlyOnce
from shardline.errors import ConfigError
from shardline.models.llama import ModelArgs
from shardline.models.presets import PRESETS
from shardline.planner.calibrate import cluster_cli
from shardline.planner.calibrate.cluster_cli import out_problem
from shardline.planner.hardware import (DEVICE_NAMES, Hardware, cuda_index, detected_gpu, get_hardware,
                                        read_profile, with_local_memory)
from shardline.layout import resolve
from shardline.planner.emit import emit_config
from shardline.planner.layout import FIX_KEYS, Workload, parse_fix


def register(sub) -> None:
    plan = sub.add_parser("plan", description="Rank parallel layouts by predicted throughput. Config overrides "
                                      "(--section.key=value) go into the --emit-config file, but for those the "
                                      "plan chooses (batch, precision, [parallel], activation checkpointing), "
                                      "which are refused: give them as plan options, --fix among them.")
    plan.add_argument("--model", required=True, help="preset name or Hugging Face model folder")
    _device_args(plan, required=True)
    plan.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (train.seq_len)")
    batch = plan.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch", type=int, metavar="SEQS", help="sequences per optimizer step")
    batch.add_argument("--global-batch-tokens", type=int, metavar="T", help="tokens per optimizer step")
    plan.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32", "fp8"), default="auto",
                      help="compute dtype (auto, the default: bf16 on accelerators, fp32 on cpu, as "
                           "train.precision=auto; fp8: float8 Linear GEMMs)")
    plan.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=True,
                      help="attend within packed documents (the trainer's default); the kernel is "
                           "--train.attention's (auto: flex on GPUs, SDPA's dense mask on cpu)")
    _doc_arg(plan)
    plan.add_argument("--ssd-offload-dir", default="", metavar="DIR",
                      help="a folder on each node's local SSD: layouts that step AdamW on the host (CPU offload) "
                           "keep its moments there (memory.ssd_offload_dir)")
    plan.add_argument("--fix", default="", metavar="KEY=V,...",
                      help=f"pin layout keys, e.g. tp=8,pp=4 (dp = plain DDP); keys: {', '.join(FIX_KEYS)}")
    plan.add_argument("--runnable-only", action="store_true",
                      help="only layouts `shardline train` builds today (see layout.NOT_BUILT)")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="layouts shown (default 10)")
    plan.add_argument("--json", action="store_true",
                      help="the candidates as JSON instead of a table (fields: docs/planner.md in the source tree)")
    plan.add_argument("--emit-config", metavar="FILE", help="write the best plan that `shardline train` runs")
    plan.set_defaults(func=_plan)

    est = sub.add_parser("estimate",
                         epilog="config overrides (--section.key=value) change the --config file's settings; "
                                "exit 1 where the memory estimate does not fit the device (as the dry run's)")
    est.add_argument("--config", required=True, action=OnlyOnce, help="TOML config (as `shardline train` takes)")
    _device_args(est, required=False)
    _doc_arg(est)
    est.add_argument("--json", action="store_true", help="the estimate as JSON instead of text")
    est.set_defaults(func=_estimate)

    cal = sub.add_parser("calibrate")
    cal.add_argument("--out", type=os.path.expanduser,
                     default="calibration.toml", help="profile to write (default calibration.toml)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes (~5 min on 2 cores, the full run ~21 min)")
    cal.add_argument("--no-comm", action="store_true", help="skip the gloo collective measurements")
    cal.add_argument("--threads", type=int, metavar="N",
                     help="torch threads (CPU; default torch's). 1 times with CPU time: robust on a busy machine")
    cal.set_defaults(func=_calibrate)

    cluster_cli.register(sub)


def _device_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--gpu", required=required, metavar="TYPE", help=f"device type: {', '.join(DEVICE_NAMES)}")
    p.add_argument("--gpus", type=int, required=required, metavar="N", help="number of devices")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="devices per node (default: the profile's, else the table's: 8 for GPUs, all one node for cpu)")
    p.add_argument("--inter-bw-gbs", type=float, metavar="GB/S",
                   help="each device's share of the links between nodes, GB/s a direction (default: the profile's, "
                        "else the table's: 50 for h100/h200/b200's 400G NIC a GPU)")
    p.add_argument("--oversubscription", type=float, metavar="X",
                   help="the fabric above the leaf switches carries 1/X of full bisection (default 1)")
    p.add_argument("--profile", metavar="FILE", help="hardware profile/override TOML (e.g. from calibrate)")


def _doc_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mean-doc-tokens", type=float, default=0.0, metavar="L",
                   help="mean document length of the data, in tokens: flex and varlen skip the attention "
                        "between documents (default: unknown, priced as one document per sequence)")


def _mean_doc_tokens(args: argparse.Namespace) -> float:
    if not args.mean_doc_tokens >= 0:
        raise ConfigError(f"--mean-doc-tokens {args.mean_doc_tokens} must be >= 0 (0: one document per sequence)")
    return args.mean_doc_tokens


def _check_gpus(args: argparse.Namespace) -> None:
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be >= 1")


def _hardware(args: argparse.Namespace, name: str) -> Hardware:
    _check_gpus(args)
    hw = get_hardware(name, args.profile)
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node {args.gpus_per_node} must be >= 1")
        hw = dataclasses.replace(hw, network=dataclasses.replace(hw.network, gpus_per_node=args.gpus_per_node))
    links = {k: v for k, v in (("inter_bw_gbs", args.inter_bw_gbs), ("oversubscription", args.oversubscription))
             if v is not None}  # (a cluster's network said on the command line, as a profile's [network] says it)
    for key, value in links.items():
        if not value > 0 or (key == "oversubscription" and value < 1):
            raise ConfigError(f"--{key.replace('_', '-')} {value:g} must be " + (">= 1" if key == "oversubscription"
                                                                               else "> 0"))
    return dataclasses.replace(hw, network=dataclasses.replace(hw.network, **links)) if links else hw


def _priced_by(args: argparse.Namespace, hw: Hardware) -> str:
    """What the figures the prediction rests on come from (a profile, or the table's own), and the
    network the command line gave."""
    given = [f"--{k} {getattr(args, k.replace('-', '_')):g}" for k in ("inter-bw-gbs", "oversubscription")
             if getattr(args, k.replace('-', '_'), None) is not None]
    return _priced_by_tables(args, hw) + (f"; between nodes {' '.join(given)}" if given else "")


def _priced_by_tables(args: argparse.Namespace, hw: Hardware) -> str:
    if args.profile:  # (a comm-bench profile holds [network] alone: the rest is the base's)
        given = sorted(read_profile(args.profile)) if Path(args.profile).is_file() else []
        tables = ", ".join(k for k in given if k not in ("base", "measured")) or "nothing"  # ([measured]: a record)
        trust = ("; on the CPUs checked, a calibrated profile put one process's steps within ~10% of the measured "
                 "ones and several ranks' 15-40% under them (docs/planner.md in the source tree)"
                 if hw.name == "cpu" else "")
        return f"the {hw.name} figures, with {tables} from the profile {args.profile}{trust}"
    if hw.name == "cpu":
        return "uncalibrated guesses for this CPU (`shardline calibrate` measures it, --profile reads that)"
    return f"the {hw.name} datasheet and the table's efficiencies (a --profile from calibrate or comm-bench: measured)"


def _with_source(text: str, args: argparse.Namespace, hw: Hardware) -> str:
    """The report with a line, after its first, naming what priced it."""
    first, _, rest = text.partition("\n")
    return f"{first}\npriced by {_priced_by(args, hw)}\n{rest}"


def resolve_model(name: str) -> tuple[ModelArgs, str, bool]:
    """(shape, reference for the emitted config, vocabulary sized by the tokenizer?)."""
    if name in PRESETS:
        args = PRESETS[name]
        if args.vocab_size == 0:  # sized by the tokenizer; assume the default BPE size
            return dataclasses.replace(args, vocab_size=DataConfig().vocab_size), name, True
        return args, name, False
    if Path(name).is_dir():
        from shardline.interop.hf_config import read_hf_config

        return read_hf_config(name), f"hf:{name}", False
    raise ConfigError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a Hugging Face folder")


# Keys --emit-config writes from the plan itself, each with the plan's option that sets it: an
# override of one was dropped from the file without a word.
_PLAN_SETS = {"train.seq_len": "--seq-len", "train.global_batch_size": "--global-batch",
              "train.micro_batch_size": "--fix micro_batch_size=N", "train.precision": "--precision",
              "train.document_mask": "--document-mask or --no-document-mask", "model.preset": "--model",
              "model.hf_path": "--model",
              **{f"memory.{k}": f"--fix {k}=..." for k in ("activation_checkpoint", "ac_every", "cpu_offload")},
              **{f"parallel.{k}": f"--fix {k}=..." for k in FIX_KEYS if k != "dp"}}


def _refuse_what_the_plan_sets(overrides: list[str], base: Config, work: Workload) -> None:
    """Refused unless it says what the plan's own option does (a script's `--train.seq_len` equal to `--seq-len`)."""
    same = {"train.seq_len": base.train.seq_len == work.seq_len,
            "train.precision": base.train.precision in ("auto", work.precision),
            "train.global_batch_size": base.train.global_batch_size == work.global_batch,
            "train.document_mask": base.train.document_mask == work.document_mask,
            "model.preset": base.model.preset == work.model_ref,
            "model.hf_path": work.model_ref.startswith("hf:") and bool(base.model.hf_path)
            and Path(work.model_ref[3:]).resolve() == Path(base.model.hf_path).resolve()}
    given = [o.removeprefix("--").split("=", 1)[0] for o in overrides]
    taken = [key for key in given if (key in _PLAN_SETS or key.startswith("parallel.")) and not same.get(key)]
    if taken:
        way = _PLAN_SETS.get(taken[0], "--fix KEY=V")
        raise ConfigError(f"--{taken[0]} is one of the settings the plan chooses and --emit-config writes itself "
                          f"(it would be dropped): give it to the search as {way}")


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.planner import report
    from shardline.planner.search import explain_no_fit, runnable_problem, search

    base = load_config(None, overrides)  # fails early on a bad override
    hw = _hardware(args, args.gpu)
    _refuse_what_the_plan_sets(overrides, base, _workload(args, hw))
    gpn = hw.network.gpus_per_node
    _refuse_part_nodes(args.gpus, hw)
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be >= 1")
    work = dataclasses.replace(_workload(args, hw), attention=base.train.attention, compiled=base.train.compile,
                               loss_chunk_tokens=base.train.loss_chunk_tokens,  # as the emitted config runs
                               ssd_offload_dir=args.ssd_offload_dir or base.memory.ssd_offload_dir,
                               host_adam_fused=base.optim.fused)
    work = _with_shape_overrides(work, base, overrides)
    result = search(work, hw, args.gpus, parse_fix(args.fix), runnable_only=args.runnable_only)
    if not result.candidates:
        raise ConfigError(f"{work.label} on {args.gpus} x {hw.name}: {explain_no_fit(work, hw, args.gpus, result)}")
    shown = result.candidates[:args.top]
    not_runnable = {i: p for i, e in enumerate(shown) if (p := runnable_problem(work, e.layout))}
    if args.emit_config:
        emit_config(args.emit_config, work, result.candidates, base, args, gpn)
    if args.json:
        print(json.dumps({**report.plan_json(work, hw, args.gpus, result, shown, not_runnable),
                          "priced_by": _priced_by(args, hw)}, indent=1))
    else:
        print(_with_source(report.plan_table(work, hw, args.gpus, result, shown, not_runnable), args, hw))
        if args.emit_config:
            print(f"\nwrote {args.emit_config}")
    return 0


def _refuse_part_nodes(gpus: int, hw: Hardware, given: bool = True) -> None:
    """A job of more than a node's devices on whole nodes (the network model prices each node's);
    `given`: the count is --gpus's, else the config layout's."""
    gpn = hw.network.gpus_per_node
    if gpus > gpn and gpus % gpn and hw.name != "cpu":
        what = f"--gpus {gpus}" if given else f"the config's layout of {gpus} ranks (no --gpus given)"
        raise ConfigError(f"{what} is not a whole number of {gpn}-device nodes; "
                          f"use a multiple of {gpn} or set --gpus-per-node")


def _workload(args: argparse.Namespace, hw: Hardware) -> Workload:
    model, ref, from_tok = resolve_model(args.model)
    if args.seq_len < 1:
        raise ConfigError(f"--seq-len {args.seq_len} must be >= 1")
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens % args.seq_len or args.global_batch_tokens < args.seq_len:
            raise ConfigError(f"--global-batch-tokens {args.global_batch_tokens} is not a whole number of "
                              f"{args.seq_len}-token sequences; use a multiple of {args.seq_len}")
        batch = args.global_batch_tokens // args.seq_len
    else:
        batch = args.global_batch
    if batch < 1:
        raise ConfigError(f"--global-batch {batch} must be >= 1")
    precision = settled_precision(args.precision, hw.name != "cpu", bool(hw.peak_tflops.get("bf16")))
    return Workload(model, args.seq_len, batch, precision, args.document_mask, ref, from_tok,
                    mean_doc_tokens=_mean_doc_tokens(args), ssd_offload_dir=args.ssd_offload_dir)


def _with_shape_overrides(work: Workload, base: Config, overrides: list[str]) -> Workload:
    """The model the search prices, with the [model] and [moe] overrides the emitted config carries
    (`--model.n_layers=16`): they reached the file, but the search priced `--model` as it is."""
    shaping = [o for o in overrides if o.removeprefix("--").startswith(("model.", "moe."))
               and not o.removeprefix("--").startswith(("model.preset", "model.init_from"))]
    if not shaping:
        return work
    ref = work.model_ref  # (--model's shape, not model.init_from's: a checkpoint the planning host may not hold)
    m = dataclasses.replace(base.model, hf_path=ref[3:] if ref.startswith("hf:") else "", init_from="",
                            preset=base.model.preset if ref.startswith("hf:") else ref)
    return dataclasses.replace(work, model=_config_model(dataclasses.replace(base, model=m)),  # (as estimate does)
                               model_overrides=tuple(o.removeprefix("--") for o in shaping))


def _estimate(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.interop.model_shape import shape_overrides
    from shardline.optim import ssd_offload
    from shardline.planner import report
    from shardline.planner.estimate import estimate

    cfg = load_config(args.config, overrides)
    cfg.check()
    _check_gpus(args)  # before the layout, which would blame the degrees
    layout = resolve(cfg, args.gpus)
    hw = _hardware(args, args.gpu or _default_device(cfg, layout.world))
    _refuse_part_nodes(layout.world, hw, given=args.gpus is not None)  # (as plan: a node's devices share its links)
    cfg.train.settle_precision(hw.name != "cpu", bool(hw.peak_tflops.get("bf16")))  # (auto: bf16 on a GPU)
    if not args.gpu and hw.name != "cpu" and "mem_gib" not in (read_profile(args.profile) if args.profile else {}):
        hw = with_local_memory(hw, cuda_index(cfg.run.device, layout.world))  # this machine's card, as it is
    problem = ssd_offload.problem(cfg.memory, layout.zero, on_cuda=hw.name != "cpu", node_paths=False)
    if problem:  # what the trainer refuses is not priced as if it ran
        raise ConfigError(problem)
    work = dataclasses.replace(Workload.from_config(cfg, _config_model(cfg), _mean_doc_tokens(args)),
                               model_overrides=shape_overrides(cfg.model, cfg.moe))  # (named beside the preset)
    e = estimate(work, layout, hw)
    print(json.dumps({**e.to_json(), "priced_by": _priced_by(args, hw)}, indent=1) if args.json
          else _with_source(report.estimate_text(work, hw, e), args, hw), flush=True)  # (before stderr's notes)
    for note in _estimate_notes(args, cfg, layout, hw, e.fits):
        print(f"shardline estimate: {note}", file=sys.stderr)
    return 0 if e.fits else 1  # (`estimate && torchrun ...` stops where the dry run's would)


def _estimate_notes(args: argparse.Namespace, cfg: Config, layout, hw: Hardware, fits: bool) -> list[str]:
    """What the estimate assumed that its user may not have meant: this machine's CPU for a config that
    would train on a GPU, the world size where dp_shard=-1 was left to --gpus; and a layout that does not fit."""
    notes = []
    if not args.gpu and hw.name == "cpu" and cfg.run.device != "cpu":
        notes.append(f"priced on this machine's CPU (no GPU here, run.device={cfg.run.device}): --gpu TYPE prices a "
                     "GPU launch (a dry run assumes an H100)")
    if args.gpus is None and cfg.parallel.dp_shard == -1 and (layout.world > 1 or not fits):
        notes.append(f"--gpus not given: parallel.dp_shard=-1 taken as 1, the job priced on {layout.world} device(s) "
                     "(give --gpus N for its size)")
    if not fits:
        notes.append(f"the memory estimate does not fit {hw.name} or its host (exit 1)")
    return notes


def _default_device(cfg: Config, ranks: int) -> str:
    """The device the config would train on: cpu, or the table entry of this machine's GPU."""
    import torch

    if cfg.run.device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return detected_gpu(cuda_index(cfg.run.device, ranks))


def _config_model(cfg: Config) -> ModelArgs:
    from shardline.interop.model_shape import model_shape  # reads checkpoints and HF folders: heavy, and only here

    # A preset sized by the tokenizer takes data.vocab_size, the size of the BPE it trains.
    return model_shape(cfg.model, cfg.data.vocab_size, cfg.moe)


def _calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.planner.calibrate import calibrate

    if overrides:
        raise ConfigError(f"calibrate takes no config overrides, got {' '.join(overrides)}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads} must be >= 1")
    out = Path(args.out)  # checked before minutes of measuring, not when the profile is written
    if out_problem(out, "calibrate"):
        raise ConfigError(out_problem(out, "calibrate"))
    calibrate(args.out, quick=args.quick, comm=not args.no_comm, threads=args.threads)
    return 0
