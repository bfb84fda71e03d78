"""A resume's checks against the checkpoint's saved trainer state: the data position (batch size,
sequences, seed, tokenizer, training tokens, chat packing, mixture), the steps and skipped batches.
A launch runs them before it takes the run dir's lock (preflight) and again on the data it read
(the trainer's restore); a dry run runs what needs no data read."""

from __future__ import annotations

from pathlib import Path

import torch

from shardline.config import Config
from shardline.data.file_stamps import changed_files
from shardline.data.packing import CHAT_PACKING
from shardline.data.sampler import batch_index
from shardline.data.validation import SPLIT_RULE, split_by_prepare, split_rule
from shardline.errors import CheckpointError, ConfigError
from shardline.resilience.recovery import data_changes, saved_config


def check_saved_position(path: Path | None, cfg: Config, num_samples: int | None = None,
                         position: dict | None = None, stand_in: bool = False) -> None:
    """Checkpoint `path`'s saved trainer state agrees with this config (batch size, seed, skipped
    batches, steps) and, given them, with the data read (`num_samples` training sequences, its
    `position`: DataBundle.position_state), or the one-line error: checked before a start takes
    the run dir's lock and sets newer checkpoints aside for it. A dry run that has not read the
    data (it reads it for train.epochs) passes no count (the saved one stands in)."""
    state_file = Path(path) / "trainer" / "rank0.pt" if path is not None else None
    if state_file is None or not state_file.is_file():
        return
    try:
        state = torch.load(state_file, weights_only=True)
        data, step = state["data"], state["step"]
    except Exception as e:  # a manifest-less folder named by --resume, say
        raise CheckpointError(f"checkpoint {path}: trainer/rank0.pt cannot be read ({type(e).__name__})") from None
    _check_saved_seq_len(path, cfg.train.seq_len)  # (a dry run, which counts no sequences, finds it too)
    _check_held_out_kept(path, cfg)  # (before the tokenizer and tokens it changes are named)
    if position is None:  # (a dry run, which read no data: how chat is packed follows from the config alone)
        position = {"packing": CHAT_PACKING} if cfg.data.chat else {}
    check_data_position(path, data, data["num_samples"] if num_samples is None else num_samples, cfg.train.order_seed,
                        cfg.train.global_batch_size, position, data_changes(path, cfg, stand_in),
                        cfg.train.order_seed_key, split_rule(cfg))
    check_skip_batches(path, step, data.get("skipped_batches", []), cfg.train.skip_batches)
    check_steps_ahead(path, step, cfg.train.steps, cfg.train.epochs)


def _check_saved_seq_len(path: Path, seq_len: int) -> None:
    """The seq_len the checkpoint's run trained at (its meta.json's config; unreadable: not checked)
    is this one: the launch, which counts the sequences, would refuse another."""
    try:
        saved = int(saved_config(path)["train"]["seq_len"])
    except (ValueError, KeyError, TypeError):
        return
    if saved != seq_len:
        raise CheckpointError(f"checkpoint {path} was saved at train.seq_len={saved}; this run has {seq_len}, which "
                              "cuts the data into other sequences: the saved position would mean other samples; keep "
                              f"{saved}, or start a new run.dir from these weights with model.init_from")


def _check_held_out_kept(path: Path, cfg: Config) -> None:
    """A run that held out data.val_fraction of its documents is not given data.val_path on a
    resume (those documents would train, and a trained BPE change with them), nor one that evaluated
    on data.val_path left without it (documents would leave its training data)."""
    saved = saved_config(path).get("data")
    if not isinstance(saved, dict) or split_by_prepare(cfg):
        return  # (a prepared folder holds the split `prepare` made: data.val_fraction never cuts it)
    fraction = saved.get("val_fraction", 0.01)  # (held out where no val_path was given: none at 0)
    if not saved.get("val_path") and cfg.data.val_path and isinstance(fraction, (int, float)) and fraction:
        raise CheckpointError(
            f"checkpoint {path} was trained holding out data.val_fraction={fraction:g} of its documents; with "
            f"data.val_path those would train (other training data under the saved position): evaluate on the "
            f"file with `shardline eval RUN --data.val_path={cfg.data.val_path}`, or start a new run.dir from "
            "these weights with model.init_from")
    if saved.get("val_path") and not cfg.data.val_path and cfg.data.val_fraction:
        raise CheckpointError(
            f"checkpoint {path} was trained evaluating on data.val_path={saved['val_path']!r}, its training data "
            f"whole; without it data.val_fraction={cfg.data.val_fraction:g} of that data would be held out (other "
            "training data under the saved position): give data.val_path again (any file: it changes what is "
            "evaluated, not what trains), or data.val_fraction=0 with train.eval_interval=0")


