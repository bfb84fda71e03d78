"""Memory-bound work of a block: bytes its element-wise kernels move per token.

Eager (shardline's trainer as written), fused (Megatron's kernels, `Runtime.fused_elementwise`),
compiled (`train.compile`: the compiler's fused kernels), float8's casts, and a math attention
kernel's score traffic. planner/compute.py turns bytes into seconds at the device's bandwidth.
"""

from __future__ import annotations

from shardline.models.flops import ffn_width
from shardline.planner.activations import dtype_bytes, routed_ffn_width
from shardline.planner.layout import Workload


def compute_dtype(precision: str) -> str:
    """The dtype of everything but float8's Linear GEMMs: fp8 runs the rest under bf16 autocast."""
    return "bf16" if precision == "fp8" else precision


def elementwise_bytes_per_token(work: Workload, tp: int, sp: bool) -> float:
    """Forward bytes moved by one block's memory-bound ops, per token, on one TP rank.

    Norms (pow, mean, two muls over fp32: 28h each), autocast casts of the norm outputs
    (5 x (4 + c)h), RoPE on q and k (6c + 24 per element: the fp32 products of bf16
    inputs), repeating grouped k and v (GQA), SiLU and the gate product (5c·f), two
    residual adds (2(8 + c)h). Norm-region ops shrink with sequence parallelism.
    """
    m, c = work.model, dtype_bytes(work.precision)
    h, q, kv, f = m.dim, m.n_heads * m.head_size, m.kv_heads * m.head_size, ffn_width(m)
    if work.runtime.fused_elementwise:
        return fused_elementwise_bytes_per_token(work, tp, sp)
    mixed = work.precision != "fp32"
    seq_region = (2 * 28 * h + 2 * (8 + c) * h) / (tp if sp else 1)
    casts = 5 * (4 + c) * h if mixed else 0.0
    rope = (6 * c + 24) * (q + kv) / tp
    repeat = 4 * c * q / tp if m.kv_heads != m.n_heads else 0.0
    return seq_region + casts + rope + repeat + 5 * c * f / tp


def fused_elementwise_bytes_per_token(work: Workload, tp: int, sp: bool) -> float:
    """Forward bytes of a block's memory-bound ops when each is one fused kernel (Runtime.fused_elementwise).

    Two norms (read and write the residual width r: 2rh each), two bias-dropout-residual
    adds (read two, write one, a 1-byte mask: (3r + 1)h each), the MLP activation (read the
    gate and up halves, write the product: 3c·f, which for a GeLU of 4h equals read 4h and
    write 4h), and RoPE on q and k (read and write, c each) for a Llama block; a GPT block
    has none. No casts: weights and activations stay in the compute dtype.
    """
    m, c, r = work.model, dtype_bytes(work.precision), work.runtime.residual_bytes
    h, q, kv, f = m.dim, m.n_heads * m.head_size, m.kv_heads * m.head_size, ffn_width(m)
    seq_region = (2 * 2 * r + 2 * (3 * r + 1)) * h / (tp if sp else 1)
    rope = 0.0 if work.runtime.block == "gpt" else 2 * c * (q + kv) / tp
    return seq_region + rope + 3 * c * f / tp


def float8_cast_bytes(work: Workload, gemms: list[tuple[str, int, float, float]]) -> tuple[float, float, float]:
    """(forward bytes per token, backward bytes per token, parameters) of float8's own work in one
    block on one TP rank: what its Linear layers (those float8 converts, tensorwise dynamic
    scaling) move besides their GEMMs.

    Per converted Linear of input width i and output width o: forward, the input's amax (a
    pass over its c bytes) and its cast to float8 (read c, write 1): (2c + 1)i; backward, the
    same for the output's gradient, (2c + 1)o, and float8 copies of both laid out for the
    weight gradient's GEMM (read 1, write 1): 2(i + o). Each weight: an amax and a cast from
    its stored dtype instead of autocast's (priced by the caller), and a transposed float8
    copy for the input gradient (2 B). `gemms`: the block's (dtype, 1 token, width in, width out)
    (compute.layer_gemm_dtypes). Counted kernel by kernel; a compiler may fuse some (the
    three casts of the input wq, wk and wv share). The backward casts the Linear inputs and
    weights again, from what the forward kept in high precision (torchao, eager) or recomputed (a
    compiled block keeps no Linear input): compute.layer_times adds the forward's casts to it.
    Against the H200 profile: the fp8 step's compiled kernels took at
    least 59 ms (some casts were counted with the GEMMs), where the planner's element-wise work,
    these casts and the loss included, counts 64 (benchmarks/RESULTS.md)."""
    c = dtype_bytes(compute_dtype(work.precision))
    fwd = bwd = params = 0.0
    for dtype, _, width_in, width_out in gemms:
        if dtype == "fp8":
            fwd += (2 * c + 1) * width_in
            bwd += (2 * c + 1) * width_out + 2 * (width_in + width_out)
            params += width_in * width_out
    return fwd, bwd, params


def compiled_elementwise_bytes_per_token(work: Workload, tp: int, sp: bool) -> tuple[float, float]:
    """(forward, backward) bytes of a compiled block's memory-bound kernels, per token, on one TP rank.

    The compiler fuses each chain of element-wise ops into one kernel that reads its inputs
    and writes its outputs once (no casts in between; autocast's weight casts stay, priced
    apart). Per block: the first norm (read the residual r·h, write its c·h output), the
    attention's residual add fused with the second norm (read r·h + c·h, write both) and
    the feed-forward's residual add (read r·h + c·h, write r·h; the next block's norm is in
    another graph): (5r + 4c)h, about the same again backward. RoPE on q and k: read and
    write, 2c(q + kv) each way. SwiGLU: read w1's and w3's outputs, write the product (3c·f);
    backward reads the product's gradient and both inputs and writes two gradients (5c·f).
    The routed experts of an MoE block run eagerly (parallel/compile.py): their SwiGLU is
    priced as elementwise_bytes_per_token prices it. Against the profile of a compiled
    Llama-3.2-1B step on an H200 (benchmarks/RESULTS.md: RMSNorm 8, SwiGLU 8, RoPE 1.8 ms)
    these are 8.9, 10.2 and 1.6 ms at the table's bandwidth.
    """
    m, c, r = work.model, dtype_bytes(compute_dtype(work.precision)), work.runtime.residual_bytes
    h, q, kv = m.dim, m.n_heads * m.head_size, m.kv_heads * m.head_size
    routed = routed_ffn_width(m)
    fused_ffn = ffn_width(m) - routed
    norms = (5 * r + 4 * c) * h / (tp if sp else 1)
    rope = 2 * c * (q + kv) / tp
    forward = norms + rope + (3 * c * fused_ffn + 5 * c * routed) / tp
    backward = norms + rope + (5 * c * fused_ffn + 10 * c * routed) / tp
    return forward, backward


# Bytes per attention score of a math kernel's forward (Runtime.attention = "math"): the
# fused scale-mask-softmax reads and writes it (2c), dropout reads it, writes it and a
# 1-byte mask (2c + 1). Megatron's GPT block, as Korthikanti et al. count its activations.
def math_score_bytes(c: int) -> float:
    return 4 * c + 1
