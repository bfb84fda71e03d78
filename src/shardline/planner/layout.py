"""What is planned (Workload) and how it is laid out on the devices (Layout).

A Layout holds exactly the `[parallel]` and `[memory]` keys of the trainer's config
plus the micro-batch size, so a plan converts to a config `shardline train` accepts
(`to_config`) and a config converts back (`from_config`) for `shardline estimate`.

Batch semantics, shared with the trainer's config: `global_batch` sequences per
optimizer step; each data-parallel rank (dp = dp_replicate x dp_shard) takes
global_batch / dp of them, in micro-batches of `micro_batch_size` sequences (one
forward/backward on one rank). With pp > 1 a pipeline round pushes `pp_microbatches`
micro-batches through the stages; the step is global_batch / (dp x micro_batch_size x
pp_microbatches) rounds (the planner picks one round per step). Context parallelism
splits each sequence over cp ranks; expert parallelism borrows its ranks from
dp_shard x cp (torchtitan's convention), so the world size is
dp_replicate x dp_shard x cp x tp x pp.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from shardline.config import AC_MODES, PP_SCHEDULES, Config, ParallelConfig
from shardline.errors import ConfigError
from shardline.models.llama import ModelArgs


@dataclass(frozen=True)
class Workload:
    model: ModelArgs
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"  # compute dtype; weights, gradients and Adam states stay fp32
    document_mask: bool = True  # the trainer's default: an explicit mask, so no causal-skipping kernel
    model_ref: str = ""  # preset name or HF folder, for the emitted config
    vocab_from_tokenizer: bool = False  # the preset sizes its vocabulary to the tokenizer

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 3
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    pp_virtual_stages: int = 1
    activation_checkpoint: str = "none"
    ac_every: int = 2
    cpu_offload: bool = False
    micro_batch_size: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the model states (FSDP shards over dp_shard x cp)."""
        return self.dp_shard * self.cp if self.dp_shard > 1 or self.cp > 1 else 1

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    @property
    def dp_mode(self) -> str:
        if self.dp_shard * self.cp == 1:
            return "ddp" if self.dp_replicate > 1 else "single"
        if self.dp_replicate > 1:
            return "hsdp"
        return {1: "zero1", 2: "zero2", 3: "fsdp"}[self.zero]

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each rank runs per optimizer step."""
        return global_batch // (self.dp * self.micro_batch_size)

    def describe(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.pp > 1:
            sched = self.pp_schedule + (f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else "")
            parts.append(f"pp{self.pp}({sched} m{self.pp_microbatches})")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        mode = self.dp_mode
        shard = self.dp_shard if self.dp_shard > 1 else "cp"  # dp_shard=1 with cp > 1 shards over cp
        dp = {"hsdp": f"hsdp{self.dp_replicate}x{self.dp_shard}", "ddp": f"ddp{self.dp_replicate}",
              "single": "dp1"}.get(mode, f"{mode}:{shard}")
        parts.append(dp + ("+offload" if self.cpu_offload else ""))
        ac = self.activation_checkpoint
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append("ac=" + (f"sel/{self.ac_every}" if ac == "selective" else ac))
        return " ".join(parts)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


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
            return int(value)
        except ValueError:
            raise ConfigError(f"--fix {key}={value!r} must be an integer") from None
    valid = {"pp_schedule": PP_SCHEDULES, "activation_checkpoint": AC_MODES}[key]
    if value not in valid:
        raise ConfigError(f"--fix {key}={value!r} is invalid; valid: {', '.join(valid)}")
    return value


def from_config(cfg: Config, world: int | None = None) -> Layout:
    """The Layout a config describes. dp_shard=-1 takes the rest of `world`, or 1 without one."""
    p, m = cfg.parallel, cfg.memory
    others = p.dp_replicate * p.tp * p.pp * p.cp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world is not None and world % others:
            raise ConfigError(f"--gpus {world} is not divisible by dp_replicate x tp x pp x cp = {others}")
        dp_shard = world // others if world is not None else 1
    elif world is not None and world != others * dp_shard:
        raise ConfigError(f"--gpus {world} differs from the config's world size dp_replicate x dp_shard x tp "
                          f"x pp x cp = {others * dp_shard}; drop --gpus or set parallel.dp_shard=-1")
    return Layout(dp_replicate=p.dp_replicate, dp_shard=dp_shard, zero=p.zero, tp=p.tp, pp=p.pp, cp=p.cp,
                  ep=p.ep, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel,
                  pp_schedule=p.pp_schedule, pp_microbatches=p.pp_microbatches or p.pp,
                  pp_virtual_stages=p.pp_virtual_stages, activation_checkpoint=m.activation_checkpoint,
                  ac_every=m.ac_every, cpu_offload=m.cpu_offload, micro_batch_size=cfg.train.micro_batch_size)


def to_config(layout: Layout, work: Workload, base: Config | None = None) -> Config:
    """A trainer config running `work` with `layout` (other sections from `base` or defaults)."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    if work.model_ref.startswith("hf:"):
        cfg.model.hf_path = work.model_ref[3:]
    elif work.model_ref:
        cfg.model.preset = work.model_ref
    t = cfg.train
    t.seq_len, t.global_batch_size, t.micro_batch_size = work.seq_len, work.global_batch, layout.micro_batch_size
    t.precision, t.document_mask = work.precision, work.document_mask
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    cfg.parallel = ParallelConfig(**{k: v for k, v in layout.to_json().items() if k in fields})
    cfg.memory.activation_checkpoint = layout.activation_checkpoint
    cfg.memory.ac_every = layout.ac_every
    cfg.memory.cpu_offload = layout.cpu_offload
    cfg.check(dp_world=layout.dp)
    return cfg


