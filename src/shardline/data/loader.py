"""Build the train and validation data of a run from its config.

A source is raw files (read and tokenized at start-up, as small corpora and tests want) or a folder made
by `shardline prepare` (memory-mapped; nothing is tokenized at start-up). Both give the same sequences
for the same text and tokenizer. `data.mix` combines several sources by weight (`mixture`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardline.config import Config
from shardline.data.chat_checks import (REPLY_SAMPLE, chat_checked, check_folder_template, check_one_chat_template,
                                        check_replies_fit, rendering, without_replies)
from shardline.data.chat_template import chat_template_for
from shardline.data.encode import check_replies, encode_documents, render_chat, roles_of
from shardline.data.file_stamps import stamp_files
from shardline.data.folders import other_splits
from shardline.data.mixture import MixedSequences
from shardline.data.packing import CHAT_PACKING, PackedSequences
from shardline.data.sampler import GlobalBatchSampler, batch_index
from shardline.data.shards import (id_bound, is_prepared, open_prepared, read_manifest, token_fingerprint,
                                   tokenizer_file, tokenizer_hash)
from shardline.data.sources import SUFFIXES, files_not_read, input_files, read_documents
from shardline.data.tokenizer import bos_prefix, eos_id, get_tokenizer, load_tokenizer, vocabulary_fingerprint
from shardline.data.validation import (check_sizes, check_val_size, held_out_copies, held_out_docs, held_out_text,
                                      refuse_too_short, split_documents, training_val_fraction, val_format)
from shardline.errors import DataError


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: PackedSequences | MixedSequences
    val: PackedSequences | MixedSequences
    sampler: GlobalBatchSampler
    source_names: list[str] = field(default_factory=list)  # a mixture's sources, in data.mix order
    _seen: tuple[int, tuple, np.ndarray] | None = None  # (step, skipped, sequences per source before it): a cache
    _vocabulary: str = ""  # vocabulary_fingerprint(tokenizer): a cache
    left_out: dict = field(default_factory=dict)  # what reading skipped: see read_documents
    chat_template: str = ""  # a chat run's rendering template in words (chat_checks.rendering); "" for text
    files: dict = field(default_factory=dict)  # the training files read, stamped (data/file_stamps.py)

    def describe(self, steps: int) -> dict:
        """The `data` event's fields: what the run trains on, how many passes over it `steps` make,
        and what reading the data left out (said, since a null column or a stray file type would
        otherwise shrink the data in silence)."""
        fields = {"documents": sum(p.num_documents for p in self._sources()), "sequences": len(self.train),
                  "tokens": len(self.train) * self.train.seq_len, "held_out_sequences": len(self.val),
                  "held_out_documents": sum(p.num_documents for p in self._sources(self.val)),
                  "epochs": round(steps * self.sampler.global_batch_size / max(len(self.train), 1), 3)}
        fields["fingerprint"] = self._content() or ("none: a folder prepared before fingerprints (a resume is not "
                                                     "compared with its data; run its prepare again to add one)")
        if isinstance(self.train, MixedSequences):
            fields["sources"] = self._shares(fields["epochs"])
        chat = [p for p in self._sources() if p.rows is not None]
        if chat:  # whole conversations a sequence (data/packing.py): what that costs
            fields["chat_template"], fields["conversations"] = self.chat_template, sum(p.num_documents for p in chat)
            width = sum(len(p) for p in chat) * (self.train.seq_len + 1)
            fields["conversations_cut"] = sum(p.rows.truncated for p in chat)
            fields["padding"] = round(1 - sum(int(p.rows.lengths.sum()) for p in chat) / width, 4) if width else 0.0
            shares = self.train.counts if isinstance(self.train, MixedSequences) else [len(self.train)]
            share = {id(p): int(n) for p, n in zip(self._sources(), shares)}
            fields["sequences_without_replies"] = round(  # (a mixture's: its chat sources' by their shares)
                sum(without_replies(p) * share[id(p)] for p in chat) / max(sum(share[id(p)] for p in chat), 1), 4)
        if self.left_out.get("empty_documents"):
            fields["empty_documents_skipped"] = self.left_out["empty_documents"]
        if self.left_out.get("held_out_in_training"):  # (word for word: their eval loss is a training loss)
            fields["held_out_in_training"] = self.left_out["held_out_in_training"]
        names = self.left_out.get("files_not_read", [])
        if names:
            fields["files_not_read"] = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            fields["reads"] = f"{', '.join(SUFFIXES)} files (optionally .gz)"
        return fields

    def _shares(self, passes: float) -> dict:
        """Each mixture source's share of the sequences, of the loss (its labelled tokens, from a sample: a chat
        sequence labels its replies only), how many times a pass over the mixture reads it (under 1: part of
        it, moving on each pass), and its own epochs in the run's `passes` over the mixture."""
        mix, n = self.train, len(self.train)
        rates = [p.count_labels(np.arange(min(len(p), REPLY_SAMPLE))) / max(min(len(p), REPLY_SAMPLE), 1)
                 for p in mix.sources]
        labelled = sum(int(c) * r for c, r in zip(mix.counts, rates)) or 1
        return {name: {"sequences": round(int(c) / n, 4), "loss": round(int(c) * r / labelled, 4),
                       "reads_per_pass": round(int(c) / max(int(size), 1), 3),
                       "epochs": round(passes * int(c) / max(int(size), 1), 3)}
                for name, c, r, size in zip(self.source_names, mix.counts, rates, mix.sizes)}

    @property
    def vocab_size(self) -> int:
        return id_bound(self.tokenizer)  # the embedding rows: ids may pass the count when the vocabulary has gaps

    def log_fields(self, step: int, skipped: list[int] = ()) -> dict:
        """For a mixture: {"tokens_by_source": {name: training tokens seen before `step`}}, else {}.

        Counted from the sampler over the batches the steps trained on (stepping over the
        skipped ones), so it is exact after a resume without being saved anywhere.
        """
        if not isinstance(self.train, MixedSequences):
            return {}
        skipped = tuple(sorted(skipped))
        cached = self._seen is not None and self._seen[0] <= step and self._seen[1] == skipped
        first, _, seen = self._seen if cached else (0, skipped, np.zeros(len(self.source_names), np.int64))
        for s in range(first, step):
            seen = seen + self.train.sequences_per_source(self.sampler.global_batch(batch_index(s, list(skipped))))
        self._seen = (step, skipped, seen)
        seq_len = self.train.seq_len
        return {"tokens_by_source": {n: int(c) * seq_len for n, c in zip(self.source_names, seen)}}

    def position_state(self) -> dict:
        """What a saved data position means beyond the sample count: the tokenizer's vocabulary
        (another one of the same size reads the same ids as other text), and for a mixture each
        source's size and share of the index space (other weights, or sources swapped, map the
        same index to other sequences)."""
        self._vocabulary = self._vocabulary or vocabulary_fingerprint(self.tokenizer)
        fingerprint = self._content()
        content = {"content": fingerprint} if fingerprint else {}  # (a folder prepared before it: none)
        # Chat: whole conversations a sequence, best fit (data/packing.py), since 2026-12-05; a chat checkpoint
        # from before it put the same conversations into other sequences (cut from one stream, or next-fit).
        chat = any(p.rows is not None for p in self._sources())
        content |= {"packing": CHAT_PACKING} if chat else {}
        content |= {"files": self.files} if self.files else {}  # (named where the content changed)
        mixed = isinstance(self.train, MixedSequences)
        mix = {"mix": [[int(c), int(n)] for c, n in zip(self.train.counts, self.train.sizes)]} if mixed else {}
        return {"vocabulary": self._vocabulary, **content, **mix}

    def release(self) -> None:
        """Let go of the prepared folders' reader locks (data/readers.py): a closed run reads no more,
        and a `prepare --overwrite` in the same process (a notebook) may replace them."""
        for source in [*self._sources(), *self._sources(self.val)]:
            if getattr(source, "reading", None) is not None:
                source.reading.close()

    def _sources(self, split: PackedSequences | MixedSequences | None = None) -> list[PackedSequences]:
        """A split's sources (the training split's by default): a mixture's, or the one."""
        split = self.train if split is None else split
        return split.sources if isinstance(split, MixedSequences) else [split]

    def _content(self) -> str | None:
        """The training tokens' fingerprint (a mixture's: of its sources' in order), or None where
        a source's is not known: edited data of the same length resumed onto other batches."""
        parts = self._sources()
        for part in parts:
            if part.fingerprint is None and isinstance(part.tokens, np.ndarray):  # raw files, tokenized here
                part.fingerprint = token_fingerprint([part.tokens])
        prints = [part.fingerprint for part in parts]
        if None in prints:
            return None
        return prints[0] if len(prints) == 1 else hashlib.sha256(" ".join(prints).encode()).hexdigest()[:16]

    def identity(self) -> str:
        """What every rank must have read alike: the splits' sequence counts, the tokenizer and a
        mixture's shares (a rank that read fewer documents would draw other batches)."""
        position = self.position_state()
        return (f"{len(self.train)} training and {len(self.val)} held-out sequences, vocabulary "
                f"{position['vocabulary']}" + (f", tokens {position['content']}" if "content" in position else "")
                + (f", mixture {position['mix']}" if "mix" in position else ""))


