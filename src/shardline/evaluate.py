"""`shardline eval`: a checkpoint's loss and perplexity on held-out data, as training evaluates.

Training evaluates every train.eval_interval steps on train.eval_batches global batches of the
held-out split, spread over it. This command runs that evaluation on any checkpoint, later: on
its run's own held-out data by default (the number the run logged at that step), or on other
data given as overrides (`--data.val_path=...`: all of it; `--data.path=...`: its held-out split),
over as many batches as asked (`--batches 0`: every sequence of it, as packed: a last part too
short for a window is not scored), in one process or on torchrun's (or srun's) ranks in any layout.

It is the trainer's own evaluation: a new run built from the checkpoint's weights
(model.init_from) in a temporary folder, so precision, kernels and layout are what training
uses, and the checkpoint's run dir is only read. The checkpoint's run config gives the data and
train settings; its parallel, memory, checkpoint, anomaly and fault settings are left at their
defaults (they described the training job's ranks, not this one's), unless given here.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed

from shardline.config import Config, apply_override, from_dict, override_list
from shardline.data.validation import SPLIT_RULE, split_by_prepare, split_rule, val_format
from shardline.data.shards import tokenizer_file
from shardline.data.sources import input_files
from shardline.data.tokenizer import extends_file
from shardline.errors import ConfigError, ShardlineError, on_every_rank
from shardline.eval_notes import (say_if_data_changed, say_if_other_windows, say_if_split_apart,
                                  say_if_val_path_trained_on)
from shardline.parallel.distributed import (agreed, init_distributed, pick_device, ranks_differing,
                                            speaks_for_the_job)

# The sections of the checkpoint's run config an evaluation keeps: what its data and model read.
KEPT_SECTIONS = ("run", "model", "moe", "data", "train", "fp8")
# Settings the command owns: the weights come from SRC, the run dir is a temporary one.
OWN_KEYS = ("model.init_from", "model.hf_path", "run.dir", "run.resume")


@dataclass
class Evaluation:
    checkpoint: str
    step: int
    loss: float
    sequences: int
    labelled_tokens: int
    data: str
    validation_data: bool  # data.val_path's sequences scored, not a held-out split cut from the training data
    all_sequences: bool  # every sequence of what was scored (--batches 0, or a split no larger than asked)
    seq_len: int
    by_source: dict[str, float]  # a mixture's held-out split: each source's loss in it

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    def line(self) -> str:
        return (f"eval {self.checkpoint} (step {self.step}): loss {self.loss:.4f} | ppl {self.perplexity:.2f} | "
                f"{self.sequences:,} {'' if self.validation_data else 'held-out '}sequences of {self.seq_len} tokens"
                f"{' (all of them)' if self.all_sequences else ''}, {self.labelled_tokens:,} labelled tokens of "
                f"{'the validation data ' if self.validation_data else ''}{self.data}"
                + "".join(f"\n  {name}: loss {loss:.4f}" for name, loss in self.by_source.items()))

    def as_json(self) -> str:
        return json.dumps({"checkpoint": self.checkpoint, "step": self.step, "loss": self.loss,
                           "perplexity": self.perplexity, "sequences": self.sequences,
                           "labelled_tokens": self.labelled_tokens, "data": self.data,
                           "validation_data": self.validation_data, "all_sequences": self.all_sequences,
                           "seq_len": self.seq_len, **({"by_source": self.by_source} if self.by_source else {})})


def eval_config(src: str | Path, overrides: list[str], run_dir: Path, best: bool = False) -> tuple[Config, Path, int]:
    """(the evaluation's config, the checkpoint, its step): the checkpoint's run config (its kept
    sections), the overrides, and the settings this command owns. `best`: a run dir's best checkpoint."""
    from shardline.interop.convert import best_checkpoint, checkpoint_tokenizer, other_tokenizer, resolve_checkpoint
    from shardline.resilience.checkpoint import verify
    from shardline.resilience.safe_load import removed_while_read
    from shardline.resilience.recovery import saved_step

    src = best_checkpoint(Path(src)) if best else src
    ckpt = resolve_checkpoint(Path(src))  # a run dir's newest valid one: verified as it was chosen
    if ckpt == Path(src):  # a folder named: verified here, and the load does not hash it again (minutes at 70B)
        verify(ckpt)
    try:
        meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))  # (verified: read as it is)
    except FileNotFoundError:  # (a live run's prune since it was chosen)
        raise removed_while_read(ckpt) from None
    saved = meta.get("config") or {}  # none for a checkpoint converted from HF: the defaults
    cfg = from_dict({name: table for name, table in saved.items() if name in KEPT_SECTIONS})
    if isinstance(saved.get("data"), dict) and "add_bos" not in saved["data"]:  # saved before it: no BOS, as a
        cfg.data.add_bos = False  # resume reads it (config.load_relaunch_config)
    # The tokenizer the run trained with, as the checkpoint keeps it beside it or in its run dir: the saved
    # data.tokenizer may name a starting model's file since removed, or a path relative to another directory.
    own = kept = checkpoint_tokenizer(ckpt)
    given = {item.removeprefix("--").split("=", 1)[0] for item in overrides}
    if not saved and given.isdisjoint({"data.path", "data.mix", "data.val_path"}):  # (the defaults: the shipped corpus)
        raise ConfigError(f"{ckpt} holds no run's config (converted from HF?), so no data of its own: give the data "
                          "to evaluate on, --data.path=PATH (its held-out share) or --data.val_path=PATH (all of it)")
    own = own or (tokenizer_file(cfg.data) if given.isdisjoint({"data.path", "data.mix"}) else None)  # the run's
    if own:  # own data fixes its tokenizer (a prepared folder's), which it trained with
        cfg.data.tokenizer = str(own)
    elif "data.tokenizer" not in given:  # (raw data or other data: a BPE trained anew would mean other ids)
        raise ConfigError(f"{ckpt} has no tokenizer.json beside it or in a run dir above it (a checkpoint moved out of "
                          "its run?): give the one it was trained with, --data.tokenizer=PATH")
    if not given.isdisjoint({"data.path", "data.mix"}) and "data.val_path" not in given:
        cfg.data.val_path = ""  # other data given: its held-out split, not the run's validation file
    if "data.path" in given and "data.mix" not in given:  # (in place of the run's own, as one or the other)
        cfg.data.mix = []
    if "data.mix" in given and "data.path" not in given:
        cfg.data.path = ""
    _check_saved_paths(cfg, given)
    for item in overrides:
        key = item.removeprefix("--").split("=", 1)[0]
        if key in OWN_KEYS:
            raise ConfigError(f"eval sets {key} itself (the weights are SRC's, the run dir a temporary one); drop "
                              f"--{key}")
        if key.startswith("model."):  # (a preset or shape given here was read as the checkpoint's, in silence)
            raise ConfigError(f"--{key}: eval takes the model, its shape and weights, from the checkpoint {ckpt}; "
                              "drop it")
        apply_override(cfg, item)
    if kept and "data.tokenizer" in given and other_tokenizer(kept, Path(cfg.data.tokenizer)) and \
            not extends_file(kept, cfg.data.tokenizer):  # (the base of the run's own, tokens added: its rows alike)
        raise ConfigError(f"--data.tokenizer={cfg.data.tokenizer} is not the tokenizer {ckpt} was trained with "
                          f"({kept}): its ids name other rows than the weights learned, a loss of no model; drop it")
    if "data.val_path" in given and given.isdisjoint({"data.path", "data.mix"}):
        _val_path_alone(cfg, saved.get("data") or {})
    elif not cfg.data.val_path and not given.isdisjoint({"data.path", "data.mix", "data.val_fraction", "data.split"}):
        say_if_split_apart(saved.get("data") or {}, cfg)  # (a held-out split other than the run's: on it)
    cfg.model.init_from, cfg.model.hf_path = str(ckpt), ""
    cfg.run.dir, cfg.run.resume = str(run_dir), "never"
    cfg.checkpoint.interval, cfg.checkpoint.memory_interval = 0, 0
    cfg.train.epochs = 0.0  # (nothing is trained: the saved train.steps stand, whatever data is given)
    cfg.metrics.tensorboard, cfg.metrics.progress, cfg.metrics.profile_steps = False, "none", []
    cfg.train.eval_interval = max(cfg.train.eval_interval, 1)  # (an evaluation needs a held-out split)
    if not (cfg.data.val_fraction or cfg.data.val_path) and not split_by_prepare(cfg):
        raise ConfigError("data.val_fraction=0: the data holds nothing out to evaluate on; give data to evaluate "
                          "on (--data.val_path=...), or --data.val_fraction=0.01 for a share of it (where the run "
                          "held nothing out, documents it trained on: a training loss)")
    return cfg, ckpt, saved_step(ckpt)  # (a folder renamed or converted keeps its manifest's step)


