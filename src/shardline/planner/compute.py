"""Compute time of one rank: matmuls by shape, attention, element-wise ops, optimizer.

* Matmuls: 2·m·n·k FLOPs at a shape-dependent efficiency
      eff(m, n, k) = eff_max · m/(m + d0) · n/(n + d0) · k/(k + d0)
  (d0 = `matmul_half_dim`): large GEMMs approach eff_max, thin tensor-parallel shards
  and short micro-batches fall off, as measured GEMM throughput does. The backward runs
  two GEMMs of the same FLOPs per forward GEMM; the product form is symmetric in the
  three dimensions, so they get the same efficiency.
* Attention: 4·b·s_q·s_k·(heads·head_dim) FLOPs forward, 2.5x that backward (flash
  recomputes the scores), at attn_eff · s_q/(s_q + s0) · s_k/(s_k + s0) of peak
  (s0 = `attn_half_len`; context parallelism runs kernels on s/cp chunks, which are
  less efficient, and merges their partial outputs: element-wise work), times the share
  of scores the kernel computes: 1 for SDPA's dense document mask, about 1/2 causal,
  less for flex and varlen over short documents (planner/attention.py).
* fp8 (parallel/float8.py): only the Linear layers' GEMMs (wq, wk, wv, wo, w1, w2, w3,
  shared experts; both weight dims multiples of 16) run at the fp8 peak; attention, the
  output projection, the routed experts, the router and the element-wise work run bf16.
* Element-wise ops (norms, casts, RoPE, SwiGLU's product, residual adds, the
  embedding gradient, autocast's weight casts) are memory-bound: bytes moved /
  (bandwidth x `elementwise_eff` of the compute dtype); backward moves twice the
  forward's bytes. The fp32 softmax + cross-entropy moves 32 bytes per vocabulary
  entry per token (+ the casts), at `loss_eff` of that rate (exp and log make it
  compute-bound on CPUs). Each launched op also
  costs `op_overhead_us`. Compiled (`train.compile`), a block's element-wise chains are
  fused kernels, each reading and writing once (`compiled_elementwise_bytes_per_token`),
  and the cross-entropy reads its compute-dtype logits twice forward and once backward.
* Optimizer: fused AdamW + grad-norm clipping over the rank's (sharded) parameters,
  `optimizer_bytes_per_param` of memory traffic each (ZeRO-1's AdamW clips in a pass of its own:
  `ZERO1_CLIP_BYTES` more).
* Distributed wrappers' host time: planner/host.py; the optimizer step's on DTensor
  parameters, per tensor, here.

On a CPU the processes of one node share its cores and memory bandwidth
(`shared_compute`). The profile's figures describe one process of `threads` threads
(as calibrated); N such ranks on C cores each get min(1, C / (N x threads)) of them, and
that share stretches everything a rank runs on the CPU: kernels, element-wise traffic,
the per-op dispatcher overhead and the optimizer. On top, busy cores slow each other
(shared caches and memory bandwidth, SMT siblings on cloud VMs): `corun_*_eff`, measured
by calibrate/corun.py, scales GEMMs, element-wise work and dispatch when more cores are
busy than the calibration used. With cores = 0 (an old profile) the node is split
evenly, 1/N each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardline.models.flops import ffn_width
from shardline.layout.rules import fp8_aligned as float8_aligned
from shardline.planner import attention as attn_kernel
from shardline.planner.activations import (
    autocast_fsdp_copies,
    float8_every_linear,
    dtype_bytes,
    routed_ffn_width,
)
from shardline.planner.elementwise import (
    compiled_elementwise_bytes_per_token,
    compute_dtype,
    elementwise_bytes_per_token,
    float8_cast_bytes,
    math_score_bytes,
)
from shardline.planner.hardware import Hardware
from shardline.layout import Layout
from shardline.planner.layout import Workload
from shardline.planner.memory import layer_params

FWD_OPS_PER_LAYER, BWD_OPS_PER_LAYER = 45, 75  # launched (non-view) ops of our block, counted
LOSS_OPS = 12


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one micro-batch through one layer on one rank (forward; backward is derived)."""

    matmul: float
    attention: float
    elementwise: float
    overhead: float
    elementwise_bwd: float | None = None  # None: twice the forward's (eager); a compiled block's is counted

    @property
    def forward(self) -> float:
        return self.matmul + self.attention + self.elementwise + self.overhead

    @property
    def backward(self) -> float:
        elementwise = 2 * self.elementwise if self.elementwise_bwd is None else self.elementwise_bwd
        return (2 * self.matmul + 2.5 * self.attention + elementwise
                + self.overhead * BWD_OPS_PER_LAYER / FWD_OPS_PER_LAYER)


