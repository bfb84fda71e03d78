"""What a launch checks before it builds a model or touches the run dir: the config,
the model shape, the parallel layout on N ranks, and the machine-dependent rules.

`shardline train` runs these on every rank (check_config and the world size first,
then, once the tokenizer's size is known, `preflight()` and `check_device`);
`shardline train --dry-run --world-size N` runs the same functions for N ranks and
prints what it found (shardline/dry_run.py). Either way a mistake is the same
one-line ConfigError, and nothing has been written yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardline import layout as layouts
from shardline.optim import ssd_offload
from shardline.config import Config
from shardline.data.validation import held_out_problem
from shardline.data.folders import read_root
from shardline.data.shards import is_prepared, prepared_with_own_bpe
from shardline.data.tokenizer import bos_prefix, extends_file, tokenizer_json
from shardline.errors import CheckpointError, ConfigError
from shardline.interop.convert import checkpoint_tokenizer
from shardline.interop.hf_files import TOKENIZER_NAME
from shardline.interop.hub import hub_hint
from shardline.metrics import require_tensorboard
from shardline.interop.model_shape import model_shape, weight_changes
from shardline.layout import Job, Layout
from shardline.models import attention
from shardline.models.factory import args_from_json
from shardline.models.llama import ModelArgs
from shardline.models.presets import get_preset
from shardline.parallel import float8
from shardline.parallel.compile import config_problem as compile_problem
from shardline.resilience.anomaly import check_on_device
from shardline.resilience.checkpoint import MANIFEST, Checkpointer
from shardline.resilience.recovery import named_resume_problem, restarted, resume_path
from shardline.resilience.relaunch import foreign_files_problem
from shardline.resilience.resume_checks import check_saved_position, check_steps_ahead

@dataclass(frozen=True)
class Preflight:
    """A launch that passed every check: its layout and model shape."""
    layout: Layout
    model_args: ModelArgs


def use_model_tokenizer(cfg: Config) -> str | None:
    """A run from trained weights (model.hf_path, model.init_from) tokenizes with their own
    tokenizer.json unless data.tokenizer names one. Without one there, raw data would get a
    newly trained tokenizer whose ids mean nothing to those weights: refused, and so is a
    prepared folder whose tokenizer prepare trained (one given to prepare is the user's choice).
    When they have gone since and a resume goes on without them (gone_start_checkpoint), the
    run dir's copy of their tokenizer stands in, and the line saying so is returned."""
    m, d = cfg.model, cfg.data
    d.tokenizer = tokenizer_json(d.tokenizer)  # (an HF folder given: its tokenizer.json)
    if not (m.hf_path or m.init_from):
        return None
    key, value = ("model.hf_path", m.hf_path) if m.hf_path else ("model.init_from", m.init_from)
    stand_in = gone_start_checkpoint(cfg)
    if stand_in is not None:
        return _tokenizer_of_stand_in(cfg, stand_in, f"{key}={value!r}")
    if not Path(value).is_dir():
        raise ConfigError(f"{key}={value!r} does not exist or is not a folder{hub_hint(value) * bool(m.hf_path)}")
    if d.tokenizer:
        return None
    found = Path(m.hf_path) / TOKENIZER_NAME if m.hf_path else checkpoint_tokenizer(Path(m.init_from))
    if found is not None and found.is_file():
        if not _prepared_with_theirs_extended(cfg, found):  # (then the folders' own: it has the added tokens)
            d.tokenizer = str(found)
        return None
    paths = [s.path for s in d.mix] if d.mix else [d.path]
    hint = " (its tokenizer.model is not read: save it as tokenizer.json with transformers)" if (
        m.hf_path and (Path(m.hf_path) / "tokenizer.model").is_file()) else (
        _init_from_hint(m.init_from) if m.init_from else "")
    if any(not is_prepared(path) for path in paths):
        raise ConfigError(f"{key}={value!r} has no {TOKENIZER_NAME}{hint}, and a new tokenizer's ids would mean "
                          "nothing to its weights; set data.tokenizer to the tokenizer.json they were trained with")
    own_bpe = [path for path in paths if prepared_with_own_bpe(path)]
    if own_bpe:
        raise ConfigError(f"{key}={value!r} has no {TOKENIZER_NAME}{hint}, and data {own_bpe[0]!r} was prepared "
                          "with a BPE trained on its own text, whose ids mean nothing to those weights; prepare it "
                          "again with --overwrite --tokenizer naming the tokenizer.json they were trained with (or, "
                          "if they were trained with this one, set data.tokenizer to it)")


def _prepared_with_theirs_extended(cfg: Config, theirs: Path) -> bool:
    """The data's prepared folders were made with the starting weights' tokenizer with tokens added
    (chat markers; model.vocab_size gives them rows): their own tokenizer is the run's (a mixture's
    raw sources are tokenized with the first prepared folder's)."""
    paths = [p for p in [s.path for s in cfg.data.mix] or [cfg.data.path] if is_prepared(p)]
    if not paths:
        return False
    return all(extends_file(Path(p) / TOKENIZER_NAME, theirs) for p in paths)


def gone_start_checkpoint(cfg: Config) -> Path | None:
    """The starting weights (model.hf_path, model.init_from) have moved or gone since this run
    began, and a resume reads only their shape, HF fields and tokenizer, which the run dir holds:
    the newest of its checkpoints whose run started from that same path (meta.json read, not
    hashed: every checkpoint of a run has one shape, and the resume checks the one it takes).
    None when the weights are there or no checkpoint here started from them (a mistyped path on
    a reused run dir stays an error, and so does a fresh start)."""
    m = cfg.model
    key, start = ("hf_path", m.hf_path) if m.hf_path else ("init_from", m.init_from)
    if not start or Path(start).is_dir():
        return None
    for ckpt in reversed(Checkpointer(Path(cfg.run.dir), 0).list()):
        try:
            named = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))["config"]["model"][key]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if named and os.path.abspath(named) == os.path.abspath(start):
            return ckpt
    return None


