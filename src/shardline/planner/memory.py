"""Memory per rank: model states by ZeRO stage, activations, loss buffers, transients.

Model states follow the ZeRO paper (Rajbhandari et al. 2020): with Ψ parameters, N
ranks sharing the states, p/g/o bytes per parameter of compute-dtype weights,
gradients and optimizer states (K = o: fp32 master + Adam m and v = 12),

    stage 0 (DDP)  (p + g + o)Ψ         stage 2  pΨ + (g + o)Ψ/N
    stage 1        (p + g)Ψ + oΨ/N      stage 3  (p + g + o)Ψ/N

The paper's mixed precision is p = g = 2, o = 12 (7.5B on 64 GPUs: 120 / 31.4 /
16.6 / 1.9 GB). shardline keeps fp32 gradients (g = 4); the compute copy p = 2 is
autocast's cached bf16 weights (single device, DDP) or FSDP2's gathered bf16 weights
(zero=2 keeps them from forward to backward; zero=3 frees them per block, so only two
blocks are resident: the current and the prefetched). In fp32 there is no separate
master (o = 8 for m and v, p = 4 for the weights themselves, sharded at stage 3).
FSDP shards over dp_shard x cp; HSDP replicates that group dp_replicate times; CPU
offload moves the sharded states to the host, an SSD folder AdamW's moments on from there
(offload.py). Routed experts under expert parallelism: FSDP shards each rank's ep-th of them
over the remaining shard_degree / ep ranks (efsdp), the same bytes as all of them over
shard_degree; ZeRO-1 keeps a rank's ep-th whole (weights and gradients) and cuts their states
over efsdp, again all of them over shard_degree (`zero1_ep_away`).

Another program's ZeRO-1 is a Runtime field: DeepSpeed's BF16_Optimizer (BLOOM) shards only
Adam's m and v and keeps the fp32 master and an fp32 gradient buffer whole on every rank
(`deepspeed_bf16_states`: 12 + 8/N bytes per parameter in bf16).

Everything else: `activations.py` gives bytes per token per layer, `pipeline.py` how
many micro-batches are in flight; the last stage adds the output logits and loss
(12 B per vocabulary entry per token, see `loss_bytes_per_token`); transients are the
gathered blocks of FSDP, DDP's buckets (a copy of every gradient), the gathered
sequence of TP and PP's send and receive buffers; on a GPU `peak.py` says which are alive
at once. A fragmentation allowance (a share of allocated bytes, per device) and memory
outside the allocator (CUDA context, NCCL; on CPU the process baseline: torch, the
tokenizer, the dataset) complete the peak.
"""

from __future__ import annotations

import functools

from shardline.models.flops import ffn_width, num_params
from shardline.planner import activations as act, peak
from shardline.planner.attention import document_mask_bytes
from shardline.planner.hardware import Hardware
from shardline.layout import Layout
from shardline.planner.layout import Workload
from shardline.planner.offload import OUTSIDE_DEVICE, offloaded
from shardline.layout import RankStages, pipeline_ranks
from shardline.planner.pipeline import inflight_on_rank

GB, GiB = 1e9, 2**30
DDP_BUCKET_BYTES = 25 * 2**20
_STAGES = {"single": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}


def zero_stage(layout: Layout) -> int:
    """What the layout shards, as a ZeRO stage: HSDP shards as its `zero` says (2 keeps the
    gathered weights from forward to backward, as the trainer's FSDP2 units do)."""
    return 2 if layout.dp_mode == "hsdp" and layout.zero == 2 else _STAGES[layout.dp_mode]


def zero_model_states(psi: float, n: int, stage: int, p: float = 2, g: float = 2, o: float = 12) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer states per rank (ZeRO paper, section 5)."""
    return {"params": p * psi / (n if stage >= 3 else 1),
            "grads": g * psi / (n if stage >= 2 else 1),
            "optimizer": o * psi / (n if stage >= 1 else 1)}


def layer_params(work: Workload, tp: int) -> float:
    """Parameters of one transformer block on one tensor-parallel rank (norm weights replicated)."""
    m = work.model
    q, kv = m.n_heads * m.head_size, m.kv_heads * m.head_size
    return (m.dim * (2 * q + 2 * kv) + 3 * m.dim * ffn_width(m, active=False)) / tp + 2 * m.dim


def expert_layer_params(work: Workload, tp: int) -> float:
    """The routed experts' share of layer_params (a block's mean; 0 for a dense model)."""
    m = work.model
    moe = getattr(m, "moe", None)
    if moe is None:
        return 0.0
    return 3 * m.dim * moe.n_experts * moe.expert_ffn_dim * m.n_moe_layers / m.n_layers / tp


def ranks(work: Workload, layout: Layout) -> tuple[RankStages, ...]:
    """The pipeline ranks' blocks and model ends, split as the training program splits them:
    shardline's trainer (pipeline.py), or with the ends counted as blocks (Runtime.pp_split)."""
    return _ranks(work.model, layout.pp, layout.pp_virtual_stages, layout.pp_schedule, work.runtime.pp_split)