def share(hw: Hardware, layout: Layout, kind: str | None = None) -> float:
    """Fraction of a device's compute one rank gets (1, except CPU ranks sharing a node).

    `kind` ("matmul", "memory" or "dispatch") also charges that kind of work's co-run
    slowdown (CpuRanks.corun_*_eff, calibrated with one-thread processes): it grows
    linearly from none, with only the calibrated `threads` cores busy, to the calibrated
    ratio with every core busy. Without `kind` it is not charged: the wrapper overheads
    were calibrated with their ranks running side by side already.
    """
    if not hw.cpu.shared_compute:
        return 1.0
    ranks = min(layout.world, hw.network.gpus_per_node)
    if hw.cpu.cores <= 0:
        return 1.0 / ranks
    threads = max(1, hw.cpu.threads)
    fraction = min(1.0, hw.cpu.cores / (ranks * threads))
    busy, alone = min(ranks * threads, hw.cpu.cores), min(threads, hw.cpu.cores)
    if kind is None or busy <= alone:
        return fraction
    corun = getattr(hw.cpu, f"corun_{kind}_eff")
    return fraction * (1.0 - (1.0 - corun) * (busy - alone) / (hw.cpu.cores - alone))


def saturated(hw: Hardware, layout: Layout) -> bool:
    """CPU ranks that keep every core busy: communication has no idle core to overlap on.

    gloo moves data with the CPU (memcpy over loopback TCP), so a collective "overlapped"
    with compute takes cores from it; the estimate then charges it in full.
    """
    if not hw.cpu.shared_compute:
        return False
    ranks = min(layout.world, hw.network.gpus_per_node)
    return hw.cpu.cores <= 0 or ranks * max(1, hw.cpu.threads) >= hw.cpu.cores


def matmul_efficiency(hw: Hardware, dtype: str, m: float, n: float, k: float) -> float:
    d0 = hw.matmul_half_dim
    return hw.matmul_eff_max.get(dtype, 0.5) * (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))


def attention_efficiency(hw: Hardware, dtype: str, q_len: int, k_len: int) -> float:
    """Flash-style attention reaches attn_eff on long sequences; short query/key blocks fall off."""
    half = hw.attn_half_len
    return hw.attn_eff.get(dtype, 0.3) * (q_len / (q_len + half)) * (k_len / (k_len + half))


def matmul_time(hw: Hardware, dtype: str, m: float, n: float, k: float, share_: float = 1.0) -> float:
    if dtype == "fp8" and "fp8" not in hw.peak_tflops:  # no float8 GEMMs (a CPU emulates them): bf16's rate
        dtype = "bf16"
    return 2.0 * m * n * k / (hw.peak(dtype) * share_ * matmul_efficiency(hw, dtype, m, n, k))


# Mixture of experts, dropless, under expert parallelism: the busiest rank's routed tokens
# over the mean, with balancing on (without ep every rank runs top_k slots of each of its
# own tokens, however they route: no rank waits on another's load). An assumption (per-layer
# max/mean loads of about 1.1-1.3 are what balanced MoE runs report), not a measurement of
# ours; it scales the routed experts' share of a block's feed-forward GEMMs.
EXPERT_LOAD_ALLOWANCE = 1.15


def ffn_compute_width(model, ep: int = 1) -> float:
    """The feed-forward width a block's GEMMs are priced at: the active width, with the
    routed experts' part scaled by EXPERT_LOAD_ALLOWANCE under expert parallelism (ep > 1)."""
    return ffn_width(model) + (EXPERT_LOAD_ALLOWANCE - 1) * routed_ffn_width(model) * (ep > 1)