def _tokenizer_of_stand_in(cfg: Config, stand_in: Path, start: str) -> str:
    """data.tokenizer for a resume whose starting folder is gone: the one named if it is still
    there, else the copy the run dir keeps of the one it trained with. Returns the line to log."""
    if not (cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file()):
        kept = checkpoint_tokenizer(stand_in)
        if kept is None:
            raise ConfigError(f"{start} is gone and {cfg.run.dir} keeps no {TOKENIZER_NAME}: set data.tokenizer "
                              "to the tokenizer.json this run trained with")
        cfg.data.tokenizer = str(kept)
    return f"{start} is gone; the run resumes with the shape and tokenizer its checkpoints keep ({stand_in.name})"


def _converted_from_hf(checkpoint: str) -> str:
    """The HF folder a checkpoint was made from by `convert from-hf` (its meta.json names it and holds
    no run config: a training checkpoint's has one, and an `hf` section too), else ""."""
    meta = Path(checkpoint) / "meta.json"
    source = _read_json(meta, "source")
    return str(source) if source is not None and _read_json(meta, "config") is None else ""


def _init_from_hint(checkpoint: str) -> str:
    """Why a checkpoint `convert from-hf` made holds no tokenizer, and where its own is."""
    source = _converted_from_hf(checkpoint)
    if not source:
        return ""
    if (Path(source) / TOKENIZER_NAME).is_file():  # (a convert before 2026-12-03 copied none)
        return f" (the HF folder it was converted from holds {Path(source) / TOKENIZER_NAME}: give that)"
    if not Path(source).is_dir():
        return (f" (converted from {source}, not found here; a convert before 2026-12-03 copied no "
                f"{TOKENIZER_NAME}: give that folder's, or convert it again)")
    return f" (converted from {source}, which holds no {TOKENIZER_NAME})"


def check_values(cfg: Config) -> None:
    """The checks of the config's values alone, on any host: each section, a known model, what the
    trainer builds (`train --print-config` runs these: a file may be written for another machine)."""
    cfg.check_sections()
    if not cfg.model.hf_path:
        get_preset(cfg.model.preset)  # (its one line: "is invalid: one of ...")
    _raise(attention.config_problem(cfg.train.attention, cfg.train.precision))
    _raise(compile_problem(cfg.train.compile, cfg.parallel.pp, cfg.parallel.pp_schedule))
    _raise(float8.config_problem(cfg.train.precision, cfg.parallel.pp, cfg.parallel.pp_schedule))
    _raise(held_out_problem(cfg))


