"""The context-parallel attention core: Ulysses, then the ring, then Ulysses back.

`ContextParallel` is what parallelize installs into a model: `mask` replaces the
model's attention mask (it gathers the document ids of the whole sequence once per
forward, so any block's mask can be built locally), `attend` replaces each layer's
attention core. Modes: ring (U = 1), ulysses (R = 1: after the all-to-all the whole
sequence is local and a local core runs on it, fused kernels included), and
hybrid (R x U, USP / LoongTrain's 2-D attention: heads over the U ranks of a group,
K/V blocks around the R groups). Under Ulysses alone the local core is the kernel
`train.attention` resolves to (models/attention.py: dense-mask SDPA, flex or varlen),
given the whole sequence's document ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline.models.attention import DenseAttention
from shardline.parallel.context.ring import Ring, RingPlan, ring_attention
from shardline.parallel.context.sharding import SequenceSplit
from shardline.parallel.context.ulysses import heads_to_seq, kv_for_ulysses, seq_to_heads


@dataclass
class SequenceMask:
    """What the cp attention core needs, made once per forward for every layer: the whole
    sequence's document ids [b, s] in global order (None: one document per sequence), and
    under a ring the plan of its blocks."""

    doc_ids: torch.Tensor | None
    ring_plan: RingPlan | None = None  # under a ring: which blocks to compute, how masked
    local: object = None  # Ulysses alone: the local core's mask of the whole sequence


class ContextParallel:
    def __init__(self, split: SequenceSplit, cp_group: dist.ProcessGroup, ring_group: dist.ProcessGroup | None,
                 ulysses_group: dist.ProcessGroup | None, local=None):
        """local: the core that runs on the whole sequence under Ulysses alone (an object with
        `mask(doc_ids)` and `attend(q, k, v, mask)`; default dense-mask SDPA)."""
        self.split, self.cp_group, self.ulysses_group = split, cp_group, ulysses_group
        self.local = local or DenseAttention()
        self.cp_rank = dist.get_rank(cp_group)
        self.ring = Ring(ring_group) if split.ring > 1 else None
        self.ring_index = self.cp_rank // split.ulysses
        self._shards = [split.ring_shard(i) for i in range(split.ring)]  # host positions of each ring shard
        self._on_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def local_positions(self, device: torch.device | None = None) -> torch.Tensor:
        """This rank's tokens' global positions; on `device`, the copy held there (see _positions_on)."""
        return self.split.positions(self.cp_rank) if device is None else self._positions_on(device)[1][self.cp_rank]

    def mask(self, doc_ids: torch.Tensor | None) -> SequenceMask:
        """Replaces Llama.attention_mask (doc_ids: this rank's tokens'): the whole sequence's
        document ids, and the ring's plan."""
        full = self._gather(doc_ids) if doc_ids is not None else None
        if self.ring is None:  # after the all-to-all the whole sequence is local, in order
            return SequenceMask(full, local=self.local.mask(full))
        mine = self._shards[self.ring_index]
        if full is None:
            return SequenceMask(None, RingPlan(self.ring, mine, self._shards, None, None, None))
        shards, _ = self._positions_on(full.device)
        kv_doc = [full[:, s] for s in shards]
        plan = RingPlan(self.ring, mine, self._shards, kv_doc[self.ring_index], kv_doc, full.device,
                        on_device=(shards[self.ring_index], shards))
        return SequenceMask(full, plan)

    def _positions_on(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ring shards' and the cp ranks' positions on `device`, copied there once: a copy from
        host memory waits for the device's queue to drain, and one per forward, layer or masked
        block would stop the host from running ahead of the kernels."""
        if device not in self._on_device:
            self._on_device[device] = ([s.to(device) for s in self._shards],
                                       [self.split.positions(r).to(device) for r in range(self.split.cp)])
        return self._on_device[device]

    def _gather(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """Every cp rank's document ids put back in sequence order (a few KB per forward)."""
        parts = [torch.empty_like(doc_ids) for _ in range(self.split.cp)]
        dist.all_gather(parts, doc_ids.contiguous(), group=self.cp_group)
        full = torch.empty(doc_ids.shape[0], self.split.seq_len, dtype=doc_ids.dtype, device=doc_ids.device)
        _, ranks = self._positions_on(full.device)
        for rank, part in enumerate(parts):
            full[:, ranks[rank]] = part
        return full

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SequenceMask) -> torch.Tensor:
        """Replaces Attention.core: q [b, h, s/cp, d], k/v [b, hk, s/cp, d] of this rank's tokens."""
        u = self.split.ulysses
        if u > 1:
            k, v = kv_for_ulysses(k, v, q.shape[1], u)
            q, k, v = (seq_to_heads(t, self.ulysses_group) for t in (q, k, v))
        if self.ring is None:  # the whole sequence is here, in order
            out = self.local.attend(q, k, v, mask.local)
        else:
            out = ring_attention(q, k, v, self.ring, mask.ring_plan, 1.0 / math.sqrt(q.shape[-1]))
        return heads_to_seq(out, self.ulysses_group) if u > 1 else out