def layer_gemms(work: Workload, tp: int, tokens: int, ep: int = 1) -> list[tuple[int, float, float]]:
    """(m, n, k) of the forward GEMMs of one block on one TP rank: wq, wk, wv, wo, w1, w3, w2."""
    mdl = work.model
    h, q, kv, f = mdl.dim, mdl.n_heads * mdl.head_size, mdl.kv_heads * mdl.head_size, ffn_compute_width(mdl, ep)
    return [(tokens, h, q / tp), (tokens, h, kv / tp), (tokens, h, kv / tp), (tokens, q / tp, h),
            (tokens, h, f / tp), (tokens, h, f / tp), (tokens, f / tp, h)]


def layer_gemm_dtypes(work: Workload, tp: int, tokens: int, ep: int = 1) -> list[tuple[str, int, float, float]]:
    """(dtype, m, n, k) of a block's forward GEMMs: under fp8, those float8 converts (a weight
    whose dims are multiples of FP8_GEMM_MULTIPLE x tp) at "fp8", the routed experts' share of the
    feed-forward width (grouped weights, not nn.Linear) at bf16."""
    gemms = layer_gemms(work, tp, tokens, ep)
    if work.precision != "fp8":
        return [(work.precision, *g) for g in gemms]
    m = work.model
    h, q, kv = m.dim, m.n_heads * m.head_size, m.kv_heads * m.head_size
    moe = getattr(m, "moe", None)
    ffn = m.ffn_dim if moe is None else math.gcd(m.ffn_dim, moe.expert_ffn_dim)  # both widths aligned
    out = [(_fp8_if_aligned(tp, h, width), *g) for width, g in zip((q, kv, kv, q), gemms[:4])]
    linear = _linear_ffn_width(m)
    for dtype, width in ((_fp8_if_aligned(tp, h, ffn), linear), ("bf16", ffn_compute_width(m, ep) - linear)):
        if width > 0:
            out += [(dtype, tokens, h, width / tp), (dtype, tokens, h, width / tp), (dtype, tokens, width / tp, h)]
    return out


def _fp8_if_aligned(tp: int, *dims: int) -> str:
    return "fp8" if float8_aligned(tp, *dims) else "bf16"


def _linear_ffn_width(model) -> float:
    """The feed-forward width float8 converts: dense blocks' and shared experts' (nn.Linear), all
    but the routed experts'."""
    return ffn_width(model) - routed_ffn_width(model)


def math_attention(work: Workload, layout: Layout, hw: Hardware, tokens: int, share_: float) -> tuple[float, float]:
    """(GEMM seconds, score bytes moved) of a math attention kernel per block and micro-batch.

    QK^T and AV are batched GEMMs of s x s x head_dim per head, priced on the matmul curve;
    every score is computed (the causal mask is applied, not skipped). The score tensors
    (heads/tp x s per token) are element-wise traffic, so a long sequence or a thin model
    pays for them where a flash kernel does not.
    """
    m, s, dtype = work.model, work.seq_len, compute_dtype(work.precision)
    d, heads = m.head_size, m.n_heads / layout.tp
    flops = 4.0 * tokens * s * d * heads
    gemm = flops / (hw.peak(dtype) * share_ * matmul_efficiency(hw, dtype, s, s, d))
    return gemm, math_score_bytes(dtype_bytes(dtype)) * heads * s * tokens


def attention_time(work: Workload, layout: Layout, hw: Hardware, tokens: int, share_: float) -> float:
    """Seconds of a fused attention kernel's forward per block and micro-batch on one rank:
    the scores the resolved kernel computes (planner/attention.py), in the compute dtype."""
    dtype, s = compute_dtype(work.precision), work.seq_len
    q_width = work.model.n_heads * work.model.head_size / layout.tp
    ring = layout.cp_degrees[0]
    kernel = attn_kernel.kernel(work, hw, ring)
    computed = attn_kernel.computed_fraction(kernel, s, work.document_mask, work.mean_doc_tokens)
    # Under cp the slowest rank sets the pace. The trainer's ring computes chunk pairs
    # (a chunk: s/2R tokens) and skips those wholly in the future: with zigzag every rank
    # does 2R + 1 of them, with balance "none" the last rank does 4R.
    imbalance = 4 * ring / (2 * ring + 1) if layout.cp_balance == "none" and ring > 1 else 1.0
    attn_flops = 4.0 * tokens * s * q_width * computed * imbalance
    chunk = s // ring  # a ring of R runs kernels of s/R queries x s/R keys; Ulysses one of s x s
    return attn_flops / (hw.peak(dtype) * share_ * attention_efficiency(hw, dtype, chunk, chunk))


