"""Pack documents into fixed-length training sequences, keeping document boundaries.

All documents of a split are concatenated into one token stream (each followed by
the end-of-document token when the tokenizer has one); `doc_starts` records where
each document begins, so the document of any token is a binary search away. Sequence
i is the window stream[i*s : i*s + s + 1]: inputs are its first s tokens, labels the
last s. A label that belongs to another document than its input token is ignored
(-100): with document masking that prediction has no context to be made from.

Chat data adds a loss mask (1 = this token is a target, e.g. an assistant's reply);
a label whose token is not a target is ignored too. The mask travels with the tokens,
so packing and sampling never separate a token from its mask. A reply is learned from
the conversation before it, so chat sequences hold whole conversations: each row packs
the next conversations that fit its s + 1 tokens, in stream order, and fills the rest
with the stream that follows (the next row's opening, read twice: documents of their own,
no labels), not padding, so that every position holds real text (an MoE router sees the
data's tokens there, not a run of one pad token; a row at the stream's very end is padded
with token 0). A conversation longer than that is a row of its own, cut there; what is
cut off is not trained on (`truncated` counts them), since without its opening a reply
would be learned with no prompt.

The stream can be a numpy array (raw text, tokenized at start-up) or memory-mapped
shards of a prepared folder (`TokenShards`): a batch reads only its own windows.
"""

from __future__ import annotations

import numpy as np
import torch

from shardline.errors import DataError
from shardline.models.loss import IGNORE_INDEX  # the label the loss skips: one value for both sides


