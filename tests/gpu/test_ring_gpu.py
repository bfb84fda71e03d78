"""Ring attention's block kernels on a CUDA device: the fused path (flash for unmasked
bf16 blocks, the memory-efficient kernel with an additive bias for masked and fp32
blocks) against the fp32 math path on the same inputs, forward (output, lse) and
backward (dq, dk, dv), for every block kind, with GQA and without. Skipped without
CUDA; `benchmarks/gpu_check.sh` runs them.

What the CPU suite cannot show (tests/unit/test_ring_kernels.py runs the same calls on
meta tensors): the kernels' numbers, that their lse is the natural-log one the merge
needs, that the bias layout and the dropout-free RNG placeholders are accepted, and
that a query row with no allowed key in a block stays finite. Tiny shapes, off the
kernels' tile sizes (72 queries: the efficient kernel pads its lse to 96; 40 keys: the
bias rows are padded to 48). Written for the GPU machine's torch (2.11).
"""

from __future__ import annotations

import pytest
import torch

from shardline.parallel.context.blocks import (
    block_attention,
    block_backward,
    block_backward_math,
    block_forward,
    block_kernel,
)

pytestmark = pytest.mark.gpu

SCALE = 0.125  # 1 / sqrt(64)
SQ = 72


def _block(kind: str, h: int, hk: int, dtype: torch.dtype):
    """q [2, h, 72, 64], k/v [2, hk, sk, 64] and the block's mask as block_forward takes it
    (allowed, causal), plus the boolean mask the math path takes for the same block.

    mask: queries at positions 30..101, keys at 0..39; row 0 holds documents of 35
    tokens (its queries from position 70 on see no key of this block), row 1 one
    document. shared_mask: the same positions, causal only, one [1, sq, sk] mask for
    both rows (a partial causal overlap without documents)."""
    sk = SQ if kind == "causal" else 40
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, h, SQ, 64, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(2, hk, sk, 64, device="cuda", generator=gen).to(dtype) for _ in range(2))
    qpos, kpos = torch.arange(30, 30 + SQ, device="cuda"), torch.arange(sk, device="cuda")
    causal_overlap = kpos[None, None, :] <= qpos[None, :, None]
    if kind == "full":
        return q, k, v, None, False, None
    if kind == "causal":
        return q, k, v, None, True, torch.ones(SQ, SQ, dtype=torch.bool, device="cuda").tril()[None]
    if kind == "shared_mask":
        return q, k, v, causal_overlap, False, causal_overlap
    docs_q = torch.stack([qpos // 35, torch.zeros_like(qpos)])
    docs_k = torch.stack([kpos // 35, torch.zeros_like(kpos)])
    allowed = causal_overlap & (docs_q[:, :, None] == docs_k[:, None, :])
    return q, k, v, allowed, False, allowed


def _assert_fused_equals_math(kind, h, hk, dtype, tol, grad_tol):
    q, k, v, allowed, causal, mask = _block(kind, h, hk, dtype)
    out, lse = block_forward(q, k, v, allowed, causal, SCALE)
    ref_out, ref_lse = block_attention(q, k, v, mask, SCALE)  # fp32 on the same (upcast) inputs
    assert out.dtype == lse.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    seen = torch.ones_like(ref_lse, dtype=torch.bool) if mask is None else mask.any(-1)[:, None].expand_as(ref_lse)
    torch.testing.assert_close(out[seen], ref_out[seen], atol=tol, rtol=tol)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=tol, rtol=tol)
    assert (lse[~seen] < -1e29).all()  # no key here: merged with weight 0

    # Backward against the final output and lse, as the ring gives them: a row with no key
    # in this block has its mass elsewhere (lse 0 stands for that), so its share is zero.
    final_lse = torch.where(seen, ref_lse, torch.zeros_like(ref_lse))
    grad = torch.randn(ref_out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    delta = (grad * ref_out).sum(-1)
    fused = block_backward(q, k, v, allowed, causal, SCALE, grad, ref_out, final_lse, delta)
    want = block_backward_math(q, k, v, mask, SCALE, grad, final_lse, delta)
    for name, got, ref in zip("qkv", fused, want):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        assert torch.isfinite(got).all(), f"d{name} not finite"
        error = (got - ref).norm() / ref.norm()
        assert error < grad_tol, f"d{name}: relative error {error:.3g}"


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("kind", ["full", "causal", "mask", "shared_mask"])
def test_fused_block_equals_the_math_path_in_bf16(kind, heads):
    q = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    assert block_kernel(q, masked=kind.endswith("mask")) == ("efficient" if kind.endswith("mask") else "flash")
    _assert_fused_equals_math(kind, *heads, torch.bfloat16, tol=2e-2, grad_tol=2e-2)


@pytest.mark.parametrize("kind", ["full", "causal", "mask"])
def test_fused_block_equals_the_math_path_in_fp32(kind):
    assert block_kernel(torch.empty(1, 1, 1, 64, device="cuda"), masked=kind == "mask") == "efficient"
    _assert_fused_equals_math(kind, 4, 2, torch.float32, tol=5e-3, grad_tol=1e-2)
