"""`shardline convert to-hf | from-hf`: between shardline checkpoints and Hugging Face folders.

Registered by the top-level CLI (`register`); the work is done by `convert.convert`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from shardline.errors import ShardlineError


def register(sub) -> None:
    p = sub.add_parser("convert")
    p.add_argument("direction", choices=["to-hf", "from-hf"],
                   help="to-hf: checkpoint (or run dir) -> HF folder; from-hf: HF folder -> checkpoint")
    p.add_argument("src", type=os.path.expanduser,
                   help="to-hf: a run dir (its newest valid checkpoint) or a checkpoint folder; "
                        "from-hf: an HF model folder")
    p.add_argument("dst", type=os.path.expanduser,
                   help="to-hf: the HF folder to write (an earlier export there is replaced); "
                        "from-hf: a new or empty folder for the checkpoint")
    p.add_argument("--dtype", default="",
                   help="to-hf: the weights' dtype on disk, float32, bfloat16 or float16 (or fp32, bf16, fp16; "
                        "default: the HF folder's the checkpoint came from, else float32)")
    p.add_argument("--tokenizer", type=os.path.expanduser, default="",
                   help="to-hf: the tokenizer.json (or its folder) to export with, its side files too "
                        "(default: the one beside the checkpoint, else its run dir's)")
    p.add_argument("--best", action="store_true",
                   help="to-hf: a run dir's checkpoint of the lowest eval loss (checkpoint.keep_best), not its newest")
    p.add_argument("--drop-router-bias", action="store_true",
                   help="to-hf: export a mixture of experts whose routers learned a balancing bias "
                        "(moe.bias_update_rate), which HF models lack: refused without this, as the export chooses "
                        "other experts for some tokens (the refusal measures how many)")
    p.set_defaults(func=_convert)


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.interop.convert import convert  # (at the call: the parser is built without the models)

    if overrides:
        raise ShardlineError(f"convert takes no config overrides, got {' '.join(overrides)}")
    if args.dtype and args.direction != "to-hf":
        raise ShardlineError("convert --dtype applies to to-hf only (from-hf keeps float32 master weights)")
    if args.tokenizer and args.direction != "to-hf":
        raise ShardlineError("convert --tokenizer applies to to-hf only (from-hf takes the HF folder's)")
    if args.drop_router_bias and args.direction != "to-hf":
        raise ShardlineError("convert --drop-router-bias applies to to-hf only")
    if args.best and args.direction != "to-hf":
        raise ShardlineError("convert --best applies to to-hf only (a run dir's best checkpoint)")
    if args.best:
        from shardline.interop.convert import best_checkpoint

        args.src = str(best_checkpoint(Path(args.src)))
    with warnings.catch_warnings(record=True) as said:  # what the export computes otherwise: one line each
        try:
            written = convert(args.direction, args.src, args.dst, args.dtype, args.tokenizer, args.drop_router_bias)
        finally:  # (said before an error too)
            for w in said:  # a library's deprecations as Python shows them
                if w.category is UserWarning:
                    print(f"shardline: warning: {w.message}", file=sys.stderr)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    what = f"start a run with --model.init_from={written}"
    if args.direction == "to-hf":  # which checkpoint a run dir gave (its newest valid one)
        from shardline.interop.hf_files import EXPORT_MARK

        try:  # (the class it loads as: a Phi-3 run's is Llama's, or Mistral's with a window)
            config, mark = (json.loads((written / name).read_text(encoding="utf-8"))
                            for name in ("config.json", EXPORT_MARK))
            what = f"an HF {config['architectures'][0]} folder of {mark['checkpoint']}"
        except (OSError, ValueError, KeyError, TypeError, IndexError):  # written all the same: not worth a traceback
            what = "an HF folder"
    if args.direction == "from-hf" and not (written / "tokenizer.json").is_file():
        what += "; the HF folder holds no tokenizer.json, so give that run data.tokenizer"
    if args.direction == "to-hf" and not (written / "tokenizer.json").is_file():
        what += ", without a tokenizer: none beside the checkpoint or in its run dir; give --tokenizer"
    print(f"wrote {written} ({what})")
    return 0