def layer_times(work: Workload, layout: Layout, hw: Hardware) -> LayerTimes:
    dtype, s = compute_dtype(work.precision), work.seq_len
    tokens = layout.micro_batch_size * s // layout.cp
    sh, sh_mem, sh_ops = (share(hw, layout, kind) for kind in ("matmul", "memory", "dispatch"))
    mm = sum(matmul_time(hw, d, *g, sh) for d, *g in layer_gemm_dtypes(work, layout.tp, tokens, layout.ep))
    q_width = work.model.n_heads * work.model.head_size / layout.tp
    bw = hw.mem_bw_gbs * 1e9 * hw.elementwise_eff.get(dtype, 0.7) * sh_mem
    if work.runtime.attention == "math":
        attn, score_bytes = math_attention(work, layout, hw, tokens, sh)
        attn_elem = score_bytes / bw
    else:
        attn, attn_elem = attention_time(work, layout, hw, tokens, sh), 0.0
    # Ring attention merges each partial result into the running output and logsumexp.
    attn += (layout.cp - 1) * 8 * dtype_bytes(dtype) * q_width * tokens / bw
    elem_bwd = None
    compiled = work.compiled_blocks(layout) and not work.runtime.fused_elementwise
    if compiled:
        fwd_bytes, bwd_bytes = compiled_elementwise_bytes_per_token(work, layout.tp, layout.sp)
        elem, elem_bwd = fwd_bytes * tokens / bw + attn_elem, bwd_bytes * tokens / bw + 2 * attn_elem
    else:
        elem = elementwise_bytes_per_token(work, layout.tp, layout.sp) * tokens / bw + attn_elem
    fsdp_casts = layout.dp_mode in ("fsdp", "zero2", "hsdp") and not autocast_fsdp_copies(work)
    autocast_casts = work.precision != "fp32" and work.runtime.weight_casts and not fsdp_casts
    # Autocast casts each fp32 weight to the compute dtype once per forward (read 4, write 2
    # bytes); FSDP's mixed precision casts while gathering instead (not fp16's: it gathers fp32).
    casts = 6 * layer_params(work, layout.tp) / bw if autocast_casts else 0.0
    if work.precision == "fp8":  # float8's Linear layers cast their own weights (not autocast)
        act_fwd, act_bwd, params = float8_cast_bytes(work, layer_gemm_dtypes(work, layout.tp, 1, layout.ep))
        weight_src = 4 if autocast_casts else 2  # fp32 weights, or FSDP's gathered bf16 ones
        f8_fwd = (act_fwd * tokens + (2 * weight_src + 1) * params) / bw
        # The backward casts the Linear inputs and weights to float8 again, eager (torchao keeps
        # them in high precision) or compiled (the block keeps no Linear input): the forward's casts.
        recast = float8_every_linear(work.model, layout.tp)
        f8_bwd = (act_bwd * tokens + 2 * params) / bw + (f8_fwd if recast else 0.0)
        casts *= max(0.0, 1 - params / layer_params(work, layout.tp))  # the weights float8 leaves to autocast
        # Eager, the backward is twice the forward's element-wise work, autocast's casts included (as bf16's).
        elem_bwd = (2 * (elem + casts) if elem_bwd is None else elem_bwd) + f8_bwd
        elem += f8_fwd
    elem += casts
    return LayerTimes(mm, attn, elem, FWD_OPS_PER_LAYER * hw.op_overhead_us * 1e-6 / sh_ops, elem_bwd)


