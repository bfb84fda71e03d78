"""Command line: train LLMs and plan their layouts (`shardline COMMAND --help` for each).

Commands: train, check, convert, prepare, plan, estimate, calibrate, comm-bench, simulate,
generate, eval.

`shardline train` with no arguments trains the tiny preset on the shipped corpus.
Config: `--config FILE.toml` then `--section.key=value` overrides. Mistakes the user
can fix (config, data, checkpoint) print one line and exit with code 2; a failed storage
or a run dir the same job's last launch still holds, 75 (try later). Halts 3, hangs 4,
stops 5, `check` 6.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import sys
import time

from shardline.config import to_toml
from shardline.config.reader import OnlyOnce
from shardline.errors import (TRY_LATER, AnomalyHalt, ConfigError, Preempted, ShardlineError, exit_code, interrupted,
                              transient)
from shardline.version import version


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.resume is not None:
        given = [o for o in overrides if o.removeprefix("--").startswith("run.resume=")]
        if given:
            raise ShardlineError(f"--resume and --{given[0].removeprefix('--')} both say what to resume; give one")
        overrides = [*overrides, f"run.resume={args.resume}"]
    from shardline.resilience.relaunch import relaunch_config

    try:
        cfg = relaunch_config(args.config, overrides, (args.world_size if args.dry_run else None) or _env_world_size(),
                              printing=args.print_config)  # (its stdout is the config)
    except ShardlineError as e:  # the command line and the files: alike on a node's ranks, said once there;
        e.node_alike = not _io_fault(e.__context__)  # not a read the storage refused (maybe one rank's alone)
        raise
    if args.print_config:  # a whole config to start from where no example file is at hand (an installed package)
        if args.dry_run or args.world_size is not None or args.gpu is not None:
            raise ShardlineError("--print-config takes no --dry-run, --world-size or --gpu: it prints the config alone")
        from shardline.preflight import check_values

        check_values(cfg)  # (a file that fails on first use is no start; what it names may be on another host)
        print(f"# shardline {version()}: the config `shardline train --config FILE` reads\n{to_toml(cfg)}", end="")
        return 0
    if args.dry_run:
        from shardline.dry_run import dry_run
        from shardline.parallel.distributed import speaks_for_the_job

        given = bool(args.world_size or os.environ.get("WORLD_SIZE"))
        report, fits = dry_run(cfg, args.world_size or _env_world_size(), args.gpu, world_given=given)
        if not speaks_for_the_job():  # under torchrun: every rank checks, rank 0 prints
            return 0 if fits else 1
        print(report)
        if not fits:  # a script's `--dry-run && torchrun ...` stops here; a launch itself is not refused
            lower = "lower train.micro_batch_size, or " if cfg.train.micro_batch_size > 1 else ""
            on_gpu = (args.gpu or ("cpu" if cfg.run.device == "cpu" else "gpu")) != "cpu"  # (as the dry run prices)
            offload = ", or offload (memory.cpu_offload)" if on_gpu and not cfg.memory.cpu_offload else ""
            print(f"shardline: the planner's memory estimate does not fit the device (exit 1); {lower}set "
                  "train.loss_chunk_tokens or memory.activation_checkpoint, or raise parallel.tp or parallel.cp "
                  f"(more ranks){offload} (`shardline plan` searches them)", file=sys.stderr)
            return 1
        return 0
    if args.world_size is not None or args.gpu is not None:
        raise ShardlineError("--world-size and --gpu go with --dry-run; a launch takes its world size from torchrun")
    from shardline.parallel.distributed import shutdown_distributed
    from shardline.resilience.goodput import process_start_time
    from shardline.trainer import Trainer

    # (a stop, a halt or a refusal alike on every rank: main() leaves together)
    Trainer(cfg, started=process_start_time()).build().train()
    shutdown_distributed()
    return 0


# The commands whose processes may be ranks of a job (started by torchrun, or as srun's tasks).
RANKED = ("train", "check", "eval")


def _env_world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ShardlineError(f"WORLD_SIZE={value!r} in the environment is not a positive integer; "
                             "give --world-size N for the dry run")
    return int(value)


def _check(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardline.config import load_config
    from shardline.parallel.distributed import shutdown_distributed, speaks_for_the_job
    from shardline.resilience.health import CHECK_FAILED_EXIT, check

    cfg = load_config(args.config, overrides)
    cfg.check_sections()
    drill = cfg.faults.rank_problem(_env_world_size())  # (before the group: a drill that never fires passes)
    if not drill and cfg.faults.slow_rank >= 0 and _env_world_size() == 1:
        drill = (f"faults.slow_rank={cfg.faults.slow_rank} on one process: check names a rank slower than its "
                 "peers, and it has none, so the drill would pass unseen; run it under torchrun on 2 or more")
    if drill:
        error = ConfigError(drill)
        error.node_alike = True  # the command line's: said once a node
        raise error
    report, healthy = check(cfg, size=args.size, slow_factor=args.slow_factor)
    if speaks_for_the_job():
        print(report)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and cfg.run.device in ("auto", "cuda") else 0
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and gpus > 1:  # "all ranks ok" of one of several GPUs
        print(f"note: one rank checked one of this machine's {gpus} GPUs; torchrun --nproc_per_node={gpus} -m "
              "shardline check tests them all")
    shutdown_distributed()
    return 0 if healthy else CHECK_FAILED_EXIT


# Subcommands that live beside their feature: each module has `register(subparsers)`,
# which adds its parser and sets `func(args, overrides) -> int`.
# The commands whose code lives with their feature: the module that builds each one's parser, and its
# line in `shardline --help`. Only the command given has its module imported (they import torch, seconds):
# the others are listed by name and line, so `shardline --help` and `train --help` answer at once.
FEATURE_COMMANDS = {
    "convert": ("shardline.interop.cli", "convert between shardline checkpoints and HF folders"),
    "prepare": ("shardline.data.cli", "tokenize a corpus once into memory-mapped token shards (data.path = DIR)"),
    "plan": ("shardline.planner.cli", "search parallel layouts for a model on N devices"),
    "estimate": ("shardline.planner.cli", "memory breakdown and step time of a config"),
    "calibrate": ("shardline.planner.cli", "measure this machine and write a hardware profile"),
    "comm-bench": ("shardline.planner.cli", "under torchrun: time the job's collectives inside nodes and across "
                                            "them, and write a [network] profile for plan and estimate"),
    "simulate": ("shardline.simulator.cli", "simulate a training run under failures: goodput, lost GPU-hours, "
                                            "checkpoint interval"),
    "generate": ("shardline.generate", "sample text from a checkpoint (or a run dir's newest) to read what it learned"),
    "eval": ("shardline.evaluate", "a checkpoint's loss and perplexity on held-out data, as training evaluates"),
}


def _register_feature_commands(sub, given: str | None) -> None:
    """The `given` command's parser, built by its module (its page opens with its line), and the
    others listed by name and line (not parsed: not the command given)."""
    if given in FEATURE_COMMANDS:
        module = FEATURE_COMMANDS[given][0]
        importlib.import_module(module).register(sub)
        for name, (owner, line) in FEATURE_COMMANDS.items():
            if owner == module:
                sub.choices[name].description = sub.choices[name].description or line
    for name, (_, line) in FEATURE_COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=line)


def _positive_int(text: str, most: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or (most and value > most):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer" + f" up to {most}" * bool(most))
    return value


def _factor_above_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 1 (a rank this many times slower than the "
                                         "median is slow)")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the command, as every other error here is
    (argparse prints the whole usage block first, which buries the message). Subcommands inherit it.
    No abbreviated options: `simulate --global-batch` read as --global-batch-tokens (sequences taken
    as tokens), in silence."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self._given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(args) if args is not None else []
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # (the same command line on every rank: said by a node's first)
        if _another_local_rank():
            _let_the_first_say_it()
            self.exit(2)
        # A missing required option is reported before any unknown one: a misspelt `--seqlen` read as absent.
        unknown = [a.split("=")[0] for a in self._given if a.startswith("--") and "." not in a
                   and a.split("=")[0] not in self._option_string_actions]
        if unknown and "arguments are required" in message:
            message += f"; not an option here: {', '.join(unknown)}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser for `argv` (None: sys.argv's): the command it gives is built whole."""
    argv = sys.argv[1:] if argv is None else argv
    # The command: the first word (the top level's options take no value); none after the top level's --help,
    # which lists every command with its line
    first = next((a for a in argv if a in ("-h", "--help") or not a.startswith("-")), None)
    given = None if first in ("-h", "--help") else first
    parser = _OneLineParser(prog="shardline", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"shardline {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    line = "train a model (default: tiny preset on the shipped corpus)"
    train = sub.add_parser("train", help=line, description=line,
                           epilog="any config key can be overridden as --section.key=value, e.g. --train.steps=50")
    train.add_argument("--config", action=OnlyOnce, help="TOML config file")
    train.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                       help="resume from the newest valid checkpoint of run.dir (or the one given); "
                            "without this flag a run resumes automatically when run.dir holds one")
    train.add_argument("--dry-run", action="store_true",
                       help="check config, data and layout as a launch would, print the layout, the pipeline "
                            "placement and the memory per rank, and exit (no process group, no run dir; exit 1 when "
                            "the memory estimate does not fit)")
    train.add_argument("--print-config", action="store_true",
                       help="print the config this command would train with (defaults, --config, overrides; a run "
                            "dir's saved one on a relaunch) as TOML that --config reads, and exit")
    train.add_argument("--world-size", type=_positive_int, metavar="N",
                       help="with --dry-run: the number of ranks to check for (default $WORLD_SIZE or 1)")
    train.add_argument("--gpu", metavar="TYPE", help="with --dry-run: the device type of the memory estimate "
                                                     "(default: this machine's GPU, else h100-sxm assumed; "
                                                     "cpu with --run.device=cpu)")
    train.set_defaults(func=_train)
    line = "test every rank (GEMM result and speed, all-reduce) before a long job"
    chk = sub.add_parser("check", help=line, description=line,
                         epilog="run under torchrun for all ranks; exit code 6 names a faulty or slow rank; "
                                "config overrides (--section.key=value, e.g. --run.device=cpu) as train takes them")
    chk.add_argument("--config", action=OnlyOnce, help="TOML config (its run.device and [faults] drills apply)")
    chk.add_argument("--size", type=functools.partial(_positive_int, most=32768), default=512,  # (4 GiB a matrix)
                     help="GEMM dimension (default 512 everywhere; pass ~8192 on GPUs, where 512 times launches)")
    chk.add_argument("--slow-factor", type=_factor_above_one, default=1.5,
                     help="a rank below the median GEMM throughput / this is slow (default 1.5)")
    chk.set_defaults(func=_check)
    _register_feature_commands(sub, given)
    return parser


