"""Read documents from the shipped corpus or a user's files, as a stream.

Accepted: `.txt` (documents separated by two or more blank lines), `.jsonl` or `.ndjson` (one object per
line with a text field), `.parquet` (a text column), `.arrow` (the files of a Hugging Face
`datasets.save_to_disk` folder; read with pyarrow, `datasets` itself is not needed), each optionally
gzipped (`.gz`), a folder holding such files (read in sorted order; a `save_to_disk` DatasetDict folder
reads its `train` split), or a glob pattern of them (`data/train-*.parquet`).

Every reader streams (one line, one parquet batch or one .txt document in memory), so `prepare` reads
corpora larger than RAM; training and `prepare` read through it alike: the same documents, in order.
"""

from __future__ import annotations

import glob
import codecs
import contextlib
import gzip
import io
import itertools
import json
import os
import re
import zlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from shardline.data.conversation import (CHAT_FIELD, PAIR_FIELDS, SHAREGPT_FIELD, conversation, record_hint,
                                         record_messages, strings)
from shardline.data.folders import folder_entries, read_once, read_root
from shardline.data.not_text import convert_hint
from shardline.data.shards import is_prepared
from shardline.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow", ".ndjson")  # (.ndjson: JSON lines too)
# Two blank lines end a document (in text read with universal newlines); a line of any whitespace is blank
_DOC_BREAK = re.compile(r"\n[^\S\n]*\n[^\S\n]*\n+")  # (a full-width space U+3000 as Chinese indents, a no-break space)
_LINE_END = re.compile(rb"\r\n?|\n")  # (as universal newlines end lines: \n, \r\n or a lone \r, an old Mac's)
_CHUNK = 1 << 20  # characters of a .txt file decoded at a time
_GLOB = re.compile(r"[*?[]")


def shipped_corpus() -> Path:
    return Path(str(resources.files("shardline.data") / "corpus" / "kjv.jsonl.gz"))


def read_documents(path: str, text_field: str = "text", left_out: dict | None = None,
                   key: str = "data.path") -> list:
    """All non-empty documents under `path` ("" = the shipped corpus), in memory. `left_out`, when
    given, gets what was not trained on, so that a launch can say so: "empty_documents" (null,
    empty or blank texts) and "files_not_read" (see `files_not_read`). `key`: the config key naming
    `path` in errors (a mixture's source: data.mix[i].path)."""
    docs, empty = [], 0
    for f in input_files(path, key):
        for d in read_file(f, text_field):
            if not d or (isinstance(d, str) and not d.strip()):  # blank text, a conversation of no messages
                empty += 1
            else:
                docs.append(d)
    if not docs:
        raise DataError(f"{key}={path or str(shipped_corpus())!r} contains no text (all documents are empty)")
    if left_out is not None:
        left_out["empty_documents"] = left_out.get("empty_documents", 0) + empty
        left_out["files_not_read"] = left_out.get("files_not_read", []) + [str(f) for f in files_not_read(path)]
    return docs


_DATASET_METADATA = {"dataset_info.json", "state.json", "dataset_dict.json"}  # a save_to_disk folder's own: not text


def files_not_read(path: str) -> list[Path]:
    """The files of a folder input that no reader takes (a README, a .json that is not JSON lines,
    a .csv): skipped, so a launch names them. Hidden files and a `datasets` folder's metadata are not
    named; a file or a glob pattern names its files itself."""
    root = Path(path) if path else None
    if root is None or not root.is_dir():
        return []
    return [p for p in folder_entries(read_root(root))
            if p.is_file() and not _kind(p) and p.name not in _DATASET_METADATA]


