"""One ring step's block of attention: forward, backward, and the kernel each runs on.

Kernels, per block (`block_kernel`; every one returns the output and the natural-log
log-sum-exp of the scaled scores, in fp32, so the ring's merge is the same for all; FULL,
CAUSAL and MASK are the kinds of block pair ring.RingPlan names):

- CPU: the CPU flash kernel, every kind and dtype (an additive mask for MASK blocks).
- CUDA, bf16/fp16: FULL and CAUSAL blocks on the flash kernel
  (`_scaled_dot_product_flash_attention` and its backward); MASK blocks (packed
  documents, partial causal overlaps) on the memory-efficient kernel
  (`_scaled_dot_product_efficient_attention`) with the mask as an additive bias. Flash
  takes no mask; the efficient kernel is the one SDPA itself picks for arbitrary masks
  and takes fp32 as well. cuDNN's kernel also
  takes a bias, but what it supports (bias gradients, alignment, shapes) moves with the
  cuDNN version, so it is not used.
- CUDA, fp32: every kind on the efficient kernel (flash needs half precision).
- CUDA with a head dim that is not a multiple of 8 or is over 256, other dtypes, and
  other devices (meta traces included): the fp32 math path (`block_attention`,
  `block_backward_math`), exact but materialising each block's [sq, sk] scores.

The fused kernels see K/V repeated to the query heads (dK/dV summed back per kv head)
and compute the backward's delta = rowsum(dO * O) themselves from the final output;
tests/unit/test_ring_kernels.py checks their calls on meta tensors and
tests/gpu/test_ring_gpu.py their numbers against the math path on a GPU.
"""

from __future__ import annotations

import torch

MASKED = -1e30


def block_attention(q, k, v, allowed: torch.Tensor | None, scale: float):
    """Attention of q [b, h, sq, d] on one K/V block [b, hk, sk, d] (GQA: h a multiple of hk).

    allowed [b, sq, sk] (None: all). Returns the output [b, h, sq, d] and the
    log-sum-exp of the scores [b, h, sq], both fp32.
    """
    b, h, sq, d = q.shape
    hk = k.shape[1]
    qg = q.float().reshape(b, hk, h // hk, sq, d)  # q head j uses kv head j // (h / hk)
    scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float().unsqueeze(2))
    return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)


def block_forward(q, k, v, allowed, causal: bool, scale: float):
    """One block's (output, lse), fp32, on the kernel `block_kernel` names for it."""
    allowed = allowed.to(q.device) if allowed is not None else None
    if q.device.type == "cpu":
        k, v = _repeat_kv(k, v, q.shape[1])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=attention_bias(allowed, q), scale=scale)
        return out.float(), lse.float()
    kernel = block_kernel(q, allowed is not None)
    if kernel != "math":
        return fused_block_forward(kernel, q, k, v, allowed, causal, scale)
    return block_attention(q, k, v, _causal_mask(q, k) if causal else allowed, scale)


def block_backward(q, k, v, allowed, causal: bool, scale: float, grad_out, out, lse, delta):
    """Gradients of one block's share of the attention, given the final output and its lse."""
    allowed = allowed.to(q.device) if allowed is not None else None
    if q.device.type == "cpu":
        hk = k.shape[1]
        kr, vr = _repeat_kv(k, v, q.shape[1])
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(q.dtype), q, kr, vr, out.to(q.dtype), lse, 0.0, causal,
            attn_mask=attention_bias(allowed, q), scale=scale)
        return dq.float(), _sum_groups(dk, hk), _sum_groups(dv, hk)
    kernel = block_kernel(q, allowed is not None)
    if kernel != "math":
        return fused_block_backward(kernel, q, k, v, allowed, causal, scale, grad_out, out, lse)
    return block_backward_math(q, k, v, _causal_mask(q, k) if causal else allowed, scale, grad_out, lse, delta)


_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_EFFICIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LSE_ALIGN = 32  # the efficient kernel's lse is [b, h, sq rounded up to this] (+inf in the padding)
BIAS_ALIGN = 16  # its attn_bias row stride must be a multiple of 8 (half) / 4 (fp32) elements: 16 covers both


