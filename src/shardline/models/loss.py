"""The language-model loss: output projection + summed cross-entropy, whole or in chunks.

At a 128k vocabulary the fp32 logits of one micro-batch dwarf everything else a step
holds (seq 4096 x batch 4 x 128256 x 4 bytes = 8 GiB, and softmax keeps another copy for
backward). `LinearCrossEntropy(chunk_tokens=n)` projects and scores `n` tokens at a
time under activation checkpointing: forward keeps only each chunk's loss, backward
recomputes one chunk's logits at a time, and the output weight's gradient adds up over
the chunks through autograd. The peak is then a chunk's logits, not the batch's.

The head is called as a module, so whatever a parallel plan installed on it still
applies: under tensor parallelism with loss parallelism each chunk's logits stay
vocab-sharded and the cross-entropy reduces over the vocabulary shards (that needs the
`loss_parallel` context around forward and backward, as the unchunked loss does).
Nothing here knows about process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # labels the loss skips (the data layer pads and masks with it)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over labelled tokens, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@dataclass(frozen=True)
class LinearCrossEntropy:
    """Summed fp32 cross-entropy of `head(hidden)` against labels; 0 chunk tokens = all at once.

    `score(logits, labels)` turns logits into the summed loss (a compiled plan passes a
    compiled cross_entropy_sum)."""

    chunk_tokens: int = 0
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum

    def __call__(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        if self.chunk_tokens <= 0:
            return self.score(head(hidden), labels)
        return chunked_cross_entropy_sum(hidden, head, labels, self.chunk_tokens, self.score)


def chunked_cross_entropy_sum(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk_tokens: int,
                              score: Callable = cross_entropy_sum) -> torch.Tensor:
    """cross_entropy_sum(head(hidden), labels), `chunk_tokens` tokens at a time.

    hidden [..., dim], labels [...]. Each chunk runs under non-reentrant checkpointing,
    which saves only its inputs (a slice of hidden, the head's weight), so no chunk's
    logits outlive its own forward or its own recomputation in backward. `split` (not
    slicing) makes autograd join the chunks' input gradients with one concatenation.
    """
    tokens, targets = _whole(hidden).flatten(0, -2), labels.flatten()
    total = None
    for h, y in zip(tokens.split(chunk_tokens), targets.split(chunk_tokens)):
        part = checkpoint(_chunk_loss, h, head, y, score, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total


def _whole(hidden: torch.Tensor) -> torch.Tensor:
    """A sequence-sharded DTensor (tensor parallelism's sequence parallel) gathered once, as
    the head would gather each chunk. Its tokens cannot be flattened while sharded (torch
    2.11 refuses the view), and one gather costs less than one per chunk."""
    if isinstance(hidden, DTensor) and any(p.is_shard() for p in hidden.placements):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    return hidden


def _chunk_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, score: Callable) -> torch.Tensor:
    return score(head(hidden), labels)