def input_files(path: str, key: str = "data.path") -> list[Path]:
    """The data files under `path` in reading order, or a DataError naming the path as `key` (the config
    key, or `shardline prepare`'s input). A path that does not exist as written but holds glob characters
    (`data/train-*.parquet`, `shards/**/*.jsonl`) is a pattern: the data files it matches, and those
    under the folders it matches, in sorted order."""
    root = Path(path) if path else shipped_corpus()
    if not root.exists() and _GLOB.search(path):
        return _matched_files(path, key)
    if not root.exists():
        prepared = " or a folder made by `shardline prepare`" if key.startswith("data.") else ""  # (prepare: not)
        raise DataError(f"{key}={path!r} does not exist; give a file ({', '.join(SUFFIXES)}, "
                        f"optionally .gz), a folder of them, a glob pattern of them{prepared}")
    root = read_root(root) if root.is_dir() else root  # (a save_to_disk DatasetDict: its train split)
    entries = folder_entries(root) if root.is_dir() else []
    files = [p for p in entries if _kind(p)] if root.is_dir() else [root]
    _refuse_broken_links(path, entries, key)
    if not files:
        raise DataError(f"{key}={path!r} holds no {', '.join(SUFFIXES)} files")
    _refuse_held_out(path, root if root.is_dir() else root.parent, files, key)
    return files


def inputs_files(paths: list[str], key: str) -> list[Path]:
    """The data files of several inputs (prepare's), each read once, in the order given. A
    dataset's held-out file given beside training files as an input of its own (a shell's
    `data/*.jsonl` passes validation.jsonl so) is refused, as it is inside one folder: each file
    judged by its name below the input that named it (a file: its own name)."""
    seen: dict[Path, Path] = {}
    held_out = []
    for path in paths:
        root = _input_root(path)
        for f in input_files(path, key):
            if seen.setdefault(f.resolve(), f) is f and _held_out_name(f.relative_to(root) if root else Path(f.name)):
                held_out.append(f)
    files = list(seen.values())
    if held_out and len(held_out) < len(files):
        raise DataError(f"{key}s hold held-out files ({', '.join(f.name for f in held_out[:3])}) beside the "
                        "training files, and every input is trained on: leave them out (a share of the training "
                        "files is held out for evaluation: --val-fraction)")
    return files


def _input_root(path: str) -> Path | None:
    """What an input's files are named below: a folder, a pattern's fixed part; None for a file."""
    p = Path(path)
    if p.is_dir():
        return p
    return _fixed_part(path) if not p.exists() and _GLOB.search(path) else None


def _fixed_part(pattern: str) -> Path:
    """The folder a glob pattern's matches lie below: its parts before the first with a glob character."""
    return Path(*[part for part in itertools.takewhile(lambda q: not _GLOB.search(q), Path(pattern).parts)])


def _matched_files(pattern: str, key: str) -> list[Path]:
    """The data files a glob pattern names. The held-out check reads the names below the pattern's
    fixed folder, so `data/*` beside `data/validation.jsonl` is refused as the folder `data` is."""
    matches = [Path(m) for m in sorted(glob.glob(pattern, recursive=True))]
    entries = [f for m in matches for f in (folder_entries(m) if m.is_dir() else [m])]
    _refuse_broken_links(pattern, entries, key)
    files = read_once(f for f in entries if _kind(f))  # (a folder and a link to it both matched: its files once)
    prepared = [m for m in matches if m.is_dir() and is_prepared(str(m))]
    if prepared:  # a prepared folder holds shards, not text, and a mixture is how several are combined
        raise DataError(f"{key}={pattern!r} matches the prepared folder {prepared[0]}: give a prepared folder "
                        "by its own path (several: data.mix); a pattern reads raw text files")
    if not files:
        what = f"matches {len(matches)} path(s) but no {', '.join(SUFFIXES)} file" if matches else "matches no path"
        raise DataError(f"{key}={pattern!r} {what} (a pattern: the path does not exist as written)")
    _refuse_held_out(pattern, _fixed_part(pattern), files, key)
    return files


