"""The sections of the training config: [run] [model] [train] [optim] [checkpoint] [metrics]
[parallel] [memory] ([data] in data_section.py).

Each section validates its own values (`check()`): a ConfigError naming the key, the
value and what would be valid. Rules that need the model shape, the data or the
world size live with the layout (`shardline.layout`) and the launch checks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from shardline.errors import require

SWITCH = "-1 (the preset's or the starting weights'), 0 or false (off), 1 or true (on)"  # what a yes/no model key takes
SWITCH_FIELD = {"valid": SWITCH, "switch": True}  # the metadata of such a key (the reader takes true/false as 1/0)

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")
# A weights' dtype (convert and generate --dtype) by torch's name or train.precision's short one
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTION_KERNELS = ("auto", "sdpa", "flex", "varlen")
FP8_RECIPES = ("tensorwise", "rowwise")
SCHEDULES = ("cosine", "linear", "wsd", "constant", "rsqrt")


_require = require


@dataclass
class RunConfig:
    dir: str = "runs/default"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    resume: str = "auto"  # auto (if the run dir has a checkpoint) | latest (insist on one) | never | <checkpoint dir>

    def check(self) -> None:
        _require(bool(self.dir) and "\0" not in self.dir, "run.dir", self.dir, "must be a non-empty path (no NUL byte)")
        _require(bool(self.resume), "run.resume", self.resume, "one of auto, latest, never or a checkpoint folder")
        ok = self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device) is not None
        _require(ok, "run.device", self.device, "use auto, cpu, cuda or cuda:N")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    hf_path: str = ""  # start from this HF folder (Llama, Mistral, Qwen2/3, Phi-3/4, Mixtral, Qwen3-MoE), not a preset
    init_from: str = ""  # start from the weights of this shardline checkpoint (fresh optimizer, step 0)
    # Shape overrides on top of the preset (0 / -1 = keep the preset's value).
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    ffn_dim: int = 0
    vocab_size: int = 0
    rope_theta: float = 0.0
    tie_embeddings: int = field(default=-1, metadata=SWITCH_FIELD)  # -1 keep, 0 untied, 1 tied
    qk_norm: int = field(default=-1, metadata=SWITCH_FIELD)  # 1: an RMSNorm on each query and key head (Qwen3)
    qkv_bias: int = field(default=-1, metadata=SWITCH_FIELD)  # 1: biases on the q, k and v projections (Qwen2)

    def check(self) -> None:
        # The preset name is checked against the model table by the launch checks
        # (config sits below models and cannot see it).
        _require(bool(self.preset) or bool(self.hf_path), "model.preset", self.preset, "a preset name")
        _require(not (self.hf_path and self.init_from), "model.init_from", self.init_from,
                 "set model.hf_path or model.init_from, not both")
        for key in ("tie_embeddings", "qk_norm", "qkv_bias"):
            _require(getattr(self, key) in (-1, 0, 1), f"model.{key}", getattr(self, key), "-1, 0 or 1")
        _require(self.rope_theta >= 0, "model.rope_theta", self.rope_theta, "must be > 0 (0 keeps the preset's)")
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size"):
            _require(0 <= getattr(self, key) < 2**31 and (key != "n_layers" or self.n_layers <= 100_000),
                     f"model.{key}", getattr(self, key), "must be > 0 (0 keeps the preset's), at most "
                     + ("100000 layers" if key == "n_layers" else "2**31 - 1"))


MOE_ROUTERS = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    """Mixture-of-experts overrides on top of the model's shape (-1 / 0 / "" keep its value).

    On a dense preset, setting num_experts, top_k and expert_ffn_dim makes it an MoE model.
    """

    num_experts: int = 0  # routed experts per MoE layer
    top_k: int = 0  # routed experts per token
    expert_ffn_dim: int = 0  # hidden size of each expert's SwiGLU
    shared_experts: int = -1  # always-on experts (one SwiGLU of shared_experts x expert_ffn_dim)
    first_dense_layers: int = -1  # leading blocks that keep the dense feed-forward
    router: str = ""  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3)
    norm_topk: int = field(default=-1, metadata=SWITCH_FIELD)  # 1: top_k weights sum to one; 0: raw scores
    capacity_factor: float = -1.0  # 0 = dropless; c > 0: each expert takes ceil(c x tokens x top_k / experts)
    aux_loss_coef: float = -1.0  # Switch/GShard balance loss per sequence; 0 = off
    z_loss_coef: float = -1.0  # router z-loss; 0 = off
    bias_update_rate: float = -1.0  # auxiliary-loss-free balancing (per-expert bias step); 0 = off
    route_scale: float = -1.0  # multiplies the routed experts' weights (DeepSeek-V3: 2.5); > 0

    def check(self) -> None:
        for key in ("num_experts", "top_k", "expert_ffn_dim"):
            _require(getattr(self, key) >= 0, f"moe.{key}", getattr(self, key), "must be > 0 (0 keeps the model's)")
        for key in ("shared_experts", "first_dense_layers", "capacity_factor", "aux_loss_coef", "z_loss_coef",
                    "bias_update_rate"):
            _require(getattr(self, key) >= 0 or getattr(self, key) == -1, f"moe.{key}", getattr(self, key),
                     "must be >= 0 (-1 keeps the model's)")
        _require(self.router in ("", *MOE_ROUTERS), "moe.router", self.router,
                 f"one of {', '.join(MOE_ROUTERS)} (or empty to keep the model's)")
        _require(self.norm_topk in (-1, 0, 1), "moe.norm_topk", self.norm_topk, "-1 (the model's), 0 or 1")
        _require(self.route_scale > 0 or self.route_scale == -1, "moe.route_scale", self.route_scale,
                 "must be > 0 (-1 keeps the model's)")

    def overrides(self) -> dict:
        """The keys set here, by MoEArgs field name (num_experts is MoEArgs.n_experts)."""
        keep = {"num_experts": 0, "top_k": 0, "expert_ffn_dim": 0, "router": ""}
        return {("n_experts" if key == "num_experts" else key): bool(value) if key == "norm_topk" else value
                for key, value in self.__dict__.items() if value != keep.get(key, -1)}


@dataclass
class TrainConfig:
    steps: int = 200  # length of the run (and of the learning-rate schedule)
    stop_at_step: int = 0  # stop early at this step, e.g. to fit a time slot; 0 = run to train.steps
    # > 0: the run's length in passes over the training sequences instead (fine-tuning's way to say
    # it); train.steps is then derived at launch, once the data is read: ceil(epochs x sequences / batch)
    epochs: float = 0.0
    seq_len: int = 256
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    seed: int = 1234  # the weights' initialisation and the data order (unless data_seed sets that apart)
    data_seed: int = -1  # the order the training sequences are read in; -1 = train.seed
    # auto (bf16 on a GPU that has it, else fp32: settle_precision) | fp32 | bf16 | fp16 | fp8 (bf16 autocast,
    # Linear layers in float8; see [fp8])
    precision: str = "auto"
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    compile: bool = False
    document_mask: bool = True  # tokens attend only within their own packed document
    attention: str = "auto"  # auto | sdpa (dense mask) | flex (FlexAttention block mask) | varlen (cu_seqlens)
    loss_chunk_tokens: int = 0  # output projection + cross-entropy this many tokens at a time; 0 = all at once
    eval_interval: int = 50  # 0 disables evaluation
    eval_batches: int = 2  # global batches of the held-out split per evaluation, whatever the layout
    # end the run once this many evaluations in a row have not lowered the lowest eval loss (by more than
    # early_stop_min_delta): a fine-tune past its best point; 0 = off (train to train.steps)
    early_stop_patience: int = 0
    early_stop_min_delta: float = 0.0
    skip_batches: list[int] = field(default_factory=list)  # 0-based global batch indices never to train on

    @property
    def order_seed(self) -> int:
        """The seed of the data order: train.data_seed, or train.seed where it is -1 (an ablation of the
        initialisation alone keeps the data order by setting data_seed, as one of the order alone sets seed)."""
        return self.seed if self.data_seed == -1 else self.data_seed

    @property
    def order_seed_key(self) -> str:
        """The key that gives order_seed (what a refusal of another data order asks to set back)."""
        return "train.seed" if self.data_seed == -1 else "train.data_seed"

    def steps_for_epochs(self, sequences: int) -> int:
        """train.steps for train.epochs passes over `sequences` training sequences (at least one step)."""
        return max(1, math.ceil(round(self.epochs * sequences / self.global_batch_size, 9)))  # (0.07 x 800 / 8: 7)

    @property
    def last_step(self) -> int:
        """The step a launch trains to: train.steps, or train.stop_at_step before it."""
        return min(self.steps, self.stop_at_step or self.steps)

    def settle_precision(self, on_gpu: bool, gpu_bf16: bool = True) -> None:
        """precision = "auto" as the device decides it (settled_precision), before anything reads it."""
        self.precision = settled_precision(self.precision, on_gpu, gpu_bf16)

    def check(self) -> None:
        _require(self.stop_at_step >= 0, "train.stop_at_step", self.stop_at_step, "must be >= 0 (0 = train.steps)")
        _require(0 <= self.seed < 2**63, "train.seed", self.seed, "must be in [0, 2**63) (torch's generator seed)")
        _require(-1 <= self.data_seed < 2**63, "train.data_seed", self.data_seed,
                 "must be -1 (train.seed) or in [0, 2**63)")
        for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size"):
            _require(0 < getattr(self, key) < 2**63, f"train.{key}", getattr(self, key), "must be > 0 (and < 2**63)")
        _require(self.epochs >= 0, "train.epochs", self.epochs, "must be >= 0 (0: train.steps gives the length)")
        _require(self.stop_at_step <= self.steps or bool(self.epochs), "train.stop_at_step", self.stop_at_step,
                 f"must be <= train.steps ({self.steps}), the run's end (0 = train.steps)")  # (epochs: checked again)
        _require(self.precision in PRECISIONS, "train.precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        _require(self.attention in ATTENTION_KERNELS, "train.attention", self.attention,
                 f"one of {', '.join(ATTENTION_KERNELS)}")
        _require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0 (0 disables)")
        _require(self.eval_interval >= 0, "train.eval_interval", self.eval_interval, "must be >= 0 (0 disables)")
        _require(self.eval_batches > 0, "train.eval_batches", self.eval_batches, "must be > 0")
        _require(self.early_stop_patience >= 0, "train.early_stop_patience", self.early_stop_patience,
                 "must be >= 0 (evaluations without a lower eval loss; 0 = off)")
        _require(not self.early_stop_patience or self.eval_interval > 0, "train.early_stop_patience",
                 self.early_stop_patience, "needs train.eval_interval > 0: the evaluations decide the stop")
        _require(self.early_stop_min_delta >= 0, "train.early_stop_min_delta", self.early_stop_min_delta,
                 "must be >= 0 (how much lower an eval loss must be to count; e.g. 0.001)")
        _require(self.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", self.loss_chunk_tokens,
                 "must be >= 0 (0 = no chunking; e.g. 4096)")
        _require(all(b >= 0 for b in self.skip_batches), "train.skip_batches", self.skip_batches,
                 "batch indices must be >= 0")
        _require(len(set(self.skip_batches)) == len(self.skip_batches), "train.skip_batches", self.skip_batches,
                 "must name each batch once (a repeated index would shift the batches after it once more)")


def settled_precision(asked: str, on_gpu: bool, gpu_bf16: bool = True) -> str:
    """`asked`, or for "auto" what the device decides: bf16 on a GPU with bf16 (Ampere and newer; fp32
    there ran ~14x under the bf16 peak), fp32 on a CPU (whose 16-bit matmuls are often slower) and on an
    older GPU (whose fp16 needs loss scaling: asked for by name). The trainer, the dry run, estimate and
    plan all settle it here."""
    if asked != "auto":
        return asked
    return "bf16" if on_gpu and gpu_bf16 else "fp32"


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | linear | wsd | constant | rsqrt, after a linear warmup
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying at the end
    implementation: str = "auto"  # auto | fused | foreach | for-loop

    @property
    def fused(self) -> bool:
        """AdamW on torch's fused kernel: fused, or auto (which builds foreach only where parameters sit
        on two kinds of device, or ZeRO-1's slices are strided)."""
        return self.implementation in ("auto", "fused")

    def check(self) -> None:
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _require(self.eps > 0, "optim.eps", self.eps, "must be > 0 (e.g. 1e-8)")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        for key in ("beta1", "beta2"):
            _require(0 <= getattr(self, key) < 1, f"optim.{key}", getattr(self, key), "must be in [0, 1)")
        _require(self.schedule in SCHEDULES, "optim.schedule", self.schedule, f"one of {', '.join(SCHEDULES)}")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.schedule != "rsqrt" or self.warmup_steps > 0, "optim.warmup_steps", self.warmup_steps,
                 "optim.schedule=rsqrt needs >= 1: its lr after the warm-up is lr x sqrt(warmup_steps / step)")
        _require(0 < self.decay_fraction <= 1, "optim.decay_fraction", self.decay_fraction, "must be in (0, 1]")
        impls = ("auto", "fused", "foreach", "for-loop")
        _require(self.implementation in impls, "optim.implementation", self.implementation,
                 f"one of {', '.join(impls)}")


