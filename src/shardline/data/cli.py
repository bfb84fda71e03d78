"""`shardline prepare INPUT... --out DIR`: tokenize once, train from memory-mapped shards after.

Registered by the top-level CLI (`register`); the work is done by `prepare.prepare`.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from shardline.config import DataConfig
from shardline.errors import DataError, nearly_full


def _tokenizer_arg(text: str) -> str:
    from shardline.data.tokenizer import tokenizer_json  # (the parser is built without tokenizers)

    return tokenizer_json(os.path.expanduser(text))


def register(sub) -> None:
    p = sub.add_parser("prepare", epilog="then train with --data.path=DIR; a rerun resumes an interrupted prepare")
    p.add_argument("inputs", type=os.path.expanduser, nargs="*", metavar="INPUT",
                   help=".txt/.jsonl/.ndjson/.parquet/.arrow files (optionally .gz), folders of them, glob patterns "
                        "of them (quoted), or datasets save_to_disk folders")
    p.add_argument("--out", type=os.path.expanduser,
                   required=True, metavar="DIR", help="the prepared folder to write (or resume)")
    p.add_argument("--tokenizer", type=_tokenizer_arg, default="", metavar="T",
                   help="a tokenizer.json, or a folder holding one (default: train the byte-level BPE a raw-text run "
                        "would)")
    p.add_argument("--vocab-size", type=int, help=f"size of the trained BPE (default {DataConfig().vocab_size})")
    p.add_argument("--workers", type=int,
                   help="tokenizer processes (default: the cores this process may use, less one)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents held out (default 0.01; 0: none, for runs without evaluation)")
    p.add_argument("--text-field", default="text",
                   help="field with the text in .jsonl/.parquet/.arrow (default text)")
    p.add_argument("--format", default="text", choices=["text", "chat"],
                   help="chat: records with messages (ShareGPT's conversations, or prompt/completion pairs), "
                        ".jsonl, .parquet or .arrow; loss on assistant tokens only")
    p.add_argument("--no-bos", action="store_true",
                   help="text documents without the BOS tokens the tokenizer puts before a text (data.add_bos=false)")
    p.add_argument("--shard-tokens", type=int, default=1 << 25,
                   help="tokens per shard, whole documents: a shard ends at the first unit of work past it (default "
                        "33554432; each is a point an interrupted prepare resumes from)")
    p.add_argument("--verify", action="store_true", help="check the checksums of an existing --out and exit")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out finished from other inputs or options (refused without it), or redo one")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_prepare)


SHORT_VAL_TOKENS = 4096  # a held-out split below one sequence of a common train.seq_len


def _prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise DataError(f"prepare takes no config overrides, got {' '.join(overrides)}")
    if args.verify:
        if args.inputs:  # (a folder is checked against its own manifest)
            print(f"note: --verify checks {args.out} as it was prepared; the inputs given are not read",
                  file=sys.stderr)
        return _verify(Path(args.out))
    if not args.text_field.strip():  # (as data.text_field: a run on the folder's raw files refuses it)
        raise DataError(f"--text-field={args.text_field!r} is invalid: must be a field name")
    if args.tokenizer and args.vocab_size is not None:
        print(f"note: --vocab-size {args.vocab_size} is not used: --tokenizer gives the vocabulary", file=sys.stderr)
    _say_unread_splits(args.inputs)
    args.vocab_size = DataConfig().vocab_size if args.vocab_size is None else args.vocab_size  # (data.vocab_size's)
    from shardline.data.pool import usable_cores
    from shardline.data.prepare import PrepareOptions, prepare
    from shardline.data.shards import MANIFEST

    if args.format == "chat" and args.text_field != "text":  # (a run says so in settings_unused)
        print(f"note: --text-field {args.text_field} is not used: --format chat reads each record's 'messages'",
              file=sys.stderr)
    opts = PrepareOptions(inputs=args.inputs, out=args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                          workers=max(1, usable_cores() - 1) if args.workers is None else args.workers,
                          val_fraction=args.val_fraction, text_field=args.text_field,
                          format=args.format, add_bos=not args.no_bos, shard_tokens=args.shard_tokens,
                          progress=not args.quiet, overwrite=args.overwrite)
    started, clock = time.time(), time.perf_counter()
    m = _stoppable(prepare, opts)
    if isinstance(m, int):
        return m
    tr, va = m["splits"]["train"], m["splits"]["val"]
    took = time.perf_counter() - clock
    files = len(m.get("request", {}).get("inputs", []))
    # (this run's pace where it wrote the folder: a --quiet run or a log's last line has no progress line)
    pace = f" in {took:.1f} s ({(tr['tokens'] + va['tokens']) / took:,.0f} tokens/s)" if Path(
        args.out, MANIFEST).stat().st_mtime >= started and took > 0 else ""
    print(f"prepared {args.out}: train {tr['documents']:,} documents / {tr['tokens']:,} tokens in "
          f"{len(tr['shards'])} shard(s), val {va['documents']:,} / {va['tokens']:,}; {m['dtype']}, "
          f"vocab {m['vocab_size']:,}; from {m.get('input_documents', 0):,} documents of {files} file(s){pace}; "
          f"train with {shlex.quote('--data.path=' + args.out)}")
    left_out = [f"{m['empty_documents']:,} empty or null documents"] if m.get("empty_documents") else []
    names = m.get("files_not_read", [])
    if names:
        more = " ..." if len(names) > 3 else ""
        left_out.append(f"{len(names)} file(s) of no type it reads ({', '.join(names[:3])}{more}; it reads "
                        ".txt, .jsonl, .ndjson, .parquet, .arrow, optionally .gz)")
    if left_out:
        print(f"note: skipped {' and '.join(left_out)}", file=sys.stderr)
    if m.get("held_out_in_training"):
        print(f"note: {m['held_out_in_training']:,} of the {va['documents']:,} held-out documents are also in the "
              "training split, word for word (copied files or merged sets?): their eval loss is a training loss",
              file=sys.stderr)
    if not args.tokenizer and m["vocab_size"] < args.vocab_size:  # (the run's vocabulary: model.vocab_size follows)
        print(f"note: the BPE learned {m['vocab_size']:,} tokens, not --vocab-size {args.vocab_size:,}: the training "
              "documents hold no more merges to learn (more text gives more)", file=sys.stderr)
    if not args.val_fraction:
        print("note: nothing is held out (--val-fraction 0): runs on this folder set train.eval_interval=0",
              file=sys.stderr)
    elif va["tokens"] < SHORT_VAL_TOKENS and args.format != "chat":  # said now, not at a training start that
        # refuses it (chat: a sequence of whole conversations, held out at any train.seq_len)
        txt = any(".txt" in str(i).lower() for i in args.inputs)  # (a hint about .txt files for .txt inputs)
        print(f"note: the held-out split is {va['tokens']:,} tokens; a run evaluates on it only at train.seq_len < "
              f"that (a sequence and its next token); hold out more (--val-fraction) or give more documents "
              f"({m['input_documents']:,} read"
              + ("; a .txt file's documents end at two blank lines)" if txt else ")"), file=sys.stderr)
    return 0


def _say_unread_splits(inputs: list[str]) -> None:
    """A `datasets` DatasetDict folder reads its train split: its others (validation, test) are named,
    where they were passed over in silence, with how to use one (hidden folders, .cache, are none)."""
    from shardline.data.folders import other_splits

    for given in inputs:
        root = Path(given)
        if (root / "train").is_dir() and (others := other_splits(root)):
            print(f"note: {given} is a datasets DatasetDict: its train split is read, not {', '.join(others)} "
                  f"(a run evaluates on one as data.val_path={root / others[0]}, tokenized with its tokenizer)",
                  file=sys.stderr)


class _Terminated(BaseException):
    """SIGTERM during a prepare (scancel, a container's stop, `kill`): not an Exception, which the
    readers' handlers would report as a file they could not read."""


def _stoppable(prepare, opts) -> dict | int:
    """`prepare(opts)`, or the exit code of a prepare ended by SIGTERM (143) or Ctrl-C (130), said in
    one line with what a rerun does: a SIGTERM killed it with no word, and the chunks it committed
    are kept for the rerun of the same command to resume from."""
    owner = os.getpid()

    def stop(signum, frame):
        if os.getpid() != owner:  # a worker forked a moment before, not yet on the default (pool._worker_start):
            os._exit(128 + signum)  # it goes as the default would, not with a traceback from its fork's hooks
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)  # (the workers take the default back: pool._worker_start)
    try:
        return prepare(opts)
    except (_Terminated, KeyboardInterrupt) as e:
        how = "stopped by SIGTERM" if isinstance(e, _Terminated) else "interrupted"
        print(f"shardline: prepare {how}; {_what_a_rerun_does(Path(opts.out), opts.overwrite)}", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    except BrokenPipeError:
        raise  # (its reader gone: not the folder's storage)
    except OSError as e:  # a write the storage refused: numpy's says "N requested and M written", no errno
        full = e.errno in (errno.ENOSPC, errno.EDQUOT) or (e.errno is None and nearly_full(opts.out))
        why = f"the disk holding {opts.out} is full ({e})" if full else f"writing {opts.out} failed: {e}"
        raise DataError(f"prepare: {why}; {'free space, then ' if full else ''}"
                        f"{_what_a_rerun_does(Path(opts.out), opts.overwrite)}") from e
    finally:
        signal.signal(signal.SIGTERM, previous)


def _what_a_rerun_does(root: Path, overwrite: bool) -> str:
    """Told from the folder as the stop left it: a stop before the tokens were touched (still in the
    passes that count the inputs and train the tokenizer) left an earlier finished prepare in place,
    which a rerun without --overwrite is refused on; one after it left committed chunks to resume."""
    from shardline.data.shards import MANIFEST, PROGRESS

    if (root / MANIFEST).is_file():
        return f"nothing in {root} was replaced (it holds its earlier prepare); the same command starts again"
    if not (root / PROGRESS).is_file():
        return "nothing was committed; the same command starts again"
    again = ("the same command without --overwrite resumes it (with --overwrite it starts over)" if overwrite
             else "the same command resumes it")
    return f"{again}, keeping the documents it committed"


def _verify(root: Path) -> int:
    from shardline.data.shards import verify

    if not root.is_dir():
        raise DataError(f"--out {str(root)!r} does not exist or is not a folder: nothing to verify")
    bad = verify(root)
    if bad:
        from shardline.errors import links_outside

        gone = [name for name in bad if not (root / name).exists()]
        out = [name for name in bad if name not in gone and links_outside(root, root / name)]
        changed = [name for name in bad if name not in gone and name not in out]
        said = "; ".join(f"{what}{', '.join(names)}" for what, names in (
            ("missing: ", gone), ("linked outside the folder: ", out), ("checksum mismatch in ", changed)) if names)
        print(f"{root}: {said}; copy the folder again from a good copy, or prepare it again with --overwrite",
              file=sys.stderr)
        return 2
    print(f"{root}: every shard matches its checksum")
    return 0
