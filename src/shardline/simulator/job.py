"""The job being simulated: model, accelerators, step time and checkpoint costs.

`step_time_s` is the single place the simulator learns how long one optimizer step
takes: given (`--step-time`), else the planner's predicted step time of the best layout
for this model, accelerator, count, sequence length and batch (`shardline plan`'s
search; `--fix KEY=V,...` pins keys, as `plan --fix` does; `--profile FILE` refines the
accelerator and its network, as `plan --profile` does; cached per request). If the
planner has no plan (nothing fits, the batch does not split, the device is not in its
table) it falls back, saying why, to model FLOPs at an assumed MFU:

    step_time = flops_per_token(model, seq_len) * tokens_per_step / (gpus * peak * mfu)

Checkpoint costs are estimated from the size of the training state (fp32 weights and
Adam moments: 12 bytes per parameter), assuming it is sharded evenly over all GPUs.
Measured costs (`--save-time`, `--snapshot-time`) replace the estimates.
"""

from __future__ import annotations

import math

import dataclasses
import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from shardline.errors import ConfigError, ShardlineError
from shardline.devices import PEAK_TFLOPS, cpu_peak_tflops
from shardline.models import PRESETS, ModelArgs, flops_per_token, num_params
from shardline.planner.hardware import DEVICE_NAMES, apply_overrides, get_hardware, read_profile
from shardline.planner.layout import Workload, parse_fix
from shardline.planner.search import explain_no_fit, search
from shardline.simulator.settings import Settings

GPU_TYPES = tuple(dict.fromkeys((*PEAK_TFLOPS, "cpu")))  # the planner table may list cpu itself
MAX_SEQS_PER_STEP = 2048  # Llama 3 405B's final batch: 2048 x 8192 = 16M tokens


@dataclass(frozen=True)
class Job:
    model_name: str
    model: ModelArgs
    gpu: str
    gpus: int
    gpus_per_node: int
    days: float
    # A hardware profile (calibrate, comm-bench) the planner's step time uses: (its path, its fields as
    # JSON), read once, so the step time's cache is keyed by what the file held.
    profile: tuple[str, str] | None = None

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def duration_s(self) -> float:
        return self.days * 86400.0


def resolve_model(name: str) -> ModelArgs:
    """A preset name, or a Hugging Face folder holding config.json."""
    if name in PRESETS:
        args = PRESETS[name]
        # `tiny` takes its vocabulary from the tokenizer; assume the shipped 4096-token one.
        return args if args.vocab_size > 0 else replace(args, vocab_size=4096)
    if Path(name).is_dir():
        from shardline.interop.hf_config import read_hf_config

        try:
            return read_hf_config(name)
        except ShardlineError as e:
            raise ConfigError(f"--model {name}: {e}") from None
    raise ConfigError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a HF model folder")


def make_job(model: str, gpu: str, gpus: int, gpus_per_node: int | None, days: float,
             profile: str | None = None) -> Job:
    """The job, checked. `gpus_per_node` None: the profile's `[network] gpus_per_node` where it
    sets one (comm-bench writes the nodes it measured), else 8."""
    if gpu not in GPU_TYPES:
        raise ConfigError(f"--gpu {gpu!r} is not a known accelerator; valid: {', '.join(GPU_TYPES)}")
    per_node_from, hint = "--gpus-per-node", ""
    fields = None
    if profile is not None:
        fields = read_profile(profile)
        apply_overrides(get_hardware(gpu), fields, str(profile))  # its mistakes, in one line, before any simulation
        if gpus_per_node is None and "gpus_per_node" in fields.get("network", {}):
            gpus_per_node = fields["network"]["gpus_per_node"]
            per_node_from, hint = f"{profile}'s [network] gpus_per_node", " (or give --gpus-per-node)"
    gpus_per_node = 8 if gpus_per_node is None else gpus_per_node
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    if gpus_per_node < 1:
        raise ConfigError(f"{per_node_from} {gpus_per_node} must be at least 1{hint}")
    if gpus % gpus_per_node:
        lower = gpus - gpus % gpus_per_node
        fix = f"use {lower} or {lower + gpus_per_node}" if lower else f"use {gpus_per_node}, or --gpus-per-node {gpus}"
        raise ConfigError(f"--gpus {gpus} is not a multiple of {per_node_from} {gpus_per_node}: {fix}{hint}")
    if not (days > 0 and math.isfinite(days)):
        raise ConfigError(f"--days {days} must be a finite number > 0")
    held = (str(profile), json.dumps(fields, sort_keys=True)) if profile is not None else None
    return Job(model, resolve_model(model), gpu, gpus, gpus_per_node, days, held)


FALLBACK_MFU = 0.40  # a device the planner has no table for; Llama 3 405B: 38-43% BF16 MFU (Table 4)


def peak_flops(gpu: str) -> float:
    """Dense peak FLOP/s of one accelerator (bf16; fp32 for `cpu`)."""
    if gpu == "cpu":
        return cpu_peak_tflops(shared=False) * 1e12
    return PEAK_TFLOPS[gpu][1]["bf16"] * 1e12