@dataclass
class CheckpointConfig:
    interval: int = 50  # save every N steps (and at the end); 0 disables
    keep: int = 3  # keep the newest K checkpoints
    keep_best: bool = False  # also keep the lowest eval loss's: an evaluation that beats it saves its step
    mode: str = "sync"  # sync | async (snapshot to host memory, then write in the background)
    memory_interval: int = 0  # in-memory tier: snapshot into host RAM every N steps; 0 disables
    memory_redundancy: str = "replica"  # replica (a peer keeps a copy) | xor (parity across a group)
    memory_mode: str = "async"  # async (stall only for a host copy) | sync (also wait for the peer exchange)
    memory_dir: str = ""  # base folder of the in-memory tier (RAM-backed); "" = /dev/shm/shardline-<user>
    on_error: str = "continue"  # a save the disk refuses (full, read-only): continue (retry next time) | stop

    def check(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval", self.interval, "must be >= 0 (0 disables)")
        _require(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")
        _require(not self.keep_best or self.interval > 0, "checkpoint.keep_best", self.keep_best,
                 "needs checkpoint.interval > 0: it keeps a checkpoint on disk")
        _require(self.mode in ("sync", "async"), "checkpoint.mode", self.mode, "sync or async")
        _require(self.memory_interval >= 0, "checkpoint.memory_interval", self.memory_interval,
                 "must be >= 0 (0 disables)")
        _require(self.memory_redundancy in ("replica", "xor"), "checkpoint.memory_redundancy",
                 self.memory_redundancy, "replica or xor")
        _require(self.memory_mode in ("sync", "async"), "checkpoint.memory_mode", self.memory_mode, "sync or async")
        _require(self.on_error in ("continue", "stop"), "checkpoint.on_error", self.on_error, "continue or stop")
        _require("\0" not in self.memory_dir, "checkpoint.memory_dir", self.memory_dir, "a folder path (no NUL byte)")


@dataclass
class MetricsConfig:
    log_interval: int = 10
    progress: str = "auto"  # auto (rich on a terminal, plain lines otherwise) | rich | plain | none
    tensorboard: bool = True
    peak_tflops: float = 0.0  # per device; 0 = from the device table
    profile_steps: list[int] = field(default_factory=list)  # [first, last]: a profiler trace (+ CUDA memory snapshot)

    def check(self) -> None:
        _require(self.log_interval > 0, "metrics.log_interval", self.log_interval, "must be > 0")
        modes = ("auto", "rich", "plain", "none")
        _require(self.progress in modes, "metrics.progress", self.progress, f"one of {', '.join(modes)}")
        _require(self.peak_tflops >= 0, "metrics.peak_tflops", self.peak_tflops, "must be >= 0 (0 = table)")
        steps = self.profile_steps
        _require(not steps or (len(steps) == 2 and 1 <= steps[0] <= steps[1]), "metrics.profile_steps", steps,
                 "empty, or [first, last] with 1 <= first <= last (e.g. [5, 7])")


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
CP_MODES = ("ring", "ulysses", "hybrid")
CP_BALANCES = ("zigzag", "none")
AC_MODES = ("none", "full", "selective", "op")


@dataclass
class ParallelConfig:
    """Degrees of each parallel dimension; their product is the world size.

    dp_shard=-1 takes whatever the other degrees leave of the world size.
    """

    dp_replicate: int = 1  # replicas (DDP, or across groups in HSDP)
    dp_shard: int = -1  # ranks that shard state (FSDP2); -1 = the rest of the world
    # what dp_shard shards: 1 optimizer states, 2 + gradients, 3 + parameters
    zero: int = field(default=3, metadata={"valid": "1, 2 or 3"})
    tp: int = 1  # tensor parallel (Megatron 1-D)
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel: every sequence split over cp ranks
    cp_mode: str = "ring"  # ring (K/V blocks pass around) | ulysses (all-to-all to heads) | hybrid (both)
    cp_ulysses: int = 0  # hybrid only: the all-to-all (head) part U of cp; cp / U ranks form the ring
    cp_balance: str = "zigzag"  # zigzag (rank i holds chunks i and 2R-1-i: equal causal work) | none
    ep: int = 1  # expert parallel: MoE experts split over ep ranks borrowed from dp_shard (or dp_shard x cp)
    sequence_parallel: bool = True  # with tp > 1: shard the norm regions along the sequence
    loss_parallel: bool = True  # with tp > 1: cross-entropy on vocab-sharded logits
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zbv | dualpipev
    pp_microbatches: int = 0  # 0 = global_batch / (dp x micro_batch): one round a step (only that number)
    pp_virtual_stages: int = 1  # stages per rank (interleaved schedules)

    def check(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "cp", "ep", "pp_virtual_stages"):
            _require(getattr(self, key) >= 1, f"parallel.{key}", getattr(self, key),
                     "must be >= 1" + (" (-1, the rest of the world size, is dp_shard's alone)"
                                       if getattr(self, key) == -1 else ""))
        _require(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
                 "must be >= 1, or -1 for the rest of the world size")
        _require(self.zero in (1, 2, 3), "parallel.zero", self.zero, "1, 2 or 3")
        _require(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
                 f"one of {', '.join(PP_SCHEDULES)}")
        _require(self.pp_microbatches >= 0, "parallel.pp_microbatches", self.pp_microbatches, "must be >= 0")
        _require(self.cp_mode in CP_MODES, "parallel.cp_mode", self.cp_mode, f"one of {', '.join(CP_MODES)}")
        _require(self.cp_balance in CP_BALANCES, "parallel.cp_balance", self.cp_balance,
                 f"one of {', '.join(CP_BALANCES)}")
        _require(self.cp_ulysses >= 0, "parallel.cp_ulysses", self.cp_ulysses, "must be >= 0")


@dataclass
class MemoryConfig:
    activation_checkpoint: str = "none"  # none | full | selective (every ac_every-th block) | op
    ac_every: int = 2
    cpu_offload: bool = False  # FSDP2 CPU offload of parameters, gradients and optimizer states
    # AdamW's moments in memory-mapped files in this folder (a local SSD): host RAM for them becomes
    # page cache the OS may evict; "" = off. On a GPU it needs cpu_offload (the states on the host).
    ssd_offload_dir: str = ""
    expandable_segments: bool = True  # CUDA allocator: grow segments instead of fragmenting (env wins if set)

    def check(self) -> None:
        _require(self.activation_checkpoint in AC_MODES, "memory.activation_checkpoint",
                 self.activation_checkpoint, f"one of {', '.join(AC_MODES)}")
        _require(self.ac_every >= 1, "memory.ac_every", self.ac_every, "must be >= 1")


@dataclass
class Float8Config:
    """train.precision = "fp8": Linear layers run their matmuls in float8 (Hopper and newer)."""

    recipe: str = "tensorwise"  # tensorwise (one scale per tensor) | rowwise (one per row: more accurate, slower)
    fsdp_all_gather: bool = True  # tensorwise: FSDP gathers parameters already cast to float8 (half the bytes)

    def check(self) -> None:
        _require(self.recipe in FP8_RECIPES, "fp8.recipe", self.recipe, f"one of {', '.join(FP8_RECIPES)}")
