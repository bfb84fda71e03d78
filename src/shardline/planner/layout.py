"""What is planned (Workload), and the planner's side of the layout (shardline.layout).

A Layout holds exactly the `[parallel]` and `[memory]` keys of the trainer's config
plus the micro-batch size, so a plan converts to a config `shardline train` accepts
(`to_config`) and a config converts back (`shardline.layout.resolve`) for `shardline estimate`.
Whether a layout can run is asked of `shardline.layout.problems`, the function the
trainer and `train --dry-run` use; the batch and degree semantics are written there.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from shardline import layout as layouts
from shardline.config import AC_MODES, CP_BALANCES, CP_MODES, PP_SCHEDULES, Config, MemoryConfig, ParallelConfig
from shardline.errors import ConfigError
from shardline.layout import IDLE_AT_DEGREE_ONE, Job, Layout
from shardline.models.llama import ModelArgs
from shardline.optim import ssd_offload
from shardline.parallel.compile import options as compile_options


@dataclass(frozen=True)
class Runtime:
    """How the training program runs a block: the implementation traits the cost model prices.

    The defaults describe shardline's eager trainer. A published run on another system
    (planner/validation/gpu_runs.toml: Megatron-LM's fused kernels, 16-bit residual stream,
    contiguous gradient buffer) states what it does differently; each field is a fact
    about a system, set for every run of that system, never a per-run fit.
    """

    residual_bytes: int = 4  # residual stream, TP gathers of it and PP sends: fp32 here (the embedding is fp32)
    fused_elementwise: bool = False  # norms, bias-dropout-residual adds and the MLP activation fused: one
    # read and one write each in the compute dtype (Megatron's fused kernels, or a compiler), no casts
    weight_casts: bool = True  # autocast casts every fp32 weight each forward; False: 16-bit weights kept
    grad_bytes: int = 4  # gradient bytes per parameter (fp32 here; Megatron: the compute dtype)
    grads_on_demand: bool = True  # gradients made in backward, set to None after each step (shardline);
    # False: a buffer allocated up front holds them throughout (Megatron's contiguous gradient buffer)
    ddp_grad_copy: bool = False  # True: DDP's reducer buckets hold a copy of every gradient (torch DDP without
    # gradient_as_bucket_view); False: the gradients are views of the buckets (shardline) or reduced in place
    tp_backward_overlap: float = 0.0  # share of the backward TP collectives hidden under the weight-gradient
    # GEMMs (Megatron with sequence parallelism overlaps them; eager DTensor does not: 0)
    pp_scatter_gather: bool = False  # TP ranks each send 1/tp of a stage's output, all-gathered over NVLink
    clip_in_optimizer: bool = True  # the clip's scale applied inside the fused AdamW step (shardline, but
    # under ZeRO-1); False: the clip multiplies every gradient in a pass of its own (Megatron's)
    block: str = "llama"  # activation accounting: "llama" (shardline's, counted) or "gpt" (Korthikanti's)
    attention: str = "flash"  # "flash": fused kernel (SDPA); "math": QK^T and AV GEMMs with the scores
    # materialised (softmax and dropout over heads x s per token: Megatron before flash attention)
    zero1: str = "shardline"  # how ZeRO-1 is built. "shardline": the fp32 parameters (the master) whole on
    # every rank beside autocast's 16-bit copies, Adam's moments sharded, the updated rows all-gathered.
    # "deepspeed_bf16": DeepSpeed's BF16_Optimizer (BLOOM): the fp32 master and an fp32 gradient buffer kept
    # whole on every rank beside the bf16 weights and gradients, that fp32 buffer all-reduced after the last
    # backward, the updated bf16 shards all-gathered
    pp_split: str = "trainer"  # blocks per pipeline stage. "trainer": shardline's balance, the output weighed by its
    # parameters. "ends_as_blocks": the embedding and the output count one block each and the stages get equal
    # counts (Megatron-DeepSpeed's --pp-partition-method 'type:transformer|embedding', BLOOM)


@dataclass(frozen=True)
class Workload:
    model: ModelArgs
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"  # compute dtype; weights, gradients and Adam states stay fp32
    document_mask: bool = True  # the trainer's default: attend within packed documents
    model_ref: str = ""  # preset name or HF folder, for the emitted config
    vocab_from_tokenizer: bool = False  # the preset sizes its vocabulary to the tokenizer
    runtime: Runtime = Runtime()  # the implementation: shardline's eager trainer unless stated
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: the logits of this many tokens at a time (0: all)
    attention: str = "auto"  # train.attention; the kernel it resolves to is priced (planner/attention.py)
    mean_doc_tokens: float = 0.0  # mean document length of the data (0: unknown, one document per row)
    compiled: bool = False  # train.compile: blocks and cross-entropy compiled (compiled_blocks, compiled_loss)
    ssd_offload_dir: str = ""  # memory.ssd_offload_dir: AdamW's moments on an SSD where AdamW steps on the host
    host_adam_fused: bool = True  # optim.implementation auto or fused: the host's AdamW (CPU offload) on the fused
    # kernel; foreach and for-loop step slower there
    model_overrides: tuple[str, ...] = ()  # the [model]/[moe] overrides priced over model_ref's ("model.dim=7168")

    @property
    def label(self) -> str:
        """The model as the reports name it: its reference, and the overrides priced over it."""
        return (self.model_ref or "model") + (f" with {' '.join(self.model_overrides)}" if self.model_overrides else "")

    @classmethod
    def from_config(cls, cfg: Config, model: ModelArgs, mean_doc_tokens: float = 0.0) -> Workload:
        """What a trainer config runs, for `model` (the shape the config resolves to): `shardline
        estimate`, `train --dry-run` and the benchmarks price a config through this one reading."""
        t = cfg.train
        if t.precision == "auto":  # (a programming slip, not the user's: the caller knows the device)
            raise ValueError("train.precision=auto: settle it for the device first (TrainConfig.settle_precision)")
        return cls(model, t.seq_len, t.global_batch_size, t.precision, t.document_mask,
                   cfg.model.hf_path or cfg.model.preset, loss_chunk_tokens=t.loss_chunk_tokens,
                   attention=t.attention, mean_doc_tokens=mean_doc_tokens, compiled=t.compile,
                   ssd_offload_dir=cfg.memory.ssd_offload_dir,
                   host_adam_fused=cfg.optim.fused)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch

    def compiled_blocks(self, layout: Layout) -> bool:
        """Whether each block runs as one compiled graph (train.compile): it keeps less for backward
        (activations.llama_compiled_block) and fuses its element-wise work. Not under the split
        backward of zbv/dualpipev, whose Linear layers run eagerly between compiled regions, nor
        under a context-parallel ring, whose attention does (priced as eager: an upper bound)."""
        return (self.compiled and self.runtime.block == "llama" and not layout.split_backward
                and layout.cp_degrees[0] == 1)

    def compiled_loss(self, layout: Layout) -> bool:
        """Whether the cross-entropy runs compiled: train.compile, except under loss parallelism."""
        return self.compiled and not compile_options(layout, layout.activation_checkpoint)["loss_parallel"]


FIX_KEYS = tuple(f.name for f in dataclasses.fields(Layout)) + ("dp",)


def parse_fix(text: str) -> dict:
    """`tp=8,pp=4,pp_schedule=interleaved_1f1b,...` -> typed dict; `dp=N` means plain DDP."""
    out: dict = {}
    types = {f.name: f.type for f in dataclasses.fields(Layout)}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            raise ConfigError(f"--fix item {item!r} must look like key=value (e.g. tp=8)")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in FIX_KEYS:
            raise ConfigError(f"--fix key {key!r} is unknown; valid: {', '.join(FIX_KEYS)}")
        if key in out:  # (tp=2,tp=4 priced tp=4 in silence)
            raise ConfigError(f"--fix gives {key} twice ({key}={out[key]}, {item}): give it once")
        kind = "int" if key == "dp" else types[key]
        out[key] = _parse_value(key, value, kind)
    if "dp" in out:
        dp = out.pop("dp")
        if out.get("dp_shard", 1) not in (1, -1) or out.get("dp_replicate", dp) != dp:
            raise ConfigError("--fix dp=N means plain data parallel (dp_replicate=N, dp_shard=1); "
                              "do not combine it with dp_shard or dp_replicate")
        out.update(dp_replicate=dp, dp_shard=1)
    return out


def _parse_value(key: str, value: str, kind: str):
    if kind == "bool":
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--fix {key}={value!r} must be true or false")
    if kind == "int":
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"--fix {key}={value!r} must be an integer") from None
        if key == "zero" and number not in (1, 2, 3):
            raise ConfigError(f"--fix zero={number} is invalid; valid: 1, 2, 3")
        least = 0 if key == "cp_ulysses" else 1  # 0: no Ulysses part; every other count is >= 1
        if number < least:
            raise ConfigError(f"--fix {key}={number} must be >= {least}")
        return number
    valid = {"pp_schedule": PP_SCHEDULES, "activation_checkpoint": AC_MODES, "cp_mode": CP_MODES,
             "cp_balance": CP_BALANCES}[key]
    if value not in valid:
        raise ConfigError(f"--fix {key}={value!r} is invalid; valid: {', '.join(valid)}")
    return value


def to_config(layout: Layout, work: Workload, base: Config | None = None, on_cpu: bool = False) -> Config:
    """A trainer config running `work` with `layout` (other sections from `base` or defaults) on
    GPUs, or CPU processes (`on_cpu`)."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    if work.model_ref.startswith("hf:"):
        cfg.model.hf_path = work.model_ref[3:]
    elif work.model_ref:
        cfg.model.preset = work.model_ref
    t = cfg.train
    t.seq_len, t.global_batch_size, t.micro_batch_size = work.seq_len, work.global_batch, layout.micro_batch_size
    t.precision, t.document_mask, t.attention = work.precision, work.document_mask, work.attention
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    given = {k: v for k, v in layout.to_json().items() if k in fields}
    unread = {key for degree, keys in IDLE_AT_DEGREE_ONE.items() if given[degree] == 1 for key in keys}  # defaults
    if layout.dp_mode in ("ddp", "single"):  # nothing sharded: no ZeRO stage is read
        unread.add("zero")
    cfg.parallel = ParallelConfig(**{k: v for k, v in given.items() if k not in unread})
    cfg.memory.activation_checkpoint = layout.activation_checkpoint
    cfg.memory.ac_every = layout.ac_every if layout.activation_checkpoint == "selective" else \
        MemoryConfig().ac_every  # (a base config's would be read by nothing)
    cfg.memory.cpu_offload = layout.cpu_offload
    # The folder where this layout can use it (the trainer refuses it elsewhere); else the plan does not.
    usable = ssd_offload.usable(layout.zero, layout.cpu_offload, on_cuda=not on_cpu)
    cfg.memory.ssd_offload_dir = work.ssd_offload_dir if usable else ""
    if on_cpu:  # (auto would take a GPU where the file runs, and its dry run prices one)
        cfg.run.device = "cpu"
    cfg.check(dp_world=layout.dp)
    return cfg


def job(work: Workload) -> Job:
    return Job(work.model, work.seq_len, work.global_batch, work.attention, work.precision)


def layout_problem(work: Workload, layout: Layout, runnable: bool = False) -> tuple[str, str] | None:
    """(rule key, message) of the first rule `layout` breaks for `work`, else None.

    runnable=False: the rules any implementation obeys (the planner ranks layouts the
    trainer does not build yet); True: also what `shardline train` does not build, which
    is exactly the trainer's acceptance.
    """
    return layouts.first_problem(layout, job(work), runnable=runnable)
