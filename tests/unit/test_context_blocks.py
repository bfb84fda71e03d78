"""The ring's block kernels: the math path (kept for head dims and dtypes the GPU kernels do not take)
equals the fused CPU flash kernel, forward and backward, for every kind of block."""

from __future__ import annotations

import pytest
import torch

from shardline.parallel.context.blocks import block_attention, block_backward, block_backward_math, block_forward
from shardline.parallel.context.ring import merge
from shardline.parallel.context.sharding import SequenceSplit


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 8, 16, generator=gen) for h in (4, 2, 2))
    docs = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    return q, k, v, docs


@pytest.mark.parametrize("kind", ["full", "causal", "mask"])
def test_math_path_equals_the_fused_kernel(kind):
    q, k, v, docs = _inputs()
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None]
    allowed = {"full": None, "causal": None, "mask": causal & (docs[:, :, None] == docs[:, None, :])}[kind]
    fused_out, fused_lse = block_forward(q, k, v, allowed, kind == "causal", 0.25)
    math_out, math_lse = block_attention(q, k, v, causal if kind == "causal" else allowed, 0.25)
    assert torch.allclose(fused_out, math_out, atol=1e-5) and torch.allclose(fused_lse, math_lse, atol=1e-5)
    grad = torch.randn(fused_out.shape, generator=torch.Generator().manual_seed(1))
    delta = (grad * fused_out).sum(-1)
    fused = block_backward(q, k, v, allowed, kind == "causal", 0.25, grad, fused_out, fused_lse, delta)
    math = block_backward_math(q, k, v, causal if kind == "causal" else allowed, 0.25, grad, fused_lse, delta)
    for a, b in zip(fused, math):
        assert torch.allclose(a, b, atol=1e-5)


def test_two_blocks_merged_equal_one_attention():
    q, k, v, _ = _inputs()
    whole, lse = block_attention(q, k, v, None, 0.25)
    a, la = block_attention(q, k[:, :, :3], v[:, :, :3], None, 0.25)
    b, lb = block_attention(q, k[:, :, 3:], v[:, :, 3:], None, 0.25)
    merged, merged_lse = merge(a, la, b, lb)
    assert torch.allclose(merged, whole, atol=1e-6) and torch.allclose(merged_lse, lse, atol=1e-6)


def test_zigzag_shards_cover_the_sequence_once_and_balance_the_work():
    split = SequenceSplit(32, ring=4, ulysses=1, balance="zigzag")
    held = torch.cat([split.positions(r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(32))
    assert split.positions(0).tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    work = [int((split.ring_shard(i) + 1).sum()) for i in range(4)]  # keys each shard's queries see
    assert len(set(work)) == 1
    hybrid = SequenceSplit(32, ring=2, ulysses=2, balance="zigzag")
    assert torch.equal(torch.cat([hybrid.positions(0), hybrid.positions(1)]), hybrid.ring_shard(0))


def test_a_ring_pair_inside_one_document_runs_without_a_document_mask():
    """With packed documents, a pair of runs whose queries and keys are all of one document (in
    every sequence) needs only the causal mask: FULL or CAUSAL, which a GPU runs on the flash
    kernel; a pair across a document boundary stays MASK, one sharing no document is skipped."""
    from types import SimpleNamespace

    from shardline.parallel.context.ring import CAUSAL, FULL, MASK, RingPlan

    split = SequenceSplit(16, ring=2, ulysses=1, balance="zigzag")  # rank 0: tokens 0-3, 12-15; rank 1: 4-11
    shards = [split.ring_shard(i) for i in range(2)]

    def kinds(docs: list[list[int]], rank: int) -> list[list[str]]:
        kv_doc = [torch.tensor(docs)[:, s] for s in shards]
        plan = RingPlan(SimpleNamespace(rank=rank, size=2), shards[rank], shards, kv_doc[rank], kv_doc, None)
        return [[kind for _, _, kind in plan.pairs(step)] for step in range(2)]

    at_a_chunk_edge = [[0] * 4 + [1] * 12]  # documents 0-3 and 4-15
    assert kinds(at_a_chunk_edge, 0) == [[CAUSAL, CAUSAL], [FULL]]  # 12-15 on 0-3: no shared document
    assert kinds(at_a_chunk_edge, 1) == [[CAUSAL], []]
    inside_a_chunk = [[0] * 6 + [1] * 10, [2] * 16]  # a boundary inside rank 1's tokens; one document
    assert kinds(inside_a_chunk, 0) == [[CAUSAL, MASK, CAUSAL], [MASK]]
    assert kinds(inside_a_chunk, 1) == [[MASK], [MASK]]