def distinct_ranks(work: Workload, layout: Layout) -> tuple[RankStages, ...]:
    """One pipeline rank per (blocks, first, last): what a rank's parameters and tensors depend
    on, so a max over these equals the max over all ranks at a fraction of the cost (pp = 128)."""
    return _distinct_ranks(work.model, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                           work.runtime.pp_split)


@functools.lru_cache(maxsize=4096)
def _ranks(model, pp: int, virtual: int, schedule: str, pp_split: str) -> tuple[RankStages, ...]:
    """ranks() from the values it reads, cached: a search asks again for every layout."""
    if pp_split == "ends_as_blocks" and pp > 1 and virtual == 1:
        split = ends_as_blocks_ranks(model.n_layers, pp)
        if min(r.layers for r in split) >= 1:  # DeepSpeed needs a block on every stage
            return split
    return pipeline_ranks(model, pp, virtual, schedule)


@functools.lru_cache(maxsize=4096)
def _distinct_ranks(model, pp: int, virtual: int, schedule: str, pp_split: str) -> tuple[RankStages, ...]:
    """distinct_ranks() from the values it reads, cached; the first rank of each shape, in order."""
    shapes: dict[tuple[int, bool, bool], RankStages] = {}
    for r in _ranks(model, pp, virtual, schedule, pp_split):
        shapes.setdefault((r.layers, r.first, r.last), r)
    return tuple(shapes.values())


def ends_as_blocks_ranks(n_layers: int, pp: int) -> tuple[RankStages, ...]:
    """Megatron-DeepSpeed's 'type:transformer|embedding' partition: the embedding and the tied
    output are one block each, and the n_layers + 2 units are dealt out evenly (BLOOM, 70 blocks
    on 12 stages: [embed | 5], 6 x 10, [5 | embed]); remainders go to the first stages."""
    base, extra = divmod(n_layers + 2, pp)
    units = [base + (r < extra) for r in range(pp)]
    counts = [u - (r == 0) - (r == pp - 1) for r, u in enumerate(units)]
    starts = [sum(counts[:r]) for r in range(pp)]
    return tuple(RankStages(r, c, r == 0, r == pp - 1, (r,), tuple(range(starts[r], starts[r] + c)))
                 for r, c in enumerate(counts))


def layers_per_rank(work: Workload, layout: Layout) -> int:
    """Blocks on the pipeline rank that holds the most."""
    return max(r.layers for r in ranks(work, layout))


def stage_params(work: Workload, layout: Layout, stage: RankStages, per_layer: float | None = None) -> float:
    """Parameters on one rank of pipeline rank `stage` (all of them without a pipeline).

    The last stage holds the output and final norm; a tied output is a copy of the
    embedding there, and one shared weight when one rank holds both ends. per_layer:
    layer_params(work, layout.tp), when the caller has it (a search's hot loop does).
    """
    m = work.model
    embed = m.vocab_size * m.dim / layout.tp
    out = stage.layers * (layer_params(work, layout.tp) if per_layer is None else per_layer)
    if stage.first:
        out += embed
    if stage.last:
        out += embed + m.dim
    if stage.first and stage.last and m.tie_embeddings:
        out -= embed
    return out


def stage_tensors(work: Workload, stage: RankStages) -> int:
    """Parameter tensors on a rank: 9 per block (7 matmuls, 2 norms) and the ends it holds."""
    n = 9 * stage.layers + int(stage.first) + 2 * int(stage.last)
    return n - int(stage.first and stage.last and work.model.tie_embeddings)


def max_stage_params(work: Workload, layout: Layout) -> float:
    return max(stage_params(work, layout, r) for r in distinct_ranks(work, layout))


def zero1_ep_away(work: Workload, layout: Layout, stage: RankStages) -> float:
    """Of a stage's parameters, those a ZeRO-1 rank under ep does not hold: the routed experts
    of the other ep ranks (parallel/zero1.py). 0 elsewhere: FSDP's sharding already prices them."""
    if zero_stage(layout) != 1:
        return 0.0
    return ep_away(work, layout, stage.layers)


