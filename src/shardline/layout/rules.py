"""The rules a layout must obey for a job (`first_problem`, `check`), each a one-line message."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from shardline.errors import ConfigError
from shardline.layout.degrees import SINGLE_STAGE, V_SHAPED, Layout, ModelShape, Problem

# ---- the rules ----------------------------------------------------------------------
#
# Each rule returns a Problem or None. RULES hold for any trainer; NOT_BUILT are what
# shardline's trainer does not implement yet (the planner can still rank such layouts
# unless asked for --runnable-only).


@dataclass(frozen=True)
class Job:
    """What the rules check a layout against: the model shape, the batch, the attention kernel
    and the precision asked for."""

    model: ModelShape
    seq_len: int
    global_batch: int
    attention: str = "auto"  # train.attention
    precision: str = "bf16"  # train.precision


def _tp_heads(lay: Layout, job: Job) -> Problem | None:
    m, t = job.model, lay.tp
    if m.n_heads % t or m.kv_heads % t:
        valid = ", ".join(str(d) for d in range(1, min(m.n_heads, m.kv_heads) + 1)
                          if m.n_heads % d == 0 and m.kv_heads % d == 0)
        return "tp", f"parallel.tp={t} must divide n_heads={m.n_heads} and n_kv_heads={m.kv_heads}; valid tp: {valid}"
    if m.ffn_dim % t:
        valid = ", ".join(str(d) for d in range(1, min(m.n_heads, m.kv_heads) + 1)
                          if m.n_heads % d == 0 and m.kv_heads % d == 0 and m.ffn_dim % d == 0)
        return "tp", f"parallel.tp={t} must divide ffn_dim={m.ffn_dim} (the MLP is split by columns); valid tp: {valid}"
    return None


def _tp_sequence(lay: Layout, job: Job) -> Problem | None:
    if lay.sp and job.seq_len % lay.tp:
        return "tp", (f"train.seq_len={job.seq_len} must be divisible by parallel.tp={lay.tp} with sequence_parallel "
                      f"(e.g. {_near(job.seq_len, lay.tp)}; or parallel.sequence_parallel=false)")
    return None


def _near(n: int, multiple: int) -> str:
    """The multiples of `multiple` on either side of `n` ("1020 or 1024"), for a length that must be one."""
    below = n - n % multiple
    return " or ".join(str(m) for m in (below, below + multiple) if m > 0)


def _cp_split(lay: Layout, job: Job) -> Problem | None:
    """The cp grid, the sequence's chunks and the heads Ulysses splits."""
    if lay.cp_ulysses and lay.cp_mode != "hybrid":  # it would be ignored
        return "cp", (f"parallel.cp_ulysses={lay.cp_ulysses} applies to cp_mode='hybrid' only "
                      f"(here cp_mode={lay.cp_mode!r}: leave it 0)")
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
        plain = (", or set parallel.cp_balance='none' (one chunk per rank, which the causal mask leaves "
                 "unbalanced)" if chunks == 2 * lay.cp and job.seq_len % lay.cp == 0 else "")
        return "cp", (f"train.seq_len={job.seq_len} must be divisible by {chunks} (parallel.cp={lay.cp}, {why}); "
                      f"use a multiple of {chunks} (e.g. {_near(job.seq_len, chunks)}){plain}")
    local_heads = job.model.n_heads // lay.tp
    if u > 1 and local_heads % u:
        key = "parallel.cp_ulysses" if lay.cp_mode == "hybrid" else "parallel.cp"
        fits = [d for d in range(2, local_heads + 1) if local_heads % d == 0 and (
            lay.cp % d == 0 and d < lay.cp if lay.cp_mode == "hybrid" else True)]
        hybrid = any(lay.cp % d == 0 and 1 < d < lay.cp and local_heads % d == 0 for d in range(2, lay.cp))
        other = ("" if lay.cp_mode == "hybrid" else "; or keep this cp with cp_mode='ring'"
                 + (" (or 'hybrid', whose Ulysses part is such a divisor)" if hybrid else ""))
        return "cp", (f"{key}={u} splits the {local_heads} attention heads per tp rank (n_heads={job.model.n_heads} / "
                      f"tp={lay.tp}) over {u} Ulysses ranks: they must divide evenly; valid: {fits or 'none'}{other}")
    if lay.sp and (job.seq_len // lay.cp) % lay.tp:
        step = math.lcm(chunks, lay.cp * lay.tp)  # (whole chunks, and each cp rank's share whole tp pieces)
        return "cp", (f"each cp rank's {job.seq_len // lay.cp} tokens must split over parallel.tp={lay.tp} with "
                      f"sequence_parallel; train.seq_len={job.seq_len} must be a multiple of {step} (e.g. "
                      f"{_near(job.seq_len, step)}; or parallel.sequence_parallel=false)")
    return None


def ep_borrows(ep: int, dp_shard: int, cp: int) -> bool:
    """Whether expert parallelism of degree `ep` divides the ranks it borrows, dp_shard x cp."""
    return (dp_shard * cp) % ep == 0


def ep_built(lay: Layout, ep: int) -> bool:
    """Whether expert parallelism `ep` can borrow its ranks here: it divides dp_shard x cp, and takes
    either dp_shard's ranks alone or every cp rank (part of cp is not built)."""
    return ep_borrows(ep, lay.dp_shard, lay.cp) and (lay.dp_shard % ep == 0 or ep % lay.cp == 0)


def _valid_ep(lay: Layout, n_experts: int, least: int = 1) -> str:
    """The ep degrees (from `least`) this layout can build that hold whole experts (each of ep x tp
    ranks an equal share), as a refusal names them."""
    return ", ".join(str(e) for e in range(least, max(n_experts, lay.dp_shard * lay.cp) + 1)
                     if ep_built(lay, e) and n_experts % (e * lay.tp) == 0) or "none"


def _ep_ranks(lay: Layout, job: Job) -> Problem | None:
    if lay.ep > 1 and not getattr(job.model, "n_experts", 0):
        return "ep", f"parallel.ep={lay.ep} needs a mixture-of-experts model; this model is dense"
    moe, n = getattr(job.model, "moe", None), getattr(job.model, "n_experts", 0)
    borrow = lay.dp_shard * lay.cp  # (expert parallelism borrows these ranks: a valid ep divides both)
    if lay.ep > 1 and not ep_borrows(lay.ep, lay.dp_shard, lay.cp):
        return "ep", (f"parallel.ep={lay.ep} must divide dp_shard x cp = {borrow} (expert parallelism borrows "
                      f"those ranks); valid: {_valid_ep(lay, n)}")
    if moe is not None and (moe.shared_experts * moe.expert_ffn_dim) % lay.tp:
        return "tp", (f"parallel.tp={lay.tp} must divide the shared experts' width shared_experts x expert_ffn_dim "
                      f"= {moe.shared_experts * moe.expert_ffn_dim} (they are split by columns)")
    if n and n % (lay.ep * lay.tp):
        return "ep", (f"parallel.ep={lay.ep} x tp={lay.tp} must divide the {n} experts (each rank of ep x tp "
                      f"holds an equal share of whole experts); valid ep with this tp and dp_shard x cp = {borrow}: "
                      f"{_valid_ep(lay, n)}")
    return None


def model_parallel_hint() -> str:
    """The batch rule's way out through model parallelism (the planner, which tried those, words its own)."""
    return ", or give ranks to parallel.tp, cp or pp, which leaves fewer to data parallelism"


def _batch(lay: Layout, job: Job) -> Problem | None:
    per_step = lay.micro_batch_size * lay.dp
    if job.global_batch % per_step:
        return "batch", (f"train.global_batch_size={job.global_batch} is not divisible by "
                         f"train.micro_batch_size={lay.micro_batch_size} x {lay.dp} data-parallel rank(s) = "
                         f"{per_step}; use a multiple of {per_step}"
                         + (", lower train.micro_batch_size " + (f"(one dividing {job.global_batch // lay.dp})"
                                                                  if job.global_batch > lay.dp else "to 1")
                            if lay.micro_batch_size > 1 and job.global_batch % lay.dp == 0 else "")
                         + (model_parallel_hint() if lay.dp > 1 else ""))
    return None


FP8_GEMM_MULTIPLE = 16  # torch._scaled_mm: a float8 GEMM's dims are multiples of 16


def fp8_aligned(tp: int, *dims: int) -> bool:
    """Whether a Linear of these dims can run in float8 under tensor parallelism tp: each a multiple
    of FP8_GEMM_MULTIPLE x tp (parallel/float8.converts' rule; the planner prices with it, and
    _fp8_no_layer refuses fp8 where model.dim, a side of every projection, fails it)."""
    return all(d % (FP8_GEMM_MULTIPLE * tp) == 0 for d in dims)


def _fp8_tokens(lay: Layout, job: Job) -> Problem | None:
    """fp8: the weight gradient's float8 GEMM multiplies over the tokens a rank holds of a
    micro-batch, its inner dim too. A CPU's emulation runs any count; a GPU failed at the first
    backward. (seq_len not divisible by cp is _cp_split's.)"""
    tokens, rest = divmod(lay.micro_batch_size * job.seq_len, lay.cp)
    if job.precision != "fp8" or rest or tokens % FP8_GEMM_MULTIPLE == 0:
        return None
    return "batch", (f"train.precision='fp8' needs the tokens of a micro-batch on a rank (train.micro_batch_size x "
                     f"train.seq_len / parallel.cp = {tokens}) to be a multiple of {FP8_GEMM_MULTIPLE}: float8's "
                     "weight-gradient GEMM multiplies over them; change train.seq_len or train.micro_batch_size")


def _fp8_no_layer(lay: Layout, job: Job) -> Problem | None:
    """fp8 where no Linear can run in float8: each projection has model.dim as one of its sides, and a
    float8 Linear's sides are each a multiple of 16 x tp (parallel/float8.converts' rule, which asks it
    of both sides though tp splits one). The run trained in bf16, logging precision=fp8."""
    multiple = FP8_GEMM_MULTIPLE * lay.tp
    if job.precision != "fp8" or fp8_aligned(lay.tp, job.model.dim):
        return None
    return "fp8", (f"train.precision='fp8' would run no layer in float8: every projection has model.dim="
                   f"{job.model.dim} as a side, and a float8 GEMM's sides are multiples of {FP8_GEMM_MULTIPLE}"
                   + (f" x parallel.tp={lay.tp}" if lay.tp > 1 else "") + f" (so {multiple}); it would train in "
                   f"bf16: use train.precision=bf16, or a model.dim that is a multiple of {multiple}"
                   + (", or a lower parallel.tp" if lay.tp > 1 and job.model.dim % FP8_GEMM_MULTIPLE == 0 else ""))


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
        ways = ["lower parallel.pp" + " or parallel.pp_virtual_stages" * (lay.pp_schedule == "interleaved_1f1b")]
        if lay.pp_schedule in V_SHAPED:  # 2 stages a rank: pp=2 the least of a pipeline, one stage a rank may fit
            ways = ways * (lay.pp > 2 and job.model.n_layers >= 4) + [
                "use a schedule of one stage per rank (parallel.pp_schedule=1f1b or gpipe, pp_virtual_stages=1)"] * (
                job.model.n_layers >= lay.pp) or ways
        way_out = ", or ".join(ways)
        return "pp", (f"model has {job.model.n_layers} layers, fewer than the {lay.n_stages} pipeline stages "
                      f"(pp={lay.pp} x {lay.stages_per_rank} per rank); {way_out}")
    return None


def _pp_microbatches(lay: Layout, job: Job) -> Problem | None:
    """One pipeline round per step, with as many micro-batches as the schedule needs."""
    if lay.pp == 1:
        return None
    n_mb = lay.micro_batches(job.global_batch)
    if lay.pp_microbatches != n_mb:
        return "pp", (f"parallel.pp_microbatches={lay.pp_microbatches} but global_batch_size / (dp x "
                      f"micro_batch_size) = {n_mb}; set pp_microbatches=0 or change the batch sizes")
    dual = lay.pp_schedule == "dualpipev"  # its two directions fill every stage; the others, every rank
    need = lay.n_stages if dual else lay.pp
    if n_mb < need:
        return "pp", (f"{n_mb} micro-batches per step cannot fill the pipeline: {lay.pp_schedule} needs at least "
                      f"{need} ({'one per stage' if dual else f'one per pipeline rank, pp={lay.pp}'}); raise "
                      "train.global_batch_size or lower train.micro_batch_size")
    rounds = max(1, n_mb // lay.pp)
    if lay.pp_schedule == "interleaved_1f1b" and n_mb % rounds:
        per = job.global_batch // n_mb  # sequences per micro-batch across the dp ranks
        fits = (rounds * lay.pp, (rounds + 1) * lay.pp)
        return "pp", (f"interleaved 1F1B runs {n_mb} micro-batches in rounds of pp={lay.pp}: they must be a "
                      f"multiple of the {rounds} rounds; set train.global_batch_size={fits[0] * per} or "
                      f"{fits[1] * per} ({fits[0]} or {fits[1]} micro-batches)")
    return None


def _ac_split_backward(lay: Layout, job: Job) -> Problem | None:
    """The zero-bubble schedules run a block's backward in two passes over one graph (inputs,
    then weights, one `autograd.grad` call per group of weights). torch's op-level checkpoint
    hands its saved tensors out once; a checkpointed block is recomputed in every call
    (measured at pp 2: 5-10 forwards of a block per micro-batch, against 1 under 1F1B)."""
    if not lay.split_backward or lay.activation_checkpoint == "none":
        return None
    why = ("torch's op-level checkpoint hands its saved tensors out once" if lay.activation_checkpoint == "op" else
           "a checkpointed block is recomputed in every weight-gradient group, 5-10 times a micro-batch")
    return "ac", (f"memory.activation_checkpoint={lay.activation_checkpoint!r} with parallel.pp_schedule="
                  f"{lay.pp_schedule!r}: its split backward runs each block's backward in two passes, and {why}; "
                  "use activation_checkpoint=none, or pp_schedule interleaved_1f1b, 1f1b or gpipe")


def _offload(lay: Layout, job: Job) -> Problem | None:
    """Offload is FSDP2's, at any shard degree (one GPU included: see Layout.offload_fsdp)."""
    if lay.cpu_offload and lay.zero == 1:
        return "offload", ("memory.cpu_offload=true offloads FSDP's sharded state, but parallel.zero=1 keeps "
                           "parameters replicated (DDP); use zero=2 or zero=3")
    return None


def _not_built_cp_attention(lay: Layout, job: Job) -> Problem | None:
    """A context-parallel ring runs its own attention blocks (SDPA with each block's mask):
    the packed-document kernels are not wired into it. Ulysses alone runs any kernel."""
    if lay.cp_degrees[0] > 1 and job.attention in ("flex", "varlen"):
        return "cp", (f"train.attention={job.attention!r} with parallel.cp={lay.cp} (cp_mode={lay.cp_mode!r}) is "
                      "not built: the ring runs its own attention blocks; use cp_mode=ulysses, or "
                      "train.attention=auto or sdpa")
    return None


def _not_built_moe(lay: Layout, job: Job) -> Problem | None:
    """Mixture-of-experts layouts the trainer does not build yet."""
    if not getattr(job.model, "n_experts", 0):
        return None
    capacity = job.model.moe.capacity_factor
    if lay.cp > 1 and capacity:  # the first `capacity` tokens of each expert, counted on each rank's slice
        return "cp", (f"moe.capacity_factor={capacity:g} with parallel.cp={lay.cp} is not built: each cp rank would "
                      "drop tokens by its own slice of the sequence, not as one process drops them; use "
                      "moe.capacity_factor=0 (dropless) or cp=1")
    ranks = lay.dp_shard * lay.cp
    if lay.ep_borrows_cp and ranks % lay.ep == 0 and lay.ep % lay.cp:
        # ep borrows either dp_shard ranks alone or every cp rank, not part of cp.
        return "ep", (f"parallel.ep={lay.ep} with dp_shard={lay.dp_shard} and cp={lay.cp} would borrow part of the "
                      f"cp ranks, which is not built: ep must divide dp_shard or be a multiple of cp; valid ep: "
                      f"{_valid_ep(lay, job.model.n_experts, least=2)}")
    return None


def _not_built_zero1_tp_bias(lay: Layout, job: Job) -> Problem | None:
    """ZeRO-1 cuts each tensor-parallel shard's AdamW states along a dimension tp leaves whole;
    a q/k/v bias (Qwen2) has one dimension, which tp cuts already."""
    if getattr(job.model, "qkv_bias", False) and lay.zero == 1 and lay.tp > 1:
        return "zero", (f"parallel.zero=1 with parallel.tp={lay.tp} and q/k/v biases (model.qkv_bias, Qwen2) is not "
                        "built: a bias cut by tp has no dimension left to shard its states by; use parallel.zero=2 "
                        "or 3, or tp=1")
    return None


def _not_built_window(lay: Layout, job: Job) -> Problem | None:
    """A sliding window (Mistral 7B v0.1, Phi-3-mini) is not built: the model attends to the whole
    sequence, which gives the window's result only for sequences no longer than the window."""
    window = getattr(job.model, "sliding_window", None)
    if window is None or job.seq_len <= window:
        return None
    # The longest length within it that this layout's other rules take (Phi-3-mini's 2047 is odd: tp with
    # sequence parallelism, cp and fp8 each want a multiple).
    takes = next((s for s in range(window, 0, -1)
                  if not any(rule(lay, dataclasses.replace(job, seq_len=s)) for rule in (_tp_sequence, _cp_split,
                                                                                          _fp8_tokens))), window)
    longest = f" ({takes} is the longest this layout also takes)" if takes < window else ""
    return "window", (f"train.seq_len={job.seq_len} is longer than the model's sliding window of {window} tokens, "
                      "which is not built (shardline attends to the whole sequence, the same within the "
                      f"window): use train.seq_len <= {window}{longest}")


Rule = Callable[[Layout, Job], "Problem | None"]
RULES: tuple[Rule, ...] = (_tp_heads, _tp_sequence, _cp_split, _ep_ranks, _batch, _fp8_tokens, _fp8_no_layer, _offload,
                           _pp_stages, _pp_microbatches, _ac_split_backward)
NOT_BUILT: tuple[Rule, ...] = (_not_built_window, _not_built_cp_attention, _not_built_moe, _not_built_zero1_tp_bias)


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
