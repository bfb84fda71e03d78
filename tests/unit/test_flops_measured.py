"""models/flops.py against an independent count: torch's FlopCounterMode around one training step.

flops_per_token (the MFU numerator, trainer and planner) claims 6 N + 12 L d s per token:
N the matmul parameters (no embedding lookup, the output projection once, tied or not; in an
MoE the router, top_k routed experts and the shared ones), d = n_heads x head_dim. Here the
model's own forward (loss included, as the trainer's loss_sum computes it) and backward run
under FlopCounterMode, which counts matmul FLOPs from the ops' shapes (dtype-independent),
and the count is split by sequence length: measured(s) = a + b s, so a must be 6 N and b 12 L d.

Conventions made explicit (they are choices, not measurement error):
- PaLM's count: every attention score, no causal half. Attention runs on SDPA's math backend,
  which forms the full s x s scores (and masks them), whatever the mask: causal, or a document
  mask. The CPU flash kernel the model uses by default skips blocks, and FlopCounterMode has no
  formula for it (aten._scaled_dot_product_flash_attention_for_cpu, torch 2.13): it would count 0.
- The routed experts run as the per-expert loop of F.linear (the reference loop_experts):
  FlopCounterMode has no formula for aten._grouped_mm either. Dropless routing: each token's
  top_k slots go through exactly one SwiGLU each.
- Element-wise work (norms, rotary, SiLU, softmax, cross-entropy, the balance loss) and the
  embedding's lookup and gradient scatter are not matmuls: neither side counts them.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import shardline.models.moe.layer as moe_layer
from shardline.models.factory import build_model_on
from shardline.models.flops import flops_per_token, matmul_params, num_params
from shardline.models.llama import ModelArgs
from shardline.models.moe import MoEArgs

BATCH = 2
SEQS = (32, 64)
DENSE = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128, max_seq_len=64)
MOE = dataclasses.replace(DENSE, moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1,
                                             first_dense_layers=1, aux_loss_coef=0.01))

SHAPES = {
    "untied_gqa": DENSE,
    "tied_gqa": dataclasses.replace(DENSE, tie_embeddings=True),
    "mha": dataclasses.replace(DENSE, n_kv_heads=None),
    "head_dim_32": dataclasses.replace(DENSE, head_dim=32),  # 4 x 32 = 128 attention width, dim 64
    "qk_norm_qkv_bias": dataclasses.replace(DENSE, qk_norm=True, qkv_bias=True),
    "moe_top2_of_8": MOE,
    "moe_tied": dataclasses.replace(MOE, tie_embeddings=True),
}


def measured_flops(args: ModelArgs, seq: int, document_mask: bool = False) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs per token of one step of shardline's model."""
    torch.manual_seed(0)
    model = build_model_on(args, "cpu")
    model.init_weights(seed=0)
    model.train()
    for layer in moe_layer.moe_layers(model):
        layer.aux_grad_scale.fill_(1.0)  # the balance loss on, as the trainer sets it
    ids = torch.randint(0, args.vocab_size, (BATCH, seq))
    labels = torch.randint(0, args.vocab_size, (BATCH, seq))
    doc_ids = (torch.arange(seq) * 3 // seq).expand(BATCH, seq).contiguous() if document_mask else None
    counter = FlopCounterMode(display=False)
    with mock.patch.object(moe_layer, "grouped_mm_usable", lambda x: False), sdpa_kernel([SDPBackend.MATH]):
        with counter:
            loss = model(ids, doc_ids, labels=labels)
            forward = counter.get_total_flops()
            loss.backward()
        total = counter.get_total_flops()
    return forward / (BATCH * seq), total / (BATCH * seq)


def attention_width(args: ModelArgs) -> int:
    return args.n_heads * (args.head_dim or args.dim // args.n_heads)


def active_matmul_params(model: torch.nn.Module, args: ModelArgs) -> int:
    """N read off the built model: each distinct 2-D weight once (a tied output is the
    embedding's tensor), less the embedding lookup unless the output reuses it; an MoE layer's
    routed experts scaled to the top_k a token goes through."""
    seen, n = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() < 2 or id(p) in seen:
            continue
        seen.add(id(p))
        if name == "tok_embeddings.weight" and not args.tie_embeddings:
            continue  # a lookup, not a matmul (untied: the output has its own weight)
        if ".experts." in name:
            n += p.numel() * args.moe.top_k // args.moe.n_experts
        else:
            n += p.numel()
    return n


@pytest.mark.parametrize("name", list(SHAPES))
def test_flops_per_token_matches_flop_counter(name):
    args = SHAPES[name]
    (f1, t1), (f2, t2) = (measured_flops(args, s) for s in SEQS)
    s1, s2 = SEQS
    per_seq = (t2 - t1) / (s2 - s1)  # attention: linear in s
    fixed = t1 - per_seq * s1  # the matmuls of the parameters: independent of s
    n = matmul_params(args)
    # 6 N: forward 2 N, backward 4 N (input and weight gradients), N without the embedding lookup.
    assert fixed == 6 * n, (fixed / 6, n)
    # 12 L d s: QK^T and PV, 2 x 2 s d a layer forward, twice that backward, every score (PaLM).
    assert per_seq == 12 * args.n_layers * attention_width(args), (per_seq, attention_width(args))
    for s, total in zip(SEQS, (t1, t2)):
        assert total == flops_per_token(args, s)
    # Backward is exactly twice forward, for the parameters' matmuls and for attention.
    assert t1 == 3 * f1 and t2 == 3 * f2


@pytest.mark.parametrize("name", ["untied_gqa", "tied_gqa", "head_dim_32", "moe_top2_of_8", "moe_tied"])
def test_matmul_params_is_the_built_models(name):
    """N from the formula equals N read off the module (tied output once, lookup out, top_k experts)."""
    args = SHAPES[name]
    model = build_model_on(args, "meta")
    assert matmul_params(args) == active_matmul_params(model, args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())  # parameters() dedups a tie


@pytest.mark.parametrize("name", ["untied_gqa", "moe_top2_of_8"])
def test_document_mask_counts_every_score(name):
    """With a document mask the count is the same: the model FLOPs count every score of the
    sequence (a kernel that skips the scores across documents makes MFU read high: README)."""
    args = SHAPES[name]
    _, total = measured_flops(args, SEQS[0], document_mask=True)
    assert total == flops_per_token(args, SEQS[0])

