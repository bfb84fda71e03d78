"""What a run evaluates on: a held-out share of its training documents (data.val_fraction,
chosen by each document's content, so runs with other seeds, and runs on the data with files added,
evaluate on the same documents), or data
given for that alone (data.val_path), read whole while the training data holds nothing out.
And the checks that there is enough of it."""

from __future__ import annotations

import hashlib
import json
from array import array

import numpy as np

from shardline.config import Config
from shardline.data.shards import is_prepared
from shardline.errors import DataError


def training_val_fraction(cfg: Config) -> float:
    """The share of the training data held out: none where data.val_path gives the held-out data."""
    return 0.0 if cfg.data.val_path else cfg.data.val_fraction


def val_format(cfg: Config) -> str:
    """The format data.val_path is read in: the sources' own where they agree (a mixture's may each
    set one), else data.format (chat SFT with text replayed: the user says which)."""
    formats = set(cfg.data.formats())
    return formats.pop() if len(formats) == 1 else cfg.data.format


def split_documents(docs: list, val_fraction: float, rule: str = "content") -> tuple[list, list]:
    """Hold out a share of documents (at least one; none at `val_fraction` 0), chosen by their content
    (held_out) or, by data.split=position, as before 2026-12-07 (held_out_docs), for validation.

    A single document is split by characters instead, so one big .txt file still works.
    `shardline prepare` splits a stream the same way, document by document.
    """
    if len(docs) == 1:
        train, val = split_single(docs[0], val_fraction)
        return [train], [val]
    val_set = set(held_out_docs(docs, val_fraction, rule).tolist())
    train = [d for i, d in enumerate(docs) if i not in val_set]
    val = [d for i, d in enumerate(docs) if i in val_set]
    return train, val


COPIES_CHECKED_UP_TO = 50_000_000  # documents whose held-out copies prepare counts (450 MB in RAM)


def digest(doc) -> int:
    """8 bytes of a document's exact content (a conversation's as JSON): what chooses the held-out
    documents, and finds held-out documents that the training split holds too (copied files, merged
    sets: their eval loss is a training loss)."""
    text = doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True, ensure_ascii=False, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def held_out_in_training(digests: array, held: np.ndarray) -> int:
    """How many held-out documents (indices `held` of the documents' `digests`, an array('Q')) the
    training documents hold word for word. 9 bytes a document; a collision is ~1e-19 a pair."""
    every = np.frombuffer(digests, dtype=np.uint64) if len(digests) else np.zeros(0, np.uint64)
    is_val = np.zeros(len(every), bool)
    is_val[held] = True
    val = np.unique(every[is_val])  # (sorted; a few per cent of them: the training ones looked up a chunk at a time)
    if not len(val):
        return 0
    copied = np.zeros(len(val), bool)
    for start in range(0, len(every), 1 << 20):
        train = every[start : start + (1 << 20)][~is_val[start : start + (1 << 20)]]
        at = np.minimum(np.searchsorted(val, train), len(val) - 1)
        copied[at[val[at] == train]] = True
    return int(np.isin(every[is_val], val[copied]).sum())


def held_out_copies(train: list, val: list) -> int:
    """held_out_in_training of a split already made (split_documents'): its held-out documents last."""
    if not val:
        return 0
    return held_out_in_training(array("Q", map(digest, [*train, *val])), np.arange(len(train), len(train) + len(val)))


SPLIT_RULE = "content-hash"  # what a prepared folder's request and a checkpoint's data state record


def split_rule(cfg: Config) -> str | None:
    """The rule a run holds its raw documents out by, as a checkpoint records it (None: no raw source)."""
    if split_by_prepare(cfg):
        return None
    return SPLIT_RULE if cfg.data.split == "content" else cfg.data.split


