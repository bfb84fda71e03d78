"""Tokenizer: a byte-level BPE trained on the data (cached), or a user's tokenizer.json."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardline.errors import DataError, links_outside

EOS = "<|endoftext|>"
# The files beside an HF tokenizer.json that go with it: its settings (special tokens), chat
# template, and the slow tokenizer's files of the same vocabulary (BPE's vocab.json and merges.txt,
# SentencePiece's tokenizer.model) that other tools read. `prepare` keeps them in its folder, a run
# in its run dir, `convert to-hf` in the export.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
                        "merges.txt", "tokenizer.model")


def side_file_held(source: Path, name: str) -> bool:
    """Whether folder `source` holds side file `name` of its own, to be copied with its tokenizer: a
    file, or a link into the folder or into a download's content-addressed store (errors.links_outside:
    an HF cache's models--ORG--NAME/blobs/SHA, say). A link to anywhere else is passed over, and
    said: a folder someone gave, holding `special_tokens_map.json -> ~/.ssh/id_rsa`, had that file
    copied into the prepared folder, the run dir and every export, readable by all."""
    file = Path(source) / name
    if not file.is_file():
        return False
    if not links_outside(source, file):
        return True
    print(f"note: {file} links to {file.resolve()}, outside its folder: not copied (copy the file itself into "
          "the folder to keep it)", file=sys.stderr)
    return False


# End-of-document tokens of common tokenizers, tried in order for a user's tokenizer: GPT-2's,
# Qwen's, Phi's, OLMo's; Llama 3's; Llama 2's, Mistral's; Gemma's; DeepSeek's; ChatML's.
KNOWN_EOS = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|im_end|>")


def bos_prefix(tok: Tokenizer) -> list[int]:
    """The tokens the tokenizer's own post-processor puts before a text: Llama 3's
    <|begin_of_text|>, Llama 2's and Mistral's <s>; what HF's `tokenizer(text)` starts a document
    with, and what such a model was pretrained with before each. Empty for a tokenizer without
    them (shardline's trained BPE, Qwen's)."""
    try:
        plain = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
    except Exception:  # noqa: BLE001 - a closed vocabulary without "a" nor an unknown token: none known
        return []
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def cache_dir() -> Path:
    """$SHARDLINE_CACHE, else $XDG_CACHE_HOME/shardline, else ~/.cache/shardline (a leading ~ read as
    the home folder, as a shell would have)."""
    root = os.environ.get("SHARDLINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "shardline"
    )
    return Path(os.path.expanduser(root))


def tokenizer_json(path: str) -> str:
    """`path`, or, where it is a folder holding a tokenizer.json (an HF model folder, given as users give
    one), that file: the setting then names the file, whose folder holds the side files read with it."""
    inside = os.path.join(path, "tokenizer.json") if path else ""
    return inside if inside and os.path.isdir(path) and os.path.isfile(inside) else path


def load_tokenizer(path: str, key: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer.json at `path`; errors name it as `key` (the setting that gave it; "": a file
    the user did not name, such as a run dir's own)."""
    what = f"{key}={path!r}" if key else f"the tokenizer {path}"
    path = tokenizer_json(path)  # (a caller that did not resolve a folder given: read what it holds)
    if os.path.isdir(path):  # (a folder holding one is read as it: tokenizer_json)
        slow = [n for n in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt") if os.path.isfile(
            os.path.join(path, n))]
        raise DataError(f"{what} is a folder without a tokenizer.json: give the tokenizer.json to use" + (
            f" (it holds a slow tokenizer's {', '.join(slow)}, which shardline does not read: transformers writes "
            "its tokenizer.json with AutoTokenizer.from_pretrained(folder).save_pretrained(folder), a fast "
            "tokenizer converted from them)" if slow else ""))
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for bad files
        raise DataError(f"{what} cannot be read as a tokenizer.json: {e}") from None
    return tok


def get_tokenizer(documents, tokenizer_path: str, vocab_size: int) -> Tokenizer:
    """The user's tokenizer if given, else a BPE trained on `documents` and cached by content.

    `documents` may be any re-iterable of strings (it is read twice: to hash, to train).
    """
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(hashlib.sha256(doc.encode()).digest())
    cached = cache_dir() / "tokenizers" / f"bpe{vocab_size}-{digest.hexdigest()[:16]}.json"
    try:
        if cached.exists():
            return Tokenizer.from_file(str(cached))
    except Exception:  # noqa: BLE001 - a damaged or unreadable entry (the user never named it): train again
        with contextlib.suppress(OSError):
            cached.unlink(missing_ok=True)
    tok = train_bpe(documents, vocab_size)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        tmp.replace(cached)  # atomic: concurrent ranks never read a half-written file
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs the next run a training, no more
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # (once a node)
            print(f"shardline: warning: the tokenizer cache {cached.parent} cannot be written ({e}); the tokenizer "
                  "is trained again next time (SHARDLINE_CACHE or XDG_CACHE_HOME name another folder)", file=sys.stderr)
    return tok


