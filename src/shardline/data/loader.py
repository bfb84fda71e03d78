"""Build the train and validation data of a run from its config."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from shardline.config import Config
from shardline.data.packing import PackedSequences
from shardline.data.sampler import GlobalBatchSampler
from shardline.data.sources import read_documents
from shardline.data.tokenizer import eos_id, get_tokenizer
from shardline.errors import DataError


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: PackedSequences
    val: PackedSequences
    sampler: GlobalBatchSampler

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Hold out a seeded random share of documents (at least one) for validation.

    A single document is split by characters instead, so one big .txt file still works.
    """
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    n_val = max(1, round(len(docs) * val_fraction))
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(docs))
    val_set = set(order[:n_val].tolist())
    train = [d for i, d in enumerate(docs) if i not in val_set]
    val = [d for i, d in enumerate(docs) if i in val_set]
    return train, val


def build_data(cfg: Config) -> DataBundle:
    d, t = cfg.data, cfg.train
    docs = read_documents(d.path, d.text_field)
    # The split depends on the data only (fixed seed), not on train.seed, so runs with
    # different seeds are evaluated on the same held-out documents.
    train_docs, val_docs = split_documents(docs, d.val_fraction, seed=0)
    tok = get_tokenizer(train_docs, d.tokenizer, d.vocab_size)
    eos = eos_id(tok)
    train = PackedSequences(_encode(tok, train_docs), t.seq_len, eos)
    val = PackedSequences(_encode(tok, val_docs), t.seq_len, eos)
    where = d.path or "the shipped corpus"
    if len(train) == 0:
        raise DataError(f"{where} has {train.num_tokens} training tokens: too few for one sequence of "
                        f"train.seq_len={t.seq_len}; add data or lower train.seq_len")
    if t.eval_interval and len(val) == 0:
        raise DataError(f"{where} holds out {val.num_tokens} validation tokens: too few for one sequence "
                        f"of train.seq_len={t.seq_len}; raise data.val_fraction or set train.eval_interval=0")
    return DataBundle(tok, train, val, GlobalBatchSampler(len(train), t.global_batch_size, t.seed))


def _encode(tok: Tokenizer, docs: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
