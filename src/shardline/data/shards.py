"""A prepared folder (made by `shardline prepare`), read through memory maps.

Layout of a folder:

    manifest.json        written last: its presence means every file below is complete
    tokenizer.json       the tokenizer the tokens were made with (sha256 in the manifest)
    train/tokens-NNNNN.bin   the split's token stream in shards (uint16 or uint32)
    train/mask-NNNNN.bin     chat only: 1 byte per token, 1 = loss target
    train/docs.idx           int64: where each document starts in the split's stream
    val/...                  the same for the held-out split

`SplitWriter` writes a split (for `prepare`). Opening a folder reads the manifest and
the tokenizer and checks every file's size; it reads no token. A batch then reads only
its own windows from the page cache, so start-up time and memory per rank do not grow
with the corpus (but for the sampler's permutation: 8 bytes per sequence; and for chat data,
packing its conversations into rows: data/packing.py `pack_rows`, ~0.6 s a million conversations,
4 bytes kept a conversation and 16 a row). Checksums
are checked by `shardline prepare --verify DIR` (that reads everything).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from shardline.data.packing import PackedSequences
from shardline.data.readers import MANIFEST, reading
from shardline.data.tokenizer import bos_prefix, extension_gap, load_tokenizer
from shardline.errors import DataError, links_outside, outside_folder

PROGRESS, TOKENIZER = "progress.json", "tokenizer.json"  # (MANIFEST: readers.py's, which locks it)
FORMAT_VERSION = 1
SPLITS = ("train", "val")
_OPEN_MAPS = 64  # memory maps kept open at once (each holds a file descriptor)


def is_prepared(path: str) -> bool:
    """A folder made (or being made) by `shardline prepare`. A run dir's progress.json (goodput's
    account, of the same name) does not make one."""
    p = Path(path) if path else None
    if p is None:
        return False
    return (p / MANIFEST).is_file() or (p / "train" / "docs.idx").is_file() or _prepare_progress(p / PROGRESS)


def _prepare_progress(path: Path) -> bool:
    """A progress.json there that is not a training run's goodput account (which holds its high-water step,
    beside the run's files: a garbled account, any JSON, must not make its run dir "data")."""
    with contextlib.suppress(OSError, ValueError, TypeError):  # (a list, a string: no account)
        if "high_water_step" in dict(json.loads(path.read_text(encoding="utf-8"))):
            return False
    return path.is_file() and not ((path.parent / "checkpoints").is_dir() or (path.parent / "metrics.jsonl").is_file())


def prepared_with_own_bpe(path: str) -> bool:
    """A prepared folder whose tokenizer `shardline prepare` trained on the folder's text (no
    --tokenizer given); False where the manifest cannot tell (opening the folder says why)."""
    try:
        request = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8")).get("request", {})
        return request.get("tokenizer", [None])[0] == "bpe"
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return False


def tokenizer_hash(tok: Tokenizer) -> str:
    """Which tokenizer `tok` is, as the installed `tokenizers` writes it: compare two hashes made by
    the same version only (an upgrade may write the same tokenizer differently). A folder's
    manifest holds the hash of its tokenizer.json's bytes, which prepare wrote as this text."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def token_fingerprint(chunks) -> str:
    """A short hash of a token stream given in order as arrays of any integer dtype (the ids as
    4-byte little-endian): the same for raw files tokenized at launch and for their prepared
    folder, different for other text of the same length. A resume compares it with the saved one."""
    digest = hashlib.sha256()
    for chunk in chunks:
        for start in range(0, len(chunk), 1 << 22):  # 16 MB at a time: a shard is not copied whole
            digest.update(np.ascontiguousarray(chunk[start:start + (1 << 22)], dtype="<u4").tobytes())
    return digest.hexdigest()[:16]


def id_bound(tok: Tokenizer) -> int:
    """One past the largest token id: a vocabulary with gaps has ids beyond its size."""
    return max(tok.get_vocab_size(), max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class TokenShards:
    """One split's token stream (or loss mask) spread over shard files, memory-mapped lazily."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: np.dtype):
        self.paths, self.sizes, self.dtype = paths, sizes, np.dtype(dtype)
        self.bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def _map(self, k: int) -> np.memmap:
        if k not in self._maps:
            if len(self._maps) >= _OPEN_MAPS:
                self._maps.popitem(last=False)
            self._maps[k] = np.memmap(self.paths[k], dtype=self.dtype, mode="r", shape=(self.sizes[k],))
        self._maps.move_to_end(k)
        return self._maps[k]

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows stream[start : start + length], read from the shards that hold them."""
        starts = np.asarray(starts, dtype=np.int64)
        return self.runs(starts, np.full(len(starts), length, dtype=np.int64)).reshape(len(starts), length)

    def runs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """stream[start : start + length] for each (start, length), concatenated: contiguous reads (a
        chat row's conversations), a run that crosses into the next shard read from both."""
        parts, shards = [], np.searchsorted(self.bounds, starts, side="right") - 1
        for k, start, length in zip(shards.tolist(), np.asarray(starts).tolist(), np.asarray(lengths).tolist()):
            while length > 0:
                lo = start - int(self.bounds[k])
                take = min(length, self.sizes[k] - lo)
                parts.append(self._map(k)[lo:lo + take])
                start, length, k = start + take, length - take, k + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)


