"""Activation checkpointing: recompute activations in backward instead of storing them.

none:      store everything.
full:      every block keeps only its input; the whole block is recomputed.
selective: every `ac_every`-th block is fully checkpointed (trade memory for compute
           in steps of one block).
op:        every block, but the outputs of matmuls (the experts' grouped GEMMs too) and
           attention (SDPA's kernels, varlen, flex) are saved and only
           the cheap element-wise ops (norms, SiLU, RoPE) are recomputed: most of the
           memory saving of `full` at a fraction of its recompute (Korthikanti et al.).

The block's forward is replaced in place, so parameter names (and checkpoints) do
not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import shardline.models.attention  # noqa: F401  (registers torch_attn::_varlen_attn where torch has it)

# Looked up by name because the set of attention kernels differs between builds.
# _scaled_mm: the float8 matmuls of train.precision=fp8 (parallel/float8.py); _grouped_mm: the
# MoE experts' GEMMs (models/moe/layer.py). Any op not listed is recomputed, so a missing GEMM
# or attention kernel silently runs twice.
_SAVE_OP_NAMES = ("mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_flash_attention_for_cpu")
_SAVE_OPS = {getattr(torch.ops.aten, n).default for n in _SAVE_OP_NAMES if hasattr(torch.ops.aten, n)}
# train.attention = varlen: a custom op, registered by models/attention.py's import of its module
# (where this torch has it); flex: a higher-order op, which torch hands to the policy as itself.
_VARLEN = getattr(torch.ops.torch_attn, "_varlen_attn", None)
_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
_SAVE_OPS |= {op for op in (_VARLEN and _VARLEN.default, _FLEX) if op is not None}


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed(forward, context_fn=None):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    return run


def apply_ac(model: nn.Module, mode: str, every: int = 1) -> None:
    if mode == "none":
        return
    for i, block in enumerate(model.layers.values()):
        if mode == "selective" and i % every:
            continue
        context_fn = _op_level_context if mode == "op" else None
        block.forward = _checkpointed(block.forward, context_fn)
