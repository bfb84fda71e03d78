"""Tokenizing a stream of documents chunk by chunk, in worker processes, results in input order.

`shardline prepare`'s third pass. Chunks are a few MB of text each; at most two per worker are
in flight, so memory holds a few chunks whatever the corpus size. Tokens come back in the
shard's dtype (2 bytes each for a vocabulary that fits uint16, not 8). `Progress` is the pass's
status line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from tokenizers import Tokenizer

from shardline.data.chat_template import ChatTemplate
from shardline.data.encode import encode_documents
from shardline.data.shards import SPLITS
from shardline.data.tokenizer import eos_id
from shardline.errors import DataError


@dataclass(frozen=True)
class EncodeJob:
    """What every chunk is encoded with (sent to each worker with its chunk)."""

    tokenizer_file: str
    chat: bool
    template: ChatTemplate | None
    dtype: np.dtype
    bos: list[int] = field(default_factory=list)


def check_workers(workers: int) -> None:
    """--workers >= 1 (each a process, forked at once: encoded_chunks runs no more than the cores)."""
    if workers < 1:
        raise DataError(f"--workers={workers} is invalid: a number of processes, >= 1")


def usable_cores() -> int:
    """The cores this process may run on (a Slurm task's share of its node, not the node's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count(workers: int) -> int:
    """--workers, no more than the cores this process may run on (said on stderr where cut): past them
    the processes share the cores, and a number a few digits long forked that many, for nothing."""
    cores = usable_cores()
    if workers > cores:
        print(f"shardline: note: --workers {workers} is more than the {cores} cores here: {cores} run",
              file=sys.stderr)
    return min(workers, cores)


def encoded_chunks(job: EncodeJob, documents: Iterable, chunk_bytes: int, workers: int,
                   inherited: tuple[int, ...] = ()) -> Iterator[tuple]:
    """(input documents, bytes, {split: (tokens, lengths, mask)}) per chunk of `documents`
    ((index, split, document) triples), in input order; workers > 1 run that many processes, which
    close the file descriptors `inherited` (a lock the caller holds: forked, they held it too).
    A chunk ends at the first document that takes it to `chunk_bytes` of UTF-8.

    An executor, not a multiprocessing Pool: a worker the OOM killer takes (a document of
    gigabytes is tokenized whole) fails its chunk here, where a Pool waits for it forever."""
    chunks, workers = _chunks(documents, chunk_bytes), worker_count(workers)
    if workers == 1:
        yield from (encode_chunk(job, chunk) for chunk in chunks)
        return
    with _one_thread_per_worker(), ProcessPoolExecutor(workers, mp.get_context("fork"), initializer=_worker_start,
                                                       initargs=(os.getpid(), inherited)) as pool:
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(encode_chunk, job, chunk))
                if len(pending) >= 2 * workers:  # bounded: memory holds a few chunks, not the corpus
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise DataError("a tokenizing worker died (killed for memory? a document of gigabytes, such as a .txt "
                            "file without blank lines, is tokenized whole); what was committed is kept: run again "
                            "with fewer --workers or the documents split") from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # stopped early: the queued chunks are not wanted


PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


def _worker_start(parent: int, inherited: tuple[int, ...]) -> None:
    """A worker lets go of the caller's lock (forked, it held it: a SIGTERM or SIGKILL to the prepare
    left its workers running with it, and a rerun waited for ever), leaves Ctrl-C to the prepare, and
    goes with the prepare that forked it (Linux's parent-death signal; elsewhere an orphan finishes
    its chunk and idles)."""
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)  # (the worker's copy: the caller's lock stays held)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the caller's handler raises in its own main thread only)
    # A terminal's Ctrl-C reaches the whole group: a worker's KeyboardInterrupt, raised while it held the
    # pool's queue lock, left the prepare waiting for ever at its exit. The prepare alone stops on it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # (gone before the signal was asked for; a prepare that is PID 1 is no orphan's)
        os._exit(1)


def encode_chunk(job: EncodeJob, chunk: list) -> tuple[int, int, dict]:
    tok = _load_cached(job.tokenizer_file, os.stat(job.tokenizer_file).st_mtime_ns)
    eos = eos_id(tok, job.tokenizer_file)
    n_bytes = sum(utf8_bytes(d) for _, d in chunk)  # (as the chunk was measured)
    encoded = {}
    for name in SPLITS:
        docs = [d for s, d in chunk if s == name]
        tokens, lengths, mask = encode_documents(tok, docs, eos, job.template, job.chat, job.bos)
        if len(tokens) and tokens.max() > np.iinfo(job.dtype).max:  # astype would wrap it silently
            raise DataError(f"token id {int(tokens.max())} does not fit the folder's {np.dtype(job.dtype)} shards")
        encoded[name] = (tokens.astype(job.dtype), lengths, mask)
    return len(chunk), n_bytes, encoded


def _chunks(documents: Iterable, chunk_bytes: int) -> Iterator[list]:
    chunk, size = [], 0
    for _, split, doc in documents:
        chunk.append((split, doc))
        size += utf8_bytes(doc)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def utf8_bytes(doc: str | list) -> int:
    """A document's UTF-8 bytes (a conversation's as its JSON, unescaped: a CJK character 3, not 6); ASCII
    text's without a copy (its length: a document of GBs is not encoded once more here)."""
    text = doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)
    return len(text) if text.isascii() else len(text.encode())


@contextmanager
def _one_thread_per_worker():
    """Forked workers tokenize on one thread each (N workers = N cores), without the fork warning."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


@lru_cache(maxsize=2)
def _load_cached(path: str, mtime_ns: int) -> Tokenizer:
    """Each worker process loads the tokenizer once (keyed by its file's version)."""
    return Tokenizer.from_file(path)


class Progress:
    """One status line: documents, tokens, MB/s, ETA (at most once a second; a line per 10 s off a tty)."""

    def __init__(self, enabled: bool, total_docs: int, done: int, tokens_done: int = 0):
        """`done` documents and `tokens_done` tokens an interrupted prepare committed: the line counts the
        whole job's (its pace and ETA are this session's)."""
        self.enabled, self.total, self.docs, self.resumed_at = enabled, total_docs, done, done
        self.tokens, self.bytes = tokens_done, 0
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, docs: int, n_bytes: int, tokens: int) -> None:
        self.docs, self.bytes, self.tokens = self.docs + docs, self.bytes + n_bytes, self.tokens + tokens
        now = time.perf_counter()
        if self.enabled and now - self.last >= (1 if self.tty else 10):
            self.last = now
            print(self.line(now), end="\r" if self.tty else "\n", file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        rate = self.bytes / max(now - self.start, 1e-9)
        per_doc = (now - self.start) / max(self.docs - self.resumed_at, 1)  # this session's pace
        eta = int(per_doc * max(self.total - self.docs, 0))
        return (f"prepare: {self.docs:,}/{self.total:,} documents, {self.tokens:,} tokens, "
                f"{rate / 1e6:.1f} MB/s, ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")

    def done(self) -> None:
        if self.enabled:
            print(self.line(time.perf_counter()) + " - done", file=sys.stderr, flush=True)