def ep_away(work: Workload, layout: Layout, layers: float) -> float:
    """Of `layers` blocks' parameters, the routed experts of the other ep ranks: never gathered,
    nor their gradients held, on this rank (0 without ep)."""
    return layers * expert_layer_params(work, layout.tp) * (1 - 1 / layout.ep)


def state_bytes(work: Workload, layout: Layout, psi: float, away: float = 0.0) -> dict[str, float]:
    """Weights, gradients and optimizer states of shardline's trainer on one rank; `away`: the
    parameters among `psi` it holds no weights or gradients of (zero1_ep_away), whose states
    are still a 1/shard_degree share."""
    stage = zero_stage(layout)
    mixed = work.precision != "fp32"
    # p: compute-dtype weights besides the fp32 master (the master itself in fp32 where it is
    # replicated: ZeRO-1, whose parameters are the fp32 master on every rank, and fp32 ZeRO-2);
    # zero=3 gathers them per block (transient_bytes).
    # o: Adam m and v, plus the fp32 master wherever it is sharded with them.
    if stage == 1 and mixed and work.runtime.zero1 == "deepspeed_bf16":
        return deepspeed_bf16_states(work, layout, psi)
    if stage == 3:
        p = 0.0
    elif stage == 1:
        p = 4.0 + (act.dtype_bytes(work.precision) if mixed else 0.0)
    elif mixed:  # fp16 under zero=2: the gathered fp32 weights kept to backward, and autocast's copies
        p = 2.0 + (act.fsdp_gather_bytes(work) if stage == 2 and act.autocast_fsdp_copies(work) else 0.0)
    else:
        p = 4.0 if stage == 2 else 0.0
    o = 8.0 if stage == 1 else 12.0
    states = zero_model_states(psi, layout.shard_degree, stage, p, float(work.runtime.grad_bytes), o)
    states["params"] -= p * away
    states["grads"] -= work.runtime.grad_bytes * away
    return states


def zero1_step_bytes(work: Workload, layout: Layout, psi: float, away: float) -> float:
    """Bytes alive at shardline's ZeRO-1 parameter all-gather after the optimizer step
    (parallel/zero1.py), when the activations are gone but the whole fp32 weights and
    gradients are not: the weights (4) and gradients (grad_bytes) it holds, the sharded Adam
    states (8/N), this rank's packed slices and their concatenation (8/N), and the gathered
    buffer of every rank's (4). Under tp, pp or ep its reduce-scatter's send buffer (4, + 4/N
    received) comes earlier and is smaller. 0 outside ZeRO-1 (and DeepSpeed's BF16_Optimizer)."""
    if zero_stage(layout) != 1 or layout.shard_degree == 1 or work.runtime.zero1 == "deepspeed_bf16":
        return 0.0
    held, n = psi - away, layout.shard_degree
    # One cut gathered at a time (its buffers freed before the next): the dense parameters over
    # the shard dim, under ep this rank's experts over efsdp (nothing to gather on one rank).
    experts = away / (layout.ep - 1) if layout.ep > 1 else 0.0
    cuts = [(held - experts, n)] + ([(experts, layout.efsdp)] if experts and layout.efsdp > 1 else [])
    gather = max(4 * p + 8 * p / ranks for p, ranks in cuts)
    return (4 + work.runtime.grad_bytes) * held + 8 * psi / n + gather


def deepspeed_bf16_states(work: Workload, layout: Layout, psi: float) -> dict[str, float]:
    """DeepSpeed's BF16_Optimizer as ZeRO-1: only Adam's m and v (8 B) are sharded. Every rank
    keeps the 16-bit weights and the whole fp32 master (p = c + 4), the 16-bit gradients autograd
    leaves and the whole fp32 buffer they are accumulated into (g = grad_bytes + 4): 12 + 8/N
    bytes per parameter in bf16, where the ZeRO paper's P_os is 4 + 12/N."""
    c = act.dtype_bytes(work.precision)
    return zero_model_states(psi, layout.shard_degree, 1, c + 4.0, work.runtime.grad_bytes + 4.0, 8.0)


