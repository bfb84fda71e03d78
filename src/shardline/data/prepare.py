"""`shardline prepare`: tokenize a corpus once into a folder of token shards (see `shards`).

Three streaming passes over the inputs, none holding more than a chunk of documents:
1. count the documents (the held-out split needs their number, as at training time);
2. without --tokenizer only: train the same byte-level BPE the raw-text path would
   (on the training documents; cached by content, so a rerun skips it);
3. tokenize in worker processes (`pool`), chunk by chunk in input order, and write shards.

Restartable: after each shard the state is committed to progress.json (atomic
rename); a rerun with the same inputs and options continues after the last committed
document, deleting what was written after it. The manifest is deleted first and
written last, so no manifest ever points at missing or partial data.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardline.config.data_section import MAX_TRAINED_VOCAB
from shardline.data.chat_template import ChatTemplate, chat_template_for, template_sha256
from shardline.data.encode import CHAT_MASK_RULE, check_replies, note_roles, render_chat
from shardline.data.validation import (COPIES_CHECKED_UP_TO, SPLIT_RULE, HeldOut, digest, held_out_in_training,
                                      split_single)
from shardline.data.pool import EncodeJob, Progress, check_workers, encode_chunk, encoded_chunks, utf8_bytes
from shardline.data.readers import unread
from shardline.data.prepare_out import LOCK, check_out, check_replacing, differs, finished, made, written
from shardline.data.shards import (FORMAT_VERSION, MANIFEST, PROGRESS, SPLITS, TOKENIZER, SplitWriter,
                                   check_manifest_keys, file_sha256, id_bound, token_dtype, token_fingerprint,
                                   tokenizer_hash)
from shardline.data.sources import CHAT_FIELD, files_not_read, inputs_files, read_file
from shardline.data.tokenizer import (TOKENIZER_SIDE_FILES, bos_prefix, eos_id, get_tokenizer, load_tokenizer,
                                      side_file_held)
from shardline.errors import DataError

FORMATS = ("text", "chat")


class PrepareStopped(Exception):
    """Raised by `stop_after_shards` (a test's stand-in for a killed prepare)."""


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: str
    tokenizer: str = ""  # "" = train a byte-level BPE of vocab_size on the training documents
    vocab_size: int = 4096
    workers: int = 1
    val_fraction: float = 0.01
    text_field: str = "text"
    format: str = "text"  # text | chat (jsonl records with "messages")
    add_bos: bool = True  # text documents start with the tokenizer's BOS tokens, if it has any (data.add_bos)
    shard_tokens: int = 1 << 25  # tokens per shard (before a commit point)
    chunk_bytes: int = 1 << 21  # the most text (UTF-8 bytes) a unit of work sent to a worker holds
    progress: bool = True
    overwrite: bool = False  # replace a folder finished from other inputs or options (else refused), or redo it
    stop_after_shards: int = 0  # testing aid: stop (as if killed) after this many commits; 0 = never

    def read_field(self) -> str:
        if self.format != "chat" and self.text_field == CHAT_FIELD:  # conversations, read as text: a traceback
            raise DataError(f"--text-field {CHAT_FIELD} is the conversations chat data holds: prepare with "
                            "--format chat")
        return CHAT_FIELD if self.format == "chat" else self.text_field


@dataclass
class _Stream:
    """Which input documents go where: the held-out indices of the split, or a lone document's cut."""

    files: list[Path]
    field: str
    count: int
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    val_fraction: float = 0.01
    empty: int = 0  # the null, empty or blank texts a whole pass skipped
    duplicated: int | None = 0  # held-out documents the training split holds word for word (None: not checked)
    not_read: list = field(default_factory=list)  # the inputs' files no reader takes

    def documents(self, skip: int = 0):
        """(input index, split, document) in input order; the first `skip` are read but not yielded."""
        held, h, i, empty = self.held, 0, 0, 0
        for f in self.files:
            for doc in read_file(f, self.field):
                if not doc or (isinstance(doc, str) and not doc.strip()):  # as read_documents skips them
                    empty += 1
                    continue
                if self.count == 1:
                    train, val = split_single(doc, self.val_fraction)
                    yield from [(0, "train", train), (0, "val", val)][skip:]
                    return
                while h < len(held) and held[h] < i:
                    h += 1
                if i >= skip:
                    yield i, "val" if h < len(held) and held[h] == i else "train", doc
                i += 1
        self.empty = empty

    @property
    def pieces(self) -> int:
        """How many items documents() yields: a lone document is cut into a train and a val piece."""
        return 2 if self.count == 1 else self.count

    def training_texts(self, chat: bool, template: ChatTemplate | None):
        """Re-iterable training documents as text (what a BPE is trained on)."""
        stream = self

        class _Texts:
            def __iter__(self):
                for _, split, doc in stream.documents():
                    if split == "train":
                        yield render_chat(doc, template) if chat else doc
        return _Texts()


def prepare(opts: PrepareOptions) -> dict:
    """Prepare `opts.out` from `opts.inputs`; returns the manifest (resumes or skips when it can)."""
    _check_options(opts)
    files = inputs_files(opts.inputs, key="prepare INPUT")
    root = Path(opts.out)
    check_out(root, files)
    request = _request(opts, files)
    done = finished(root, request)
    if done is not None and not opts.overwrite:
        _say(opts, f"{root} is already prepared from these inputs; nothing to do (its shards are not read again: "
                   "--verify checks them)")
        _keep_side_files(opts.tokenizer, root)  # (tokens do not depend on them: the ones given now)
        check_manifest_keys(root, done)  # a damaged manifest: one line, not a KeyError in the fingerprint's read
        return _with_fingerprint(root, done)
    _say(opts, check_replacing(root, request, opts.overwrite))
    with unread(root):  # said before the passes below (again under the folder's lock, where it counts)
        pass
    before = written(root)  # (a manifest another prepare writes while this one tokenizes or waits: judged again)
    # Passes 1 and 2 before the folder is touched: bad inputs or a bad tokenizer leave it as it was.
    stream = _count(opts, files)
    template = chat_template_for(opts.tokenizer) if opts.format == "chat" else None
    tok = _tokenizer(opts, stream, template, None if opts.overwrite else _interrupted_bpe(root, request))
    root.mkdir(parents=True, exist_ok=True)
    with _writing(root) as lock_fd:  # one prepare writes a folder at a time (srun's prepare runs one a task)
        now = made(root) if written(root) != before else None  # another one finished it meanwhile:
        if now is not None and now[1] == request:  # these inputs (srun's tasks, --overwrite too: one prepare,
            _say(opts, f"{root} was prepared from these inputs meanwhile; nothing to do")  # not one a task)
            return now[0]
        if now is not None:  # other inputs: judged as if found at the start
            _say(opts, check_replacing(root, request, opts.overwrite))
        request["tokenizer_sha256"] = tokenizer_hash(tok)
        with unread(root):  # (no run starts on it meanwhile)
            (root / MANIFEST).unlink(missing_ok=True)  # from here on the folder is incomplete until the end
        if opts.overwrite:  # (not an interrupted prepare's progress either: from the first document)
            (root / PROGRESS).unlink(missing_ok=True)
        state = _resume_state(root, request, opts)  # its progress file marks the folder as prepare's from now on
        _atomic_write(root / TOKENIZER, tok.to_str())
        _keep_side_files(opts.tokenizer, root)
        writers = {name: SplitWriter(root, name, token_dtype(id_bound(tok)), opts.format == "chat",
                                     state["splits"].get(name)) for name in SPLITS}
        _tokenize_all(opts, root, stream, writers, state, template, lock_fd)
        return _finish(root, request, writers, tok, stream)


@contextmanager
def _writing(root: Path):
    """An exclusive lock on the folder's lock file, waited for: a second prepare of the same
    folder, started at once, goes on when the first is done (finding it prepared, or resuming)."""
    with open(root / LOCK, "a", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # (it waited in silence)
            print(f"prepare: another prepare of {root} holds its {LOCK}; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle.fileno()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _keep_side_files(tokenizer: str, root: Path) -> None:
    """The settings and chat template beside --tokenizer, into the folder: a run trained on it
    keeps them (`generate --chat`, `convert to-hf`); ones a former tokenizer left there go."""
    for name in TOKENIZER_SIDE_FILES:
        source = Path(tokenizer).parent / name if tokenizer else None
        if source is None or not side_file_held(source.parent, name):
            (root / name).unlink(missing_ok=True)
        elif source.resolve() != (root / name).resolve():  # (--tokenizer may be the folder's own)
            shutil.copyfile(source, root / name)


def _check_options(opts: PrepareOptions) -> None:
    if opts.format not in FORMATS:
        raise DataError(f"--format={opts.format!r} is invalid: one of {', '.join(FORMATS)}")
    if not 0 <= opts.val_fraction < 0.5:
        raise DataError(f"--val-fraction={opts.val_fraction!r} is invalid: must be in [0, 0.5) (0 holds nothing "
                        "out: runs on the folder then set train.eval_interval=0)")
    if opts.shard_tokens < 1:
        raise DataError(f"--shard-tokens={opts.shard_tokens} is invalid: a number of tokens, >= 1")
    check_workers(opts.workers)
    if not opts.inputs:
        raise DataError("shardline prepare needs at least one input file or folder")
    if opts.tokenizer and not Path(opts.tokenizer).is_file():
        raise DataError(f"--tokenizer {opts.tokenizer} is not a file; give a tokenizer.json")
    if not opts.tokenizer and not 260 <= opts.vocab_size <= MAX_TRAINED_VOCAB:
        raise DataError(f"--vocab-size={opts.vocab_size} is invalid: must be in [260, {MAX_TRAINED_VOCAB}] "
                        "(256 bytes + specials; a larger vocabulary comes with --tokenizer)")


def _request(opts: PrepareOptions, files: list[Path]) -> dict:
    """What the folder's content depends on: a rerun with another request starts over."""
    inputs = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    tok = ["file", file_sha256(Path(opts.tokenizer))] if opts.tokenizer else ["bpe", opts.vocab_size]
    request = {"inputs": inputs, "field": opts.read_field(), "format": opts.format, "val_fraction": opts.val_fraction,
               **({"split": SPLIT_RULE} if opts.val_fraction else {}),  # (a folder holding nothing out: as before)
               "tokenizer": tok, "shard_tokens": opts.shard_tokens, "format_version": FORMAT_VERSION}
    if opts.format == "chat":  # the loss mask depends on the template and on the rule that reads it
        template = chat_template_for(opts.tokenizer)
        request["chat"] = {"mask_rule": CHAT_MASK_RULE, "template_sha256": template_sha256(template)}
    elif opts.add_bos and opts.tokenizer:  # (the trained BPE has no BOS)
        bos = bos_prefix(load_tokenizer(opts.tokenizer, key="--tokenizer"))
        if bos:  # absent otherwise, as in folders prepared before BOS was added
            request["bos"] = bos
    if opts.tokenizer and opts.format == "text":  # an end of text only tokenizer_config.json names (absent
        tok = load_tokenizer(opts.tokenizer, key="--tokenizer")  # otherwise, as before it was read there)
        if eos_id(tok) is None and eos_id(tok, opts.tokenizer) is not None:
            request["eos"] = eos_id(tok, opts.tokenizer)
    return request


def _count(opts: PrepareOptions, files: list[Path]) -> _Stream:
    """Pass 1: the number of documents and the held-out ones (each chosen by its content)."""
    stream = _Stream(files, opts.read_field(), count=-1, val_fraction=opts.val_fraction)
    count, roles, digests, held = 0, {}, array("Q"), HeldOut(opts.val_fraction)
    for _, _, doc in stream.documents():
        count += 1
        held.add(doc_digest := digest(doc))
        if count <= COPIES_CHECKED_UP_TO:  # (8 bytes a document, in RAM: a web-scale corpus is not checked)
            digests.append(doc_digest)
        if opts.format == "chat":
            note_roles(roles, doc)
    if count == 0:
        raise DataError(f"{', '.join(opts.inputs)} contains no text (all documents are empty)")
    if count == 1 and opts.format == "chat" and opts.val_fraction:
        raise DataError(f"{', '.join(opts.inputs)} holds one conversation; chat data needs at least two "
                        "(one is held out)")
    if opts.format == "chat":
        check_replies(", ".join(opts.inputs), roles)
    stream.count, stream.not_read = count, [str(f) for path in opts.inputs for f in files_not_read(path)]
    stream.held = held.result() if count > 1 else stream.held
    stream.duplicated = held_out_in_training(digests, stream.held) if count <= COPIES_CHECKED_UP_TO else None
    return stream


def _tokenizer(opts: PrepareOptions, stream: _Stream, template: ChatTemplate | None,
               trained: Tokenizer | None) -> Tokenizer:
    """Pass 2 (without --tokenizer): the BPE the raw-text path would train on the same data, or the
    one an interrupted prepare of this request trained (`trained`)."""
    if opts.tokenizer:
        return load_tokenizer(opts.tokenizer, key="--tokenizer")
    if trained is not None:
        _say(opts, "using the byte-level BPE the interrupted prepare trained (its tokenizer.json)")
        return trained
    _say(opts, f"training a byte-level BPE of {opts.vocab_size} tokens on the training documents")
    return get_tokenizer(stream.training_texts(opts.format == "chat", template), "", opts.vocab_size)


def _interrupted_bpe(root: Path, request: dict) -> Tokenizer | None:
    """The BPE an interrupted prepare of this request trained, which its progress file names by hash:
    the rerun that resumes it reads its documents once more to train it again, otherwise."""
    try:
        state = json.loads((root / PROGRESS).read_text(encoding="utf-8"))
        saved = dict(state["request"])
        sha = saved.pop("tokenizer_sha256")
        if saved != request or request["tokenizer"][0] != "bpe" or not state.get("documents_done"):
            return None
        tok = load_tokenizer(str(root / TOKENIZER), key="")
        return tok if tokenizer_hash(tok) == sha else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, DataError):
        return None


def _resume_state(root: Path, request: dict, opts: PrepareOptions) -> dict:
    """The committed state of an interrupted prepare of the same request, else a fresh start (what
    an interrupted one of another request had done is said as it is dropped)."""
    try:
        state = json.loads((root / PROGRESS).read_text(encoding="utf-8"))
        if state.get("request") == request:
            if state.get("documents_done"):
                _say(opts, f"resuming an interrupted prepare at document {state['documents_done']:,}")
            return state
        if state.get("documents_done"):
            _say(opts, f"the interrupted prepare in {root} was of other inputs or options "
                       f"({differs(state['request'], request)}): starting over, its "
                       f"{state['documents_done']:,} documents done dropped")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    state = {"request": request, "documents_done": 0, "splits": {}}
    _atomic_write(root / PROGRESS, json.dumps(state))  # before anything is deleted or written
    for name in SPLITS:
        shutil.rmtree(root / name, ignore_errors=True)
    return state


def _tokenize_all(opts, root: Path, stream: _Stream, writers: dict, state: dict, template, lock_fd: int) -> None:
    """Pass 3: tokenize every document not yet committed, committing after each full shard."""
    progress = Progress(opts.progress, stream.pieces, state["documents_done"], sum(w.tokens for w in writers.values()))
    commits = 0
    job = EncodeJob(str(root / TOKENIZER), opts.format == "chat", template, writers["train"].dtype,
                    state["request"].get("bos", []))
    unit = _unit_of_work(opts, job, stream)
    chunks = encoded_chunks(job, stream.documents(state["documents_done"]), unit, opts.workers,
                            inherited=(lock_fd,))  # (a worker holding the lock kept it past a killed prepare)
    for n_docs, n_bytes, encoded in chunks:
        for name, (tokens, lengths, mask) in encoded.items():
            writers[name].add(tokens, lengths, mask)
        state["documents_done"] += n_docs
        progress.update(n_docs, n_bytes, sum(len(e[0]) for e in encoded.values()))
        if writers["train"].pending >= opts.shard_tokens:
            _commit(root, writers, state)
            commits += 1
            if commits == opts.stop_after_shards:
                raise PrepareStopped(f"stopped after {commits} shard(s), as asked")
    _commit(root, writers, state)
    progress.done()


def _unit_of_work(opts, job: EncodeJob, stream: _Stream) -> int:
    """The UTF-8 bytes of text sent to a worker at a time. A shard commits at the first unit past
    --shard-tokens (whole documents), so a unit holds about a quarter of a shard's tokens at the tokens
    a byte of the corpus's first 64 KB (English through a large BPE ~0.25; CJK through a small one up
    to 1): units of a fixed 4 bytes a token made a small --shard-tokens's shards of CJK text 3-12x what
    it asked. Read from the corpus's head, not from what this pass has seen: a resumed prepare, and
    one with other --workers, cut the same shards."""
    if opts.shard_tokens >= 4 * opts.chunk_bytes or stream.count == 1:  # (the default; a lone document)
        return opts.chunk_bytes
    head, size = [], 0
    for _, split, doc in stream.documents():
        head.append((split, doc[: 1 << 16] if isinstance(doc, str) else doc))  # (a first document of GBs)
        size += utf8_bytes(head[-1][1])
        if size >= 1 << 16:
            break
    _, n_bytes, encoded = encode_chunk(job, head)
    per_byte = sum(len(e[0]) for e in encoded.values()) / n_bytes if n_bytes else 1.0
    return int(min(opts.chunk_bytes, max(1 << 12, opts.shard_tokens / 4 / max(per_byte, 1e-3))))


def _commit(root: Path, writers: dict, state: dict) -> None:
    for w in writers.values():
        w.flush()
    state["splits"] = {name: w.state() for name, w in writers.items()}
    _atomic_write(root / PROGRESS, json.dumps(state))


def _finish(root: Path, request: dict, writers: dict, tok: Tokenizer, stream: _Stream) -> dict:
    """Write the manifest (atomically, last) and drop the progress file."""
    splits = {name: {**w.state(), "docs_sha256": file_sha256(root / name / "docs.idx")} for name, w in writers.items()}
    manifest = {"format_version": FORMAT_VERSION, "format": request["format"], "request": request,
                "tokenizer_sha256": request["tokenizer_sha256"], "vocab_size": tok.get_vocab_size(),
                "eos_id": eos_id(tok, root / TOKENIZER), "bos_ids": request.get("bos", []),
                "dtype": np.dtype(writers["train"].dtype).name, "val_fraction": request["val_fraction"],
                "input_documents": stream.count, "empty_documents": stream.empty,
                "held_out_in_training": stream.duplicated, "files_not_read": stream.not_read, "splits": splits,
                "train_fingerprint": _train_fingerprint(root, splits["train"]["shards"], writers["train"].dtype)}
    _atomic_write(root / MANIFEST, json.dumps(manifest, indent=1))
    (root / PROGRESS).unlink(missing_ok=True)
    return manifest


def _train_fingerprint(root: Path, shards: list[dict], dtype: np.dtype) -> str:
    """The training tokens' fingerprint, read from the folder's shards (one pass)."""
    return token_fingerprint(np.memmap(root / shard["file"], dtype=dtype, mode="r")
                             for shard in shards if shard["tokens"])


def _with_fingerprint(root: Path, manifest: dict) -> dict:
    """A manifest written before the training tokens' fingerprint existed, given one (a read of
    the shards): a resume on the folder is then compared. Running prepare again adds it."""
    if "train_fingerprint" in manifest:
        return manifest
    manifest = {**manifest, "train_fingerprint": _train_fingerprint(root, manifest["splits"]["train"]["shards"],
                                                                   np.dtype(manifest["dtype"]))}
    _atomic_write(root / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _say(opts: PrepareOptions, message: str) -> None:
    if opts.progress and message:
        print(f"prepare: {message}", file=sys.stderr, flush=True)