def _val_path_alone(cfg: Config, trained: dict) -> None:
    """--data.val_path without other data: the evaluation reads that file alone, so the run's
    training data stands in by it (neither found nor tokenized), read in the format val_path is.
    Data the run trained on is said on stderr: what it scores was trained on, a training loss mostly."""
    if not cfg.data.val_path:
        raise ConfigError("--data.val_path= is empty: omit it to evaluate on the run's own held-out data")
    input_files(cfg.data.val_path, "data.val_path")  # (read as data.path below: its refusals named that key)
    say_if_val_path_trained_on(cfg.data.val_path, trained)
    cfg.data.format = val_format(cfg)
    cfg.data.path, cfg.data.mix = cfg.data.val_path, []


def _check_saved_paths(cfg: Config, given: set[str]) -> None:
    """The data paths the run's saved config names, relative to where it trained, are found from
    here, or one line saying so (the data's own error would not say where the path came from);
    the training data's not where --data.val_path alone is evaluated on."""
    alone = "data.val_path" in given
    keys = [] if "data.path" in given or "data.mix" in given or alone else (
        [(f"data.mix[{i}].path", s.path) for i, s in enumerate(cfg.data.mix)] or [("data.path", cfg.data.path)])
    keys += [] if "data.val_path" in given else [("data.val_path", cfg.data.val_path)]
    for key, path in keys:
        if path and not os.path.isabs(path) and not (os.path.exists(path) or glob.glob(path, recursive=True)):
            raise ConfigError(f"{key}={path!r} (from the run's saved config: relative to the directory it trained "
                              f"in) is not found from {os.getcwd()}: run eval from there, or give the data again "
                              f"(--{key.split('[')[0]}=...)")