def build_data(cfg: Config) -> DataBundle:
    d, t = cfg.data, cfg.train
    if d.mix:
        return _build_mixture(cfg)
    left_out: dict = {}
    files = stamp_files([d.path])  # (before the read: see there)
    # data.val_path the training file itself (eval's stand-in for the run's data, or a run evaluating on its
    # training data), read alike: its packed sequences serve both, tokenized once
    same = (bool(d.val_path) and d.val_path == d.path and bool(t.eval_interval) and not is_prepared(d.path)
            and val_format(cfg) == d.formats()[0])
    if same:
        _refuse_dataset_dict(d.val_path)
    tok, train, val = load_source(d.path, cfg, left_out=left_out)
    if same:
        check_val_size(train, cfg)  # (named as the validation file, before check_sizes names it training data)
    check_sizes(d.path or "the shipped corpus", train, val, cfg)
    if d.val_path and t.eval_interval:  # (nothing evaluated: not read)
        val = train if same else load_val(cfg, tok)
    check_replies_fit([(d.path, train)], val, cfg)
    return DataBundle(tok, train, val, GlobalBatchSampler(len(train), t.global_batch_size, t.order_seed),
                      left_out=left_out, chat_template=rendering(cfg) if d.chat else "", files=files)


def load_source(path: str, cfg: Config, tok: Tokenizer | None = None, left_out: dict | None = None,
                index: int | None = None):
    """(tokenizer, train, val) of one source: a prepared folder or raw files. `left_out` gets what
    reading skipped (a prepared folder's, as its manifest recorded it); `index`: data.mix's, None for data.path."""
    d, seq_len = cfg.data, cfg.train.seq_len
    fmt, key = d.formats()[index or 0], "data.path" if index is None else f"data.mix[{index}].path"
    if is_prepared(path):
        prepared = open_prepared(path, seq_len, d.tokenizer, fmt, d.add_bos, _format_key(cfg, index))
        _check_mixture_tokenizer(path, tok, prepared.tokenizer)
        check_folder_template(path, prepared.manifest, d.tokenizer)
        if left_out is not None:
            left_out["empty_documents"] = (left_out.get("empty_documents", 0)
                                           + prepared.manifest.get("empty_documents", 0))
            left_out["files_not_read"] = left_out.get("files_not_read", []) + prepared.manifest.get(
                "files_not_read", [])
            left_out["held_out_in_training"] = (left_out.get("held_out_in_training", 0) + (  # (null: not checked)
                prepared.manifest.get("held_out_in_training") or 0) * (not cfg.data.val_path))  # (evaluated: not)
        return prepared.tokenizer, prepared.train, prepared.val
    chat = fmt == "chat"
    docs = read_documents(path, "messages" if chat else d.text_fields()[index or 0], left_out, key)
    fraction = training_val_fraction(cfg)
    if chat and len(docs) < (2 if fraction else 1):
        raise DataError(f"{key}={path!r} holds {len(docs)} conversations; chat data needs at least "
                        + ("two (one is held out)" if fraction else "one"))
    if chat:
        check_replies(f"{key}={path!r}", roles_of(docs))
    # The split depends on the documents' content only, not on train.seed or their order, so runs with
    # different seeds, or on the data with files added, are evaluated on the same held-out documents.
    train_docs, val_docs = split_documents(docs, fraction, d.split)
    if left_out is not None:  # (held-out documents that training also holds, word for word)
        copies = held_out_copies(train_docs, val_docs)
        left_out["held_out_in_training"] = left_out.get("held_out_in_training", 0) + copies
    template = chat_template_for(tokenizer_file(d)) if chat else None  # (a mixture's: the run's, it exports it)
    if tok is None:
        texts = [render_chat(m, template) for m in train_docs] if chat else train_docs
        tok = get_tokenizer(texts, d.tokenizer, d.vocab_size)
    eos, bos = eos_id(tok, tokenizer_file(d)), bos_prefix(tok) if d.add_bos and not chat else []
    return tok, *(_pack(tok, part, eos, seq_len, template, chat, bos) for part in (train_docs, val_docs))


