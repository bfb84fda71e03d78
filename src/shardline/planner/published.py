"""Published GPU training runs as a check on the planner: predicted vs reported throughput.

The runs are in `validation/gpu_runs.toml` (Megatron-LM SC21 Table 1, Korthikanti et al.
2022, BLOOM-176B, OPT-175B): model shape, machine, layout, batch, and the published
throughput in that paper's own FLOP convention. Each row is predicted the way a user
would ask: the published layout pinned (`plan --fix`), anything the paper does not state
(micro-batch size, stages per rank) left to the search, and the result compared in
tokens/s, the one quantity that needs no FLOP convention: the published figure is turned
into tokens/s with the paper's formula, the prediction is tokens/s. The error is
predicted / published - 1.

The published models are GPT-style; the planner's block is Llama's. A GeLU MLP of width
4h has 8h² weights; a SwiGLU of width 8h/3 has the same, so its GEMM FLOPs and parameters
match (the width is rounded to a multiple of 64). What differs, and is not corrected:
the activations the block saves (SwiGLU keeps more) and the element-wise work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from shardline.config import reader
from shardline.errors import ConfigError
from shardline.models.llama import ModelArgs
from shardline.planner.estimate import Estimate, estimate
from shardline.planner.hardware import Hardware, get_hardware
from shardline.planner.layout import Layout, Runtime, Workload
from shardline.planner.search import search

RUNS_FILE = Path(__file__).with_name("validation") / "gpu_runs.toml"
CONVENTIONS = ("megatron_recompute", "megatron_model")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: shape, machine, layout, and the figure it reported."""

    id: str = ""
    source: str = ""
    note: str = ""
    dim: int = 0
    layers: int = 0
    heads: int = 0
    vocab: int = 0
    seq_len: int = 2048
    gpu: str = "a100-80gb"
    gpus: int = 0
    inter_bw_gbs: float = 0.0  # 0: the hardware table's NIC share per GPU
    tp: int = 1
    pp: int = 1
    dp_mode: str = "ddp"  # ddp | zero1 | fsdp
    schedule: str = "1f1b"
    virtual_stages: int = 0  # 0: not published (searched)
    micro_batch: int = 0  # 0: not published (searched)
    ac: str = "full"
    sequence_parallel: bool = False
    global_batch: int = 0
    precision: str = "bf16"
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    aggregate_pflops: float = 0.0  # the paper's all-GPU figure where it gives one (a typo check)
    convention: str = "megatron_recompute"
    mem_gib: float = 0.0  # published peak memory per GPU (nvidia-smi's "GB", read as GiB), 0: not published
    base: str = ""  # [[memory]] rows only: the [[run]] this row changes (its other keys override that run's)
    system: str = ""  # a [system.NAME] table of the file: the program's Runtime ("": shardline's)
    runtime: Runtime = Runtime()

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


RUNTIME_CHOICES = {"zero1": ("shardline", "deepspeed_bf16"), "pp_split": ("trainer", "ends_as_blocks")}


def load_runs(path: str | Path = RUNS_FILE) -> list[PublishedRun]:
    """The rows of a validation file; a wrong key or convention is a ConfigError naming the row."""
    raw = reader.read_toml(path, "validation file")
    systems = _systems(raw, path)
    runs = []
    for i, row in enumerate(raw.get("run", [])):
        run = reader.updated(PublishedRun(), row, f"run[{i}]", kind="validation key")
        if run.convention not in CONVENTIONS:
            raise ConfigError(f"{path}: run {run.id!r} convention={run.convention!r}; valid: {', '.join(CONVENTIONS)}")
        if run.system and run.system not in systems:
            raise ConfigError(f"{path}: run {run.id!r} names system {run.system!r}; defined: {', '.join(systems)}")
        runs.append(dataclasses.replace(run, runtime=systems.get(run.system, Runtime())))
    return runs


def _systems(raw: dict, path: str | Path) -> dict[str, Runtime]:
    """The file's [system.NAME] tables as Runtimes; a choice field with an unknown value is an error
    (it would otherwise read as shardline's default)."""
    systems = {name: reader.updated(Runtime(), table, f"system.{name}", kind="runtime key")
               for name, table in raw.get("system", {}).items()}
    for name, rt in systems.items():
        for key, valid in RUNTIME_CHOICES.items():
            if getattr(rt, key) not in valid:
                raise ConfigError(f"{path}: system.{name}.{key}={getattr(rt, key)!r}; valid: {', '.join(valid)}")
    return systems


def load_memory_rows(path: str | Path = RUNS_FILE) -> list[PublishedRun]:
    """Published per-GPU memory: the [[run]] rows that give one, and the [[memory]] rows, each a
    [[run]] (`base`) with the keys it changes (a benchmark of the same program on the same cluster)."""
    runs = {r.id: r for r in load_runs(path)}
    rows = [r for r in runs.values() if r.mem_gib]
    for i, row in enumerate(reader.read_toml(path, "validation file").get("memory", [])):
        base = runs.get(row.get("base", ""))
        if base is None:
            raise ConfigError(f"{path}: memory[{i}] base={row.get('base')!r} is not a run id")
        rows.append(reader.updated(base, row, f"memory[{i}]", kind="validation key"))
    return rows


def memory_error(run: PublishedRun) -> tuple[Estimate, float]:
    """The published layout's estimate and its peak memory over the published figure, minus one."""
    e = estimate(workload(run), published_layout(run), hardware(run))
    return e, e.memory["total"] / 2**30 / run.mem_gib - 1


