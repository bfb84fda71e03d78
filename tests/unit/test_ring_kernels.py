"""The ring's GPU block kernels, checked without a GPU.

The CUDA branch (flash for unmasked half-precision blocks, the memory-efficient kernel
with an additive bias for masked and fp32 blocks) calls aten ops that have meta
kernels, so it runs here on meta tensors: output shapes and dtypes, the lse cut back
from the efficient kernel's padded layout, the GQA reduction. The schemas are pinned
so a torch whose signatures move fails here, not on a GPU. The bias and the helpers
are checked by value on CPU (the bias also through the CPU flash kernel, which takes
the same additive mask). The numbers of the GPU kernels themselves: tests/gpu/test_ring_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from shardline.parallel.context.blocks import (
    BIAS_ALIGN,
    LSE_ALIGN,
    MASKED,
    _sum_groups,
    attention_bias,
    block_attention,
    block_backward_math,
    block_kernel,
    cuda_block_kernel,
    fused_block_backward,
    fused_block_forward,
    pad_lse,
)

aten = torch.ops.aten

# What blocks.py passes, positionally, to each op: (name, type) in order, then scale by keyword.
SCHEMAS = {
    "_scaled_dot_product_flash_attention": [
        ("query", "Tensor"), ("key", "Tensor"), ("value", "Tensor"), ("dropout_p", "float"),
        ("is_causal", "bool"), ("return_debug_mask", "bool")],
    "_scaled_dot_product_flash_attention_backward": [
        ("grad_out", "Tensor"), ("query", "Tensor"), ("key", "Tensor"), ("value", "Tensor"), ("out", "Tensor"),
        ("logsumexp", "Tensor"), ("cum_seq_q", "Tensor"), ("cum_seq_k", "Tensor"), ("max_q", "int"),
        ("max_k", "int"), ("dropout_p", "float"), ("is_causal", "bool"), ("philox_seed", "Tensor"),
        ("philox_offset", "Tensor")],
    "_scaled_dot_product_efficient_attention": [
        ("query", "Tensor"), ("key", "Tensor"), ("value", "Tensor"), ("attn_bias", "Optional[Tensor]"),
        ("compute_log_sumexp", "bool"), ("dropout_p", "float"), ("is_causal", "bool")],
    "_scaled_dot_product_efficient_attention_backward": [
        ("grad_out_", "Tensor"), ("query", "Tensor"), ("key", "Tensor"), ("value", "Tensor"),
        ("attn_bias", "Tensor"), ("out", "Tensor"), ("logsumexp", "Tensor"), ("philox_seed", "Tensor"),
        ("philox_offset", "Tensor"), ("dropout_p", "float"), ("grad_input_mask", "List[bool]"),
        ("is_causal", "bool")],
}
RETURNS = {"_scaled_dot_product_flash_attention": 9, "_scaled_dot_product_flash_attention_backward": 3,
           "_scaled_dot_product_efficient_attention": 4, "_scaled_dot_product_efficient_attention_backward": 4}


@pytest.mark.parametrize("op", sorted(SCHEMAS))
def test_op_schemas_take_the_arguments_ring_passes(op):
    schema = getattr(aten, op).default._schema
    positional = [(a.name, str(a.type)) for a in schema.arguments if not a.kwarg_only]
    assert positional == SCHEMAS[op], schema
    scale = [a for a in schema.arguments if a.name == "scale"]
    assert len(scale) == 1 and scale[0].kwarg_only and str(scale[0].type) == "Optional[float]", schema
    # blocks.py reads the first two returns (output, lse) of the forwards, three of the backwards.
    assert len(schema.returns) == RETURNS[op], schema


def _meta(dtype, b=2, h=4, hk=2, sq=72, sk=40, d=64):
    q = torch.empty(b, h, sq, d, dtype=dtype, device="meta")
    k, v = (torch.empty(b, hk, sk, d, dtype=dtype, device="meta") for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kernel, dtype, masked, causal", [
    ("flash", torch.bfloat16, False, False), ("flash", torch.float16, False, True),
    ("efficient", torch.bfloat16, True, False), ("efficient", torch.float32, True, False),
    ("efficient", torch.float32, False, True), ("efficient", torch.float32, False, False)])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_fused_branch_on_meta_gives_the_math_paths_shapes_and_dtypes(kernel, dtype, masked, causal, heads):
    h, hk = heads
    sk = 72 if causal else 40
    q, k, v = _meta(dtype, h=h, hk=hk, sk=sk)
    allowed = torch.empty(2, 72, sk, dtype=torch.bool, device="meta") if masked else None
    out, lse = fused_block_forward(kernel, q, k, v, allowed, causal, 0.125)
    assert out.shape == (2, h, 72, 64) and out.dtype == torch.float32
    assert lse.shape == (2, h, 72) and lse.dtype == torch.float32  # the efficient kernel's 96 cut to 72
    dq, dk, dv = fused_block_backward(kernel, q, k, v, allowed, causal, 0.125, out, out, lse)
    assert dq.shape == (2, h, 72, 64) and dk.shape == dv.shape == (2, hk, sk, 64)  # summed to the kv heads
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32


def test_the_efficient_kernels_lse_is_padded_as_pad_lse_pads_it():
    """The un-padding in the forward and the padding for the backward follow the op's own
    (meta) layout: queries rounded up to LSE_ALIGN; flash's lse is not padded."""
    for sq in (1, 40, 64, 72):
        q, k, v = _meta(torch.bfloat16, h=2, hk=2, sq=sq)
        lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=0.125)[1]
        assert lse.shape == pad_lse(torch.zeros(2, 2, sq)).shape == (2, 2, -(-sq // LSE_ALIGN) * LSE_ALIGN)
        flash_lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=0.125)[1]
        assert flash_lse.shape == (2, 2, sq)
    lse = torch.randn(2, 3, 40)
    padded = pad_lse(lse)
    assert torch.equal(padded[..., :40], lse) and torch.isinf(padded[..., 40:]).all() and padded.is_contiguous()


def test_kernel_choice_per_device_dtype_and_kind():
    assert cuda_block_kernel(torch.bfloat16, 64, masked=False) == "flash"
    assert cuda_block_kernel(torch.float16, 128, masked=False) == "flash"
    assert cuda_block_kernel(torch.bfloat16, 64, masked=True) == "efficient"
    assert cuda_block_kernel(torch.float32, 64, masked=False) == "efficient"
    assert cuda_block_kernel(torch.float32, 64, masked=True) == "efficient"
    for dtype, d in [(torch.bfloat16, 60), (torch.bfloat16, 512), (torch.float64, 64)]:
        assert cuda_block_kernel(dtype, d, masked=False) == "math"
    assert block_kernel(torch.empty(1, 1, 1, 64), masked=True) == "cpu"
    assert block_kernel(torch.empty(1, 1, 1, 64, device="meta", dtype=torch.bfloat16), masked=False) == "math"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_bias_is_aligned_expanded_and_finite(dtype):
    allowed = torch.rand(1, 5, 21, generator=torch.Generator().manual_seed(0)) > 0.5
    q = torch.empty(3, 4, 5, 8, dtype=dtype)
    bias = attention_bias(allowed, q)
    assert bias.shape == (3, 4, 5, 21) and bias.dtype == dtype
    assert bias.stride(3) == 1 and bias.stride(2) % BIAS_ALIGN == 0 and bias.stride(2) >= 21
    assert bias.stride(1) == 0 and bias.stride(0) == 0  # heads and a shared mask's batch: not copied
    assert torch.isfinite(bias).all()
    assert (bias[:, :, allowed[0]] == 0).all()
    fill = torch.tensor(MASKED if dtype != torch.float16 else torch.finfo(dtype).min, dtype=dtype)
    assert (bias[:, :, ~allowed[0]] == fill).all()  # fp16 cannot hold -1e30: its lowest, not -inf
    assert attention_bias(None, q) is None


def test_attention_bias_means_the_boolean_mask():
    """Through the CPU flash kernel (the same additive-mask semantics): equal to the math path
    on its boolean mask, and a query row with no allowed key stays finite with an lse near
    MASKED, so the ring's merge weighs it 0."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 16, generator=gen), torch.randn(2, 4, 10, 16, generator=gen), \
        torch.randn(2, 4, 10, 16, generator=gen)
    qpos, kpos = torch.arange(6, 18), torch.arange(10)
    docs_q = torch.stack([qpos // 7, torch.zeros(12, dtype=torch.long)])
    docs_k = torch.stack([kpos // 7, torch.zeros(10, dtype=torch.long)])
    allowed = (kpos[None, None] <= qpos[None, :, None]) & (docs_q[:, :, None] == docs_k[:, None, :])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                attn_mask=attention_bias(allowed, q), scale=0.25)
    ref_out, ref_lse = block_attention(q, k, v, allowed, 0.25)
    seen = allowed.any(-1)[:, None].expand(2, 4, 12)
    assert (~seen).any() and seen.any()
    assert torch.allclose(out[seen], ref_out[seen], atol=1e-5) and torch.allclose(lse[seen], ref_lse[seen], atol=1e-5)
    assert torch.isfinite(out).all() and (lse[~seen] < -1e29).all()


def test_gqa_reduction_sums_each_kv_heads_query_heads():
    grad = torch.randn(2, 6, 5, 4, dtype=torch.bfloat16)
    summed = _sum_groups(grad, 2)
    assert summed.shape == (2, 2, 5, 4) and summed.dtype == torch.float32
    # kv head j serves query heads 3j .. 3j+2 (k.repeat_interleave(3, dim=1))
    assert torch.allclose(summed[:, 1], grad[:, 3:6].float().sum(1))
    assert torch.equal(_sum_groups(grad, 6), grad.float())


# The CUDA kernels' contracts as blocks.py relies on them (read from PyTorch's attention.cu /
# attention_backward.cu), emulated as CPU kernels of the same aten ops for the tests below:
# every argument is read by its schema name (defaults as the schemas give them: the
# dispatcher leaves out arguments equal to their defaults), so a swapped, missing or mis-shaped one in
# blocks.py's calls shows up here. The real kernels' numbers: tests/gpu/test_ring_gpu.py.

def _scores(q, k, bias, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = s if bias is None else s + bias.float()  # the bias is added to the scaled scores
    if causal:  # top-left aligned (square blocks here)
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return s


def _inputs_ok(q, k, v, bias=None):
    assert q.shape[1] == k.shape[1] == v.shape[1]  # no GQA in the efficient kernel: ring.py repeats K/V
    assert all(t.stride(-1) == 1 and t.shape[-1] % 8 == 0 for t in (q, k, v))
    if bias is not None:
        align = 4 if q.dtype == torch.float32 else 8
        assert bias.dtype == q.dtype and bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(3) == 1
        assert all(stride % align == 0 for stride in bias.stride()[:3])


def _backward(go, q, k, v, out, lse, bias, causal, scale):
    p = torch.exp(_scores(q, k, bias, causal, scale) - lse.unsqueeze(-1))
    ds = p * (go.float() @ v.float().transpose(-1, -2) - (go.float() * out.float()).sum(-1, keepdim=True))
    grads = ds @ k.float() * scale, ds.transpose(-1, -2) @ q.float() * scale, p.transpose(-1, -2) @ go.float()
    return tuple(g.to(q.dtype) for g in grads)


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert query.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0 and not return_debug_mask
    _inputs_ok(query, key, value)
    s = _scores(query, key, None, is_causal, scale)
    rng, none = torch.empty((), dtype=torch.long), torch.empty(0)
    out = (torch.softmax(s, -1) @ value.float()).to(query.dtype)
    return out, torch.logsumexp(s, -1), none, none, query.shape[2], key.shape[2], rng, rng, none.to(query.dtype)


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, philox_seed, philox_offset, *, scale=None):
    assert cum_seq_q is None and cum_seq_k is None  # defined ones would select the varlen kernel
    assert (max_q, max_k, dropout_p) == (query.shape[2], key.shape[2], 0.0)
    assert out.dtype == grad_out.dtype == query.dtype and logsumexp.dtype == torch.float32
    assert logsumexp.shape == query.shape[:3] and logsumexp.is_contiguous()
    _inputs_ok(query, key, value)
    return _backward(grad_out, query, key, value, out, logsumexp, None, is_causal, scale)


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert compute_log_sumexp and dropout_p == 0.0
    _inputs_ok(query, key, value, attn_bias)
    s = _scores(query, key, attn_bias, is_causal, scale)
    lse = torch.cat([torch.logsumexp(s, -1), torch.full((*s.shape[:2], -s.shape[2] % 32), float("inf"))], -1)
    rng = torch.empty((), dtype=torch.long)
    return (torch.softmax(s, -1) @ value.float()).to(query.dtype), lse, rng, rng


def _efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                        dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    sq = query.shape[2]
    assert list(grad_input_mask) == [True, True, True, False] and dropout_p == 0.0
    assert logsumexp.shape == (*query.shape[:2], -(-sq // 32) * 32) and logsumexp.dtype == torch.float32
    assert out.dtype == grad_out_.dtype == query.dtype
    # the CUDA kernel reads out's row stride as heads x head_dim: [b, sq, h, d] in memory, as its forward returns it
    assert out.transpose(1, 2).is_contiguous()
    _inputs_ok(query, key, value, attn_bias)
    return *_backward(grad_out_, query, key, value, out, logsumexp[..., :sq], attn_bias, is_causal, scale), None


@pytest.fixture(scope="module")
def emulated_cuda_kernels():
    lib = torch.library.Library("aten", "IMPL")
    for op, kernel in [("_scaled_dot_product_flash_attention", _flash),
                       ("_scaled_dot_product_flash_attention_backward", _flash_backward),
                       ("_scaled_dot_product_efficient_attention", _efficient),
                       ("_scaled_dot_product_efficient_attention_backward", _efficient_backward)]:
        lib.impl(op, kernel, "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["full", "causal", "mask", "shared_mask"])
def test_fused_branch_against_emulated_kernels_equals_the_math_path(emulated_cuda_kernels, kind, dtype):
    gen = torch.Generator().manual_seed(0)
    sk = 24 if kind == "causal" else 16
    q = torch.randn(2, 4, 24, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, sk, 16, generator=gen).to(dtype) for _ in range(2))
    qpos, kpos = torch.arange(8, 32), torch.arange(sk)
    overlap = (kpos[None, None] <= qpos[None, :, None])
    docs = torch.stack([qpos // 10, torch.zeros_like(qpos)])[:, :, None] == \
        torch.stack([kpos // 10, torch.zeros_like(kpos)])[:, None, :]
    allowed = {"full": None, "causal": None, "mask": overlap & docs, "shared_mask": overlap}[kind]
    mask = torch.ones(24, 24, dtype=torch.bool).tril()[None] if kind == "causal" else allowed
    kernel = cuda_block_kernel(dtype, 16, allowed is not None)
    assert kernel == ("flash" if dtype == torch.bfloat16 and allowed is None else "efficient")
    out, lse = fused_block_forward(kernel, q, k, v, allowed, kind == "causal", 0.25)
    ref_out, ref_lse = block_attention(q, k, v, mask, 0.25)
    seen = torch.ones_like(ref_lse, dtype=torch.bool) if mask is None else mask.any(-1)[:, None].expand_as(ref_lse)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out[seen], ref_out[seen], atol=tol) and torch.allclose(lse[seen], ref_lse[seen], atol=tol)
    assert torch.isfinite(out).all() and (lse[~seen] < -1e29).all()
    final_lse = torch.where(seen, ref_lse, torch.zeros_like(ref_lse))  # a row's mass elsewhere
    grad = torch.randn(ref_out.shape, generator=gen)
    delta = (grad * ref_out).sum(-1)
    fused = fused_block_backward(kernel, q, k, v, allowed, kind == "causal", 0.25, grad, ref_out, final_lse)
    for got, want in zip(fused, block_backward_math(q, k, v, mask, 0.25, grad, final_lse, delta)):
        assert got.shape == want.shape and (got - want).norm() / want.norm() < (2e-2 if tol == 2e-2 else 1e-5)
