"""Activation memory per transformer layer, counted tensor by tensor as Korthikanti et al. did.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models") list every tensor the GPT block saves for backward and add up their bytes
per token: 34·h + 5·a·s (16-bit values, 1-byte dropout masks). We do the same for
shardline's Llama block *as implemented* (models/llama.py, eager autograd), and check
the list against the tensors autograd really saves (tests/unit/test_planner_memory.py
counts them with saved_tensors_hooks on CPU).

Per token and layer, with h = dim, q = n_heads·head_dim, f = ffn_dim, a = heads,
c = bytes of the compute dtype (2 under bf16/fp16 autocast, 4 in fp32):

    tensor saved for backward                          bytes        region
    attention_norm: input x (pow)                      4h           seq   (residual stream is fp32:
                    x·rsqrt(mean x^2) (mul by weight)  4h           seq    the embedding is fp32)
                    rsqrt per token                    4            seq
    wq, wk, wv inputs: autocast casts the fp32 norm    3·c·h        lin_in (fp32: the norm output, 4h,
        output separately for each linear                                   saved once)
    RoPE: cos/sin only (need no grad), nothing per token
    SDPA (flash/efficient kernels): q, out, and k, v   2·c·(q+kv)   tp    (GQA through enable_gqa:
        at kv width, and the fp32 logsumexp            4a           tp     k, v are not repeated)
    wo input: the SDPA output itself (same storage)    0
    ffn_norm: as attention_norm                        8h + 4       seq
    w1, w3 inputs: two casts                           2·c·h        lin_in (fp32: 4h once)
    SwiGLU: w1 out (silu in), silu out, w3 out,        4·c·f        tp
        product (w2 in)

    total, bf16:  26h + 4q + 4kv + 8f + 4a + 8    (kv = n_kv_heads·head_dim; GPT-shaped q = kv = h,
    total, fp32:  24h + 8q + 8kv + 16f + 4a + 8    f = 4h: 66h)

Regions say what tensor parallelism divides: `tp` tensors are sharded over heads or
the ffn dimension; `seq` tensors (the norm region) only under sequence parallelism;
`lin_in` are the inputs of the column-parallel linears. Megatron's sequence
parallelism saves its own sequence shard of them and all-gathers again in backward
(so they are divided by t); DTensor's, which shardline uses, saves the all-gathered
input (not divided). `partial` tensors are the row-parallel linears' own outputs,
full-sequence partial sums on every rank before their all-reduce or reduce-scatter:
never divided (op-level AC saves them). `score` tensors (a·s per token: attention probabilities) exist
only in a math-kernel attention such as Korthikanti's GPT; flash kernels keep only
the logsumexp. The same machinery, fed the GPT block, reproduces the paper's
formulas exactly (see `gpt_block`).

Compiled (`train.compile`), the block is one graph whose forward/backward split the
compiler chooses (min-cut: keep few bytes, recompute cheap element-wise work), and it
keeps less (`llama_compiled_block`, counted the same way on a compiled block):

    block input (fp32 residual) and each norm's rsqrt      4h + 8       seq
    each norm's output, once, in the compute dtype         2·c·h        lin_in
    q, k, v, out at their widths, the logsumexp            c·(2q + 2kv) + 4a   tp
    the attention output again, contiguous (wo's input)    c·q          tp
    SwiGLU: w1 out, w3 out, their product (w2's input)     3·c·f        tp

    total, bf16: 8h + 6q + 4kv + 6f + 4a + 8 (Llama-3.2-1B: 80 kB a token and layer, 62% of eager's 129)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardline.models.flops import ffn_width
from shardline.models.llama import ModelArgs
from shardline.parallel.data_parallel import gather_dtype
from shardline.layout.rules import fp8_aligned as float8_aligned

REGIONS = ("seq", "lin_in", "tp", "score", "partial")


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps for backward, in bytes per token of the (unsharded) layer."""

    what: str
    bytes_per_token: float
    region: str


def dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def fsdp_gather_bytes(work) -> int:
    """Bytes per parameter FSDP gathers: shardline's FSDP2 gathers in data_parallel.gather_dtype
    (bf16 under bf16 and fp8; the fp32 parameters themselves under fp32 and fp16, whose casts
    autocast makes). A program that keeps 16-bit weights (Runtime.weight_casts off: Megatron,
    metaseq) gathers those."""
    if autocast_fsdp_copies(work) or work.precision == "fp32":
        return 4
    return dtype_bytes(work.precision)


def autocast_fsdp_copies(work) -> bool:
    """Whether autocast casts FSDP's gathered fp32 weights to the compute dtype (fp16 here)."""
    return work.precision != "fp32" and work.runtime.weight_casts and gather_dtype(work.precision) is None