def _refuse_broken_links(path: str, entries, key: str) -> None:
    """A data file that is a link to nothing (a Hugging Face cache with a blob missing) was skipped in
    silence, its documents not trained on: refused, named."""
    for entry in entries:
        if entry.is_symlink() and not entry.exists() and entry.name.lower().removesuffix(".gz").endswith(SUFFIXES):
            raise DataError(f"{key}={path!r}: {entry} is a link to {os.readlink(entry)}, which does not exist; "
                            "restore its target or remove the link")


def _refuse_held_out(path: str, root: Path, files: list[Path], key: str) -> None:
    """A folder's own validation or test files are not trained on beside its training files."""
    held_out = [f for f in files if _held_out_name(f.relative_to(root))]
    if held_out and len(held_out) < len(files):
        names = ", ".join(str(f.relative_to(root)) for f in held_out[:3]) + (" ..." if len(held_out) > 3 else "")
        if key == "data.val_path":  # (the reverse mistake: training files evaluated on)
            raise DataError(f"{key}={path!r} holds training files beside its held-out files ({names}), and every "
                            f"file of a folder is evaluated on: point {key} at the held-out files' own file or "
                            "folder (or a glob pattern of them)")
        raise DataError(f"{key}={path!r} holds held-out files ({names}) beside the training files, and every file "
                        f"of a folder is trained on: point {key} at the training files' own file or folder "
                        "(a share of them is held out for evaluation: data.val_fraction, prepare's --val-fraction; "
                        "or evaluate on the held-out files themselves: data.val_path)")


_HELD_OUT = {"val", "valid", "validation", "test", "testing", "dev", "eval", "evaluation", "heldout"}


def _held_out_name(relative: Path) -> bool:
    """A file a dataset's own split names as held out: validation.jsonl, data/test-0000.parquet,
    dev/part-1.jsonl (a word of its name or of a folder's, between separators)."""
    words = {w for part in relative.parts for w in re.split(r"[^a-z]+", part.lower().split(".")[0]) if w}
    return bool(words & _HELD_OUT)


def _kind(p: Path) -> str | None:
    name = p.name.lower().removesuffix(".gz")  # A.TXT is text too (a folder's were skipped in silence)
    return next((s for s in SUFFIXES if name.endswith(s)), None) if p.is_file() else None


def read_file(f: Path, field: str) -> Iterator:
    """The values of `field` in one file (for .txt: its documents), streamed."""
    kind = _kind(f)
    if kind is None:
        raise DataError(f"data file {f} has an unsupported type; use {', '.join(SUFFIXES)} (optionally .gz)"
                        + ("; JSON lines in a .json file are read once it is named .jsonl" * (f.suffix == ".json")))
    if kind == ".txt":
        if field == CHAT_FIELD:  # plain text holds no roles to mask by
            raise DataError(f"data file {f} is plain text, but the chat format reads conversations: a "
                            f"'{CHAT_FIELD}' list of {{role, content}} (or ShareGPT's 'conversations' of "
                            "{from, value}) per record of a .jsonl, .parquet or .arrow file")
        return _read_txt(f)
    if kind in (".jsonl", ".ndjson"):
        return _read_jsonl(f, field)
    return _read_table(f, field, kind)


def _open(f: Path):
    return gzip.open(f, "rb") if f.name.lower().endswith(".gz") else open(f, "rb")