class HeldOut:
    """The held-out documents of a stream, chosen one at a time by content: a document is held out when
    its digest, as a share of 2**64, is below `val_fraction` (the lowest digest where none is, so at
    least one; none at `val_fraction` 0). Adding, removing or reordering documents leaves every other
    one on its side (a rule by position moved 8 of 10 held-out documents into training when 1% more
    came), and copies of a document fall on one side together. The count is val_fraction of the
    documents on average, not exactly. Holds the held-out indices only: 8 bytes each."""

    def __init__(self, val_fraction: float):
        self.fraction, self.below = val_fraction, min(int(val_fraction * 2**64), 2**64 - 1)
        self.indices, self.lowest, self.highest, self.count = array("q"), (2**64, -1), (-1, -1), 0

    def add(self, doc_digest: int) -> None:
        if doc_digest < self.below:
            self.indices.append(self.count)
        this = (doc_digest, self.count)
        self.lowest, self.highest = min(self.lowest, this), max(self.highest, this)
        self.count += 1

    def result(self) -> np.ndarray:
        """Sorted indices of the held-out documents among those added: at least one where any is asked,
        and never all of several (the highest digest trains: two documents at 0.4 were both held out 16%
        of the time, nothing left to train on)."""
        if not self.fraction or not self.count:
            return np.zeros(0, np.int64)
        if not self.indices:
            return np.array([self.lowest[1]], np.int64)
        held = np.frombuffer(self.indices, np.int64).copy()
        return held[held != self.highest[1]] if len(held) == self.count > 1 else held


def held_out_docs(docs: list, val_fraction: float, rule: str = "content") -> np.ndarray:
    """Sorted indices of the held-out documents of `docs` by data.split's `rule`: by content (HeldOut), or
    by position, a seeded permutation of the document count (the rule before 2026-12-07, which moved most
    held-out documents into training when documents were added: kept to resume runs saved under it)."""
    if rule == "position":
        n_val = max(1, round(len(docs) * val_fraction)) if val_fraction else 0
        return np.sort(np.random.default_rng([0, 0x5EED]).permutation(len(docs))[:n_val])
    return held_out(map(digest, docs), val_fraction)


def held_out(digests, val_fraction: float) -> np.ndarray:
    """Sorted indices of the held-out documents among those of `digests` (digest()'s), as HeldOut chooses."""
    chooser = HeldOut(val_fraction)
    for d in digests:
        chooser.add(d)
    return chooser.result()


def split_single(doc, val_fraction: float):
    """A lone document's (train, val) parts: its characters cut at 1 - val_fraction."""
    cut = int(len(doc) * (1 - val_fraction))
    return doc[:cut], doc[cut:]


def split_by_prepare(cfg: Config) -> bool:
    """Whether every training source is a prepared folder: its held-out split is the one `prepare`
    made, which data.val_fraction does not cut."""
    return all(map(is_prepared, [s.path for s in cfg.data.mix] or [cfg.data.path]))


def held_out_problem(cfg: Config) -> str | None:
    """An evaluation asked of raw data that holds nothing out (data.val_fraction=0, no data.val_path),
    said before any data is read. A prepared folder holds the split `prepare` made, which
    data.val_fraction does not touch: opening it says whether it holds one (check_sizes)."""
    d, every = cfg.data, cfg.train.eval_interval
    if d.val_path or d.val_fraction or not every or split_by_prepare(cfg):
        return None
    return (f"data.val_fraction=0 holds nothing out for train.eval_interval={every} to evaluate on: set "
            "train.eval_interval=0 (no evaluation), a data.val_fraction in (0, 0.5), or data.val_path")


def check_sizes(where: str, train, val, cfg: Config) -> None:
    """A source with too little to train on; or, held out from it, too little to evaluate on."""
    t = cfg.train
    if len(train) == 0:
        raise DataError(f"{where} has {train.num_tokens} training tokens: too few for one sequence of "
                        f"train.seq_len={t.seq_len}; add data or lower train.seq_len")
    if t.eval_interval and len(val) == 0 and not cfg.data.val_path:  # (data.val_path's: check_val_size)
        # A prepared folder's split was made by `prepare`: data.val_fraction does not apply to it.
        prepared = is_prepared(where)
        more = ("prepare it again with --overwrite and a larger --val-fraction" if prepared
                else "raise data.val_fraction")
        if val.num_tokens == 0:  # nothing held out at all
            how = ("prepared with --val-fraction 0", "prepare it again with --overwrite and --val-fraction in "
                   "(0, 0.5)") if prepared else ("data.val_fraction=0", "a data.val_fraction in (0, 0.5)")
            raise DataError(f"{where} holds nothing out to evaluate on ({how[0]}): set train.eval_interval=0 "
                            f"(no evaluation), {how[1]}, or data.val_path")
        raise DataError(f"{where} holds out {val.num_tokens} validation tokens: too few for one sequence "
                        f"of train.seq_len={t.seq_len}; {more}, evaluate on all of a file (data.val_path), or "
                        "set train.eval_interval=0 (no evaluation)")