class SplitWriter:
    """Appends one split's documents to its shards; `flush` commits the buffered ones as a shard."""

    def __init__(self, root: Path, name: str, dtype: np.dtype, chat: bool, state: dict | None):
        self.root, self.name, self.dtype, self.chat = root, name, dtype, chat
        state = state or {"shards": [], "tokens": 0, "documents": 0}
        self.shards, self.tokens, self.documents = state["shards"], state["tokens"], state["documents"]
        self.buffer: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        self.pending = 0
        (root / name).mkdir(parents=True, exist_ok=True)
        self._drop_uncommitted()

    def _drop_uncommitted(self) -> None:
        """Delete what an interrupted run wrote after its last commit."""
        keep = {s[k] for s in self.shards for k in ("file", "mask") if k in s}
        for f in (self.root / self.name).iterdir():
            if f.name != "docs.idx" and f"{self.name}/{f.name}" not in keep:
                f.unlink()
        with open(self.root / self.name / "docs.idx", "ab") as idx:
            idx.truncate(self.documents * 8)

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        if len(lengths):
            self.buffer.append((tokens, lengths, mask))
            self.pending += len(tokens)

    def flush(self) -> None:
        if not self.buffer:
            return
        tokens = np.concatenate([b[0] for b in self.buffer])
        if len(tokens) and tokens.max() > np.iinfo(self.dtype).max:  # would wrap silently in astype
            raise DataError(f"token id {int(tokens.max())} does not fit the folder's {self.dtype} shards")
        tokens = tokens.astype(self.dtype)
        lengths = np.concatenate([b[1] for b in self.buffer])
        shard = {"file": self._write("tokens", tokens)}
        if self.chat:
            shard["mask"] = self._write("mask", np.concatenate([b[2] for b in self.buffer]))
        shard.update({f"{k}_sha256": file_sha256(self.root / v) for k, v in list(shard.items())},
                     tokens=len(tokens), documents=len(lengths))
        starts = self.tokens + np.cumsum(lengths) - lengths
        with open(self.root / self.name / "docs.idx", "ab") as idx:
            idx.write(starts.astype(np.int64).tobytes())
        self.shards.append(shard)
        self.tokens += len(tokens)
        self.documents += len(lengths)
        self.buffer, self.pending = [], 0

    def _write(self, kind: str, array: np.ndarray) -> str:
        rel = f"{self.name}/{kind}-{len(self.shards):05d}.bin"
        tmp = self.root / f"{rel}.tmp"
        array.tofile(tmp)
        tmp.replace(self.root / rel)
        return rel

    def state(self) -> dict:
        return {"shards": self.shards, "tokens": self.tokens, "documents": self.documents}


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: PackedSequences
    val: PackedSequences
    manifest: dict


def open_prepared(path: str, seq_len: int, tokenizer_path: str = "", fmt: str = "text",
                  add_bos: bool = True, format_key: str = "data.format") -> PreparedData:
    """The splits of a prepared folder as sequences over its memory-mapped shards; `add_bos`:
    data.add_bos, which the folder's documents must agree with; `format_key` the setting that asked for `fmt`."""
    root = Path(path)
    held = reading(root)  # (kept by the splits: prepare --overwrite waits for no reader, it refuses)
    manifest = read_manifest(root)
    check_manifest_keys(root, manifest)
    tok = _folder_tokenizer(root, manifest, tokenizer_path)
    if manifest["format"] != fmt:
        raise DataError(f"{format_key}={fmt!r} but {path} was prepared as {manifest['format']!r} data; set "
                        f"{format_key}={manifest['format']} or prepare it again with --overwrite --format {fmt}")
    _check_bos(path, manifest, tok, add_bos and fmt == "text")
    splits = [_open_split(root, manifest, name, seq_len) for name in SPLITS]
    splits[0].fingerprint = manifest.get("train_fingerprint")  # (folders prepared before it: None, not compared)
    for split in splits:  # what a token id past the tokenizer's says (shards damaged in place, their sizes kept)
        split.id_bound, split.where, split.reading = id_bound(tok), path, held
    return PreparedData(tok, splits[0], splits[1], manifest)