def seq_len(job: Job, settings: Settings) -> int:
    return settings.seq_len or min(job.model.max_seq_len, 8192)


def tokens_per_step(job: Job, settings: Settings) -> int:
    sequences = settings.global_batch or min(job.gpus, MAX_SEQS_PER_STEP)
    return settings.global_batch_tokens or sequences * seq_len(job, settings)


def step_time_s(job: Job, settings: Settings) -> tuple[float, str]:
    """Seconds per optimizer step, and where the number came from."""
    if settings.step_time_s is not None:
        return settings.step_time_s, "given (--step-time)"
    seconds, how = planned_step(job.model, job.gpu, job.gpus, job.gpus_per_node, seq_len(job, settings),
                                tokens_per_step(job, settings), settings.fix, job.profile)
    if seconds is not None:
        return seconds, how + (f" (--mfu {settings.mfu} not used: it prices a job the planner has no layout for)"
                               if settings.mfu is not None else "")
    if settings.mfu is None and job.gpu in DEVICE_NAMES:  # the planner says it cannot run: a goodput of what?
        raise ConfigError(f"{job.model_name} on {job.gpus:,} x {job.gpu}: {how}; to simulate it anyway, give "
                          "--step-time S, or --mfu X for a step time from FLOPs at that MFU")
    mfu = settings.mfu or FALLBACK_MFU
    flops = flops_per_token(job.model, seq_len(job, settings)) * tokens_per_step(job, settings)
    seconds = flops / (job.gpus * peak_flops(job.gpu) * mfu)
    estimate = (f"estimate: {flops / tokens_per_step(job, settings):.3g} FLOP/token x "
                f"{tokens_per_step(job, settings):,} tokens / ({job.gpus:,} x {peak_flops(job.gpu) / 1e12:.3g} "
                f"TFLOP/s x MFU {mfu:.2f})")
    return seconds, f"{estimate}; no planner estimate: {how}"


@functools.lru_cache(maxsize=64)
def planned_step(model: ModelArgs, gpu: str, gpus: int, gpus_per_node: int, seq: int, tokens: int,
                 fix: str = "", profile: tuple[str, str] | None = None) -> tuple[float | None, str]:
    """(step seconds of the planner's best layout, description), or (None, why there is none).

    bf16 on accelerators, fp32 on `cpu`, with the trainer's document mask, as `shardline
    plan` assumes by default. The search is the planner's (seconds at 16k GPUs) and is
    cached, so sweeps and repeated calls pay it once.
    """
    if gpu not in DEVICE_NAMES:
        return None, f"{gpu} is not in the planner's hardware table"
    if tokens % seq:
        return None, f"{tokens:,} tokens per step is not a whole number of {seq}-token sequences"
    hw = get_hardware(gpu)
    if profile is not None:  # (path, fields as JSON): Job.profile
        hw = apply_overrides(hw, json.loads(profile[1]), profile[0])
    hw = dataclasses.replace(hw, network=dataclasses.replace(hw.network, gpus_per_node=gpus_per_node))
    work = Workload(model, seq, tokens // seq, "fp32" if gpu == "cpu" else "bf16")
    try:
        result = search(work, hw, gpus, parse_fix(fix), runnable_only=True)  # (a layout the trainer builds)
    except ConfigError as e:
        return None, str(e)
    if not result.candidates:
        return None, explain_no_fit(work, hw, gpus, result, overrides=False)
    best = result.candidates[0]
    pinned = (f", --fix {fix}" if fix else "") + (f", --profile {profile[0]}" if profile else "")
    return best.step_time_s, (f"planner: {best.layout.describe()}{pinned}, MFU {100 * best.mfu:.1f}%, "
                              f"{best.memory['total'] / 2**30:.1f} GiB/GPU; best of {len(result.candidates):,} "
                              f"fitting layouts; a step of {tokens // seq:,} sequences of {seq:,} tokens "
                              "(--global-batch or --global-batch-tokens, --seq-len)")


def state_bytes(job: Job, settings: Settings) -> float:
    return num_params(job.model) * settings.state_bytes_per_param


def save_cost_s(job: Job, settings: Settings) -> float:
    """Write (or read) one full checkpoint: storage bandwidth is per node, capped in total."""
    if settings.save_s is not None:
        return settings.save_s
    bandwidth = min(job.nodes * settings.storage_gbps_per_node, settings.storage_gbps_total) * 1e9
    return settings.save_overhead_s + state_bytes(job, settings) / bandwidth


def snapshot_cost_s(job: Job, settings: Settings) -> float:
    """Copy each GPU's shard of the state to pinned host memory (the async stall)."""
    if settings.snapshot_s is not None:
        return settings.snapshot_s
    per_gpu = state_bytes(job, settings) / job.gpus
    return settings.snapshot_overhead_s + per_gpu / (settings.host_copy_gbps * 1e9)


def load_cost_s(job: Job, settings: Settings) -> float:
    return settings.load_s if settings.load_s is not None else save_cost_s(job, settings)


def memory_load_cost_s(job: Job, settings: Settings) -> float:
    return settings.memory_load_s if settings.memory_load_s is not None else snapshot_cost_s(job, settings)