def refuse_too_short(where: str, docs: list[str], seq_len: int) -> None:
    """Text a dry run (which does not tokenize it) can tell holds no sequence: fewer tokens than
    seq_len even at a token a byte, with its document markers, which no tokenizer exceeds."""
    if sum(map(len, docs)) < seq_len and (most := sum(len(t.encode()) + 4 for t in docs)) < seq_len:
        raise DataError(f"{where} has at most {most:,} training tokens (a token a byte, and its document "
                        f"markers): too few for one sequence of train.seq_len={seq_len}; add data or lower "
                        "train.seq_len")


def check_val_size(val, cfg: Config) -> None:
    """data.val_path's data holds at least one sequence (where the run evaluates)."""
    if cfg.train.eval_interval and len(val) == 0:
        raise DataError(f"data.val_path={cfg.data.val_path!r} holds {val.num_tokens} tokens: too few for one "
                        f"sequence of train.seq_len={cfg.train.seq_len}; give more data or a lower train.seq_len (in "
                        "training, train.eval_interval=0 evaluates nothing)")


def held_out_large(share: float, val_fraction: float) -> bool:
    """Whether a held-out `share` of the training data is far above the data.val_fraction asked:
    whole documents are held out, at least one a source, so a few documents hold out much more."""
    return share > max(2 * val_fraction, 0.05)


def held_out_note(cfg: Config, train, val) -> dict | None:
    """The `held_out_large` launch note's fields, where a raw training source holds out far more of its
    sequences than data.val_fraction says (a prepared folder's split is prepare's, which says its
    share), each such source named; None otherwise. `train`, `val`: the data's splits (a mixture's:
    their sources, in data.mix order)."""
    d = cfg.data
    if d.val_path or not d.val_fraction:
        return None
    keys = [f"data.mix[{i}].path={s.path}" for i, s in enumerate(d.mix)] or [
        f"data.path={d.path}" if d.path else "data.path='' (the shipped corpus)"]
    large = {}
    for key, path, t, v in zip(keys, [s.path for s in d.mix] or [d.path], getattr(train, "sources", [train]),
                               getattr(val, "sources", [val])):
        total = len(t) + len(v)
        if not is_prepared(path) and total and held_out_large(len(v) / total, d.val_fraction):
            large[key] = f"{len(v):,} of {total:,} sequences ({len(v) / total:.0%})"
    if not large:
        return None
    return {"held_out": large, "val_fraction": d.val_fraction,
            "why": "whole documents are held out, at least one a source: with few documents that is a large share",
            "to_train_on_them": "data.val_fraction=0 with train.eval_interval=0, or data.val_path (other data to "
                                "evaluate on)"}


def held_out_text(docs: list, kept, cfg: Config) -> str:
    """Where the held-out documents are far more of the text than data.val_fraction asks: the share,
    by characters (a dry run does not tokenize), and the settings that train on them."""
    size = [len(str(doc)) for doc in docs]
    share = sum(size[i] for i in kept) / max(sum(size), 1)
    if not held_out_large(share, cfg.data.val_fraction):
        return ""
    return (f": {share:.0%} of the text, where data.val_fraction={cfg.data.val_fraction:g} asks for "
            f"{cfg.data.val_fraction:.0%}, a whole document at least; to train on them: data.val_fraction=0 with "
            "train.eval_interval=0, or data.val_path")