def resolve_epochs(cfg: Config, sequences: int) -> None:
    """train.epochs, once the data is read (its `sequences` training sequences): train.steps for that
    many passes, and the checks of values the config's own checks left to it (stop_at_step, the drills')."""
    t = cfg.train
    if t.epochs:
        if t.epochs * sequences / t.global_batch_size >= 2**63:  # (named on what was set, not the steps it gives)
            raise ConfigError(f"train.epochs={t.epochs:g} is invalid: over {sequences:,} training sequences it gives "
                              "2**63 steps or more; give fewer passes")
        t.steps = t.steps_for_epochs(sequences)
        if t.stop_at_step > t.steps:
            raise ConfigError(f"train.stop_at_step={t.stop_at_step} is invalid: must be <= train.steps ({t.steps}), "
                              f"which train.epochs={t.epochs:g} gives over {sequences:,} training sequences")
        cfg.check_drills(steps_known=True)


def check_config(cfg: Config) -> None:
    """The config's values, then what they name on this host: the run dir, starting weights, a
    checkpoint to resume, the packages fp8 and TensorBoard need."""
    check_values(cfg)
    _raise(named_resume_problem(cfg.run.resume) if not restarted() else None)  # a restart may go on from its own
    for problem in (init_from_problem(cfg.model.init_from), run_dir_problem(cfg.run.dir), _run_dir_in_data(cfg),
                    foreign_files_problem(Path(cfg.run.dir))):
        _raise(problem)
    if cfg.train.precision == "fp8":
        float8.require_torchao()  # (parallel/float8.py: its install line)
    if cfg.metrics.tensorboard:
        require_tensorboard()


def _run_dir_in_data(cfg: Config) -> str | None:
    """A run dir inside a raw data folder: the next launch would read the run's own files
    (metrics.jsonl, a .txt it holds) as documents."""
    try:
        run = Path(cfg.run.dir).resolve()
    except (RuntimeError, OSError) as e:  # (a link loop: Python raises RuntimeError)
        return f"run.dir={cfg.run.dir!r} cannot be resolved ({e}): give a folder, not a loop of links"
    sources = [(f"data.mix[{i}].path", s.path) for i, s in enumerate(cfg.data.mix)] or [("data.path", cfg.data.path)]
    for key, path in [*sources, *([("data.val_path", cfg.data.val_path)] if cfg.data.val_path else [])]:
        read = read_root(Path(path))  # (a DatasetDict: its train split, as input_files reads)
        inside = path and read.is_dir() and not is_prepared(path) and run.is_relative_to(read.resolve())
        if inside and not any(part.startswith(".") for part in run.relative_to(read.resolve()).parts):
            return (f"run.dir={cfg.run.dir!r} is inside {key}={path!r}: the run's own files (metrics.jsonl) would be "
                    "read as documents by its next launch; put the run dir outside the data folder")
    return None


# What a run keeps in its run dir, and whether each is a folder: something else of that name is refused up front.
RUN_DIR_ENTRIES = {"checkpoints": True, "config.toml": False, "metrics.jsonl": False, "tokenizer.json": False,
                   "tensorboard": True, "progress.json": False, "checkpoints/set-aside": True}


def run_dir_problem(run_dir: str) -> str | None:
    """run.dir naming another tool's folder, whose files a run would overwrite (its tokenizer.json, a
    config.toml): a Hugging Face model, a prepared data folder, a checkpoint, a run's checkpoints
    folder (a run written there mixed its files into that run's history)."""
    path = Path(run_dir)
    what = ("a Hugging Face model folder (config.json)" if (path / "config.json").is_file() else
            "a checkpoint (manifest.json)" if (path / MANIFEST).is_file() and (path / "meta.json").is_file() else
            "a prepared data folder" if is_prepared(run_dir) else
            "a run's checkpoints folder (step-N checkpoints)" if any((c / MANIFEST).is_file() for c in
                                                                     path.glob("step-*")) else None)
    if what:
        return f"run.dir={run_dir!r} is {what}: a run would write over its files; use another run.dir"
    if path.is_file():
        return f"run.dir={run_dir!r} is a file, not a folder; use another run.dir"
    wrong = [(n, dir) for n, dir in RUN_DIR_ENTRIES.items() if (path / n).exists() and (path / n).is_dir() != dir]
    return (f"run.dir={run_dir!r}: its {wrong[0][0]} is a {'file' if wrong[0][1] else 'folder'}, where a run keeps "
            f"its {'folder' if wrong[0][1] else 'file'} of that name; move it away") if wrong else None