def load_val(cfg: Config, tok: Tokenizer) -> PackedSequences | MixedSequences:
    """data.val_path, whole: raw files tokenized with the run's tokenizer, or a prepared folder
    (both its splits) prepared with it; in val_format."""
    d, key, path, fmt = cfg.data, "data.val_path", cfg.data.val_path, val_format(cfg)
    _refuse_dataset_dict(path)
    if is_prepared(path):
        prepared = open_prepared(path, cfg.train.seq_len, "", fmt, d.add_bos)  # (its own, compared here)
        _check_val_tokenizer(prepared.tokenizer, tok, path)
        parts = [p for p in (prepared.train, prepared.val) if len(p)] or [prepared.train]
        val = parts[0] if len(parts) == 1 else MixedSequences(parts, None)
    else:
        chat = fmt == "chat"
        docs = read_documents(path, "messages" if chat else d.text_field, key=key)
        if chat:
            check_replies(f"{key}={path!r}", roles_of(docs))
        template = chat_template_for(tokenizer_file(d)) if chat else None
        eos, bos = eos_id(tok, tokenizer_file(d)), bos_prefix(tok) if d.add_bos and not chat else []
        val = _pack(tok, docs, eos, cfg.train.seq_len, template, chat, bos)
    check_val_size(val, cfg)
    return val


