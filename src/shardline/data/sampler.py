"""The layout-independent sampler.

For a seed and a global batch size, the global batch at step k is the same whatever
the number of ranks: the sample stream is a concatenation of seeded permutations of
the dataset (one per epoch), and step k takes items [k*G, (k+1)*G). Each rank takes
its contiguous slice, then splits it into micro-batches. The sampler holds no state
of its own beyond a cache: its position is the step, saved in every checkpoint.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    """`tag_passes`: each index carries its pass over the data (index + pass x num_samples), for
    a dataset that draws other sequences in each pass (a mixture's down-weighted sources)."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, tag_passes: bool = False):
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.tag_passes = tag_passes
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm

    def global_batch(self, index: int) -> np.ndarray:
        """Sample indices of global batch `index` (0-based; a step's is batch_index(step, skipped),
        which steps over the batches a run skipped)."""
        first = index * self.global_batch_size
        positions = np.arange(first, first + self.global_batch_size)
        out = np.empty(len(positions), dtype=np.int64)
        epochs = positions // self.num_samples
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[positions[sel] % self.num_samples]
            if self.tag_passes:
                out[sel] += int(epoch) * self.num_samples
        return out

    def rank_micro_batches(self, index: int, rank: int, ranks: int, micro_batch_size: int) -> list[np.ndarray]:
        """Data-parallel rank `rank`'s slice (of `ranks`: the dp degree, not the world) of global
        batch `index`, split into micro-batches."""
        per_rank = self.global_batch_size // ranks
        mine = self.global_batch(index)[rank * per_rank : (rank + 1) * per_rank]
        return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch_size / self.num_samples

    def state_dict(self, step: int) -> dict:
        return {"step": step, "seed": self.seed, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size}


def batch_index(step: int, skipped: list[int]) -> int:
    """Global batch index of 0-based optimizer step `step`, stepping over skipped batches."""
    index = step
    for s in sorted(skipped):
        if s <= index:
            index += 1
    return index


# Which held-out sequences an evaluation reads, as a checkpoint records it: "spread" over the split (each
# mixture source's share over its own); a checkpoint saved before 2026-12-08 records none (its first ones).
EVAL_ORDER = "spread"


def eval_sequences(val, asked: int) -> np.ndarray:
    """The held-out sequences an evaluation reads, in order: `asked` of the split `val`, spread evenly
    over it, or the whole split when it holds no more, each read once. The first `asked` in file
    order scored one end of the split alone (a corpus's first books, a folder's first domain);
    repeating a small split to make up the count weighted its first sequences twice, and an eval
    loss should be the mean over distinct held-out text. A mixture spreads each source's share over
    that source (MixedSequences.spread): an even spread over its interleaved blocks could land on
    one source alone (an A,B,A,B order at every second index)."""
    return val.spread(asked) if hasattr(val, "spread") else even_spread(len(val), asked)


def even_spread(size: int, asked: int) -> np.ndarray:
    """min(asked, size) indices of range(size) spread evenly over it, in order: floor(i x size / n)."""
    count = min(asked, size)
    return np.arange(count, dtype=np.int64) * size // max(count, 1)