def _check_bos(path: str, manifest: dict, tok: Tokenizer, add_bos: bool) -> None:
    """The folder's documents start with the BOS tokens data.add_bos asks for, or none (a folder
    prepared before prepare added them has no `bos_ids`: none)."""
    want, have = bos_prefix(tok) if add_bos else [], manifest.get("bos_ids", [])
    if want == have:
        return
    if have:
        raise DataError(f"data.add_bos=false but {path} was prepared with {have} before each document; set "
                        "data.add_bos=true, or prepare it again with --overwrite --no-bos")
    raise DataError(f"data.add_bos=true (the default) and the tokenizer starts a text with {want}, but {path} was "
                    "prepared without it; prepare it again with --overwrite (its documents then start with it), or set "
                    "data.add_bos=false")


def read_manifest(root: Path) -> dict:
    """The manifest of a complete prepared folder, or a DataError saying what to run."""
    if not (root / MANIFEST).is_file():
        raise DataError(f"data.path={str(root)!r} is an unfinished prepared folder (no {MANIFEST}); run "
                        "`shardline prepare` with the same inputs and --out again to finish it")
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        version = manifest["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{root / MANIFEST} is damaged ({type(e).__name__}); prepare the folder again with "
                        "--overwrite") from None
    if version != FORMAT_VERSION:
        raise DataError(f"{root} was prepared in format {version}; this shardline reads format "
                        f"{FORMAT_VERSION}: prepare it again with --overwrite")
    return manifest


def check_manifest_keys(root: Path, manifest: dict) -> None:
    """What opening or verifying the folder reads: a missing key is damage, said here, not a
    KeyError later."""
    try:
        missing = [key for key in ("format", "dtype", "tokenizer_sha256", "splits") if key not in manifest]
        missing += [f"splits.{name}.{key}" for name in SPLITS for key in ("shards", "documents")
                    if key not in manifest.get("splits", {}).get(name, {})]
    except AttributeError:  # splits, or a split, that is not a table
        missing = ["splits"]
    if missing:
        raise DataError(f"{root / MANIFEST} is damaged (no {', '.join(missing)}); prepare the folder again with "
                        "--overwrite")
    wrong = _wrong_values(manifest)
    if wrong:
        raise DataError(f"{root / MANIFEST} is damaged ({wrong}); prepare the folder again with --overwrite")


def _wrong_values(manifest: dict) -> str:
    """The first value opening the folder would misread or fail on (a TypeError, a KeyError, a
    token dtype prepare never writes), or ""."""
    if manifest["dtype"] not in ("uint16", "uint32"):
        return f"dtype {manifest['dtype']!r} is neither uint16 nor uint32"
    for name in SPLITS:
        split = manifest["splits"][name]
        if not _is_count(split["documents"]) or not isinstance(split["shards"], list):
            return f"splits.{name} needs a document count and a list of shards"
        for i, shard in enumerate(split["shards"]):
            keys = ("file", "mask") if manifest["format"] == "chat" else ("file",)
            if not (isinstance(shard, dict) and _is_count(shard.get("tokens"))
                    and all(isinstance(shard.get(k), str) for k in keys)):
                return f"splits.{name}.shards[{i}] needs {', '.join(keys)} and a token count"
            if any(outside_folder(shard[k]) for k in ("file", "mask") if k in shard):  # (it names its own files)
                return f"splits.{name}.shards[{i}] names a file outside the folder"
    return ""


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _folder_tokenizer(root: Path, manifest: dict, tokenizer_path: str) -> Tokenizer:
    """The folder's tokenizer; data.tokenizer, when given, must be the same one."""
    tok = load_tokenizer(str(root / TOKENIZER))
    if not _matches(root / TOKENIZER, manifest["tokenizer_sha256"]):  # its bytes: the same under any version
        raise DataError(f"{root / TOKENIZER} does not match the manifest's tokenizer_sha256; prepare the "
                        "folder again with --overwrite")
    other = load_tokenizer(tokenizer_path) if tokenizer_path else None
    if other is not None and tokenizer_hash(other) != tokenizer_hash(tok):
        raise DataError(f"data.tokenizer={tokenizer_path!r} (given, or the starting weights' own) differs from "
                        f"the tokenizer {root} was prepared with ({other.get_vocab_size():,} tokens; the folder's "
                        f"{tok.get_vocab_size():,}); {_what_to_do(root, tok, other, tokenizer_path)}")
    return tok