# A refusal's way out for the data: a new run reads it from its first batch (skips: in its own global batches).
FROM_THE_START = " (a new run reads its data from the first batch: train.skip_batches passes over batches)"


def check_data_position(path: Path | str, data_pos: dict, num_samples: int, seed: int,
                        global_batch_size: int, position: dict | None = None, changed: str = "",
                        seed_key: str = "train.seed", split: str | None = None) -> None:
    """The saved sample position means the same in this run, or a CheckpointError saying what changed.

    The position is step x global batch: another batch size would skip or repeat samples.
    `position`: the data's own (DataBundle.position_state), e.g. a mixture's sources; `changed`:
    the data settings changed since the checkpoint (data_changes), which the refusals name;
    `seed_key`: the key that gives `seed` (train.order_seed_key), which a refusal of the order names; `split`:
    the rule this run holds raw documents out by (the checkpoint's "split"; None: no raw source).
    """
    back = f"the data settings changed since it ({changed}): set them back" if changed else ""
    vocabulary, saved_vocabulary = (position or {}).get("vocabulary"), data_pos.get("vocabulary")
    content, saved_content = (position or {}).get("content"), data_pos.get("content")
    files = changed_files(data_pos.get("files"), (position or {}).get("files"))
    saved_split = data_pos.get("split", "position")  # (none saved: before the rule by content)
    differ = (vocabulary and saved_vocabulary and vocabulary != saved_vocabulary) or (
        content and saved_content and content != saved_content)  # (older checkpoints hold neither)
    if split and saved_split != split and not files and differ:
        key = "content" if saved_split == SPLIT_RULE else "position"  # (a BPE trained at launch differs with them)
        raise CheckpointError(f"checkpoint {path} was trained with the raw documents held out by {key} (data.split="
                              f"{key}; by position was the rule before 2026-12-07), this run by the other: its "
                              f"training documents differ; resume it with --data.split={key}")
    if vocabulary and saved_vocabulary and vocabulary != saved_vocabulary:  # (older checkpoints hold none)
        run = Path(str(path)).parent.parent if Path(str(path)).parent.name == "checkpoints" else None
        copy = run / "tokenizer.json" if run and (run / "tokenizer.json").is_file() else "RUN/tokenizer.json"
        keep = ("keep data.tokenizer (or the prepared folder's: one prepared again without --tokenizer has a new "
                f"BPE; prepare it again with --overwrite --tokenizer {copy}, the run's copy; a BPE trained on .txt "
                "files with \\r\\n or \\r line ends differs since 2026-12-07, which reads them as newlines)")
        trained = (f" (files changed since: {files}; a BPE trained at launch is trained on them: give the run's, "
                   f"--data.tokenizer={copy})") if files else ""
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer (vocabulary {saved_vocabulary}, this run's "
            f"{vocabulary}){trained}: its embeddings mean other tokens; {back or keep}, or start a new run.dir from "
            "these weights with model.init_from")
    if content and saved_content and content != saved_content:  # (older checkpoints and folders hold none)
        since = f" (files changed since: {files})" if files else ""
        why = back + since if back else (
            f"its training tokens differ{since}: the files were edited or replaced, or the tokenizer, its "
            "settings or chat template changed (or, for a folder that holds hidden files or links, a tokenizer "
            "whose end of text only tokenizer_config.json names, a .txt file with a byte-order mark or with lines "
            "of other blanks (full-width spaces, form feeds) between documents: since 2026-12-06 they are read "
            "otherwise; a .txt file with \\r\\n or \\r line ends: read as newlines since 2026-12-07)")
        raise CheckpointError(
            f"checkpoint {path} was trained on other data (tokens {saved_content}, this run's {content}): {why}; "
            "the saved position would mean other samples: train on the data it was saved with, or start a new "
            "run.dir from these weights with model.init_from" + FROM_THE_START)
    packing, saved_packing = (position or {}).get("packing"), data_pos.get("packing")
    if position is not None and packing != saved_packing:  # the same tokens cut into other sequences
        # The same chat data packed by an earlier shardline (no change of format or mixture explains it): the
        # checkouts that pack it so, where they resume it with its optimizer, schedule and data position
        older = {None: "a checkout from before commit 3aba73f",
                 "whole conversations": "a checkout from commit 968f87f to adf1abc"}.get(saved_packing, "") \
            if packing == CHAT_PACKING and not any(key in changed for key in ("data.format", "data.mix")) else ""
        way = (f"finish the run with the shardline that saved it ({older}, which keeps its optimizer, schedule and "
               "data position)") if older else back
        raise CheckpointError(
            f"checkpoint {path} was saved when its sequences were "
            + ("cut from one stream" if saved_packing is None else f"packed as {saved_packing!r}")
            + (" (by an earlier shardline)" if older else "")
            + f"; this run packs them as {packing or 'one stream'}, so the saved position would mean other samples: "
            + (f"{way}, or " if way else "") + "start a new run.dir from these weights with model.init_from"
            + FROM_THE_START)
    mix, saved_mix = (position or {}).get("mix"), data_pos.get("mix")
    if mix is not None and saved_mix is not None and [list(m) for m in saved_mix] != mix:
        raise CheckpointError(
            f"checkpoint {path} was saved for a data.mix of (sequences in the mixture, source size) "
            f"{saved_mix}; this run's is {mix} (weights, sources or their order changed): resuming would "
            "skip or repeat samples; keep data.mix, or start a new run.dir from these weights with model.init_from"
            + FROM_THE_START)
    saved = data_pos.get("global_batch_size", global_batch_size)
    if saved != global_batch_size:
        raise CheckpointError(
            f"checkpoint {path} was saved with train.global_batch_size={saved} but this run has "
            f"{global_batch_size}: resuming would skip or repeat samples; keep {saved}, or start a new "
            "run.dir from these weights with model.init_from" + FROM_THE_START)
    if data_pos["num_samples"] == num_samples and data_pos["seed"] != seed:
        raise CheckpointError(
            f"checkpoint {path} was saved reading its sequences in the order of seed {data_pos['seed']}; this run's "
            f"order seed is {seed} ({seed_key}): resuming would skip or repeat samples; set {seed_key}="
            f"{data_pos['seed']}, or start a new run.dir from these weights with model.init_from" + FROM_THE_START)
    if data_pos["num_samples"] != num_samples or data_pos["seed"] != seed:
        raise CheckpointError(
            f"checkpoint {path} was saved for {data_pos['num_samples']} training sequences and data order seed "
            f"{data_pos['seed']}; this run has {num_samples} and seed {seed} "
            + (f"({back}, or use a new run.dir)" if back else "(data, train.seq_len, train.seed or train.data_seed "
               "changed); use a new run.dir"))