def evaluate(src: str | Path, overrides: list[str] | str = (), batches: int | None = None,
             best: bool = False) -> Evaluation:
    """The loss of checkpoint `src` (a run dir: its newest valid one) on the held-out split the
    config reads, over `batches` global batches (None: train.eval_batches; 0: every sequence); `best`:
    of a run dir's lowest eval loss's checkpoint (checkpoint.keep_best) instead. torch's and Python's
    generators are left as found: the build seeds them with train.seed, and a notebook's own draws after
    an evaluation followed from that seed."""
    state, gpus = random.getstate(), range(torch.cuda.device_count()) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=gpus):
        try:
            return _evaluate(src, overrides, batches, best)
        finally:
            random.setstate(state)


def _evaluate(src: str | Path, overrides: list[str] | str, batches: int | None, best: bool) -> Evaluation:
    from shardline.trainer import Trainer

    if batches is not None and (not isinstance(batches, int) or isinstance(batches, bool) or batches < 0):
        raise ConfigError(f"batches={batches!r} is invalid: a number of global batches, or 0 for every held-out "
                          "sequence")
    if not isinstance(src, (str, os.PathLike)):
        raise ConfigError(f"evaluate takes a checkpoint folder or a run dir, not {src!r}")
    run_dir = work_dir()
    try:
        given = override_list(overrides)  # (one string: one override)
        proc, (cfg, ckpt, step) = _agreed_config(src, given, run_dir, best)
        if ranks_differing(str(ckpt), proc.world_size):  # a run still saving: its newest is not every rank's alike
            raise on_every_rank(ConfigError(f"the ranks found different newest checkpoints in {src} (a run saving "
                                            "now?): name one checkpoint folder (RUN/checkpoints/step-N)"))
        trainer = Trainer(cfg, start_verified=True).build()  # (by eval_config, on every rank)
        try:
            # (any data setting given here may change the tokens: only the run's own data as it saved it is compared;
            # a validation file is not cut from the training data)
            own_data = not any(o.removeprefix("--").startswith("data.") for o in given) and not cfg.data.val_path
            if own_data and proc.rank == 0:
                say_if_data_changed(ckpt, trainer.data.position_state(), split_rule(cfg) == SPLIT_RULE, batches == 0)
            t, held_out = trainer.cfg.train, len(trainer.data.val)
            if batches is not None:
                t.eval_batches = -(-held_out // t.global_batch_size) if batches == 0 else batches
            loss = trainer.evaluate()
            (sequences, labelled), by_source = trainer.evaluated, trainer.evaluated_by_source
            if proc.rank == 0:
                say_if_other_windows(ckpt, t.seq_len, any(o.removeprefix("--").startswith("train.seq_len")
                                                          for o in given))
        finally:
            trainer.close()
        if proc.world_size > 1:
            torch.distributed.barrier()  # every rank done with the run dir before it goes
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    data = cfg.data.val_path or " + ".join(s.path for s in cfg.data.mix) or cfg.data.path or "the shipped corpus"
    return Evaluation(str(ckpt), step, loss, sequences, labelled, data, bool(cfg.data.val_path), sequences >= held_out,
                      t.seq_len, by_source)


def _agreed_config(src: str | Path, overrides: list[str], run_dir: Path, best: bool):
    """(this process in its job, eval_config's answer), agreed by every rank: a refusal on some
    ranks (a checkpoint missing on one node) is every rank's one line, not a wait at a collective.
    (A rank that cannot read the run's config takes its device from --run.device, else auto: where
    the run's own said cpu on a GPU host, its peers start another backend and wait for it.)"""
    try:
        found, failure = eval_config(src, overrides, run_dir, best), None
    except Exception as e:  # (raised again below, on every rank)
        found, failure = None, e
    given = [o.split("=", 1)[1] for o in overrides if o.removeprefix("--").startswith("run.device=")]
    proc = init_distributed(pick_device(found[0].run.device if found else (given or ["auto"])[-1]))

    def check():
        if failure is not None:
            raise failure
        return found

    return proc, agreed(check, proc.world_size)


def work_dir() -> Path:
    """The evaluation's run dir under /tmp (TMPDIR may differ between nodes): a new one of this
    process's own, or, where there are ranks, one every rank names alike (each rank's config must
    say the same run.dir) from the job (torchrun's run id and rendezvous port, unique on a host
    while it runs; srun's job), whose leftovers from killed evaluations of this user are removed."""
    base = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    prefix = f"shardline-eval-{os.getuid() if hasattr(os, 'getuid') else 0}-"
    _remove_stale(base, prefix)  # (a killed one-process evaluation's too: SIGKILL skips any cleanup)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    job = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR",
                                                   "MASTER_PORT"))
    from shardline.resilience.own_folder import make_own

    folder = base / (prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", job))  # (a name another user can work out)
    make_own(folder, base, "shardline eval", "launch it again with another torchrun --rdzv-id or master port, "
             "which names another folder")
    return folder


def _remove_stale(base: Path, prefix: str) -> None:
    """Run dirs of this user's evaluations killed before their cleanup (SIGKILL): their lock's process
    on this host is gone, or they hold no lock and are a day old."""
    from shardline.resilience.own_folder import is_own
    from shardline.resilience.run_lock import LOCK, RunLock

    for folder in base.glob(prefix + "*"):
        try:
            gone = is_own(folder.lstat()) and (RunLock(folder).abandoned() if (folder / LOCK).exists()
                                               else time.time() - folder.stat().st_mtime > 86400)
        except OSError:
            gone = False
        if gone:
            shutil.rmtree(folder, ignore_errors=True)


def register(sub) -> None:
    """The `eval` subcommand (cli.py's feature commands)."""
    p = sub.add_parser("eval", epilog="overrides (--data.path=..., --train.seq_len=..., --parallel.tp=2) change what "
                                      "the checkpoint's run config gives; under torchrun every rank takes part")
    p.add_argument("src", type=os.path.expanduser,
                   help="a run dir (its newest valid checkpoint) or a checkpoint folder")
    p.add_argument("--batches", type=int, default=None,
                   help="global batches of the held-out split to read (default: the run's train.eval_batches; "
                        "0: every held-out sequence)")
    p.add_argument("--best", action="store_true", help="a run dir's checkpoint of the lowest eval loss "
                                                       "(checkpoint.keep_best), not its newest")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    p.set_defaults(func=_command)


def _command(args, overrides: list[str]) -> int:
    from shardline.parallel.distributed import shutdown_distributed

    previous = _stop_on_sigterm() if int(os.environ.get("WORLD_SIZE", "1")) <= 1 else None
    try:
        result = evaluate(args.src, overrides, args.batches, args.best)
        shutdown_distributed()  # (before the line: a reader gone early leaves no rank waiting)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if speaks_for_the_job():
        try:
            print(result.as_json() if args.json else result.line(), flush=True)
        except BrokenPipeError:
            raise  # (a reader gone early: no failure, cli says)
        except OSError as e:  # stdout into a full disk: the result lost, said in one line (the job is done)
            raise ShardlineError(f"the evaluation's result could not be written to stdout ({e.strerror or e}): "
                                 f"loss {result.loss:.6f} at step {result.step}") from None
    return 0


def _stop_on_sigterm():
    """SIGTERM (`timeout`, a kill) ends a one-process evaluation through its cleanup, which removes
    the temporary run dir (its default action would leave it in /tmp); the handler it replaced, or
    None off the main thread (an in-process caller's), where signals cannot be set. (Not with ranks:
    a handler runs only once a blocked collective returns, so SIGTERM would wait out its timeout;
    their dir, left by a kill, goes with the user's next ranked evaluation on the host.)"""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return None