def init_from_problem(init_from: str) -> str | None:
    """model.init_from naming a folder that is no checkpoint, but what another key or form takes:
    an HF folder (model.hf_path), or a run dir (one of its checkpoints). Its absence is not one
    (gone_start_checkpoint: a run that started from it goes on without it)."""
    path = Path(init_from) if init_from else None
    if path is None or not path.is_dir() or (path / MANIFEST).is_file():
        return None
    if (path / "config.json").is_file():
        return (f"model.init_from={init_from!r} is a Hugging Face folder: give it as model.hf_path (init_from takes "
                "a shardline checkpoint, e.g. one `shardline convert from-hf` wrote)")
    saved = Checkpointer(path, keep=1, is_writer=False).list() if (path / "checkpoints").is_dir() else []
    if saved:
        return f"model.init_from={init_from!r} is a run dir: name one of its checkpoints, e.g. {saved[-1]}"
    return None


def check_resume_fits(path: Path | None, args: ModelArgs, steps: int, add_bos: bool | None = None,
                      vocab_known: bool = True, data_changed: str = "", epochs: float = 0.0) -> None:
    """A checkpoint to resume (None: none) is not past train.steps (`steps`) and holds weights of
    this model's shape, or the one-line error, before the model is built and the state loaded
    (the load would fail later, or load minutes of state to train nothing). The checkpoint was
    verified when chosen; its manifest and meta.json are read as they are (unreadable ones are
    left to the load to report). `vocab_known` False: the vocabulary is a dry run's estimate
    (a BPE trained at launch), not compared. `data_changed`: the data settings changed since the
    checkpoint (recovery.data_changes), which a vocabulary's change comes from. `epochs`:
    train.epochs, which derived `steps` (what a run behind the checkpoint is told to raise)."""
    if path is None:
        return
    step = _read_json(Path(path) / MANIFEST, "step")
    if isinstance(step, int) and not isinstance(step, bool):
        check_steps_ahead(path, step, steps, epochs)
    _check_same_bos(path, add_bos)
    saved = _read_json(Path(path) / "meta.json", "model_args")
    try:
        saved = args_from_json(saved) if saved is not None else None
    except (ValueError, KeyError, TypeError):
        saved = None
    if saved is None:
        return
    if not vocab_known:
        args = dataclasses.replace(args, vocab_size=saved.vocab_size)
    changed = weight_changes(saved, args)
    if not changed:
        return
    vocab = any(c.startswith("vocab_size") for c in changed)
    if vocab and data_changed:  # the data's change, not a [model] key, is what to undo
        why = f"; a vocabulary follows the tokenizer, and the data settings changed since it ({data_changed})"
        undo = "set them back" + (" and drop those [model]/[moe] changes" if len(changed) > 1 else "")
    else:
        why = ("; a vocabulary follows the tokenizer (data.path, data.tokenizer, data.vocab_size) unless "
               "model.vocab_size sets it") if vocab else ""
        undo = "drop those [model]/[moe] changes"
    raise CheckpointError(f"checkpoint {path} holds a model of another shape ({', '.join(changed)}){why}; {undo} "
                          "to resume it, or start a new run (another run.dir)")


def bos_setting(cfg: Config, tokenizer) -> bool | None:
    """data.add_bos where it decides tokens (text documents, a tokenizer with BOS tokens), else None."""
    return cfg.data.add_bos if "text" in cfg.data.formats() and bos_prefix(tokenizer) else None


def _check_same_bos(path: Path, add_bos: bool | None) -> None:
    """data.add_bos (where it decides tokens: bos_setting) as the checkpoint's run had it (one
    saved before the key existed: false): another value changes every document's tokens, so
    the data position would not fit."""
    run = _read_json(Path(path) / "meta.json", "config")
    if add_bos is None or not isinstance(run, dict) or not isinstance(run.get("data"), dict):
        return
    saved = run["data"].get("add_bos", False)
    if saved != add_bos:
        raise ConfigError(f"checkpoint {path} was trained with data.add_bos={str(saved).lower()}, this run has "
                          f"{str(add_bos).lower()}: every document's tokens would change; set "
                          f"data.add_bos={str(saved).lower()} to resume it")