def _guarded(f: Path, lines: Iterator):
    """Re-raise a damaged or non-UTF-8 file as one DataError naming it."""
    try:
        yield from lines
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:  # zlib.error: damaged compressed bytes
        raise DataError(f"cannot read data file {f}: {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"data file {f} is not UTF-8 text{_where_not_utf8(f)} ({e.reason}){convert_hint(e)}") from None


def _where_not_utf8(f: Path) -> str:
    """' at line N (byte offset B)': where `f` first is not UTF-8 (its text is decoded in chunks, knowing no line)."""
    decoder, line, offset, after_cr = codecs.getincrementaldecoder("utf-8")(), 1, 0, False
    with contextlib.suppress(OSError, EOFError, zlib.error), _open(f) as raw:
        while True:
            block, held = raw.read(1 << 20), len(decoder.getstate()[0])  # (held: a sequence the last cut in two)
            seam = after_cr and block.startswith(b"\n")  # a \r\n the read cut in two: counted at its \r
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                at = line + len(_LINE_END.findall(block, 0, max(e.start - held, 0))) - seam
                return f" at line {at:,} (byte offset {offset - held + e.start:,})"
            if not block:
                return ""
            line, offset = line + len(_LINE_END.findall(block)) - seam, offset + len(block)
            after_cr = block.endswith(b"\r")
    return ""


def _read_txt(f: Path) -> Iterator[str]:
    return _guarded(f, _split_txt(f))


def _split_txt(f: Path) -> Iterator[str]:
    """Documents of a .txt file, split as `_DOC_BREAK.split(whole_text)` would, one chunk at a time.

    A break is only accepted when it ends before the buffer does: the next chunk could extend it (more
    newlines) or a longer break could start in it. A break is whitespace only, so each chunk is scanned
    from the trailing whitespace of the text before it, and a long document is kept as pieces joined
    once: linear time however long it is."""
    with _open(f) as raw:
        # (a BOM some editors write: not text; Windows' and old Macs' line ends read as "\n", as Python's
        # open() and HF's text loader read them: a model does not learn to write "\r")
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline=None)
        pieces: list[str] = []  # the current document so far, less `tail`
        tail = ""  # the whitespace it ends with, where the next break may start
        while chunk := text.read(_CHUNK):
            buf, start = tail + chunk, 0
            for m in _DOC_BREAK.finditer(buf):
                if m.end() >= len(buf):
                    break
                pieces.append(buf[start : m.start()])
                yield from _unless_blank("".join(pieces))
                pieces, start = [], m.end()
            rest = buf[start:]
            body = rest.rstrip()  # (what a break may be made of)
            pieces.append(body)
            tail = rest[len(body):]
        for doc in _DOC_BREAK.split("".join(pieces) + tail):  # at the end of the file every break counts
            yield from _unless_blank(doc)


def _unless_blank(doc: str) -> Iterator[str]:
    """A .txt document, unless blank: blank lines before the first or after the last are no empty
    record (a run's empty_documents_skipped sent users looking for bad records that were not there)."""
    if doc.strip():
        yield doc


def _read_jsonl(f: Path, field: str) -> Iterator:
    return _guarded(f, _jsonl_values(f, field))


def _jsonl_values(f: Path, field: str) -> Iterator:
    with _open(f) as raw:
        for n, line in enumerate(raw, start=1):
            try:
                line = line.decode("utf-8-sig" if n == 1 else "utf-8")  # (a byte-order mark some editors write)
            except UnicodeDecodeError as e:
                raise DataError(f"data file {f} line {n} is not UTF-8 text ({e.reason}){convert_hint(e)}") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"data file {f} line {n} is not valid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(obj, dict):  # (a list, a bare string: JSON lines hold one record, an object, a line)
                raise DataError(f"data file {f} line {n} is a JSON {type(obj).__name__}: give one object a line")
            value = obj.get(field)
            if field == CHAT_FIELD:
                messages = conversation(f, f"line {n}", record_messages(obj), record_hint(obj))
                for text in strings(messages):  # tool calls and other fields reach the template too
                    _encodable(f, n, text)
                yield messages
            elif isinstance(value, str):
                yield _encodable(f, n, value)
            elif value is None and field in obj:  # null, as a parquet null row: an
                yield ""  # empty document, counted as one (a missing field is likely the wrong data.text_field)
            else:
                chat = isinstance(record_messages(obj), list)  # a conversation, not text
                said = ("; it holds a conversation: read it as chat (data.format=chat, or in "
                        "data.mix the source's format = \"chat\"; prepare: --format chat)" if chat else "")
                held = f" (its value: {json.dumps(value)[:40]})" if value is not None else ""  # (a number, a list)
                raise DataError(f"data file {f} line {n} has no string field {field!r}{held} (set data.text_field, "
                                f"or in data.mix the source's text_field; prepare: --text-field)"
                                f"{said or record_hint(obj) * (field not in obj)}")