def llama_block(model: ModelArgs, precision: str) -> list[Saved]:
    """The tensors one shardline Llama block saves for backward (see the module docstring)."""
    h, q, f, a = model.dim, model.n_heads * model.head_size, ffn_width(model), model.n_heads
    kv = model.kv_heads * model.head_size
    c = dtype_bytes(precision)
    mixed = precision != "fp32"
    saved = []
    for norm, consumers in (("attention_norm", 3), ("ffn_norm", 2)):
        saved += [Saved(f"{norm} input (fp32 residual)", 4 * h, "seq"),
                  Saved(f"{norm} x*rsqrt", 4 * h, "seq"),
                  Saved(f"{norm} rsqrt", 4, "seq"),
                  Saved(f"{norm} output as linear input", (consumers * c if mixed else 4) * h, "lin_in")]
    saved += [Saved("sdpa q, k, v, out", 2 * c * (q + kv), "tp"),
              Saved("sdpa logsumexp", 4 * a, "tp"),
              Saved("swiglu w1 out, silu out, w3 out, product", 4 * c * f, "tp")]
    return saved + routed_saved(model, precision)


def routed_saved(model: ModelArgs, precision: str, compiled: bool = False, op_ac: bool = False) -> list[Saved]:
    """What an MoE block keeps beyond the SwiGLU widths ffn_width counts, per token averaged over the blocks
    (first_dense_layers keep none). Each routed slot's gathered input row, in the compute dtype as the
    grouped GEMM takes it; eagerly also its output in fp32 as the gate weight scales it and that weighted
    row (index_add's source), where a compiled block keeps the output alone; the router's fp32 scores,
    choices and weights, the slots' order and token ids (int64), and under mixed precision with shared
    experts the router's own fp32 input beside their casts (counted with hooks on a block: the test of
    the planner's memory). Under tensor parallelism each tp rank routes every token of the sequence and
    runs its own experts on a slice of the rows: their input cast for the GEMM is a tp-th ("tp"), the
    output summed over tp and its weighted copy whole on each ("partial": not divided). `op_ac`: op-level
    checkpointing keeps the grouped GEMMs' outputs instead (w2's, per slot and tp rank: w1's and w3's are
    in ffn_width) and the router's logits."""
    moe = getattr(model, "moe", None)
    if moe is None:
        return []
    share, c, k, h = _moe_share(model), dtype_bytes(precision), moe.top_k, model.dim
    if op_ac:
        return [Saved("routed w2 outputs", share * k * c * h, "tp"), Saved("router logits", share * 4 * moe.n_experts,
                                                                            "lin_in")]
    router = 4 * moe.n_experts + 32 * k + 4 * moe.norm_topk + (4 * h if precision != "fp32" and moe.shared_experts
                                                                else 0)
    return [Saved("routed rows: the experts' input", share * k * c * h, "tp"),
            Saved("routed rows: output (eagerly in fp32, and weighted)", share * k * (c if compiled else 8) * h,
                  "partial"),
            Saved("router scores, choices, weights; slot order and token ids", share * router, "lin_in")]


def routed_ffn_width(model: ModelArgs) -> float:
    """The routed experts' part of ffn_width (top_k of them, averaged over the blocks): under
    train.compile they run eagerly (parallel/compile.py)."""
    moe = getattr(model, "moe", None)
    if moe is None:
        return 0.0
    return moe.top_k * moe.expert_ffn_dim * _moe_share(model)


def _moe_share(model: ModelArgs) -> float:
    """The share of the blocks that are MoE blocks (the first_dense_layers are not)."""
    return model.n_moe_layers / model.n_layers


