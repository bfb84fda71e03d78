"""Read documents from the shipped corpus or a user's files.

Accepted: `.txt` (documents separated by two or more blank lines), `.jsonl` (one
object per line with a text field), `.parquet` (a text column), each optionally
gzipped (`.gz`), or a folder holding such files (read in sorted order).
"""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from pathlib import Path

from shardline.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
_DOC_BREAK = re.compile(r"\n[ \t]*\n[ \t]*\n+")


def shipped_corpus() -> Path:
    return Path(str(resources.files("shardline.data") / "corpus" / "kjv.jsonl.gz"))


def read_documents(path: str, text_field: str = "text") -> list[str]:
    """All non-empty documents under `path` ("" = the shipped corpus)."""
    root = Path(path) if path else shipped_corpus()
    if not root.exists():
        raise DataError(f"data.path={path!r} does not exist; give a file ({', '.join(SUFFIXES)}, "
                        "optionally .gz) or a folder of them")
    files = sorted(p for p in root.rglob("*") if _kind(p)) if root.is_dir() else [root]
    if not files:
        raise DataError(f"data.path={path!r} holds no {', '.join(SUFFIXES)} files")
    docs: list[str] = []
    for f in files:
        docs.extend(d for d in _read_file(f, text_field) if d.strip())
    if not docs:
        raise DataError(f"data.path={path or str(root)!r} contains no text (all documents are empty)")
    return docs


def _kind(p: Path) -> str | None:
    name = p.name.removesuffix(".gz")
    return next((s for s in SUFFIXES if name.endswith(s)), None) if p.is_file() else None


def _read_text(f: Path) -> str:
    try:
        raw = gzip.decompress(f.read_bytes()) if f.name.endswith(".gz") else f.read_bytes()
        return raw.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read data file {f}: {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"data file {f} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_file(f: Path, text_field: str) -> list[str]:
    kind = _kind(f)
    if kind is None:
        raise DataError(f"data file {f} has an unsupported type; use {', '.join(SUFFIXES)} (optionally .gz)")
    if kind == ".txt":
        return _DOC_BREAK.split(_read_text(f))
    if kind == ".jsonl":
        return _read_jsonl(f, text_field)
    return _read_parquet(f, text_field)


def _read_jsonl(f: Path, text_field: str) -> list[str]:
    docs = []
    for n, line in enumerate(_read_text(f).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"data file {f} line {n} is not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise DataError(f"data file {f} line {n} has no string field {text_field!r} (set data.text_field)")
        docs.append(obj[text_field])
    return docs


def _read_parquet(f: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(f).names
        if text_field not in columns:
            raise DataError(f"data file {f} has no column {text_field!r} (set data.text_field; it has "
                            f"{', '.join(columns[:8])})")
        table = pq.read_table(f, columns=[text_field])
    except DataError:
        raise
    except Exception as e:  # pyarrow raises several types, with multi-line messages, for a damaged file
        raise DataError(f"cannot read parquet file {f}: {' '.join(str(e).split())}") from None
    return [t for t in table.column(text_field).to_pylist() if isinstance(t, str)]
