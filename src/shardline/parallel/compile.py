"""torch.compile per transformer block, plus the loss (`train.compile`).

Compiling block by block (torchtitan's way) instead of the whole model keeps every
layout working: each block is compiled in place (`nn.Module.compile`), so parameter
names, tensor-parallel hooks, the activation-checkpoint wrapper (traced as part of the
block), FSDP units (applied after, outside the compiled code) and pipeline stages (views
over the same blocks) stay as they are, and the blocks of one shape share one compiled
graph. The loss's cross-entropy is compiled too; the output projection runs eagerly.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shardline.models.loss import cross_entropy_sum


def apply_compile(model: nn.Module) -> None:
    """Compile each block of `model` in place, and its loss's scoring function."""
    for block in model.layers.values():
        block.compile()
    model.loss = dataclasses.replace(model.loss, score=torch.compile(cross_entropy_sum))
