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
the conversation before it, so chat sequences hold whole conversations, packed best-fit
(`pack_rows`: longest first, each into the row it fills most closely; next-fit in
stream order left 12-22% of the positions unused on realistic length mixes). A row
lays its conversations out in stream order and fills the rest with the stream that
follows its last one (documents of their own, no labels), not padding, so that every
position holds real text (an MoE router sees the data's tokens there, not a run of one
pad token; a row at the stream's very end is padded with token 0); document ids rise
along a row, as the attention kernels' block masks need. A conversation longer than a
row is a row of its own, cut there; what is cut off is not trained on (`truncated`
counts them), since without its opening a reply would be learned with no prompt.

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
        self.rows = pack_rows(doc_starts, len(tokens), seq_len + 1) if mask is not None else None
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
            return len(self.rows.lengths)
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def count_labels(self, indices) -> int:
        """Labelled (not ignored) tokens in the given sequences, without building them.

        Without a mask: s minus the document starts inside (start, start + s]. With one,
        the first token of a document is never a target (see `pack_lists`), so the mask
        over a chat row's conversations alone counts (its fill has none).
        """
        if self.mask is not None:
            return int(_gather(self.mask, self.rows.positions(indices)).sum())
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        inside = (np.searchsorted(self.doc_starts, starts + self.seq_len, side="right")
                  - np.searchsorted(self.doc_starts, starts, side="right"))
        return int(len(starts) * self.seq_len - inside.sum())

    def doc_ids(self, positions: np.ndarray) -> np.ndarray:
        """The document (0-based, in stream order) of each token position."""
        return np.searchsorted(self.doc_starts, positions, side="right") - 1

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """Stack sequences: input_ids, labels and doc_ids, each [len(indices), seq_len]."""
        s, indices = self.seq_len, np.asarray(indices, dtype=np.int64)
        if self.rows is None:  # text: s + 1 tokens from i * s
            positions, held = indices[:, None] * s + np.arange(s + 1), np.full(len(indices), s + 1)
            toks = _take(self.tokens, indices * s, s + 1).astype(np.int64)
        else:  # chat: a row's conversations, then the stream after its last one (module doc)
            positions, held = self.rows.laid_out(indices, s + 1), self.rows.lengths[indices]
            toks = np.where(positions < self.num_tokens,
                            _gather(self.tokens, np.minimum(positions, self.num_tokens - 1)), 0).astype(np.int64)
        if self.id_bound is not None and toks.size and int(toks.max()) >= self.id_bound:  # (the embedding's IndexError)
            raise DataError(f"{self.where} holds token id {int(toks.max())}, past its tokenizer's {self.id_bound - 1}: "
                            f"its shards are damaged; `shardline prepare --verify --out {self.where}` names them")
        column = np.arange(s + 1)
        # Past the stream's end (a last chat row): the document after the last, an id of its own in the row.
        docs = self.doc_ids(np.minimum(positions, self.num_tokens - 1)) + (positions >= self.num_tokens)
        keep = (docs[:, 1:] == docs[:, :-1]) & (column[1:] < held[:, None])  # a row's own conversations only
        if self.mask is not None:
            keep &= _gather(self.mask, np.minimum(positions, self.num_tokens - 1))[:, 1:].astype(bool)
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


def _gather(stream, positions: np.ndarray) -> np.ndarray:
    """stream[positions] (any shape, all inside the stream), from an array or `TokenShards`."""
    return stream[positions] if isinstance(stream, np.ndarray) else stream.at(positions)


class Rows:
    """Chat rows (pack_rows): row r holds the conversations (documents) `docs[first[r]:first[r + 1]]`,
    in stream order, each `pieces` tokens from its start (all of it, or a row's worth when cut),
    `lengths[r]` tokens in all; `truncated` conversations were cut to fit a row."""

    def __init__(self, doc_starts: np.ndarray, docs: np.ndarray, first: np.ndarray, pieces: np.ndarray,
                 truncated: int):
        self.docs, self.first, self.pieces, self.truncated = docs, first, pieces, truncated
        self.starts = np.asarray(doc_starts)[docs]
        self.lengths = np.add.reduceat(pieces, first[:-1]) if len(pieces) else np.zeros(0, np.int64)

    def positions(self, rows) -> np.ndarray:
        """The stream positions of these rows' conversations, one after another."""
        picked = [np.arange(self.first[r], self.first[r + 1]) for r in np.asarray(rows, dtype=np.int64).tolist()]
        picked = np.concatenate(picked) if picked else np.zeros(0, np.int64)
        return _runs(self.starts[picked], self.pieces[picked])

    def laid_out(self, rows, width: int) -> np.ndarray:
        """[len(rows), width] stream positions: each row's conversations, then the stream after its last."""
        out = np.empty((len(rows), width), dtype=np.int64)
        for i, r in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
            a, b = self.first[r], self.first[r + 1]
            held = int(self.lengths[r])
            out[i, :held] = _runs(self.starts[a:b], self.pieces[a:b])
            out[i, held:] = self.starts[b - 1] + self.pieces[b - 1] + np.arange(width - held)
        return out


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start + 1, ..., start + length - 1 for each (start, length), concatenated."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def pack_rows(doc_starts: np.ndarray, total: int, width: int) -> Rows:
    """Rows of up to `width` tokens holding whole documents, best-fit decreasing: the longest
    document first, each into the open row whose room it fills most closely (a new row when none
    has room); a document of `width` or more is a row of its own, cut (module doc). Rows are
    ordered by their first document, so the first rows (what an evaluation of part of a split
    reads) are the stream's opening. The open rows are kept by their room, a bit set over the
    rooms finding the closest in one shift: about 1.3 s a million conversations on one core."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    sizes = np.diff(np.append(starts, total))
    row_of, rows = [0] * len(sizes), 0  # each document's row; how many rows
    by_room: dict[int, list[int]] = {}  # room left -> the open rows with that much
    rooms, truncated = 0, 0  # rooms: bit k set when some open row has k tokens of room
    sizes_of = sizes.tolist()
    for d in np.argsort(-sizes, kind="stable").tolist():
        size = sizes_of[d]
        if size >= width:
            row_of[d], rows, truncated = rows, rows + 1, truncated + (size > width)
            continue
        fits = rooms >> size
        if fits:
            room = size + (fits & -fits).bit_length() - 1  # the least room that holds it
            open_rows = by_room[room]
            row = open_rows.pop()
            if not open_rows:
                rooms ^= 1 << room
        else:
            row, room, rows = rows, width, rows + 1
        row_of[d] = row
        left = room - size
        if left:
            if left in by_room:
                by_room[left].append(row)
            else:
                by_room[left] = [row]
            rooms |= 1 << left
    # Rows in the order of their first documents, each one's documents in stream order.
    row_of = np.asarray(row_of, dtype=np.int64)
    _, opening = np.unique(row_of, return_index=True)  # each row's first document
    renamed = np.empty(rows, dtype=np.int64)
    renamed[np.argsort(opening, kind="stable")] = np.arange(rows)
    row_of = renamed[row_of]
    docs = np.argsort(row_of, kind="stable")
    first = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))]).astype(np.int64)
    return Rows(starts, docs, first, np.minimum(sizes[docs], width), truncated)


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