def check_steps_ahead(path: Path | str, step: int, steps: int, epochs: float = 0.0) -> None:
    """A checkpoint past train.steps leaves nothing to train (a shorter run asked of a run dir
    that holds a longer one): a ConfigError, not a run that exits having done nothing. One at
    train.steps is a finished run, which a rerun (a requeue) may simply find finished. `epochs`:
    train.epochs, which gave `steps` (the setting to raise)."""
    if step > steps and epochs:
        raise ConfigError(f"train.epochs={epochs:g} gives train.steps={steps}, behind {path}, saved at step {step}: "
                          "nothing to train; raise train.epochs to continue it, or start a new run in another run.dir")
    if step > steps:
        raise ConfigError(f"train.steps={steps} is behind {path}, saved at step {step}: nothing to train; "
                          f"set train.steps above {step} to continue it, or start a new run in another run.dir")


def check_skip_batches(path: Path | str, step: int, saved: list[int], wanted: list[int]) -> None:
    """train.skip_batches may only name batches a resumed run has not trained on yet: skipping
    an earlier one would shift every later batch by one instead (a ConfigError naming them)."""
    next_batch = batch_index(step, saved)
    trained = sorted(b for b in wanted if b < next_batch and b not in saved)
    if trained:
        raise ConfigError(f"train.skip_batches={trained} names batches already trained on before {path} (the "
                          f"run resumes at batch {next_batch}); only batches from {next_batch} on can be skipped")