def _what_to_do(root: Path, tok: Tokenizer, other: Tokenizer, tokenizer_path: str) -> str:
    """The way out where a folder was prepared with another tokenizer than data.tokenizer: the folder's own
    where it is that one with tokens added, else a prepare with data.tokenizer's; where the folder's has more
    tokens and is built on that one, but is not it grown (tokens added to it with another BOS), what differs,
    as preparing again with data.tokenizer would drop the tokens added."""
    again = f"prepare the folder again with --overwrite --tokenizer {tokenizer_path}"
    gap, built_on = extension_gap(tok, other)
    if not gap:
        return (f"the folder's is this one with tokens added: to train with it, set data.tokenizer={root / TOKENIZER} "
                f"(or leave it unset where you gave it), or {again}")
    if built_on and tok.get_vocab_size() > other.get_vocab_size():
        return f"the folder's is not this one with tokens added ({gap}): add them to this one and prepare with that, " \
               f"or {again}"
    return again


def _open_split(root: Path, manifest: dict, name: str, seq_len: int) -> PackedSequences:
    split = manifest["splits"][name]
    dtype = np.dtype(manifest["dtype"])
    shards = split["shards"]
    tokens = TokenShards(_checked(root, shards, "file", dtype), [s["tokens"] for s in shards], dtype)
    mask = None
    if manifest["format"] == "chat":
        mask = TokenShards(_checked(root, shards, "mask", np.dtype(np.uint8)), [s["tokens"] for s in shards],
                           np.uint8)
    index = root / name / "docs.idx"
    _check_size(root, index, split["documents"] * 8)
    starts = np.memmap(index, dtype=np.int64, mode="r", shape=(split["documents"],)) \
        if split["documents"] else np.zeros(0, np.int64)
    return PackedSequences.from_stream(tokens, starts, seq_len, mask, where=str(index))


def _checked(root: Path, shards: list[dict], kind: str, dtype: np.dtype) -> list[Path]:
    paths = [root / s[kind] for s in shards]
    for path, shard in zip(paths, shards):
        _check_size(root, path, shard["tokens"] * dtype.itemsize)
    return paths


def _check_size(root: Path, path: Path, expected: int) -> None:
    if links_outside(root, path):
        raise DataError(f"prepared folder {root}: {path.relative_to(root)} links to {path.resolve()}, outside the "
                        "folder; a prepared folder holds its own files: copy them in, or prepare it again")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"prepared folder {root} is missing {path.relative_to(root)}, which its manifest "
                        "lists; prepare it again with --overwrite") from None
    if size != expected:
        raise DataError(f"prepared folder {root}: {path.relative_to(root)} has {size} bytes, its manifest "
                        f"says {expected}; prepare it again with --overwrite")


def verify(root: Path) -> list[str]:
    """Files of a prepared folder whose checksum differs from the manifest's, or that are missing
    or unreadable (reads everything)."""
    manifest = read_manifest(root)
    check_manifest_keys(root, manifest)
    bad = []
    for name in SPLITS:
        split = manifest["splits"][name]
        for shard in split["shards"]:
            bad += [shard[k] for k in ("file", "mask") if k in shard and (links_outside(root, root / shard[k])
                    or not _matches(root / shard[k], shard.get(f"{k}_sha256")))]
        index = root / name / "docs.idx"
        if links_outside(root, index) or not _matches(index, split.get("docs_sha256")):
            bad.append(f"{name}/docs.idx")
    return bad + [TOKENIZER] * (not _matches(root / TOKENIZER, manifest["tokenizer_sha256"]))  # (as a run checks it)


def _matches(path: Path, sha256: str | None) -> bool:
    try:
        return file_sha256(path) == sha256
    except OSError:  # deleted or unreadable: as bad as a changed byte
        return False


def tokenizer_file(d) -> str:
    """The tokenizer.json a run's tokenizer comes from (`d`: its DataConfig), whose side files
    (settings, chat template) go with it into the run dir and its exports: data.tokenizer, else the
    first prepared folder's; "" for a BPE trained at start-up."""
    if d.tokenizer:
        return d.tokenizer
    prepared = [path for path in [s.path for s in d.mix] or [d.path] if is_prepared(path)]
    return str(Path(prepared[0]) / TOKENIZER) if prepared else ""