def _encodable(f: Path, n: int, text: str) -> str:
    """`text`, or a DataError naming the line where JSON's escapes made it no Unicode text: half of
    an emoji's surrogate pair (`"\\ud83d"` alone, common in scraped data), which no tokenizer encodes."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"data file {f} line {n} holds a lone surrogate escape ({text[e.start]!a}, half of a "
                            "character's UTF-16 pair), which is no text: fix or drop that record") from None
    return text


def _read_table(f: Path, field: str, kind: str) -> Iterator:
    try:
        batches = _arrow_batches(f, field, kind)
        for batch in batches:
            values = batch.column(0).to_pylist()
            if field == CHAT_FIELD:  # a null row holds no conversation: an empty document, counted as one
                second = batch.column(1).to_pylist() if batch.num_columns == 2 else None
                if batch.schema.names[0] == PAIR_FIELDS[0]:  # (prompt/completion columns: a conversation a row;
                    pairs = [{"prompt": p, "completion": c} for p, c in zip(values, second)]  # a half-null one is
                    values = [None if p["prompt"] is None and p["completion"] is None else  # refused as a .jsonl
                              conversation(f, "a row", record_messages(p), record_hint(p)) for p in pairs]  # line is)
                elif second is not None:  # (messages and ShareGPT's conversations, as merged sets hold them)
                    values = [m if m is not None else c for m, c in zip(values, second)]
                yield from ("" if v is None else conversation(f, "a row", v) for v in values)
                continue
            values = ["" if v is None else v for v in values]  # a null row: an empty document, counted as one
            wrong = next((v for v in values if not isinstance(v, str)), None)
            if wrong is not None:
                raise DataError(f"data file {f}: column {field!r} holds {type(wrong).__name__} values, not text "
                                "(set data.text_field, or in data.mix the source's text_field, to a text column; "
                                "prepare: --text-field)")
            yield from values
    except DataError:
        raise
    except Exception as e:  # pyarrow raises several types, with multi-line messages, for a damaged file
        raise DataError(f"cannot read {kind[1:]} file {f}: {' '.join(str(e).split())}") from None


def _arrow_batches(f: Path, field: str, kind: str) -> Iterator:
    """Record batches of column `field` of a parquet or arrow (IPC stream or file) table."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    source = pa.BufferReader(gzip.decompress(f.read_bytes())) if f.name.lower().endswith(".gz") else str(f)
    if kind == ".parquet":
        reader = pq.ParquetFile(source)
        return reader.iter_batches(batch_size=1024, columns=_columns(f, field, reader.schema_arrow.names))
    stream = pa.memory_map(source) if isinstance(source, str) else source
    try:
        reader = ipc.open_stream(stream)
    except pa.ArrowInvalid:
        stream.seek(0)
        file_reader = ipc.open_file(stream)
        reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        columns = _columns(f, field, file_reader.schema.names)
        return (b.select(columns) for b in reader)
    columns = _columns(f, field, reader.schema.names)
    return (b.select(columns) for b in reader)


def _columns(f: Path, field: str, columns: list[str]) -> list[str]:
    """The columns to read for `field`: itself; for chat's messages, ShareGPT's conversations too where
    the table has them (a row whose messages are null reads them)."""
    if field == CHAT_FIELD and SHAREGPT_FIELD in columns:
        return [c for c in (CHAT_FIELD, SHAREGPT_FIELD) if c in columns]
    if field == CHAT_FIELD and CHAT_FIELD not in columns and all(c in columns for c in PAIR_FIELDS):
        return list(PAIR_FIELDS)
    if field not in columns:
        raise DataError(f"data file {f} has no column {field!r} (set data.text_field, or in data.mix the "
                        f"source's text_field; prepare: --text-field; it has {', '.join(columns[:8])})")
    return [field]
