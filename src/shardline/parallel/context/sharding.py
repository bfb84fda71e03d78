"""Which tokens of a sequence each context-parallel rank holds.

The cp ranks form a ring_degree x ulysses_degree grid (cp rank = ring index x U +
ulysses index, so the all-to-all of Ulysses stays between neighbouring ranks). The
sequence is first cut into ring_degree ring shards, then each ring shard into U
contiguous pieces, one per rank of its Ulysses group: after Ulysses' all-to-all a
group holds its whole ring shard (for a share of the heads), and the ring passes
whole ring shards around.

Causal attention makes late tokens dearer than early ones (they see more keys).
With balance "zigzag" ring shard i is chunks i and 2R-1-i of 2R equal chunks, so
every ring shard does the same work; with "none" it is the i-th contiguous R-th, and
the last shard does R blocks of work where the first does one. Counted in the chunk
pairs the ring computes (ring.py skips pairs wholly in the future): 2R + 1 on every
rank under zigzag, 4R on the slowest under none (1.6x at R=2, 1.78x at R=4).

Positions (RoPE) and document ids follow the tokens: every rank computes any rank's
positions from this arithmetic, so the layout of the data never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSplit:
    seq_len: int
    ring: int  # R: ranks that pass K/V around
    ulysses: int  # U: ranks that exchange heads by all-to-all
    balance: str = "zigzag"

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    def ring_shard(self, i: int) -> torch.Tensor:
        """Global positions of ring shard i (length seq_len / R), in the order they are held."""
        if self.balance == "zigzag" and self.ring > 1:
            chunk = self.seq_len // (2 * self.ring)
            first, second = i, 2 * self.ring - 1 - i
            return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                              torch.arange(second * chunk, (second + 1) * chunk)])
        size = self.seq_len // self.ring
        return torch.arange(i * size, (i + 1) * size)

    def positions(self, cp_rank: int) -> torch.Tensor:
        """Global positions of the tokens cp rank `cp_rank` holds (length seq_len / cp)."""
        ring_index, piece = divmod(cp_rank, self.ulysses)
        size = self.seq_len // self.cp
        return self.ring_shard(ring_index)[piece * size:(piece + 1) * size]


def shard_batch(batch: dict[str, torch.Tensor], positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's tokens of a [batch, seq] batch (every field), plus their global positions
    (given on the batch's device, nothing is copied: a copy from the host waits for the GPU)."""
    on: dict[torch.device, torch.Tensor] = {}  # the positions copied once to each other device
    out = {}
    for k, v in batch.items():
        if v.device not in on:
            on[v.device] = positions.to(v.device)
        out[k] = v[:, on[v.device]]
    out["positions"] = positions
    return out