def _check_val_tokenizer(own: Tokenizer, run: Tokenizer, path: str) -> None:
    """A prepared data.val_path folder holds the ids of the run's tokenizer."""
    if tokenizer_hash(own) != tokenizer_hash(run):  # (as this `tokenizers` writes them: _check_mixture_tokenizer)
        raise DataError(f"data.val_path={path!r} was prepared with another tokenizer than the run's; prepare it with "
                        "--tokenizer naming the run's tokenizer.json (or give it raw)")


def _refuse_dataset_dict(path: str) -> None:
    """A datasets DatasetDict folder given as data.val_path: data.path reads its train split, which is
    not what to evaluate on; the line names its other splits' folders."""
    if (splits := other_splits(Path(path))) is not None:
        raise DataError(f"data.val_path={path!r} is a datasets DatasetDict: name the folder of its split to evaluate "
                        f"on ({', '.join(f'{path}/{s}' for s in splits) or 'it has no split besides train'})")


def _format_key(cfg: Config, index: int | None) -> str:
    """The setting that gives source `index` its format (data.mix[i].format where the source sets one)."""
    own = index is not None and cfg.data.mix[index].format
    return f"data.mix[{index}].format" if own else "data.format"


def _pack(tok: Tokenizer, docs: list, eos: int | None, seq_len: int, template, chat: bool,
          bos: list[int]) -> PackedSequences:
    tokens, lengths, mask = encode_documents(tok, docs, eos, template, chat, bos)
    return PackedSequences.from_stream(tokens, np.cumsum(lengths) - lengths, seq_len, mask)