class PackedSequences:
    def __init__(self, token_lists: list[list[int]], seq_len: int, eos_id: int | None,
                 masks: list[list[int]] | None = None):
        tokens, starts, mask = pack_lists(token_lists, eos_id, masks)
        self._init(tokens, starts, seq_len, mask)

    @classmethod
    def from_stream(cls, tokens, doc_starts: np.ndarray, seq_len: int, mask=None) -> "PackedSequences":
        """Sequences over an existing stream (an array or `TokenShards`) and its document starts."""
        self = cls.__new__(cls)
        self._init(tokens, doc_starts, seq_len, mask)
        return self

    def _init(self, tokens, doc_starts, seq_len: int, mask) -> None:
        self.tokens, self.doc_starts, self.mask, self.seq_len = tokens, doc_starts, mask, seq_len
        # Chat: whole conversations a row (module doc); text: the stream cut every seq_len tokens.
        self.rows = whole_rows(doc_starts, len(tokens), seq_len + 1) if mask is not None else None
        self.fingerprint: str | None = None  # of the token stream (shards.token_fingerprint), where known
        self.id_bound: int | None = None  # a prepared folder's: one past its tokenizer's largest id (batch checks)
        self.where = ""  # the folder, for that error

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts)

    def __len__(self) -> int:
        if self.rows is not None:
            return len(self.rows.starts)
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def spans(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(first stream position, tokens) of each sequence: s + 1 tokens from i * s, or a chat row's."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.rows is not None:
            return self.rows.starts[indices], self.rows.lengths[indices]
        return indices * self.seq_len, np.full(len(indices), self.seq_len + 1, dtype=np.int64)

    def count_labels(self, indices) -> int:
        """Labelled (not ignored) tokens in the given sequences, without building them.

        Without a mask: s minus the document starts inside (start, start + s]. With one,
        the first token of a document is never a target (see `pack_lists`), so the mask
        alone counts (a chat row's own tokens: its fill has none).
        """
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        if self.mask is not None:
            starts, lengths = self.spans(indices)
            return int(sum(_take(self.mask, np.array([a + 1]), int(n) - 1).sum() for a, n in zip(starts, lengths)))
        inside = (np.searchsorted(self.doc_starts, starts + self.seq_len, side="right")
                  - np.searchsorted(self.doc_starts, starts, side="right"))
        return int(len(starts) * self.seq_len - inside.sum())

    def doc_ids(self, positions: np.ndarray) -> np.ndarray:
        """The document (0-based, in stream order) of each token position."""
        return np.searchsorted(self.doc_starts, positions, side="right") - 1

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """Stack sequences: input_ids, labels and doc_ids, each [len(indices), seq_len]."""
        s = self.seq_len
        starts, lengths = self.spans(indices)
        held = np.minimum(s + 1, self.num_tokens - starts)  # a chat row reads on into what follows (module doc)
        toks = _take_rows(self.tokens, starts, held, s + 1).astype(np.int64)
        if self.id_bound is not None and toks.size and int(toks.max()) >= self.id_bound:  # (the embedding's IndexError)
            raise DataError(f"{self.where} holds token id {int(toks.max())}, past its tokenizer's {self.id_bound - 1}: "
                            f"its shards are damaged; `shardline prepare --verify --out {self.where}` names them")
        column = np.arange(s + 1)
        # Past the stream's end (a last row): the document after the last, an id of its own in the row.
        docs = self.doc_ids(np.minimum(starts[:, None] + column, self.num_tokens - 1)) + (column >= held[:, None])
        keep = (docs[:, 1:] == docs[:, :-1]) & (column[1:] < lengths[:, None])  # a row's own conversations only
        if self.mask is not None:
            keep &= _take_rows(self.mask, starts, held, s + 1)[:, 1:].astype(bool)
        labels = np.where(keep, toks[:, 1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(toks[:, :-1].copy()),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(docs[:, :-1].copy()),
        }


def _take(stream, starts: np.ndarray, length: int) -> np.ndarray:
    """Rows stream[start : start + length] for each start, from an array or `TokenShards`."""
    if isinstance(stream, np.ndarray):
        return stream[starts[:, None] + np.arange(length)]
    return stream.windows(starts, length)


def _take_rows(stream, starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """`_take` of `width` tokens a row where every row is that long (text), else each row's own
    tokens and zeros after them (chat rows: the stream may end before a last row's width)."""
    if (lengths == width).all():
        return _take(stream, starts, width)
    out = np.zeros((len(starts), width), dtype=stream.dtype)
    for row, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        out[row, :n] = _take(stream, np.array([start]), n)[0]
    return out


class Rows:
    """Chat rows (whole_rows): where each starts in the stream, how many tokens it holds, and how
    many conversations were cut to fit one."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, truncated: int):
        self.starts, self.lengths, self.truncated = starts, lengths, truncated


def whole_rows(doc_starts: np.ndarray, total: int, width: int) -> Rows:
    """Rows of up to `width` tokens holding whole documents, packed in stream order: a row takes
    the next document while it fits, else the next row starts with it; a document longer than a
    row is a row of its own, cut (module doc). One pass over the documents (about a second for
    a few million conversations)."""
    sizes = np.diff(np.append(np.asarray(doc_starts, dtype=np.int64), total)).tolist()
    starts, lengths, truncated = [], [], 0
    start, held = 0, 0
    for first, size in zip(np.asarray(doc_starts, dtype=np.int64).tolist(), sizes):
        if held and held + size > width:
            starts.append(start), lengths.append(held)
            held = 0
        if size >= width:
            starts.append(first), lengths.append(width)
            truncated += size > width
            continue
        start, held = (first, size) if not held else (start, held + size)
    if held:
        starts.append(start), lengths.append(held)
    return Rows(np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64), truncated)


def pack_lists(token_lists: list[list[int]], eos_id: int | None, masks: list[list[int]] | None = None):
    """(tokens, doc_starts, mask or None) of documents concatenated, each closed by eos.

    The eos of a masked document is a target when its last token is (the model learns
    to stop after a reply); a document's first token never is (it has no context). An
    empty document is dropped, as encode.encode_documents drops one: it holds nothing to
    train on, and without an eos it would start where the next one does.
    """
    keep = [i for i, toks in enumerate(token_lists) if len(toks)]
    token_lists = [token_lists[i] for i in keep]
    masks = None if masks is None else [masks[i] for i in keep]
    lengths = np.array([len(t) + (eos_id is not None) for t in token_lists], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=np.int64)
    mask = None if masks is None else np.zeros(len(tokens), dtype=np.uint8)
    for i, (toks, pos) in enumerate(zip(token_lists, starts)):
        tokens[pos : pos + len(toks)] = toks
        if eos_id is not None:
            tokens[pos + len(toks)] = eos_id
        if mask is not None:
            m = list(masks[i]) + ([masks[i][-1] if masks[i] else 0] if eos_id is not None else [])
            mask[pos : pos + len(m)] = m
            mask[pos] = 0
    return tokens, starts, mask
