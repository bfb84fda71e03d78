"""Pack documents into fixed-length training sequences, keeping document boundaries.

All documents of a split are concatenated into one token stream (each followed by
the end-of-document token when the tokenizer has one); a parallel array records
which document every token came from. Sequence i is the window
stream[i*s : i*s + s + 1]: inputs are its first s tokens, labels the last s.
A label that belongs to another document than its input token is ignored (-100):
with document masking that prediction has no context to be made from.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100


class PackedSequences:
    def __init__(self, token_lists: list[list[int]], seq_len: int, eos_id: int | None):
        lengths = [len(t) + (eos_id is not None) for t in token_lists]
        self.tokens = np.empty(sum(lengths), dtype=np.int64)
        self.doc_ids = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        pos = 0
        for toks, n in zip(token_lists, lengths):
            self.tokens[pos : pos + len(toks)] = toks
            if eos_id is not None:
                self.tokens[pos + n - 1] = eos_id
            pos += n
        self.seq_len = seq_len
        # labelled[i] = how many of the first i positions predict a token of their own
        # document; a window's label count is then a difference of two entries.
        self._labelled = np.concatenate([[0], np.cumsum(self.doc_ids[1:] == self.doc_ids[:-1])])

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def count_labels(self, indices) -> int:
        """Labelled (not ignored) tokens in the given sequences, without building them."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        return int((self._labelled[starts + self.seq_len] - self._labelled[starts]).sum())

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """Stack sequences: input_ids, labels and doc_ids, each [len(indices), seq_len]."""
        s = self.seq_len
        starts = np.asarray(indices, dtype=np.int64)[:, None] * s
        window = starts + np.arange(s + 1)
        toks, docs = self.tokens[window], self.doc_ids[window]
        labels = np.where(docs[:, 1:] == docs[:, :-1], toks[:, 1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(toks[:, :-1].copy()),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(docs[:, :-1].copy()),
        }
