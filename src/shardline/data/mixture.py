"""A weighted mixture of data sources, seen by the sampler as one dataset.

The mixture has as many sequences as its sources together (N); source k owns a block
of n_k = weight_k / sum(weights) x N of them (largest remainder, at least one). The
layout-independent sampler permutes the mixture's indices as it does a single dataset's,
so each global batch draws sources in proportion to the weights, and the mixture is
deterministic and resumable by the step alone, with no state of its own.

Which of its len_k sequences a source's block holds moves with the pass over the mixture
(the sampler tags each index with its pass e). Down-weighted (n_k <= len_k), sequence j
of the block is the source's (j x len_k // n_k + e) mod len_k: an even spread over all
of it, shifted by one each pass, so all of it is seen within ceil(len_k / n_k) passes
(a fixed part would leave the rest unseen however long the run). Up-weighted, it is
(e x n_k + j) mod len_k: every sequence equally often, the remainder rotating.

`interleave` orders the blocks so that every prefix holds the sources in proportion (the
held-out mixture's). An evaluation reads `spread`: each source's share of the sequences asked,
spread over that source's block.
"""

from __future__ import annotations

import numpy as np
import torch

from shardline.data.packing import PackedSequences
from shardline.data.sampler import even_spread


class MixedSequences:
    def __init__(self, sources: list[PackedSequences], weights: list[float] | None, interleave: bool = False):
        """`weights` None: each source's sequences once (a held-out mixture's blocks, exactly its sizes)."""
        self.sources, self.seq_len = sources, sources[0].seq_len
        sizes = np.array([len(s) for s in sources], dtype=np.int64)
        # A source with no sequences has no block (a held-out mixture of data.val_fraction=0 had one of a
        # sequence each: two held-out sequences said, an index error where read)
        live, self.counts = sizes > 0, np.zeros(len(sources), dtype=np.int64)
        if weights is None:
            self.counts = sizes.copy()
        elif live.any():
            self.counts[live] = _apportion(np.asarray(weights, dtype=np.float64)[live], int(sizes.sum()))
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self._order = _interleaved(self.counts) if interleave else None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of each mixture index (tagged with its pass, or not)."""
        passes, v = np.divmod(np.asarray(indices, dtype=np.int64), len(self))
        if self._order is not None:
            v = self._order[v]
        src = np.searchsorted(self.offsets, v, side="right") - 1
        j = v - self.offsets[src]
        n, size = self.counts[src], np.maximum(self.sizes[src], 1)
        return src, np.where(n <= size, (j * size // np.maximum(n, 1) + passes) % size, (passes * n + j) % size)

    def count_labels(self, indices) -> int:
        src, local = self.locate(indices)
        return sum(self.sources[k].count_labels(local[src == k]) for k in np.unique(src))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """The sources' batches of these indices, rows back in the order asked."""
        src, local = self.locate(indices)
        if len(src) == 0:
            return self.sources[0].batch(local)
        parts = {int(k): self.sources[k].batch(local[src == k]) for k in np.unique(src)}
        out = {}
        for key in next(iter(parts.values())):
            rows = torch.empty((len(src), self.seq_len), dtype=torch.int64)
            for k, part in parts.items():
                rows[torch.from_numpy(np.flatnonzero(src == k))] = part[key]
            out[key] = rows
        return out

    def spread(self, asked: int) -> np.ndarray:
        """About min(asked, len) mixture indices, in order: each source's share of them by its block's size
        (largest remainder, at least one each: a few more than asked where the sources outnumber them),
        spread evenly over its block (an even spread over all the indices could land on one source
        alone: A,B,A,B at every second index)."""
        count, live = min(asked, len(self)), self.counts > 0
        # (not _apportion, whose ranking a training mixture's saved counts keep: there a one-sequence source's
        # 0.9999... share, raised to 1, still ranks first for the remainder, and would be read twice)
        exact = self.counts * count / max(int(self.counts.sum()), 1)  # (multiplied first: 1 x 2949 / 2949 is 1)
        shares = np.where(live, np.maximum(np.floor(exact), 1), 0).astype(np.int64)  # (at least one a source:
        left = np.flatnonzero(shares < self.counts)[np.argsort(-(exact - shares)[shares < self.counts],  # each
                                                               kind="stable")]  # one's loss is logged)
        shares[left[:max(count - int(shares.sum()), 0)]] += 1  # (the largest remainders after that floor)
        shares = np.minimum(shares, self.counts)
        blocks = np.concatenate([self.offsets[k] + even_spread(int(n), int(m)) for k, (n, m) in
                                 enumerate(zip(self.counts, shares))]) if count else np.zeros(0, dtype=np.int64)
        return np.sort(blocks if self._order is None else np.argsort(self._order)[blocks])

    def by_source(self, indices) -> list[tuple[int, np.ndarray]]:
        """(source, the indices of `indices` it holds, in order) for each source holding any."""
        indices = np.asarray(indices, dtype=np.int64)
        src = self.locate(indices)[0]
        return [(int(k), indices[src == k]) for k in np.unique(src)]

    def sequences_per_source(self, indices) -> np.ndarray:
        return np.bincount(self.locate(indices)[0], minlength=len(self.sources))


def _apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder shares of `total` in proportion to weights, each at least 1."""
    exact = weights / weights.sum() * total
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(exact - np.floor(exact)), kind="stable")[:short]] += 1
    return counts


def _interleaved(counts: np.ndarray) -> np.ndarray:
    """Block positions ordered so every prefix mixes the sources in proportion."""
    keys = np.concatenate([(np.arange(n) + 0.5) / n for n in counts])
    return np.argsort(keys, kind="stable").astype(np.int64)