def block_kernel(q, masked: bool) -> str:
    """The kernel a ring block of q (masked: it has a boolean mask) runs: "cpu" (the CPU
    flash kernel), "flash", "efficient" or "math"; only CUDA gets the GPU kernels (a meta
    trace keeps the math path, as before)."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda":
        return "math"
    return cuda_block_kernel(q.dtype, q.shape[-1], masked)


def cuda_block_kernel(dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """Flash takes no mask and only half precision, so it runs the unmasked (full and
    causal) blocks of bf16/fp16; the efficient kernel takes an additive bias and fp32, so
    it runs the masked blocks and every fp32 block (keeping fp32 on the math path would
    cost a score block per step for no accuracy worth having). Both want head dims that
    are multiples of 8 (their alignment) and at most 256 (flash's limit, kept for both so
    there is one rule); other head dims and dtypes take the fp32 math path."""
    if head_dim % 8 or head_dim > 256:
        return "math"
    if not masked and dtype in _FLASH_DTYPES:
        return "flash"
    return "efficient" if dtype in _EFFICIENT_DTYPES else "math"


def fused_block_forward(kernel: str, q, k, v, allowed, causal: bool, scale: float):
    """block_forward on a GPU kernel ("flash" or "efficient"): (output, lse), fp32.

    K/V heads are repeated to the query heads (the efficient kernel takes no GQA, and one
    rule for both keeps their gradients alike); inputs are made contiguous (zigzag runs
    are slices). Both kernels return the natural-log log-sum-exp of the scaled, biased
    scores, as block_attention does; the efficient kernel pads it along the queries, so
    it is cut to sq. Runs on meta tensors too (the ops have meta kernels), which is how
    the CPU tests check it.
    """
    sq = q.shape[2]
    q, k, v = _kernel_inputs(q, k, v)
    if kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, attention_bias(allowed, q), True, 0.0, causal, scale=scale)[:2]
    return out.float(), lse[..., :sq].float()


def fused_block_backward(kernel: str, q, k, v, allowed, causal: bool, scale: float, grad_out, out, lse):
    """block_backward on a GPU kernel: (dq, dk, dv), fp32, dk/dv summed over the query heads
    of each kv head. The kernels compute delta = rowsum(dO * O) themselves, from the final
    output and its gradient in q's dtype (as the CPU kernel does); the final lse goes in as
    is (the efficient kernel's padded back to the layout its forward returns). The dropout
    RNG state they take is read only when dropout_p > 0: empty scalars stand in, as the
    forward returns without dropout."""
    sq, hk, sk = q.shape[2], k.shape[1], k.shape[2]
    q, kr, vr = _kernel_inputs(q, k, v)
    lse = lse.float().contiguous()
    rng = torch.empty((), dtype=torch.long)
    if kernel == "flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.to(q.dtype).contiguous(), q, kr, vr, out.to(q.dtype).contiguous(), lse, None, None, sq, sk,
            0.0, causal, rng, rng, scale=scale)
    else:  # its wrapper lays grad_out out itself
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out.to(q.dtype), q, kr, vr, attention_bias(allowed, q), efficient_out_layout(out, q.dtype),
            pad_lse(lse), rng, rng, 0.0, [True, True, True, False], causal, scale=scale)
    return dq.float(), _sum_groups(dk, hk), _sum_groups(dv, hk)


def efficient_out_layout(out, dtype: torch.dtype):
    """out [b, h, sq, d] in `dtype`, stored as the efficient kernel's forward returns it:
    [b, sq, h, d] in memory (one copy at most). Its backward takes the output's row stride
    to be heads x head_dim whatever the tensor's strides say (where it computes delta =
    rowsum(dO * O) itself, as its bf16 kernels did on an H200), so a [b, h, sq, d]-contiguous
    output gives wrong dq there and reads past the tensor's end."""
    rows = out.transpose(1, 2)
    if rows.dtype != dtype or not rows.is_contiguous():  # (`.to(memory_format=)` would alias a same-dtype view)
        rows = torch.empty(rows.shape, dtype=dtype, device=rows.device).copy_(rows)
    return rows.transpose(1, 2)


def _kernel_inputs(q, k, v):
    k, v = _repeat_kv(k, v, q.shape[1])
    return q.contiguous(), k.contiguous(), v.contiguous()


def attention_bias(allowed, q):
    """A boolean block mask [b or 1, sq, sk] as the additive bias [b, h, sq, sk] in q's dtype
    that the CUDA efficient kernel needs (its dtype, all four dims) and the CPU flash kernel
    takes as well, so both devices mask alike (fp16 included: never -inf).

    Its rows are stored BIAS_ALIGN-aligned (the kernel refuses other row strides; the
    padding is never read) and batch (for a shared mask) and heads are stride-0
    expansions, so one [., sq, sk] block is stored. Masked entries are MASKED, or fp16's
    lowest where -1e30 would round to -inf: finite either way, so a row with no allowed
    key gets a finite lse far below any real one (merge weight 0, no NaN)."""
    if allowed is None:
        return None
    n, sq, sk = allowed.shape
    fill = max(MASKED, torch.finfo(q.dtype).min)
    bias = torch.full((n, 1, sq, sk + (-sk) % BIAS_ALIGN), fill, dtype=q.dtype, device=q.device)[..., :sk]
    bias.masked_fill_(allowed[:, None], 0.0)
    return bias.expand(q.shape[0], q.shape[1], sq, sk)


def pad_lse(lse):
    """lse [b, h, sq] in the efficient kernel's layout: the queries padded to LSE_ALIGN
    with +inf (what its forward writes there: no probability in a padding row). ROCm's
    kernel does not pad (torch's meta kernel says the same); not run here."""
    sq, align = lse.shape[-1], 1 if torch.version.hip else LSE_ALIGN
    padded = torch.full((*lse.shape[:-1], -(-sq // align) * align), float("inf"),
                        dtype=torch.float32, device=lse.device)
    padded[..., :sq] = lse
    return padded


def _sum_groups(grad, hk: int):
    """dK or dV over the repeated heads [b, h, sk, d] -> [b, hk, sk, d], fp32: each kv head
    gets the sum over its query heads (h / hk consecutive ones, as _repeat_kv laid out)."""
    b, h, sk, d = grad.shape
    return grad.float().reshape(b, hk, h // hk, sk, d).sum(2)


def _repeat_kv(k, v, n_heads: int):
    group = n_heads // k.shape[1]
    return (k, v) if group == 1 else (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


def _causal_mask(q, k):
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None]


def block_backward_math(q, k, v, allowed, scale: float, grad_out, lse, delta):
    """block_backward on the math path (fp32)."""
    b, h, sq, d = q.shape
    hk = k.shape[1]
    g = h // hk
    qg = q.float().reshape(b, hk, g, sq, d)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    scores = torch.matmul(qg, kf.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], MASKED)
    p = torch.exp(scores - lse.reshape(b, hk, g, sq, 1))
    do = grad_out.reshape(b, hk, g, sq, d)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # summed over the query heads of each kv head
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta.reshape(b, hk, g, sq, 1))
    dq = torch.matmul(ds, kf).reshape(b, h, sq, d) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq, dk, dv