def llama_compiled_block(model: ModelArgs, precision: str) -> list[Saved]:
    """The tensors one compiled shardline Llama block saves for backward (see the module docstring);
    an MoE block's routed experts, run eagerly, keep eager's SwiGLU tensors. Under fp8 (float8
    Linear layers, tensorwise) the compiled block keeps neither the norms' outputs nor SwiGLU's
    product (the Linear inputs), nor any weight copy: it recasts them from what it keeps
    (counted with hooks on a compiled float8 block, emulated on the CPU)."""
    h, q, f, a = model.dim, model.n_heads * model.head_size, ffn_width(model), model.n_heads
    kv = model.kv_heads * model.head_size
    c, routed = dtype_bytes(precision), routed_ffn_width(model)
    if precision == "fp8":
        return [Saved("block input (fp32 residual), rsqrt of both norms", 4 * h + 8, "seq"),
                Saved("sdpa q, k, v, out", 2 * c * (q + kv), "tp"),
                Saved("sdpa logsumexp", 4 * a, "tp"),
                Saved("wo input (the attention output, contiguous)", c * q, "tp"),
                Saved("swiglu w1 out, w3 out", 2 * c * (f - routed) + 4 * c * routed, "tp"),
                *routed_saved(model, precision, compiled=True)]
    return [Saved("block input (fp32 residual), rsqrt of both norms", 4 * h + 8, "seq"),
            Saved("both norms' outputs as linear inputs", 2 * c * h, "lin_in"),
            Saved("sdpa q, k, v, out", 2 * c * (q + kv), "tp"),
            Saved("sdpa logsumexp", 4 * a, "tp"),
            Saved("wo input (the attention output, contiguous)", c * q, "tp"),
            Saved("swiglu w1 out, w3 out, product", 3 * c * (f - routed) + 4 * c * routed, "tp"),
            *routed_saved(model, precision, compiled=True)]


def whole_block(model: ModelArgs, precision: str, compiled: bool, tp: int = 1) -> list[Saved]:
    """What a block that is not checkpointed keeps: compiled or eager. Compiled fp8's own saved set
    only where float8_every_linear; else the bf16 one (the compute dtype is bf16 either way)."""
    if not compiled:
        return llama_block(model, precision)
    if precision == "fp8" and not float8_every_linear(model, tp):
        precision = "bf16"
    return llama_compiled_block(model, precision)


def float8_every_linear(model: ModelArgs, tp: int) -> bool:
    """Whether float8 converts every Linear of a block (layout.rules.fp8_aligned) with no routed
    experts beside them (an MoE's experts cast their weights to bf16 and keep those copies and
    their input). Then, eager or compiled, no block weight has an autocast copy (peak.py) and the
    backward casts the Linear inputs and weights to float8 again from what the forward kept:
    torchao saves them in high precision (compute.py); compiled, the block keeps no Linear input
    at all (the saved set here). The one rule for the three."""
    if getattr(model, "moe", None) is not None:
        return False
    return float8_aligned(tp, model.dim, model.n_heads * model.head_size, model.kv_heads * model.head_size,
                          model.ffn_dim)


def llama_op_ac_block(model: ModelArgs, precision: str, compiled: bool = False) -> list[Saved]:
    """What op-level selective checkpointing keeps: the block input and every matmul/SDPA output.

    Norms, casts (autocast's weight copies too), RoPE and SwiGLU's element-wise part are
    recomputed in backward. `compiled` (the policy traced into one compiled graph): the w2
    output, which nothing in backward needs, is not kept (counted with hooks on a compiled
    op-checkpointed block).
    """
    h, q, f, a = model.dim, model.n_heads * model.head_size, ffn_width(model), model.n_heads
    kv = model.kv_heads * model.head_size
    c = dtype_bytes(precision)
    return [Saved("block input (fp32 residual)", 4 * h, "seq"),
            Saved("wq, wk, wv outputs", c * (q + 2 * kv), "tp"),
            Saved("sdpa out + logsumexp", c * q + 4 * a, "tp"),
            Saved("wo, w2 outputs (partial sums)", (1 if compiled else 2) * c * h, "partial"),
            Saved("w1, w3 outputs", 2 * c * f, "tp"), *routed_saved(model, precision, op_ac=True)]


def gpt_block(h: int, a: int, seq_len: int) -> list[Saved]:
    """Korthikanti et al.'s GPT block (fp16, dropout, GeLU MLP of 4h, math attention), section 4.1."""
    s = seq_len
    return [Saved("layernorm inputs", 4 * h, "seq"),
            Saved("dropout masks (attention out, mlp out)", 2 * h, "seq"),
            Saved("qkv linear input", 2 * h, "lin_in"),
            Saved("mlp linear input", 2 * h, "lin_in"),
            Saved("Q and K for QK^T", 4 * h, "tp"),
            Saved("V", 2 * h, "tp"),
            Saved("output projection input", 2 * h, "tp"),
            Saved("GeLU input", 8 * h, "tp"),
            Saved("second linear input", 8 * h, "tp"),
            Saved("softmax output", 2 * a * s, "score"),
            Saved("softmax dropout mask", a * s, "score"),
            Saved("dropout output", 2 * a * s, "score")]