def _read_json(path: Path, key: str):
    """`key` of the JSON file at `path`, or None where the file or key cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_layout(cfg: Config, world: int, args: ModelArgs) -> Layout:
    """The layout of `cfg` on `world` ranks, or the ConfigError of the first rule it breaks."""
    lay = layouts.resolve(cfg, world)
    job = Job(args, cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.attention, cfg.train.precision)
    layouts.check(lay, job)
    return lay


def check_layout_before_data(cfg: Config, world: int) -> None:
    """The layout rules, which never read the vocabulary, before any data is read or tokenized
    (minutes on every rank for raw files): a tp that does not divide the heads fails at once.
    A vocabulary sized to the tokenizer is taken as 1 here; preflight checks it with the real one."""
    _raise(cfg.faults.rank_problem(world))
    check_layout(cfg, world, model_shape(cfg.model, 1, cfg.moe, gone_start_checkpoint(cfg)))


def preflight(cfg: Config, world: int, tokenizer_vocab: int) -> Preflight:
    """Every check of a launch on `world` ranks once the tokenizer's size is known."""
    check_config(cfg)
    args = model_shape(cfg.model, tokenizer_vocab, cfg.moe, gone_start_checkpoint(cfg))
    if cfg.train.seq_len > args.max_seq_len:
        # Rotary positions extend to any length; the recorded maximum (checkpoints, HF
        # config.json) follows what the model is trained on.
        args = dataclasses.replace(args, max_seq_len=cfg.train.seq_len)
    return Preflight(check_layout(cfg, world, args), args)


def _raise(problem: str | None) -> None:
    """A rule's one-line problem as the ConfigError a launch stops with."""
    if problem:
        raise ConfigError(problem)


def check_resume(cfg: Config, data=None, stand_in: bool = False) -> Path | None:
    """The checkpoint a launch would resume from (None: a new run), or the error it would stop
    with: no valid one, or one whose batch size, seed or skipped batches this config contradicts.
    `data` (a DataBundle: read for train.epochs) adds what the launch compares with the data read
    (the number of training sequences, its position): without it, that needs the data tokenized."""
    held = next((p for p in (Path(cfg.run.dir), *Path(cfg.run.dir).parents) if p.exists()), None)  # (or a parent)
    if held is not None and not held.is_dir():
        raise ConfigError(f"run.dir={cfg.run.dir!r} is a file; give a folder" if held == Path(cfg.run.dir) else
                          f"run.dir={cfg.run.dir!r} cannot be created: {held} is a file")
    checkpointer = Checkpointer(Path(cfg.run.dir), cfg.checkpoint.keep)
    path = resume_path(cfg, checkpointer)[0]
    if path is not None and cfg.run.resume not in ("auto", "latest", "never"):
        checkpointer.verify(path)  # a named one is not chosen among valid ones: check it as the load would
    if data is None:
        check_saved_position(path, cfg)
    else:
        check_saved_position(path, cfg, len(data.train), data.position_state(), stand_in)
    return path


def check_rollback_target(cfg: Config, resume_from: Path | None) -> None:
    """anomaly.action=rollback has a state to go back to: a checkpoint this run saves (on disk or in
    memory) or the one it resumes; else each anomaly would be skipped while the run looked protected."""
    c = cfg.checkpoint
    if cfg.anomaly.action == "rollback" and not (c.interval or c.memory_interval or resume_from):
        raise ConfigError("anomaly.action='rollback' is invalid with checkpoint.interval=0 and "
                          "checkpoint.memory_interval=0 on a fresh start: nothing is saved to roll back to (each "
                          "anomaly would be skipped); save state, or use anomaly.action=skip or halt")


def check_device(cfg: Config, layout: Layout, on_cuda: bool, node_paths: bool = True,
                 fp8_target: str | None = None) -> None:
    """The checks that depend on the machine: a GPU that has float8 GEMMs for fp8 (read only
    where a GPU is visible: a dry run on a laptop cannot know), what the anomaly check can gate.

    A launch passes what it runs on; a dry run assumes GPUs unless run.device = cpu.
    memory.cpu_offload on a CPU device is not refused: the states are in host memory already,
    so it saves nothing, but it runs FSDP2's offload path as a GPU would (without pinned
    memory), which is how the CPU suite checks that path; the trainer logs a
    `cpu_offload_saves_nothing` event. `node_paths` false (a dry run, perhaps on a login node):
    the training nodes' own folders (memory.ssd_offload_dir) are not looked at here; `fp8_target`
    (a dry run's --gpu): its problem with fp8 ('' none), instead of this machine's card's.
    """
    _raise(attention.device_problem(cfg.train.attention, on_cuda))
    _raise(ssd_offload.problem(cfg.memory, layout.zero, on_cuda, node_paths))
    if cfg.train.precision == "fp8":
        _raise(float8.capability_problem(float8.local_capability(on_cuda)) if fp8_target is None else fp8_target)
    check_on_device(cfg, layout, cfg.optim.fused, on_cuda)
