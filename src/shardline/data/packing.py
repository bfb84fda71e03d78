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
(`pack_rows`: longest first, each into the row it fills most closely: 0.01-0.2% of the
positions left to fill, where next-fit in stream order left 11-21%). A row
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


def check_starts(starts: np.ndarray, total: int, where: str, chunk: int = 1 << 22) -> None:
    """Document starts that rise from 0 and stay inside the stream of `total` tokens, or a DataError
    naming `where`: an index edited in place (its size unchanged) moved the document masks in silence.
    Read by chunks: a memory-mapped index of 10^8 documents is not copied whole."""
    last = 0
    for i in range(0, len(starts), chunk):
        part = np.asarray(starts[i:i + chunk])
        if (i == 0 and part[0] != 0) or part[0] < last or (np.diff(part) < 0).any() or part[-1] >= max(total, 1):
            raise DataError(f"{where}: its document starts do not rise from 0 inside the {total:,} tokens (edited "
                            "or damaged after prepare?); prepare the folder again with --overwrite")
        last = int(part[-1])


class PackedSequences:
    def __init__(self, token_lists: list[list[int]], seq_len: int, eos_id: int | None,
                 masks: list[list[int]] | None = None):
        tokens, starts, mask = pack_lists(token_lists, eos_id, masks)
        self._init(tokens, starts, seq_len, mask)

    @classmethod
    def from_stream(cls, tokens, doc_starts: np.ndarray, seq_len: int, mask=None, where: str = "") -> "PackedSequences":
        """Sequences over an existing stream (an array or `TokenShards`) and its document starts; `where`:
        the file they were read from, whose starts are checked (check_starts)."""
        if where:
            check_starts(doc_starts, len(tokens), where)
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
        self.without_replies: float | None = None  # chat: the share of a sample holding no target (data.loader)

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
        if self.mask is not None:  # (read in stream order: a shard's conversations together)
            starts, pieces = self.rows.pieces_of(indices)
            order = np.argsort(starts)
            return int(_read(self.mask, starts[order], pieces[order]).sum(dtype=np.int64))
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
            positions, toks, mask = self._chat_rows(indices)
            held = self.rows.lengths[indices]
        if self.id_bound is not None and toks.size and int(toks.max()) >= self.id_bound:  # (the embedding's IndexError)
            raise DataError(f"{self.where} holds token id {int(toks.max())}, past its tokenizer's {self.id_bound - 1}: "
                            f"its shards are damaged; `shardline prepare --verify --out {self.where}` names them")
        column = np.arange(s + 1)
        # Past the stream's end (a last chat row): the document after the last, an id of its own in the row.
        docs = self.doc_ids(np.minimum(positions, self.num_tokens - 1)) + (positions >= self.num_tokens)
        keep = (docs[:, 1:] == docs[:, :-1]) & (column[1:] < held[:, None])  # a row's own conversations only
        if self.mask is not None:
            keep &= mask[:, 1:].astype(bool)
        labels = np.where(keep, toks[:, 1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(toks[:, :-1].copy()),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(docs[:, :-1].copy()),
        }

    def _chat_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Stream positions, tokens and loss mask of these chat rows, each [len(indices), s + 1]: a row's
        runs (Rows.runs) end to end; past the stream's end, position num_tokens, token and mask 0."""
        width = self.seq_len + 1
        positions = np.full((len(indices), width), self.num_tokens, dtype=np.int64)
        toks = np.zeros((len(indices), width), dtype=np.int64)
        mask = None if self.mask is None else np.zeros((len(indices), width), dtype=np.uint8)
        for i, row in enumerate(indices.tolist()):
            starts, lengths = self.rows.runs(row)
            got = int(lengths.sum())
            positions[i, :got] = _runs(starts, lengths)
            toks[i, :got] = _read(self.tokens, starts, lengths)
            if mask is not None:
                mask[i, :got] = _read(self.mask, starts, lengths)
        return positions, toks, mask


def _take(stream, starts: np.ndarray, length: int) -> np.ndarray:
    """Rows stream[start : start + length] for each start, from an array or `TokenShards`."""
    if isinstance(stream, np.ndarray):
        return stream[starts[:, None] + np.arange(length)]
    return stream.windows(starts, length)


def _read(stream, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """stream[start : start + length] for each (start, length), concatenated (a chat row's
    conversations come from all over the stream), from an array or `TokenShards`."""
    if not isinstance(stream, np.ndarray):
        return stream.runs(starts, lengths)
    parts = [stream[a:a + n] for a, n in zip(starts.tolist(), lengths.tolist())]
    return np.concatenate(parts) if parts else stream[:0]


class Rows:
    """Chat rows (pack_rows): row r holds the conversations (documents) `docs[first[r]:first[r + 1]]`,
    in stream order, each all of it or a row's worth (`width` tokens) when cut, `lengths[r]` tokens
    in all; `truncated` conversations were cut to fit a row. Where each conversation starts and how
    long it is are read from the document starts when a batch needs them, so what a rank keeps is
    4 bytes a conversation (its index) and 16 a row."""

    def __init__(self, doc_starts, total: int, width: int, docs: np.ndarray, first: np.ndarray,
                 lengths: np.ndarray, truncated: int):
        self.doc_starts, self.total, self.width = doc_starts, total, width
        self.docs, self.first, self.lengths, self.truncated = docs, first, lengths, truncated

    def _pieces(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream start, tokens a row holds) of these documents."""
        starts = np.asarray(self.doc_starts[docs], dtype=np.int64)
        after = docs.astype(np.int64) + 1
        ends = np.asarray(self.doc_starts[np.minimum(after, len(self.doc_starts) - 1)], dtype=np.int64)
        ends = np.where(after < len(self.doc_starts), ends, self.total)
        return starts, np.minimum(ends - starts, self.width)

    def pieces_of(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """(stream start, tokens) of these rows' conversations, one row after another."""
        picked = [self.docs[self.first[r]:self.first[r + 1]] for r in np.asarray(rows, dtype=np.int64).tolist()]
        return self._pieces(np.concatenate(picked) if picked else np.zeros(0, np.int64))

    def runs(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream start, tokens) of the runs that make up `row`: its conversations, then the stream
        after its last up to the row's width, or to the stream's end (what is left is padding)."""
        starts, pieces = self._pieces(self.docs[self.first[row]:self.first[row + 1]])
        end = int(starts[-1] + pieces[-1])
        fill = min(self.width - int(pieces.sum()), self.total - end)
        return np.append(starts, end), np.append(pieces, fill)


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start + 1, ..., start + length - 1 for each (start, length), concatenated."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


CHAT_PACKING = "whole conversations, best fit"  # what a chat checkpoint's data position says it was packed as
ROW_ORDER_SEED = 0  # rows in one fixed shuffled order (pack_rows): the same for the raw and prepared paths
_PACK_CHUNK = 1 << 20  # conversations a pass of pack_rows' loop holds as Python ints


def pack_rows(doc_starts, total: int, width: int) -> Rows:
    """Rows of up to `width` tokens holding whole documents, best-fit decreasing: the longest
    document first, each into the open row whose room it fills most closely (a new row when none
    has room); a document of `width` or more is a row of its own, cut (module doc).

    The open rows are kept by their room, a bit set (a Python int `width` bits wide) finding the
    closest in one shift: 0.4-0.7 s a million conversations at seq_len 512-4096, rising with the
    width (~5 s at 128k); some 50 bytes a conversation at its peak.

    Rows come in a fixed shuffled order, not their documents': the first rows, what an evaluation
    of part of a held-out split reads, are then a fair sample of the split, where rows sorted by
    their first document put rows of many short conversations first."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    sizes = np.diff(np.append(starts, total))
    order = np.argsort(-sizes, kind="stable")
    row_of, rows = np.empty(len(sizes), dtype=np.int64), 0  # each document's row; how many rows
    by_room: dict[int, list[int]] = {}  # room left -> the open rows with that much
    rooms, truncated = 0, 0  # rooms: bit k set when some open row has k tokens of room
    for lo in range(0, len(order), _PACK_CHUNK):  # (a chunk at a time: Python ints cost ~40 bytes each)
        placed = []
        for size in sizes[order[lo:lo + _PACK_CHUNK]].tolist():
            if size >= width:
                placed.append(rows)
                rows, truncated = rows + 1, truncated + (size > width)
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
            placed.append(row)
            left = room - size
            if left:
                if left in by_room:
                    by_room[left].append(row)
                else:
                    by_room[left] = [row]
                rooms |= 1 << left
        row_of[order[lo:lo + _PACK_CHUNK]] = placed
    del order
    row_of = np.random.default_rng(ROW_ORDER_SEED).permutation(rows)[row_of]  # rows renamed: shuffled
    docs = np.argsort(row_of, kind="stable")  # grouped by row, each row's in stream order
    counts = np.bincount(row_of, minlength=rows)
    lengths = np.bincount(row_of, weights=np.minimum(sizes, width), minlength=rows).astype(np.int64)
    docs = docs.astype(np.int32) if len(docs) < 2**31 else docs
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Rows(doc_starts, total, width, docs, first, lengths, truncated)


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
    starts = (np.cumsum(lengths) - lengths).astype(np.int64)  # (no documents: no starts)
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