def _build_mixture(cfg: Config) -> DataBundle:
    """Every source of data.mix, with one tokenizer; train mixed by the weights, val holding each source's once."""
    t, mix = cfg.train, cfg.data.mix
    tok = _mixture_tokenizer(cfg)
    if cfg.data.chat:
        check_one_chat_template(cfg)
    trains, vals, left_out = [], [], {}
    files = stamp_files([s.path for s in mix])  # (before the read: see there)
    for i, source in enumerate(mix):
        tok, train, val = load_source(source.path, cfg, tok, left_out, index=i)
        check_sizes(source.path, train, val, cfg)
        trains.append(train)
        vals.append(val)
    train = MixedSequences(trains, [s.weight for s in mix])
    names = _source_names([s.path for s in mix])
    # (held out: each source's sequences once, not by the weights: an up-weighted one's read twice, a down-weighted
    val = load_val(cfg, tok) if cfg.data.val_path and t.eval_interval else MixedSequences(
        vals, None, interleave=True)  # one's left unread; eval_loss_by_source: each one's loss)
    check_replies_fit([(s.path, p) for s, p in zip(mix, trains)], val, cfg)
    return DataBundle(tok, train, val,
                      GlobalBatchSampler(len(train), t.global_batch_size, t.order_seed, tag_passes=True), names,
                      left_out=left_out, chat_template=rendering(cfg) if cfg.data.chat else "", files=files)


def _mixture_tokenizer(cfg: Config) -> Tokenizer:
    """data.tokenizer, else the first prepared source's; raw-only mixtures need data.tokenizer. First,
    prepared sources whose format is not the one asked of them are one error naming them all."""
    d = cfg.data
    wrong = [(i, fmt, read_manifest(Path(s.path)).get("format")) for i, (s, fmt) in enumerate(zip(d.mix, d.formats()))
             if is_prepared(s.path)]
    wrong = [(i, fmt, has) for i, fmt, has in wrong if has is not None and has != fmt]  # (None: open_prepared says)
    if wrong:
        raise DataError("data.mix: " + "; ".join(f"{_format_key(cfg, i)}={fmt!r} but {d.mix[i].path} was prepared as "
                                                 f"{has!r} data" for i, fmt, has in wrong)
                        + "; set each source's format (data.mix[i].format: a mixture may hold both, as chat "
                        "fine-tuning with text replayed) or prepare it again in the other (--overwrite)")
    if d.tokenizer:
        return load_tokenizer(d.tokenizer)
    prepared = [i for i, s in enumerate(d.mix) if is_prepared(s.path)]
    if prepared:
        i = prepared[0]
        return open_prepared(d.mix[i].path, cfg.train.seq_len, "", d.formats()[i], d.add_bos).tokenizer
    for i, source in enumerate(d.mix):  # a source that is not there is the first thing to say (not the tokenizer)
        input_files(source.path, f"data.mix[{i}].path")
    raise DataError("data.mix of raw files needs one tokenizer for all: set data.tokenizer, or prepare the "
                    "sources with `shardline prepare --tokenizer`")


def _check_mixture_tokenizer(path: str, tok: Tokenizer | None, own: Tokenizer) -> None:
    """A prepared source of a mixture holds the ids of the mixture's tokenizer `tok` (None: not a
    mixture): its own tokenizer `own` is the same (both as this `tokenizers` writes them; folders
    prepared under other versions hold other hashes of one tokenizer)."""
    if tok is not None and tokenizer_hash(tok) != tokenizer_hash(own):
        raise DataError(f"data.mix source {path} was prepared with another tokenizer than the first "
                        "source; prepare every source with the same --tokenizer")


def _source_names(paths: list[str]) -> list[str]:
    """Short names for the log: each path's last part, numbered when two are alike."""
    names = [os.path.basename(os.path.normpath(p)) or p for p in paths]
    return [n if names.count(n) == 1 else f"{i}:{n}" for i, n in enumerate(names)]