def block_bytes_per_token(block: list[Saved], tp: int = 1, sp: bool = False, megatron_sp: bool = False,
                          drop_scores: bool = False) -> float:
    """Bytes per token one layer keeps on one tensor-parallel rank.

    megatron_sp: under sequence parallelism the linear inputs are kept sharded (Megatron)
    rather than all-gathered (DTensor). drop_scores: Korthikanti's selective recompute.
    """
    total = 0.0
    for t in block:
        if t.region == "score" and drop_scores:
            continue
        shard = {"tp": tp, "score": tp, "seq": tp if sp else 1, "partial": 1,
                 "lin_in": tp if (sp and megatron_sp) else 1}[t.region]
        total += t.bytes_per_token / shard
    return total


def boundary_bytes_per_token(model: ModelArgs | None = None, tp: int = 1, sp: bool = False,
                             h: int | None = None, value_bytes: int = 4) -> float:
    """A fully checkpointed layer keeps only its input: the residual stream (fp32 in shardline)."""
    width = h if h is not None else model.dim
    return value_bytes * width / (tp if sp else 1)


@functools.lru_cache(maxsize=4096)
def layer_bytes_per_token(model: ModelArgs, precision: str, tp: int, sp: bool, mode: str, every: int,
                          compiled: bool = False) -> float:
    """Average bytes per token per layer kept between forward and backward under an AC mode.

    Cached: a pure function of a few hashable values, asked again for every layout of a
    search (rebuilding the block's Saved list each time was a tenth of `shardline plan`).

    none: the whole block. full: only its input. selective: every `every`-th block is
    full-checkpointed, the others keep everything. op: llama_op_ac_block. `compiled`: a
    block keeps what llama_compiled_block lists.
    """
    whole = block_bytes_per_token(whole_block(model, precision, compiled, tp), tp, sp)
    boundary = boundary_bytes_per_token(model, tp, sp)
    if mode == "none":
        return whole
    if mode == "full":
        return boundary
    if mode == "selective":
        return boundary / every + whole * (1 - 1 / every)
    if mode == "op":
        # Under tp the checkpoint wraps the compiled block from outside (parallel/compile.py): eager's count.
        return block_bytes_per_token(llama_op_ac_block(model, precision, compiled and tp == 1), tp, sp)
    raise ValueError(f"memory.activation_checkpoint={mode!r} is invalid: one of none, full, selective, op")


def gpt_layer_bytes_per_token(h: int, a: int, seq_len: int, tp: int, sp: bool, mode: str, every: int,
                              residual_bytes: int = 2) -> float:
    """Korthikanti's GPT block under an AC mode, with its attention scores not kept (their
    selective recompute, which a flash kernel does anyway): 34·h/t per token under SP.

    none / op: the whole block; full: its input; selective: every `every`-th block full.
    """
    whole = block_bytes_per_token(gpt_block(h, a, seq_len), tp, sp, megatron_sp=True, drop_scores=True)
    boundary = boundary_bytes_per_token(h=h, tp=tp, sp=sp, value_bytes=residual_bytes)
    if mode == "full":
        return boundary
    if mode == "selective":
        return boundary / every + whole * (1 - 1 / every)
    return whole


@functools.lru_cache(maxsize=4096)
def recompute_transient_bytes_per_token(model: ModelArgs, precision: str, tp: int, sp: bool, mode: str,
                                        compiled: bool = False) -> float:
    """Extra bytes while one checkpointed layer is recomputed in backward (its full activations).

    Cached like layer_bytes_per_token: the same few values recur across a search's layouts."""
    whole = block_bytes_per_token(whole_block(model, precision, compiled, tp), tp, sp)
    if mode in ("full", "selective"):
        return whole
    if mode == "op":
        return max(0.0, whole - layer_bytes_per_token(model, precision, tp, sp, "op", 1, compiled))
    return 0.0


def loss_bytes_per_token(vocab: int, precision: str, tp: int, loss_parallel: bool, compiled: bool = False) -> float:
    """Peak of the output logits and cross-entropy per token, on top of the layers.

    Eager, forward keeps the fp32 log-softmax output (4 B/entry); at the start of backward
    the gradient of the loss (4 B) and of the log-softmax input (4 B) coexist with it: 12
    bytes per vocabulary entry. In forward the compute-dtype logits and their fp32 copy
    (bf16: 2 + 4 + 4 = 10 B) stay below that. `compiled` (train.compile's cross-entropy;
    loss parallelism keeps its own eager): the fused kernel keeps the compute-dtype logits
    and a log-sum-exp per token, and writes the logits' gradient in that dtype, so 2 x the
    dtype's bytes (tests/unit/test_planner_memory.py counts what each saves). Loss
    parallelism shards the vocabulary.
    """
    shard = tp if (tp > 1 and loss_parallel) else 1
    return (2.0 * dtype_bytes(precision) if compiled else 12.0) * vocab / shard