def transient_bytes(work: Workload, layout: Layout, tokens: int, psi: float = 0.0, root: float = 0.0,
                    per_layer: float | None = None) -> float:
    """Communication and gather buffers alive at the peak (psi: the rank's parameters, root:
    those outside the blocks: embedding, final norm, output; per_layer: layer_params, if known;
    under ep both without the other ep ranks' experts).

    DDP's reducer allocates its buckets up front, covering every gradient (25 MiB each,
    fp32); the trainer's gradients are views of them (gradient_as_bucket_view), so they add
    nothing unless the runtime copies gradients into them (ddp_grad_copy). FSDP keeps the
    root gathered from forward to backward (the trainer does not reshard it), and its
    unsharded gradient exists until the root's reduce-scatter. Under pp,
    torch's pipeline stages run FSDP without gradient sync until the last micro-batch: every
    gradient of the stage accumulates unsharded in the fp32 reduce dtype, reduce-scattered
    once per step, and a backward leaves the stage's weights gathered (zero=3 frees each
    block again in the next forward).
    """
    c = act.dtype_bytes(work.precision)
    per_layer = layer_params(work, layout.tp) if per_layer is None else per_layer
    out = 0.0
    stage = zero_stage(layout)
    if stage >= 2 and layout.pp > 1:  # zero=2's gathered weights are in its params
        out += 4 * psi + (act.fsdp_gather_bytes(work) * psi if stage == 3 else 0.0)
        out += c * psi if stage == 3 and act.autocast_fsdp_copies(work) else 0.0
    elif stage >= 2:
        # FSDP: gathered weights of the current and the prefetched block (zero=3), plus one
        # block's unsharded gradient and its fp32 reduce-scatter input. fp16 gathers fp32, and
        # autocast's fp16 copies of every weight stay in its cache to the end of the forward.
        gathered = act.fsdp_gather_bytes(work)
        out += (2 * gathered * per_layer if stage == 3 else 0.0) + (c + 4) * per_layer + (c + 4) * root
        if stage == 3 and act.autocast_fsdp_copies(work):
            out += c * psi
    elif layout.dp > 1 and work.runtime.ddp_grad_copy:
        out += 4 * psi
    h, r = work.model.dim, work.runtime.residual_bytes
    if layout.tp > 1:
        out += (r + c) * tokens * h  # the all-gathered (fp32) sequence entering a TP region, a partial output
    if layout.pp > 1:
        out += 4 * r * tokens * h / (layout.tp if layout.sp else 1)  # send/recv, forward and backward
    return out


def activation_bytes(work: Workload, layout: Layout, stage: RankStages, on_cuda: bool = True) -> dict[str, float]:
    """Activation bytes on one pipeline rank; the [b, 1, s, s] document mask counts only where the
    kernel `work.attention` resolves to on the target needs it (planner/attention.py)."""
    m, s = work.model, work.seq_len
    tokens = layout.micro_batch_size * s // layout.cp
    mode = layout.activation_checkpoint
    per_layer = _layer_bytes_per_token(work, layout) * tokens
    inflight = inflight_on_rank(layout.pp_schedule, layout.pp, layout.pp_microbatches, layout.pp_virtual_stages,
                                stage.rank)
    mask = document_mask_bytes(work, layout, on_cuda)
    if work.runtime.block == "gpt":
        whole = act.gpt_layer_bytes_per_token(m.dim, m.n_heads, s, layout.tp, layout.sp, "none", 1)
        transient = whole if mode in ("full", "selective") else 0.0
    else:
        transient = act.recompute_transient_bytes_per_token(m, work.precision, layout.tp, layout.sp, mode,
                                                            work.compiled_blocks(layout))
    out = {"activations": inflight * (stage.layers * per_layer + mask), "recompute": transient * tokens}
    # A chunked loss holds one chunk's logits at a time (and the hidden states of all tokens).
    logit_tokens = min(tokens, work.loss_chunk_tokens) if work.loss_chunk_tokens else tokens
    vocab, head, kept = loss_terms(work, layout)
    # GPipe runs every micro-batch's forward before any backward: the last stage keeps what
    # each one's loss keeps for backward until then.
    held = inflight if layout.pp_schedule == "gpipe" and layout.pp > 1 else 1.0
    out["logits"] = vocab * logit_tokens + head + (held - 1) * kept if stage.last else 0.0
    return out


def loss_terms(work: Workload, layout: Layout) -> tuple[float, float, float]:
    """The loss's bytes on the last stage: (its peak per token, act.loss_bytes_per_token; the head's
    input, fp32 and the compute dtype, over a micro-batch; what one micro-batch's loss keeps from
    forward to backward: that input and, unchunked, the logits (c B an entry) with, eager, the fp32
    log-softmax (4 of the 12 B an entry))."""
    m, c = work.model, act.dtype_bytes(work.precision)
    tokens = layout.micro_batch_size * work.seq_len // layout.cp
    compiled = work.compiled_loss(layout)
    vocab = act.loss_bytes_per_token(m.vocab_size, work.precision, layout.tp, layout.loss_parallel, compiled)
    head = (8 + c) * m.dim / (layout.tp if layout.sp else 1) * tokens
    kept = head + (0.0 if work.loss_chunk_tokens else vocab * (0.5 if compiled else (4 + c) / 12) * tokens)
    return vocab, head, kept