def _io_fault(error: BaseException | None) -> bool:
    """An OSError that is not what a node's ranks all see alike (a missing file, a folder, no
    permission): EIO, a stale handle, a timeout on shared storage, which can be one rank's."""
    alike = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    return isinstance(error, OSError) and not isinstance(error, alike)


def _another_local_rank() -> bool:
    """A torchrun worker that is not its node's first (LOCAL_RANK > 0, in a world of several), or an
    srun task that is not (SLURM_LOCALID > 0: a step refused before its tasks became ranks)."""
    env = os.environ
    try:
        if "LOCAL_RANK" not in env and env.get("SLURM_TASK_PID") == str(os.getpid()):
            return int(env.get("SLURM_LOCALID", "0")) > 0 and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1
        return int(env.get("LOCAL_RANK", "0")) > 0 and int(env.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _let_the_first_say_it() -> None:
    """A silenced rank waits a moment before it exits: torchrun stops the other workers as soon as
    one fails, and the node's first rank, which says the error, was killed before it printed."""
    time.sleep(SILENT_EXIT_DELAY_S)


SILENT_EXIT_DELAY_S = 3.0


def _leave(error: ShardlineError, what: str, code: int) -> int:
    """The error's one line, then its exit code. Ranks that stopped alike (a halt, a stop, an
    agreed refusal) print it once, on rank 0, and leave the process group together
    (parallel.distributed.leave_together)."""
    line = f"shardline: {what}: {error}"
    if not error.every_rank:
        if not (getattr(error, "node_alike", False) and _another_local_rank()):
            print(line, file=sys.stderr)
        else:
            _let_the_first_say_it()
        return code
    from shardline.parallel.distributed import leave_together

    leave_together(line, code)
    return code


# The commands that print a report and end: a reader that closes their pipe early is no failure.
REPORTS = ("generate", "plan", "estimate", "simulate", "convert", "eval")
# The commands that take --section.key=value config overrides (the others refuse them).
TAKES_OVERRIDES = ("train", "check", "plan", "estimate", "simulate", "eval")


def _override_hint(command: str, unknown: list[str], stray: str) -> str:
    """What a stray argument likely meant, where the command takes overrides: the value of one
    written `--section.key value`, or an override's shape ("": nothing to add)."""
    if command not in TAKES_OVERRIDES:
        return ""  # (the command's own parser points at its --help)
    at = unknown.index(stray)
    before = unknown[at - 1] if at else ""
    if before.startswith("--") and "." in before and "=" not in before:
        return f"give {before}={stray}: config overrides take their value after '='"
    return "config overrides look like --section.key=value"


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # (before the commands' parsers import torch)
        print(f"shardline {version()}")
        return 0
    try:  # (torch's import: seconds, in which a Ctrl-C is an interrupt too)
        if sys.stdout is None:  # started with stdout closed (`>&-`): fd 1 held, so no file opened later takes
            from shardline.metrics import silence  # it, and sys.stdout writes there (an exit's flush included)

            silence(1)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        parser = build_parser(argv)
    except KeyboardInterrupt:
        return print("shardline: interrupted", file=sys.stderr) or 130
    args, unknown = parser.parse_known_args(argv)
    bad = [u for u in unknown if not (u.startswith("--") and "." in u.split("=", 1)[0])]
    if bad:  # (said by the command's own parser: its --help lists its options)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        hint = _override_hint(args.command, unknown, bad[0])
        commands[args.command].error(f"unrecognized arguments: {' '.join(bad)}" + (f" ({hint})" if hint else ""))
    from shardline.parallel.slurm import srun_ranks

    strict = not getattr(args, "dry_run", False)  # (a dry run starts no group: it may run in any shell)
    with srun_ranks(os.environ, args.command in RANKED, strict) as refusal:
        return _leave(refusal, "error", 2) if refusal is not None else _run(args, unknown)


def _run(args: argparse.Namespace, unknown: list[str]) -> int:
    """The command, its errors said as one line each (exit codes in the module doc and README)."""
    try:
        code = args.func(args, unknown)
        if args.command in REPORTS:  # inside the try: a reader gone early is handled below, not at exit
            sys.stdout.flush()
        return code
    except AnomalyHalt as e:
        return _leave(e, "halted", e.exit_code)
    except Preempted as e:
        return _leave(e, "stopped", e.exit_code)
    except ShardlineError as e:  # 2, or 75 to try later (errors.exit_code)
        return _leave(e, "error", exit_code(e))
    except KeyboardInterrupt:
        print("shardline: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardline plan ... | head`: a report's reader closed the pipe, having what it wanted
        if args.command not in REPORTS:  # a run (train, prepare) fails as it did: the pipe was its log
            raise
        from shardline.metrics import silence

        silence(1)  # (no second error as Python exits)
        return 0
    except OSError as e:  # a path the file system refuses (read-only, missing, a name too long): one line
        if args.command in (*RANKED, "comm-bench") or os.environ.get("SHARDLINE_TRACEBACK"):  # (a rank's: as before)
            raise
        print(f"shardline: error: {e}", file=sys.stderr)
        return TRY_LATER if transient(e) else 2
    except BaseException as e:  # a Ctrl-C inside torch's checkpoint writer comes back wrapped in its error
        if not interrupted(e):
            if _said_peer_lost(e):
                from shardline.resilience.background import leave_if_busy

                leave_if_busy(1)
                return 1
            raise
        print("shardline: interrupted (a checkpoint being written was abandoned; the newest finished one stays)",
              file=sys.stderr)
        return 130


def _said_peer_lost(error: BaseException) -> bool:
    """One line, not a traceback, where a collective failed because another rank went away
    (parallel.distributed.lost_peer): with N ranks, one's death otherwise prints N - 1 long
    tracebacks of the same collective. SHARDLINE_TRACEBACK=1 keeps the traceback."""
    if os.environ.get("SHARDLINE_TRACEBACK") or "torch.distributed" not in sys.modules:
        return False
    from shardline.parallel.distributed import lost_peer

    lost = lost_peer(error)  # (the error itself: one wrapping several ranks' failures says more as it is)
    if lost:
        summary = ("torchrun's summary names its root cause" if "TORCHELASTIC_RUN_ID" in os.environ else "srun's "
                   "log names the task that ended first" if "SLURM_PROCID" in os.environ else "its log says why")
        print(f"shardline: rank {os.environ.get('RANK', '?')} lost a peer: {lost}: another rank failed or stopped "
              f"answering first ({summary}; SHARDLINE_TRACEBACK=1 prints this rank's traceback)", file=sys.stderr)
    return lost is not None
