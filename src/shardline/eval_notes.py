"""What `shardline eval` says on stderr beside its number: where the data it scores holds documents the
run trained on (a held-out split other than the run's, a validation file the run trained on, the run's
own data edited since), or where its number is not the one the run logged (other windows, a checkpoint
whose run read other sequences of the split). Said, never refused: the score is still the checkpoint's
on that data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from shardline.config import Config, DataConfig
from shardline.data.file_stamps import changed_files
from shardline.data.overlaps import reads_trained_files, split_apart
from shardline.data.sampler import EVAL_ORDER
from shardline.data.sources import shipped_corpus
from shardline.data.validation import SPLIT_RULE, training_val_fraction
from shardline.parallel.distributed import speaks_for_the_job


def say_if_split_apart(trained: dict, cfg: Config) -> None:
    """On stderr, where the data given to evaluate on reads files the run trained on, split apart from
    the run's split (a folder prepared again with files added holds out other documents): its held-out
    documents may be ones the run trained on, a training loss."""
    held = 0.0 if trained.get("val_path") else trained.get("val_fraction", DataConfig().val_fraction)
    found = split_apart([s.path for s in cfg.data.mix] or [cfg.data.path or str(shipped_corpus())],
                        training_val_fraction(cfg), _trained_paths(trained), held, cfg.data.split,
                        trained.get("split", "position"))  # (none saved: a run from before it)
    if found and speaks_for_the_job():
        mine = f"data.val_fraction={training_val_fraction(cfg):g} by {cfg.data.split}"
        theirs = f"{held:g} by {'content' if trained.get('split') == 'content' else 'position'}"
        print(f"shardline eval: note: {_named(found[0])} reads files the run trained on (its data "
              f"{_named(found[1])}), with a held-out split of its own ({mine}; the run's: {theirs}, or a folder's "
              "own): some of the documents it holds out are likely ones the run trained on", file=sys.stderr)


def _named(path: str) -> str:
    """A data path as a note names it ("the shipped corpus" for the file a run of data.path="" reads)."""
    return "the shipped corpus" if path == str(shipped_corpus()) else path


def _trained_paths(trained: dict) -> list[str]:
    """The paths of the data a run trained on, from its saved [data] (the shipped corpus's file for ""); none
    where nothing is saved."""
    if not trained:  # (a checkpoint converted from HF: no run's data)
        return []
    paths = [s.get("path", "") for s in trained.get("mix") or [] if isinstance(s, dict)] or [trained.get("path", "")]
    return [path or str(shipped_corpus()) for path in paths]


def say_if_val_path_trained_on(val_path: str, trained: dict) -> None:
    """--data.val_path on files the run trained on (its saved [data] `trained`): all of it is scored, those
    documents too, a training loss mostly."""
    within = reads_trained_files(val_path, _trained_paths(trained))
    if within and speaks_for_the_job():
        print(f"shardline eval: note: --data.val_path={val_path} reads files the run trained on (its data "
              f"{_named(within)}): the documents it scores are ones the run trained on, not held out: a training "
              "loss, mostly",
              file=sys.stderr)


def say_if_other_windows(ckpt: Path, seq_len: int, given: bool) -> None:
    """On stderr, where --train.seq_len gave other windows than the run evaluated in: another number,
    which reads as the logged eval loss's drift; and where a checkpoint converted from HF, with no run's
    windows, was scored in the default ones (`given`: --train.seq_len was)."""
    try:
        trained_at = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))["config"]["train"]["seq_len"]
    except (OSError, ValueError, KeyError, TypeError):  # (a checkpoint converted from HF: no run to compare)
        if not given:
            print(f"shardline: note: evaluated in windows of train.seq_len={seq_len} tokens, the default: {ckpt} "
                  "holds no run's (converted from HF?); --train.seq_len=N sets them", file=sys.stderr)
        return
    if trained_at != seq_len:
        print(f"shardline: note: evaluated in windows of train.seq_len={seq_len} tokens, where the run evaluated in "
              f"{trained_at}: not comparable to its logged eval loss", file=sys.stderr)


def say_if_data_changed(ckpt: Path, position: dict, by_content: bool, every: bool) -> None:
    """On stderr, where the run's own data no longer holds the tokens the checkpoint trained on
    (edited since): its held-out split is cut from other documents, so the loss is not the one
    the run logged and may count documents it trained on. Said, not refused: the score is still
    the checkpoint's on the data as it is now. And where the run evaluated other sequences of the
    split than this evaluation reads (its first ones, before 2026-12-08; `every`: all are read)."""
    try:
        state = torch.load(ckpt / "trainer" / "rank0.pt", weights_only=True)
        data, saved = state["data"], state["data"].get("content")
    except Exception:  # (a checkpoint converted from HF, or older: nothing to compare)
        return
    if state.get("eval_order") != EVAL_ORDER and not every:
        print(f"shardline eval: note: the run that saved {ckpt.name} evaluated the first sequences of its held-out "
              "split; this evaluation reads sequences spread over it (as training does since 2026-12-08): not the "
              "loss it logged (--batches 0 scores every sequence, either way)", file=sys.stderr, flush=True)
    now = position.get("content")
    if saved and now and saved != now:
        files = changed_files(data.get("files"), position.get("files"))
        kept = by_content and data.get("split") == SPLIT_RULE  # (held out by content then and now: kept out)
        print(f"shardline eval: the run's data changed since {ckpt.name} was saved (training tokens {saved}, "
              f"now {now}{'; changed: ' + files if files else ''}): its held-out split is not the one the run "
              "evaluated on" + (": its unchanged held-out documents are held out still (by content), documents "
                                "added or edited since are split anew, and it may hold documents it trained on, "
                                "edited since" if kept else ", and may hold documents it trained on"),
              file=sys.stderr, flush=True)