def layout_problem(work: Workload, layout: Layout) -> tuple[str, str] | None:
    """(reason key, message) when `layout` cannot run `work` at all, else None.

    The reason keys name the rule, so the search can count what it pruned and why.
    """
    from shardline.planner.pipeline import schedule_problem

    m, lay = work.model, layout
    if m.n_heads % lay.tp or m.kv_heads % lay.tp or m.ffn_dim % lay.tp:
        return "tp", (f"tp={lay.tp} must divide n_heads={m.n_heads}, n_kv_heads={m.kv_heads} "
                      f"and ffn_dim={m.ffn_dim}")
    if lay.sp and work.seq_len % lay.tp:
        return "tp", f"seq_len={work.seq_len} must be divisible by tp={lay.tp} with sequence parallelism"
    if work.seq_len % (2 * lay.cp) and lay.cp > 1:
        return "cp", (f"seq_len={work.seq_len} must split into 2 x cp={2 * lay.cp} chunks "
                      "for load-balanced ring attention")
    if lay.ep > 1 and not getattr(m, "n_experts", 0):
        return "ep", f"ep={lay.ep} needs a mixture-of-experts model; this model is dense"
    if lay.ep > 1 and (lay.dp_shard * lay.cp) % lay.ep:
        return "ep", f"ep={lay.ep} must divide dp_shard x cp = {lay.dp_shard * lay.cp} (it borrows those ranks)"
    per_step = lay.dp * lay.micro_batch_size * (lay.pp_microbatches if lay.pp > 1 else 1)
    if work.global_batch % per_step:
        what = "dp x micro_batch_size" + (" x pp_microbatches" if lay.pp > 1 else "")
        return "batch", f"global batch {work.global_batch} is not divisible by {what} = {per_step}"
    if lay.cpu_offload and lay.shard_degree == 1:
        return "offload", "cpu_offload needs FSDP (dp_shard > 1): it offloads the sharded states"
    problem = schedule_problem(lay.pp_schedule, lay.pp, lay.pp_microbatches, lay.pp_virtual_stages, m.n_layers)
    return ("pp", problem) if problem else None