def save_tokenizer(tok: Tokenizer, path: Path) -> None:
    """`tok` as tokenizer.json at `path` (as Tokenizer.save writes it), whole or not at all: a full
    disk left a run dir's copy, which eval and export read, cut short. A copy already the same is
    left as it is (a relaunch on a nearly full disk rewrites nothing)."""
    text = tok.to_str(pretty=True)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # (ranks of two nodes share a
    try:  # run dir on shared storage, and may share a process id)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def train_bpe(documents, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    length = len(documents) if hasattr(documents, "__len__") else None  # a stream has no length
    tok.train_from_iterator(documents, trainer=trainer, length=length)
    return tok


def eos_id(tok: Tokenizer, tokenizer_path: str | os.PathLike = "") -> int | None:
    """The end-of-document token id: the first of KNOWN_EOS the vocabulary holds (a base model's
    end of text, where an instruct model's tokenizer_config.json names its turn end), else the
    eos_token of the tokenizer_config.json beside `tokenizer_path`; None when neither is a token."""
    for name in KNOWN_EOS:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    named = settings_token(tokenizer_path, "eos_token")
    return tok.token_to_id(named) if named else None


def settings_token(tokenizer_path: str | os.PathLike, key: str) -> str:
    """A special token (`key`: "eos_token", "bos_token") as the tokenizer_config.json beside a
    tokenizer.json names it (a string, or {"content": ...}); "" where there is none to read."""
    if not tokenizer_path:
        return ""
    try:
        settings = json.loads((Path(tokenizer_path).parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    return special_token(settings, key) if isinstance(settings, dict) else ""


def special_token(settings: dict, key: str) -> str:
    """A token as tokenizer_config.json writes it: a string, or {"content": ...}; "" for neither."""
    value = settings.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else ""


def vocabulary_fingerprint(tok: Tokenizer) -> str:
    """A short hash of the token -> id table, added tokens included: the same for one tokenizer
    whatever `tokenizers` version writes it (unlike its serialisation), different for another
    vocabulary of the same size."""
    table = sorted(tok.get_vocab(with_added_tokens=True).items())
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()[:16]


def extends(tok: Tokenizer, theirs: Tokenizer) -> bool:
    """Whether `tok` is `theirs` with tokens added (chat markers, say): see extension_gap."""
    return not extension_gap(tok, theirs)[0]


def extension_gap(tok: Tokenizer, theirs: Tokenizer) -> tuple[str, bool]:
    """(why `tok` is not `theirs` with tokens added, "" where it is; whether it is built on theirs all the
    same: their model, normalizer, pre-tokenizer and the rest, with tokens added at other ids or another
    framing). An extension has added tokens beyond theirs, each of theirs at its id. Aside: the padding and
    truncation a transformers tokenizer saves with its last call's settings, and the post-processor it
    writes (one adding nothing), compared by what it adds to a text and a pair."""
    aside = ("padding", "truncation", "post_processor")
    mine, own = ({k: v for k, v in json.loads(t.to_str()).items() if k not in aside} for t in (tok, theirs))
    added = [{t["content"]: t["id"] for t in j.pop("added_tokens", None) or []} for j in (mine, own)]
    differ = [k for k in sorted(set(mine) | set(own)) if mine.get(k) != own.get(k)]
    moved = [c for c, i in added[1].items() if added[0].get(c) != i]
    if differ:
        return f"the {', '.join(differ)} {'differ' if len(differ) > 1 else 'differs'}", False
    if len(added[0]) <= len(added[1]):
        return "it adds no token to theirs", True
    if moved:
        return f"their token {moved[0]!r} is at another id", True
    framed = _framing(tok)
    if framed is None or framed != _framing(theirs):
        return "it starts or ends a text with other special tokens (a BOS its post-processor adds, say)", True
    return "", True


def extends_file(path: str | os.PathLike, theirs: str | os.PathLike) -> bool:
    """extends() of two tokenizer.json files; False where either cannot be read."""
    try:
        return extends(load_tokenizer(str(path)), load_tokenizer(str(theirs)))
    except (OSError, ValueError, DataError):
        return False


def _framing(tok: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids of a text and of a pair as `tok` encodes them with its special tokens (a copy, with no
    truncation or padding: transformers saves its last call's); None where it cannot encode them."""
    try:
        tok = Tokenizer.from_str(tok.to_str())
        tok.no_truncation(), tok.no_padding()
        return tok.encode("In the beginning").ids, tok.encode("In the", "beginning").ids
    except Exception:  # (tokenizers raises a bare Exception: a word-level vocabulary without an unknown token)
        return None