def model_args(run: PublishedRun) -> ModelArgs:
    """The GPT shape as a Llama block: SwiGLU of width 8h/3 (rounded to 64) for the 4h GeLU MLP."""
    ffn = max(64, round(8 * run.dim / 3 / 64) * 64)
    return ModelArgs(dim=run.dim, n_layers=run.layers, n_heads=run.heads, vocab_size=run.vocab,
                     ffn_dim=ffn, max_seq_len=run.seq_len, tie_embeddings=True)


def workload(run: PublishedRun) -> Workload:
    """The run as the planner's workload: causal attention over whole sequences, no document mask
    (Megatron's GPT data had none: reset_attention_mask off, its fused upper-triangular softmax
    builds no [b, 1, s, s] mask). The math kernel computes every score regardless."""
    return Workload(model_args(run), run.seq_len, run.global_batch, run.precision, document_mask=False,
                    runtime=run.runtime)


def hardware(run: PublishedRun) -> Hardware:
    """The table's device, with the run's network where it differs (e.g. BLOOM's Omni-Path)."""
    hw = get_hardware(run.gpu)
    if run.inter_bw_gbs:
        hw = dataclasses.replace(hw, network=dataclasses.replace(hw.network, inter_bw_gbs=run.inter_bw_gbs))
    return hw


def fixed_keys(run: PublishedRun) -> dict:
    """The published layout as `plan --fix` keys; unpublished keys stay free for the search."""
    dp = run.dp
    data = {"ddp": {"dp_replicate": dp, "dp_shard": 1}, "zero1": {"dp_replicate": 1, "dp_shard": dp, "zero": 1},
            "fsdp": {"dp_replicate": 1, "dp_shard": dp, "zero": 3}}[run.dp_mode]
    data["cpu_offload"] = False  # none of these runs offloaded (dp 1 + offload would be FSDP, not ddp)
    out = {"tp": run.tp, "pp": run.pp, "cp": 1, "sequence_parallel": run.sequence_parallel,
           "activation_checkpoint": run.ac, **data}
    if run.pp > 1:
        out["pp_schedule"] = run.schedule
    if run.virtual_stages:
        out["pp_virtual_stages"] = run.virtual_stages
    if run.micro_batch:
        out["micro_batch_size"] = run.micro_batch
    return out


def paper_flops_per_token(run: PublishedRun) -> float:
    """FLOPs per token in the paper's convention (Narayanan et al. 2021 eq. 3 and its no-recompute form)."""
    h, s, v, layers = run.dim, run.seq_len, run.vocab, run.layers
    if run.convention == "megatron_recompute":
        return 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def published_tokens_per_s(run: PublishedRun) -> float:
    """The published figure as global tokens/s (through the paper's FLOP convention)."""
    hw = get_hardware(run.gpu)
    per_gpu = run.tflops_per_gpu * 1e12 if run.tflops_per_gpu else run.mfu * hw.peak(run.precision)
    return per_gpu * run.gpus / paper_flops_per_token(run)


@dataclass
class Prediction:
    run: PublishedRun
    estimate: Estimate
    published_tokens_per_s: float

    @property
    def error(self) -> float:
        """Predicted over published throughput, minus one."""
        return self.estimate.tokens_per_s / self.published_tokens_per_s - 1

    def in_paper_units(self) -> float:
        """The prediction as the paper reports it: TFLOP/s per GPU, or MFU."""
        per_gpu = self.estimate.tokens_per_s * paper_flops_per_token(self.run) / self.run.gpus
        if self.run.tflops_per_gpu:
            return per_gpu / 1e12
        return per_gpu / get_hardware(self.run.gpu).peak(self.run.precision)


def published_layout(run: PublishedRun) -> Layout:
    """The published layout with what the paper left out at its simplest: one sequence per
    micro-batch, two stages per rank for the interleaved schedule."""
    fixed = fixed_keys(run)
    mbs = fixed.setdefault("micro_batch_size", 1)
    if run.pp > 1:
        fixed.setdefault("pp_virtual_stages", 2 if run.schedule == "interleaved_1f1b" else 1)
        fixed["pp_microbatches"] = run.global_batch // (run.dp * mbs)
    return Layout(**fixed)


def predict(run: PublishedRun) -> Prediction:
    """The planner's best layout among those the paper's pinned keys allow; when none fits,
    the published layout timed anyway (its estimate says `fits` False)."""
    work, hw = workload(run), hardware(run)
    result = search(work, hw, run.gpus, fixed_keys(run))
    best = result.candidates[0] if result.candidates else estimate(work, published_layout(run), hw)
    return Prediction(run, best, published_tokens_per_s(run))


def table(preds: list[Prediction]) -> str:
    """A markdown table of the predictions (README and docs/planner.md)."""
    lines = ["| run | GPUs | layout (planner's pick) | published | predicted | error | fits |",
             "|---|---|---|---|---|---|---|"]
    for p in preds:
        unit = "TFLOP/s" if p.run.tflops_per_gpu else "MFU"
        pub = p.run.tflops_per_gpu if p.run.tflops_per_gpu else 100 * p.run.mfu
        got = p.in_paper_units() * (1 if p.run.tflops_per_gpu else 100)
        fmt = "{:.0f}" if p.run.tflops_per_gpu else "{:.1f}%"
        lines.append(f"| {p.run.id} | {p.run.gpus} | {p.estimate.layout.describe()} | {fmt.format(pub)} {unit} "
                     f"| {fmt.format(got)} | {100 * p.error:+.1f}% | {'yes' if p.estimate.fits else 'no'} |")
    return "\n".join(lines)