def head_times(work: Workload, layout: Layout, hw: Hardware, stage: str) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the parts outside the blocks.

    The first stage runs the embedding: a gather forward, a dense V x h gradient
    backward. The last runs the final norm, the output GEMM and the cross-entropy.
    `stage` is "first", "last", "both" (no pipeline) or "middle" (neither end).
    """
    m, dtype = work.model, compute_dtype(work.precision)
    tokens = layout.micro_batch_size * work.seq_len // layout.cp
    bw = hw.mem_bw_gbs * 1e9 * hw.elementwise_eff.get(dtype, 0.7) * share(hw, layout, "memory")
    fwd = bwd = 0.0
    if stage in ("first", "both"):
        bwd += (4 * m.vocab_size * m.dim / layout.tp + 12 * m.dim * tokens) / bw
        fwd += 4 * m.dim * tokens / bw
    if stage in ("last", "both"):
        gemm, loss_fwd, loss_bwd = _output_parts(work, layout, hw)
        fwd += gemm + loss_fwd
        bwd += 2 * gemm + loss_bwd
    return fwd, bwd


def _output_parts(work: Workload, layout: Layout, hw: Hardware) -> tuple[float, float, float]:
    """Seconds per micro-batch of the output GEMM, and of the loss's forward and backward
    (the fp32 softmax and cross-entropy traffic over the logits, and its dispatch)."""
    m, dtype = work.model, compute_dtype(work.precision)  # the output projection stays bf16 under fp8
    tokens = layout.micro_batch_size * work.seq_len // layout.cp
    sh, sh_mem, sh_ops = (share(hw, layout, kind) for kind in ("matmul", "memory", "dispatch"))
    c, mixed = dtype_bytes(dtype), dtype != "fp32"
    vocab = m.vocab_size / (layout.tp if layout.loss_parallel else 1)
    gemm = matmul_time(hw, dtype, tokens, m.dim, m.vocab_size / layout.tp, sh)
    cast = c + 4 if mixed else 0
    loss_bw = hw.mem_bw_gbs * 1e9 * hw.elementwise_eff.get("fp32", 0.7) * sh_mem * hw.loss_eff  # fp32 logits
    ops = LOSS_OPS * hw.op_overhead_us * 1e-6 / sh_ops
    if work.compiled_loss(layout):  # fused: two passes over the c-byte logits forward (max, sum of
        # exponentials), one read and one write of c bytes backward; no fp32 copy
        return gemm, 2 * c * vocab * tokens / loss_bw + ops, 2 * c * vocab * tokens / loss_bw + ops
    return gemm, (12 + cast) * vocab * tokens / loss_bw + ops, (20 + cast) * vocab * tokens / loss_bw + ops


def loss_recompute_time(work: Workload, layout: Layout, hw: Hardware, stage: str) -> float:
    """Seconds per micro-batch the chunked loss (`loss_chunk_tokens`) spends recomputing on
    the last stage: each chunk is checkpointed, so the backward runs the output GEMM and the
    loss's forward again; the split backward of zbv/dualpipev runs it in both its passes
    (tests/unit/test_loss.py)."""
    if not work.loss_chunk_tokens or stage not in ("last", "both"):
        return 0.0
    gemm, loss_fwd, _ = _output_parts(work, layout, hw)
    return (gemm + loss_fwd) * (2 if layout.split_backward else 1)


ZERO1_CLIP_BYTES = 8.0  # the clip's multiply as a pass of its own: read and write each gradient


def optimizer_time(params: float, hw: Hardware, layout: Layout, tensors: int = 0,
                   clip_in_optimizer: bool = True) -> float:
    """AdamW + clipping over `params` local parameters (memory-bound) in `tensors` tensors.

    Parameters that are DTensors (FSDP, TP) add `dtensor_param_overhead_us` each.
    """
    bw = hw.mem_bw_gbs * 1e9 * hw.elementwise_eff.get("fp32", 0.7) * share(hw, layout, "memory")  # fp32 states
    dtensor = layout.tp > 1 or layout.shard_degree > 1
    host = tensors * hw.cpu.dtensor_param_overhead_us * 1e-6 / share(hw, layout) if dtensor else 0.0
    # ZeRO-1's AdamW takes no clip scale (nor did other systems'): the clip's multiply is a pass of its own
    apart = ZERO1_CLIP_BYTES if layout.dp_mode == "zero1" or not clip_in_optimizer else 0.0
    return params * (hw.optimizer_bytes_per_param + apart) / bw + host


def recompute_fraction(mode: str, every: int) -> tuple[float, float]:
    """(share of a layer's forward GEMM/attention, share of its element-wise ops) recomputed."""
    if mode == "full":
        return 1.0, 1.0
    if mode == "selective":
        return 1.0 / every, 1.0 / every
    if mode == "op":
        return 0.0, 1.0
    return 0.0, 0.0
