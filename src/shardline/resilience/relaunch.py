"""Which config a relaunch reads: `shardline train --run.dir=runs/x` without --config resumes runs/x
with the config.toml its last launch saved (or trains it again from step 0, where that launch saved
nothing to resume); the CLI's choice, made before any process group exists: from files every node
sees alike."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from pathlib import Path

from shardline.config import (PRECISIONS, Config, ParallelConfig, load_config, load_relaunch_config,
                              reader)
from shardline.errors import ConfigError, ShardlineError
from shardline.layout.degrees import WORLD_DEGREES, shard_degree
from shardline.layout.rules import ep_borrows
from shardline.metrics import written_by_a_run
from shardline.parallel.distributed import speaks_for_the_job
from shardline.resilience.checkpoint import Checkpointer
from shardline.resilience.goodput import read_account
from shardline.resilience.run_lock import RunLock


def relaunch_config(config: str | None, overrides: list[str], world: int | None = None, say: bool = True,
                    printing: bool = False) -> Config:
    """The config a launch reads: --config's file and the overrides; without a file, when run.dir
    holds the config.toml its last launch saved, that file (its per-launch settings afresh,
    config.LAUNCH_ONLY), so a relaunch need not repeat the run's settings: `--run.dir=runs/x`
    resumes runs/x as its last launch ran it (from step 0 where it saved nothing). `world`: the
    processes it runs on; `printing`: for --print-config, whose stdout is the config (the note goes to stderr)."""
    cfg = _steps_not_replaced(load_config(config, overrides), overrides)
    saved = Path(cfg.run.dir) / "config.toml"
    try:
        found = saved.is_file()
    except OSError as e:  # a name too long, a folder of no access: the run dir's one line, not a traceback
        raise ConfigError(f"run.dir={cfg.run.dir!r} cannot be used: {e.strerror}") from None
    if found and (foreign := foreign_files_problem(Path(cfg.run.dir))):  # (before its config.toml is read)
        raise ConfigError(foreign)
    if config is not None and found and cfg.train.precision == "auto" and cfg.run.resume != "never":
        _keep_saved_precision(cfg, saved)
    if config is not None or cfg.run.resume == "never" or not found:
        return cfg
    held, loaded = resumable(Path(cfg.run.dir), saved), None
    if not held:
        if cfg.run.resume == "auto":  # (a checkpoint named, or latest: the launch's own word on it)
            _refuse_a_finished_run(Path(cfg.run.dir), saved)
        loaded = _read_saved(cfg, saved, overrides)
        if loaded is None:
            return cfg
    if printing and speaks_for_the_job():  # (a config printed to start from: not the defaults, where a run is there)
        print(f"shardline: {cfg.run.dir} holds {held or 'a run whose last launch saved nothing to resume'}: this is "
              "the config.toml it saved, as a relaunch there reads "
              "it (another --run.dir prints the defaults)", file=sys.stderr)
    elif say and speaks_for_the_job() and not RunLock(Path(cfg.run.dir)).running_here():  # (refused: no "resuming")
        what = (f"holds {held}: resuming" if held else "holds a run whose last launch saved nothing to resume: "
                "training it again from step 0")
        print(f"shardline: {cfg.run.dir} {what} with the config.toml it saved and the overrides given (--config "
              "names another file)")  # stdout: stderr holds the one-line errors
    cfg = _steps_not_replaced(loaded or load_relaunch_config(saved, cfg.run.dir, overrides), overrides)
    given = _given(overrides)
    if "parallel.cp_mode" in given and "parallel.cp_ulysses" not in given and cfg.parallel.cp_mode != "hybrid":
        cfg.parallel.cp_ulysses = ParallelConfig().cp_ulysses  # (the saved hybrid's split: no other mode reads it)
    _check_relative_data(cfg, saved, given)
    cfg.parallel.check()  # (a degree of 0 or less: its own one line)
    try:
        shards = shard_degree(cfg, world)  # (the launch checks it again: here to say where refused degrees came from)
    except ConfigError as e:
        kept, default = reader.read_toml(saved).get("parallel", {}), ParallelConfig()  # (it saves every key)
        keys = [k for k in WORLD_DEGREES if kept.get(k, getattr(default, k)) != getattr(default, k)
                and f"parallel.{k}" not in given]
        if not keys:  # the command line's own degrees: its error as it is
            raise
        named = " ".join(f"parallel.{k}={getattr(cfg.parallel, k)}" for k in keys)
        fix = " or ".join(f"--parallel.{k}" for k in keys)
        raise ConfigError(f"{e} ({named} from {saved}, the run's saved config a relaunch takes over: give {fix} "
                          "for this world size)") from None
    ep = cfg.parallel.ep  # (it borrows dp_shard x cp, which a smaller world may not hold)
    if world is not None and ep > 1 and not ep_borrows(ep, shards, cfg.parallel.cp) and "parallel.ep" not in given:
        raise ConfigError(f"parallel.ep={ep} (from {saved}, the run's saved config a relaunch takes over) must divide "
                          f"dp_shard x cp = {shards * cfg.parallel.cp} on {world} process(es): give --parallel.ep "
                          "for this world size (1: no expert parallelism)")
    return cfg


def _keep_saved_precision(cfg: Config, saved: Path) -> None:
    """train.precision=auto (a --config file that never names it) resuming a run goes on in the precision
    the run trained in: auto settles by the device for a new run only (an fp32 run of before auto was the
    default switched to bf16 in mid-run on a GPU)."""
    if not resumable(Path(cfg.run.dir), saved):
        return
    with contextlib.suppress(ShardlineError, OSError, AttributeError):  # (damaged: the launch's checks say it)
        kept = reader.read_toml(saved).get("train", {}).get("precision")
        if kept in PRECISIONS and kept != "auto":
            cfg.train.precision = kept


def _given(overrides) -> set[str]:
    return {o.removeprefix("--").split("=")[0] for o in ([overrides] if isinstance(overrides, str) else overrides)}


def _steps_not_replaced(cfg: Config, overrides) -> Config:
    """A --train.steps given where train.epochs (from the file, or a run's saved config) derives the
    steps would be replaced in silence: a relaunch meant to extend a run trained to its old end."""
    given = _given(overrides)
    if cfg.train.epochs and {"train.steps", "train.epochs"} <= given:
        raise ConfigError(f"--train.steps={cfg.train.steps} and --train.epochs={cfg.train.epochs:g} both give the "
                          "run's length: give one (train.epochs derives the steps from the data)")
    if cfg.train.epochs and "train.steps" in given and "train.epochs" not in given:
        raise ConfigError(f"--train.steps={cfg.train.steps} would be replaced: train.epochs={cfg.train.epochs:g} "
                          "derives the run's steps from its data; give --train.epochs=N (more passes), or "
                          "--train.epochs=0 with --train.steps")
    return cfg


def _refuse_a_finished_run(run_dir: Path, saved: Path) -> None:
    """A run that trained to its end and saved no checkpoint, relaunched by --run.dir alone: the
    defaults trained into its folder (another model, its history cut) where nothing was left to do.
    And one that trained whose config.toml is emptied or cut short (a crash before its data reached
    the disk): its in-memory snapshots, which resumable() reads of that file, were passed over in silence."""
    account = read_account(run_dir) or {}  # (damaged: _read_saved's note is all there is to say)
    if account.get("high_water_step") and not _whole(saved):
        raise ConfigError(f"{saved}, the config of a run that trained (to step {account['high_water_step']}), is "
                          "emptied, cut short (a crash?) or not TOML: what it resumes cannot be read from it; give "
                          "--config FILE with the run's settings")
    if _trained_to_its_end(account, reader.read_toml(saved).get("train", {}).get("steps", 0) if _whole(saved) else 0):
        raise ConfigError(f"run.dir={run_dir} holds a run that trained to its end (step "
                          f"{account.get('high_water_step', '?')}) and holds no checkpoint of it: nothing to resume or "
                          "extend; another --run.dir trains anew (--config FILE: another run "
                          "in this folder, whose records follow this one's)")


def _trained_to_its_end(account: dict, steps: int) -> bool:
    """Whether the run dir's account says its run trained to its end (`steps`: its train.steps, for an
    account written before run_complete was, which says `finished` alone)."""
    return account.get("run_complete", bool(account.get("finished")) and account.get("high_water_step", 0) >= steps) \
        is True


def foreign_files_problem(run_dir: Path) -> str | None:
    """A config.toml or metrics.jsonl no run wrote (a config without its [model] table, a log whose first
    line is no record) in a folder no run has used (no progress.json, no checkpoints): a launch would
    write over the one (a project's own config) and append to the other."""
    try:
        if (run_dir / "progress.json").exists() or (run_dir / "checkpoints").exists():
            return None
        foreign = [name for name, ours in (("config.toml", _whole), ("metrics.jsonl", written_by_a_run))
                   if (run_dir / name).is_file() and not ours(run_dir / name)]
    except OSError:  # (what cannot be read is the run dir's own check's to say)
        return None
    return (f"run.dir={str(run_dir)!r} holds {' and '.join(foreign)} that no shardline run wrote (no progress.json "
            "or checkpoints beside): a run writes its own of that name there; use another run.dir, or move "
            f"{'them' if len(foreign) > 1 else 'it'} away") if foreign else None


def _whole(saved: Path) -> bool:
    """Whether a saved config.toml reads as TOML and as a whole config (reader.whole_config)."""
    try:
        return reader.whole_config(reader.read_toml(saved))
    except ConfigError:
        return False


def _read_saved(cfg: Config, saved: Path, overrides: list[str]) -> Config | None:
    """The config.toml of a launch that saved nothing to resume (killed in start-up, or before its
    first save), read as a relaunch reads it: a relaunch by --run.dir alone then trains that run
    again from step 0 (a requeue took the defaults: another model on the shipped corpus, in its
    folder). One damaged or hand-edited past reading is said (None), and the launch takes the defaults."""
    try:
        return load_relaunch_config(saved, cfg.run.dir, overrides)
    except (ShardlineError, TypeError, ValueError) as e:
        if speaks_for_the_job():
            first = str(e).split("; valid")[0]  # (its key, not the list of valid ones)
            why = ("emptied, cut short or not TOML" if not _whole(saved) else
                   f"not a config this shardline reads: {first}")
            print(f"shardline: note: {saved} is not read (its launch saved nothing to resume, and it is {why}): "
                  "this launch takes the defaults and the overrides given", file=sys.stderr)
        return None


def _check_relative_data(cfg: Config, saved: Path, given: set[str]) -> None:
    """A relative data path the saved config holds is read from where the run was launched: from
    another folder it is missing (or another folder's), and the launch's "does not exist" did not
    say where it came from. (The starting weights' paths are left to the launch: a resume goes on
    without them where its checkpoints stand in.)"""
    weights = cfg.model.hf_path or cfg.model.init_from
    keys = [("data.path", cfg.data.path), *((f"data.mix[{i}].path", s.path) for i, s in enumerate(cfg.data.mix)),
            *([] if weights and not Path(weights).exists() else [("data.tokenizer", cfg.data.tokenizer)])]
    # (the starting weights' tokenizer, saved as data.tokenizer, may be gone with them: the run dir's copy stands in)
    for key, value in keys:
        if value and not os.path.isabs(value) and key.split("[")[0] not in given and not Path(value).exists() \
                and not glob.glob(value):
            raise ConfigError(f"{key}={value!r} (from {saved}, the run's saved config: a relative path, read from "
                              f"where the run was launched) does not exist from {os.getcwd()}: launch from that "
                              f"folder, or give --{key.split('[')[0]}")


def resumable(run_dir: Path, saved: Path) -> str:
    """What run_dir holds that a relaunch resumes ("" if nothing): checkpoints on disk (or a seal the
    trainer repairs), or, for a run that keeps in-memory snapshots, the steps its account says it
    trained (the snapshots are in RAM on each node, which one node cannot see for all: the run
    dir's record decides alike on every node; the trainer then restores what the nodes hold)."""
    held = Checkpointer(run_dir, keep=1, is_writer=False)
    if held.list() or held.interrupted_seals():
        return "checkpoints"
    try:
        settings = reader.read_toml(saved)
        memory = settings.get("checkpoint", {}).get("memory_interval", 0)
        steps = settings.get("train", {}).get("steps", 0)
        account = read_account(run_dir) or {}
        trained = account.get("high_water_step", 0)
        over = _trained_to_its_end(account, steps)
    except (ShardlineError, OSError, ValueError, AttributeError, KeyError, TypeError):  # (damaged: nothing to go on)
        return ""
    # (a run that trained to its end gave its snapshots back: nothing of it is left to resume)
    return "a run kept in in-memory snapshots" if memory and trained and not over else ""