def data_summary(cfg: Config) -> tuple[str, str]:
    """(what a launch would read, in words; the tokenizer.json a prepared folder fixes, or ""), untokenized.

    For `--dry-run`: prepared folders are checked as a launch opens them (manifest,
    file sizes, tokenizer); raw files are read and counted.
    """
    d = cfg.data
    parts, folder_tokenizer = [], ""
    tok = _mixture_tokenizer(cfg) if d.mix else None  # the mixture's checks, as _build_mixture runs them
    if d.mix and d.chat:
        check_one_chat_template(cfg)
    keys = [f"data.mix[{i}].path" for i in range(len(d.mix))] or ["data.path"]
    opened = []  # (path, train, val) of the prepared sources: their replies checked as a launch does
    for i, (key, path, fmt) in enumerate(zip(keys, [s.path for s in d.mix] or [d.path], d.formats())):
        if is_prepared(path):
            p = open_prepared(path, cfg.train.seq_len, d.tokenizer, fmt, d.add_bos,
                              _format_key(cfg, i if d.mix else None))
            _check_mixture_tokenizer(path, tok, p.tokenizer)
            check_folder_template(path, p.manifest, d.tokenizer)
            check_sizes(path, p.train, p.val, cfg)
            opened.append((path, p.train, p.val))
            parts.append(f"{path}: prepared {fmt} folder, {p.train.num_documents:,} + {p.val.num_documents:,} "
                         f"held-out documents, {p.train.num_tokens:,} training tokens")
            folder_tokenizer = folder_tokenizer or os.path.join(path, "tokenizer.json")
        else:
            docs = read_documents(path, "messages" if fmt == "chat" else d.text_fields()[i], key=key)
            if fmt == "text":
                refuse_too_short(f"{key}={path!r}", docs, cfg.train.seq_len)
            where = path or "the shipped corpus (a sample to try shardline on: data.path names your data)"
            kept = held_out_docs(docs, training_val_fraction(cfg), d.split) if len(docs) > 1 else []  # (as the launch)
            parts.append(f"{where}: {len(docs):,} " + (chat_checked(f"{key}={path!r}", docs, tokenizer_file(d))
                                                       if fmt == "chat" else "documents")
                         + (f" ({len(kept):,} of them held out for evaluation{held_out_text(docs, kept, cfg)})"
                            if len(kept) else ""))
            skipped = [f.name for f in files_not_read(path)]  # (the launch's data line names them too)
            parts[-1] += (f" (not read: {', '.join(skipped[:5])}{' and more' * (len(skipped) > 5)}; it reads "
                          f"{', '.join(SUFFIXES)} files)") * bool(skipped)
    if d.val_path and cfg.train.eval_interval:  # (nothing evaluated: the launch does not read it)
        parts.append(_val_summary(cfg, d.tokenizer or folder_tokenizer))
    if opened and len(opened) == len(keys):  # (raw data is not tokenized by a dry run)
        vals = [val for _, _, val in opened]
        val = MixedSequences(vals, [s.weight for s in d.mix], interleave=True) if d.mix else vals[0]
        check_replies_fit([(path, train) for path, train, _ in opened], [] if d.val_path else val, cfg)
    return "; ".join(parts), folder_tokenizer


def _val_summary(cfg: Config, tokenizer: str) -> str:
    """data.val_path in words, read as a launch reads it (a prepared folder's tokenizer compared with
    the run's `tokenizer` where that is known before the launch; its size: by the launch)."""
    d, path, fmt = cfg.data, cfg.data.val_path, val_format(cfg)
    _refuse_dataset_dict(path)
    if is_prepared(path):
        p = open_prepared(path, cfg.train.seq_len, "", fmt, d.add_bos)
        if tokenizer:
            _check_val_tokenizer(p.tokenizer, load_tokenizer(tokenizer), path)
        return (f"evaluates on {path}: prepared {fmt} folder, "
                f"{p.train.num_documents + p.val.num_documents:,} documents")
    chat = fmt == "chat"
    docs = read_documents(path, "messages" if chat else d.text_field, key="data.val_path")
    return f"evaluates on {path}: {len(docs):,} " + ("conversations" if chat else "documents")
