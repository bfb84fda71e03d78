"""Parallel layouts: the degrees, what follows from them, every rule they must obey,
and which pipeline rank runs which layers.

This module is the one authority on what a layout is. The trainer accepts a layout
exactly when `first_problem(..., runnable=True)` finds nothing; `shardline train
--dry-run` asks the same (through shardline.preflight, as a launch does) and so does
the planner's `--runnable-only`, so the three cannot disagree. The planner's wider
search drops only the rules of what the trainer does not build yet (`NOT_BUILT`). It
needs no torch, so a 512-GPU layout is checked on a laptop in microseconds.

World size = dp_replicate x dp_shard x cp x tp x pp. Data-parallel ranks
(dp = dp_replicate x dp_shard) each take a different slice of the global batch; the
cp ranks of one group share a sequence and the tp ranks share a micro-batch. Expert
parallelism borrows its ranks from dp_shard x cp (as torchtitan and Megatron do), so it
adds no factor to the world size.

Batches: `global_batch` sequences per optimizer step; each dp rank takes
global_batch / dp of them in micro-batches of `micro_batch_size`. Under pp those
micro-batches are exactly one pipeline round (`pp_microbatches`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Protocol

from shardline.config import Config
from shardline.errors import ConfigError

V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2 pp - 1 - r
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank

Problem = tuple[str, str]  # (rule key, one-line message naming the keys and what would be valid)


class ModelShape(Protocol):
    """What the rules read of a model (ModelArgs has it)."""

    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_dim: int
    dim: int
    head_size: int
    vocab_size: int
    tie_embeddings: bool


@dataclass(frozen=True)
class Layout:
    """A resolved layout: every degree known (no -1), micro-batches counted."""

    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 3  # what dp_shard shards: 1 optimizer states, 2 + gradients, 3 + parameters
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 0  # hybrid: the all-to-all part of cp (see cp_degrees)
    cp_balance: str = "zigzag"
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1  # micro-batches of one pipeline round (= per rank and step)
    pp_virtual_stages: int = 1  # stages per rank (V-shaped schedules: 2)
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
        """Ranks that share one copy of the sharded model states: dp_shard x cp, both for FSDP
        and for ZeRO-1's optimizer states (replicas, dp_replicate, hold a copy each)."""
        return self.dp_shard * self.cp

    @property
    def offload_fsdp(self) -> bool:
        """CPU offload is FSDP2's (zero 2 or 3), so it wraps the model in FSDP2 even where no
        rank shares its states: at shard degree 1 over a size-1 shard dimension (one rank, or
        HSDP with shard 1 under dp_replicate), keeping parameters, gradients and optimizer
        states on the host all the same."""
        return self.cpu_offload and self.zero != 1

    @property
    def cp_degrees(self) -> tuple[int, int]:
        """(ring, ulysses): the ranks that pass K/V around x the ranks that exchange heads."""
        if self.cp == 1:
            return 1, 1
        u = {"ring": 1, "ulysses": self.cp}.get(self.cp_mode, self.cp_ulysses)
        return self.cp // max(u, 1), u

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule in V_SHAPED else self.pp_virtual_stages

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def dp_mode(self) -> str:
        if self.dp_shard * self.cp == 1 and not self.offload_fsdp:
            return "ddp" if self.dp_replicate > 1 else "single"
        if self.zero == 1:
            return "zero1"  # DDP, optimizer states sharded over dp_shard x cp (each replica holds a copy)
        if self.dp_replicate > 1:
            return "hsdp"  # zero=2 too: FSDP2 keeps the parameters sharded at rest either way
        return {2: "zero2", 3: "fsdp"}[self.zero]

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each rank runs per optimizer step."""
        return global_batch // (self.dp * self.micro_batch_size)

    def describe(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.pp > 1:
            sched = self.pp_schedule + (f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else "")
            parts.append(f"pp{self.pp}({sched} m{self.pp_microbatches})")
        if self.cp > 1:
            ring, u = self.cp_degrees
            mode = {"ring": f"ring {self.cp_balance}", "ulysses": "ulysses"}.get(self.cp_mode, f"ring{ring}xu{u}")
            parts.append(f"cp{self.cp}({mode})")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        shard = self.dp_shard if self.dp_shard > 1 or self.cp == 1 else "cp"  # dp_shard=1 with cp > 1 shards over cp
        dp = {"hsdp": f"hsdp{self.dp_replicate}x{self.dp_shard}", "ddp": f"ddp{self.dp_replicate}",
              "single": "dp1"}.get(self.dp_mode, f"{self.dp_mode}:{shard}")
        parts.append(dp + ("+offload" if self.cpu_offload else ""))
        ac = self.activation_checkpoint
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append("ac=" + (f"sel/{self.ac_every}" if ac == "selective" else ac))
        return " ".join(parts)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ---- from a config ------------------------------------------------------------------


def resolve(cfg: Config, world: int | None) -> Layout:
    """The Layout a config describes on `world` processes.

    dp_shard = -1 takes what the other degrees leave of `world` (1 when world is None,
    as `shardline estimate` without --gpus does). A product that is not the world size
    is a ConfigError naming the degrees.
    """
    p, m = cfg.parallel, cfg.memory
    fixed = p.dp_replicate * p.cp * p.tp * p.pp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        dp_shard = 1 if world is None else max(world // fixed, 1)
    if world is not None and fixed * dp_shard != world:
        raise ConfigError(_product_message(cfg, world, fixed if p.dp_shard == -1 else fixed * dp_shard))
    lay = Layout(dp_replicate=p.dp_replicate, dp_shard=dp_shard, zero=p.zero, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                 cp_mode=p.cp_mode, cp_ulysses=p.cp_ulysses, cp_balance=p.cp_balance,
                 sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel, pp_schedule=p.pp_schedule,
                 pp_virtual_stages=_stages_per_rank(p.pp, p.pp_schedule, p.pp_virtual_stages),
                 activation_checkpoint=m.activation_checkpoint, ac_every=m.ac_every, cpu_offload=m.cpu_offload,
                 micro_batch_size=cfg.train.micro_batch_size)
    n_mb = lay.micro_batches(cfg.train.global_batch_size) if p.pp > 1 else 1
    return dataclasses.replace(lay, pp_microbatches=p.pp_microbatches or max(n_mb, 1))


def _stages_per_rank(pp: int, schedule: str, virtual: int) -> int:
    """A V-shaped schedule always places 2 stages per rank; the config may leave it at 1."""
    return 2 if pp > 1 and schedule in V_SHAPED and virtual == 1 else virtual


def _product_message(cfg: Config, world: int, product: int) -> str:
    p = cfg.parallel
    what = "dp_replicate x dp_shard x cp x tp x pp" if p.dp_shard != -1 else "dp_replicate x cp x tp x pp"
    hint = "" if p.dp_shard == -1 else " (or set parallel.dp_shard=-1 to take what the others leave)"
    return (f"parallel degrees dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} pp={p.pp} "
            f"give {what} = {product}, which does not match the world size {world}; "
            f"their product must equal the number of processes{hint}")


# ---- the rules ----------------------------------------------------------------------
#
# Each rule returns a Problem or None. RULES hold for any trainer; NOT_BUILT are what
# shardline's trainer does not implement yet (the planner can still rank such layouts
# unless asked for --runnable-only).


@dataclass(frozen=True)
class Job:
    """What the rules check a layout against: the model shape, the batch and the attention kernel asked for."""

    model: ModelShape
    seq_len: int
    global_batch: int
    attention: str = "auto"  # train.attention


def _tp_heads(lay: Layout, job: Job) -> Problem | None:
    m, t = job.model, lay.tp
    if m.n_heads % t or m.kv_heads % t:
        valid = ", ".join(str(d) for d in range(1, min(m.n_heads, m.kv_heads) + 1)
                          if m.n_heads % d == 0 and m.kv_heads % d == 0)
        return "tp", f"parallel.tp={t} must divide n_heads={m.n_heads} and n_kv_heads={m.kv_heads}; valid tp: {valid}"
    if m.ffn_dim % t:
        return "tp", f"parallel.tp={t} must divide ffn_dim={m.ffn_dim} (the MLP is split by columns)"
    return None


def _tp_sequence(lay: Layout, job: Job) -> Problem | None:
    if lay.sp and job.seq_len % lay.tp:
        return "tp", (f"train.seq_len={job.seq_len} must be divisible by parallel.tp={lay.tp} "
                      "with sequence_parallel")
    return None


def _cp_split(lay: Layout, job: Job) -> Problem | None:
    """The cp grid, the sequence's chunks and the heads Ulysses splits."""
    if lay.cp == 1:
        return None
    if lay.cp_mode == "hybrid" and not (1 < lay.cp_ulysses < lay.cp and lay.cp % lay.cp_ulysses == 0):
        valid = [u for u in range(2, lay.cp) if lay.cp % u == 0]
        return "cp", (f"parallel.cp_mode='hybrid' needs parallel.cp_ulysses to divide parallel.cp={lay.cp} and lie "
                      f"strictly between 1 and it; valid: {valid or 'none (cp is prime: use ring or ulysses)'}")
    ring, u = lay.cp_degrees
    chunks = 2 * lay.cp if lay.cp_balance == "zigzag" and ring > 1 else lay.cp
    if job.seq_len % chunks:
        why = "2 chunks per rank for zigzag balance" if chunks == 2 * lay.cp else "one chunk per rank"
        return "cp", (f"train.seq_len={job.seq_len} must be divisible by {chunks} (parallel.cp={lay.cp}, {why}); "
                      f"use a multiple of {chunks}")
    local_heads = job.model.n_heads // lay.tp
    if u > 1 and local_heads % u:
        return "cp", (f"Ulysses splits the {local_heads} attention heads per tp rank (n_heads={job.model.n_heads} / "
                      f"tp={lay.tp}) over {u} ranks: they must be divisible by it; lower the Ulysses degree")
    if lay.sp and (job.seq_len // lay.cp) % lay.tp:
        return "cp", (f"each cp rank's {job.seq_len // lay.cp} tokens must split over parallel.tp={lay.tp} with "
                      "sequence_parallel; change train.seq_len")
    return None


def _ep_ranks(lay: Layout, job: Job) -> Problem | None:
    if lay.ep > 1 and not getattr(job.model, "n_experts", 0):
        return "ep", f"parallel.ep={lay.ep} needs a mixture-of-experts model; this model is dense"
    if lay.ep > 1 and (lay.dp_shard * lay.cp) % lay.ep:
        return "ep", (f"parallel.ep={lay.ep} must divide dp_shard x cp = {lay.dp_shard * lay.cp} "
                      "(expert parallelism borrows those ranks)")
    moe, n = getattr(job.model, "moe", None), getattr(job.model, "n_experts", 0)
    if moe is not None and (moe.shared_experts * moe.expert_ffn_dim) % lay.tp:
        return "tp", (f"parallel.tp={lay.tp} must divide the shared experts' width shared_experts x expert_ffn_dim "
                      f"= {moe.shared_experts * moe.expert_ffn_dim} (they are split by columns)")
    if n and n % (lay.ep * lay.tp):
        valid = [e for e in range(1, n + 1) if n % (e * lay.tp) == 0]
        return "ep", (f"parallel.ep={lay.ep} x tp={lay.tp} must divide the {n} experts (each rank of ep x tp "
                      f"holds an equal share of whole experts); valid ep with this tp: {valid or 'none'}")
    return None


def _batch(lay: Layout, job: Job) -> Problem | None:
    per_step = lay.micro_batch_size * lay.dp
    if job.global_batch % per_step:
        return "batch", (f"train.global_batch_size={job.global_batch} is not divisible by "
                         f"train.micro_batch_size={lay.micro_batch_size} x {lay.dp} data-parallel rank(s) = "
                         f"{per_step}; use a multiple of {per_step}")
    return None


def _pp_stages(lay: Layout, job: Job) -> Problem | None:
    """Stages per rank that each schedule runs, and enough layers for every stage."""
    if lay.pp == 1:
        return None
    s, v = lay.pp_schedule, lay.pp_virtual_stages
    if s in SINGLE_STAGE and v != 1:
        return "pp", (f"parallel.pp_schedule={s!r} runs one stage per rank; set pp_virtual_stages=1 "
                      "or use interleaved_1f1b")
    if s == "interleaved_1f1b" and v < 2:
        return "pp", "parallel.pp_schedule='interleaved_1f1b' needs pp_virtual_stages >= 2"
    if s in V_SHAPED and v != 2:
        return "pp", f"parallel.pp_schedule={s!r} places exactly 2 stages per rank; set pp_virtual_stages=2"
    if job.model.n_layers < lay.n_stages:
        return "pp", (f"model has {job.model.n_layers} layers, fewer than the {lay.n_stages} pipeline stages "
                      f"(pp={lay.pp} x {lay.stages_per_rank} per rank); lower parallel.pp")
    return None


def _pp_microbatches(lay: Layout, job: Job) -> Problem | None:
    """One pipeline round per step, with as many micro-batches as the schedule needs."""
    if lay.pp == 1:
        return None
    n_mb = lay.micro_batches(job.global_batch)
    if lay.pp_microbatches != n_mb:
        return "pp", (f"parallel.pp_microbatches={lay.pp_microbatches} but global_batch_size / (dp x "
                      f"micro_batch_size) = {n_mb}; set pp_microbatches=0 or change the batch sizes")
    need = lay.n_stages if lay.pp_schedule == "dualpipev" else lay.pp
    if n_mb < need:
        return "pp", (f"{n_mb} micro-batches per step cannot fill {need} pipeline stages; raise "
                      f"train.global_batch_size or lower train.micro_batch_size (need >= {need})")
    rounds = max(1, n_mb // lay.pp)
    if lay.pp_schedule == "interleaved_1f1b" and n_mb % rounds:
        return "pp", (f"interleaved 1F1B runs {n_mb} micro-batches in rounds of pp={lay.pp}: they must be a "
                      f"multiple of the {rounds} rounds; use {rounds * lay.pp} or {(rounds + 1) * lay.pp}")
    return None


def _offload(lay: Layout, job: Job) -> Problem | None:
    """Offload is FSDP2's, at any shard degree (one GPU included: see Layout.offload_fsdp)."""
    if lay.cpu_offload and lay.zero == 1:
        return "offload", ("memory.cpu_offload=true offloads FSDP's sharded state, but parallel.zero=1 keeps "
                           "parameters replicated (DDP); use zero=2 or zero=3")
    return None


def degree_not_built(cp: int, ep: int) -> Problem | None:
    """A dimension the trainer does not build yet; checked before anything else at a launch
    (none today: every degree is built, some combinations are not, see NOT_BUILT)."""
    return None


def _not_built_degrees(lay: Layout, job: Job) -> Problem | None:
    return degree_not_built(lay.cp, lay.ep)


def _not_built_tied_v(lay: Layout, job: Job) -> Problem | None:
    if lay.pp > 1 and job.model.tie_embeddings and lay.pp_schedule in V_SHAPED and lay.dp > 1:
        # Each stage is its own FSDP unit, and FSDP2 cannot share a parameter between units.
        return "pp", (f"parallel.pp_schedule={lay.pp_schedule!r} with tied embeddings and data parallelism "
                      f"(dp_replicate x dp_shard = {lay.dp}) is not supported: the V shape puts the first and "
                      "the last stage on one rank, where the tied weight would be one parameter in two FSDP "
                      "units; use pp_schedule=1f1b, gpipe or interleaved_1f1b, or model.tie_embeddings=0")
    return None


def _not_built_cp_attention(lay: Layout, job: Job) -> Problem | None:
    """Context parallelism runs its own attention core (ring or Ulysses over SDPA blocks):
    the packed-document kernels are not wired into it."""
    if lay.cp > 1 and job.attention in ("flex", "varlen"):
        return "cp", (f"train.attention={job.attention!r} with parallel.cp={lay.cp} is not built: context "
                      "parallelism runs its own attention core; use train.attention=auto or sdpa")
    return None


def _not_built_moe(lay: Layout, job: Job) -> Problem | None:
    """Mixture-of-experts layouts the trainer does not build yet."""
    if not getattr(job.model, "n_experts", 0):
        return None
    if lay.ep > 1 and lay.dp_shard % lay.ep:
        return "ep", (f"parallel.ep={lay.ep} must divide parallel.dp_shard={lay.dp_shard}: borrowing context-"
                      "parallel ranks for experts is not built")
    return None


Rule = Callable[[Layout, Job], "Problem | None"]
RULES: tuple[Rule, ...] = (_tp_heads, _tp_sequence, _cp_split, _ep_ranks, _batch, _offload, _pp_stages,
                           _pp_microbatches)
NOT_BUILT: tuple[Rule, ...] = (_not_built_degrees, _not_built_tied_v, _not_built_cp_attention, _not_built_moe)


def first_problem(lay: Layout, job: Job, runnable: bool = True) -> Problem | None:
    """The first rule `lay` breaks for `job`; `runnable` adds what the trainer does not build
    yet, checked first so a launch names the missing feature before any consequence of it."""
    rules = (NOT_BUILT + RULES) if runnable else RULES
    for rule in rules:
        found = rule(lay, job)
        if found is not None:
            return found
    return None


def check(lay: Layout, job: Job) -> None:
    """Raise the first problem as a ConfigError (what a launch does)."""
    found = first_problem(lay, job)
    if found is not None:
        raise ConfigError(found[1])


# ---- pipeline stage placement ---------------------------------------------------------
#
# Stages are balanced by parameters, not by layer count: the output projection
# (vocab x dim) counts as `head_cost` blocks on the last stage, which then gets fewer
# blocks (tiny, 4 layers on 2 stages: 3 + 1). The trainer cuts the model this way and
# the planner charges each rank what it holds.


def head_cost(model: ModelShape) -> float:
    """The output projection's parameters in units of one block's matmul parameters."""
    d = model.dim
    block = 2 * d * model.n_heads * model.head_size + 2 * d * model.kv_heads * model.head_size + 3 * d * model.ffn_dim
    return model.vocab_size * d / block


@functools.lru_cache(maxsize=4096)
def stage_layer_counts(n_layers: int, n_stages: int, head: float) -> tuple[int, ...]:
    """Blocks per stage: each further block goes to the lightest stage (head counted on the last).

    Every stage keeps at least one block.
    """
    counts = [1] * n_stages
    for _ in range(n_layers - n_stages):
        loads = [c + (head if i == n_stages - 1 else 0) for i, c in enumerate(counts)]
        counts[loads.index(min(loads))] += 1
    return tuple(counts)


def split_layers(n_layers: int, n_stages: int, head: float) -> list[list[int]]:
    """Contiguous layer indices of each stage (see stage_layer_counts)."""
    counts = stage_layer_counts(n_layers, n_stages, head)
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(n_stages)]


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Looped placement (rank r: r, r + pp, ...) or V-shaped (r and 2 pp - 1 - r)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds: its index, its stages and blocks, and which ends of the model."""

    rank: int
    layers: int
    first: bool  # the embedding
    last: bool  # final norm, output projection, loss
    stages: tuple[int, ...] = (0,)
    layer_ids: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return {(True, True): "both", (True, False): "first", (False, True): "last"}.get((self.first, self.last),
                                                                                          "middle")


@functools.lru_cache(maxsize=4096)
def pipeline_ranks(model: ModelShape, pp: int, virtual: int, schedule: str) -> tuple[RankStages, ...]:
    """RankStages of every pipeline rank (one entry holding the whole model without pipelining)."""
    if pp == 1:
        return (RankStages(0, model.n_layers, True, True, (0,), tuple(range(model.n_layers))),)
    n_stages = pp * (2 if schedule in V_SHAPED else virtual)
    split = split_layers(model.n_layers, n_stages, head_cost(model))
    out = []
    for r in range(pp):
        ids = stages_of_rank(r, pp, virtual, schedule)
        layers = tuple(i for s in sorted(ids) for i in split[s])
        out.append(RankStages(r, len(layers), 0 in ids, n_stages - 1 in ids, tuple(ids), layers))
    return tuple(out)
