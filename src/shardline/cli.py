"""Command line: `shardline train | convert | plan | estimate | calibrate | simulate`.

`shardline train` with no arguments trains the tiny preset on the shipped corpus.
Config: `--config FILE.toml` then `--section.key=value` overrides. Mistakes the user
can fix (config, data, checkpoint) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from shardline.errors import AnomalyHalt, ShardlineError


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.config import load_config
    from shardline.trainer import Trainer

    if args.resume is not None:
        overrides = [*overrides, f"run.resume={args.resume}"]
    cfg = load_config(args.config, overrides)
    Trainer(cfg).build().train()
    return 0


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.interop.convert import convert

    if overrides:
        raise ShardlineError(f"convert takes no config overrides, got {' '.join(overrides)}")
    convert(args.direction, args.src, args.dst)
    return 0


# Subcommands that live beside their feature: each module has `register(subparsers)`,
# which adds its parser and sets `func(args, overrides) -> int`.
_FEATURE_COMMANDS = ("shardline.planner.cli", "shardline.simulator.cli")


def _register_feature_commands(sub) -> None:
    for name in _FEATURE_COMMANDS:
        if importlib.util.find_spec(name.rsplit(".", 1)[0]) and importlib.util.find_spec(name):
            importlib.import_module(name).register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: tiny preset on the shipped corpus)",
                           epilog="any config key can be overridden as --section.key=value, e.g. --train.steps=50")
    train.add_argument("--config", help="TOML config file")
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                       help="resume from the newest valid checkpoint of run.dir (or the one given); "
                            "without this flag a run resumes automatically when run.dir holds one")
    train.set_defaults(func=_train)
    convert = sub.add_parser("convert", help="convert between shardline checkpoints and HF folders")
    convert.add_argument("direction", choices=["to-hf", "from-hf"],
                         help="to-hf: checkpoint (or run dir) -> HF folder; from-hf: HF folder -> checkpoint")
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.set_defaults(func=_convert)
    _register_feature_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    bad = [u for u in unknown if not (u.startswith("--") and "." in u.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    try:
        return args.func(args, unknown)
    except AnomalyHalt as e:
        print(f"shardline: halted: {e}", file=sys.stderr)
        return 3
    except ShardlineError as e:
        print(f"shardline: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardline: interrupted", file=sys.stderr)
        return 130