def _layer_bytes_per_token(work: Workload, layout: Layout) -> float:
    """Activation bytes per token of one block: shardline's Llama block, or (Runtime.block) Korthikanti's GPT."""
    m, mode, every = work.model, layout.activation_checkpoint, layout.ac_every
    if work.runtime.block == "gpt":
        return act.gpt_layer_bytes_per_token(m.dim, m.n_heads, work.seq_len, layout.tp, layout.sp, mode, every,
                                             work.runtime.residual_bytes)
    return act.layer_bytes_per_token(m, work.precision, layout.tp, layout.sp, mode, every,
                                     work.compiled_blocks(layout))


def peak_candidates(work: Workload, layout: Layout) -> tuple[RankStages, ...]:
    """Pipeline ranks that may hold the peak: the first (most in flight), the last (logits), the fullest."""
    return _peak_candidates(work.model, layout.pp, layout.pp_virtual_stages, layout.pp_schedule,
                            work.runtime.pp_split)


@functools.lru_cache(maxsize=4096)
def _peak_candidates(model, pp: int, virtual: int, schedule: str, pp_split: str) -> tuple[RankStages, ...]:
    """peak_candidates() from the values it reads, cached like _ranks."""
    rs = _ranks(model, pp, virtual, schedule, pp_split)
    fullest = max(rs, key=lambda r: r.layers)
    return tuple({r.rank: r for r in (rs[0], rs[-1], fullest)}.values())


def memory_breakdown(work: Workload, layout: Layout, hw: Hardware) -> dict[str, float]:
    """Peak bytes on the busiest rank, by component, with `total`."""
    worst: dict[str, float] = {}
    per_layer = layer_params(work, layout.tp)  # the same for every stage: priced once
    tokens = layout.micro_batch_size * work.seq_len // layout.cp
    for stage in peak_candidates(work, layout):
        psi = stage_params(work, layout, stage, per_layer)
        away = zero1_ep_away(work, layout, stage)
        states, host, ssd = offloaded(state_bytes(work, layout, psi, away), layout, work, hw, zero_stage(layout),
                                      psi / layout.shard_degree)
        # Gathered weights and unsharded gradients: of the routed experts only this ep rank's.
        parts = {**states, **activation_bytes(work, layout, stage, on_cuda=hw.name != "cpu"),
                 "buffers": transient_bytes(work, layout, tokens, psi - ep_away(work, layout, stage.layers),
                                            psi - stage.layers * per_layer, per_layer - ep_away(work, layout, 1))}
        if hw.name != "cpu":  # which terms are alive at once (peak.py; a CPU's RSS keeps freed pages)
            parts = peak.busiest(work, layout, parts, zero_stage(layout), stage,
                                 per_layer - ep_away(work, layout, 1), loss_terms(work, layout)[2])
        allocated = sum(parts.values())
        step = zero1_step_bytes(work, layout, psi, away)
        if step > allocated:  # the optimizer step's gather, not the backward, is this rank's peak
            parts["buffers"] += step - allocated
            allocated = step
        parts["fragmentation"] = hw.fragmentation * allocated
        parts["reserved"] = (hw.reserved_gib + hw.cpu.process_baseline_gib) * GiB
        parts["total"] = sum(parts.values())
        parts["host_offload"] = host  # on the host, not the device: not in the total
        parts["ssd_offload"] = ssd  # in files on the node's SSDs: neither
        if parts["total"] > worst.get("total", -1.0):
            worst = parts
    return worst


def largest_term(memory: dict[str, float]) -> tuple[str, float]:
    """(name, bytes) of the biggest part of a memory breakdown: what a 'does not fit' message
    names first, since shrinking it is what moves the total most."""
    parts = {k: v for k, v in memory.items() if k not in OUTSIDE_DEVICE}
    name = max(parts, key=parts.get)
    return name, parts[name]


def params_per_rank(work: Workload, layout: Layout) -> float:
    """Largest parameter count any rank updates in its optimizer step."""
    return max_stage_params(work, layout) / layout.shard_degree


def total_params(work: Workload) -> int:
    return num_params(work.model)
