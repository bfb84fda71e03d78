"""Where a run starts, and the trainer state a checkpoint carries beyond the weights."""

from __future__ import annotations

import difflib
import json
import os
import random
import time
from pathlib import Path

import torch

from shardline.config import Config, config_changes
from shardline.errors import CheckpointError, ConfigError, on_every_rank
from shardline.metrics import history, trained_in
from shardline.resilience.checkpoint import MANIFEST, Checkpointer, step_of
from shardline.resilience.goodput import read_account
from shardline.resilience.run_lock import LAUNCHERS, restarted_by, launcher_ids, restarted


def resume_path(cfg: Config, checkpointer: Checkpointer, repaired: bool = False) -> tuple[Path | None, list[str]]:
    """(checkpoint to resume from or None, problems with invalid checkpoints skipped).

    repaired: the checkpointer's interrupted seals were repaired (under the run dir's lock);
    before that, one may still become the checkpoint `--resume` asks for."""
    mode = cfg.run.resume
    invalid: list[str] = []
    if mode not in ("auto", "latest", "never"):
        named = Path(mode)
        if restarted():
            # A restarted job reruns the first attempt's command line: it goes on from its own
            # newest state, not back to the named one (which pruning may have removed since),
            # unless it had saved nothing newer yet.
            own = checkpointer.latest_valid(on_invalid=lambda p, e: invalid.append(str(e)))
            if own is not None and (not named.is_dir() or saved_step(own) > saved_step(named)):
                return own, invalid
        _raise(named_resume_problem(mode))
        return named, invalid
    path = checkpointer.latest_valid(on_invalid=lambda p, e: invalid.append(str(e)))
    if mode == "never" and restarted() and path is not None and saved_by_this_job(path):
        return path, invalid  # the first attempt started fresh; its restart goes on from what it saved
    settled = path is None and (repaired or not checkpointer.interrupted_seals())  # (a repair may yet give one)
    if mode == "latest" and settled:
        raise CheckpointError(f"--resume given but {checkpointer.root} holds no valid checkpoint"
                              + (f" ({'; '.join(invalid)})" if invalid else ""))
    if settled and not cfg.checkpoint.memory_interval:  # no RAM tier to ask: refused before any weight is read
        refuse_fresh_over_invalid(mode, None, invalid, checkpointer.root, reads_memory=False)
    if mode == "never" and checkpointer.list():
        raise ConfigError(f"run.resume='never' but {cfg.run.dir} already holds checkpoints that a new run "
                          "would overwrite; choose another run.dir or remove them")
    if mode == "never" and _trained_by_another_job(cfg.run.dir):  # (a sweep's loop reusing a name)
        raise ConfigError(f"run.resume='never' but {cfg.run.dir} already holds a run's training records "
                          "(metrics.jsonl) that a new run would supersede; choose another run.dir")
    return (None if mode == "never" else path), invalid


def _trained_by_another_job(run_dir: str) -> bool:
    """The run dir's metrics.jsonl holds training records of another job than this one: a restart
    goes on over its own first attempt's (the launchers' ids in each `start` event say whose), not
    over those that had the first attempt refused (torchrun restarts after any failure)."""
    if not trained_in(run_dir):
        return False
    ids = launcher_ids()
    starts = [r.get("launchers") or {} for r in history(run_dir) if r.get("event") == "start"]
    return not any(restarted_by(counter) and ids.get(key) and ids[key] == seen.get(key)
                   for seen in starts for key, counter in LAUNCHERS)


def refuse_fresh_over_invalid(mode: str, found, invalid: list[str], root: Path, reads_memory: bool = True) -> None:
    """Under run.resume=auto, a start that found no state (no valid checkpoint, no snapshot in
    RAM) where checkpoints failed to verify, the RAM tier's snapshots could not be used, or a run
    kept in RAM alone held snapshots no node has now, is refused: a fresh start would set them aside
    and train over the run's history from step 0. `reads_memory`: this launch asks the RAM tier."""
    if mode == "auto" and found is None and invalid and all(p.startswith("the in-memory snapshot") for p in invalid):
        raise CheckpointError(f"nothing to resume in {root.parent}: {'; '.join(invalid)}, and there is no valid "
                              "checkpoint on disk; no fresh start over the run's history: relaunch with the layout "
                              "that wrote it, or start over in another run.dir")
    if mode == "auto" and found is None and invalid:
        raise CheckpointError(f"{root} holds checkpoints but none is valid ({'; '.join(invalid)}): nothing to "
                              "resume, and no fresh start over them; fix or restore them and rerun, or start over "
                              "in another run.dir")
    if mode == "auto" and found is None and (step := snapshots_gone(root.parent)):
        where = ("no node holds now (a reboot empties RAM; a moved run dir, or another checkpoint.memory_dir, "
                 "looks elsewhere)" if reads_memory else "this launch does not read (checkpoint.memory_interval=0: "
                 "set it, and checkpoint.memory_dir, as the run had them)")
        raise CheckpointError(f"nothing to resume in {root.parent}: it kept its state in in-memory snapshots (taken "
                              f"to step {step}), which {where}, and has no checkpoint on disk; no fresh start over "
                              "the run's history: start over in another run.dir")


def snapshots_gone(run_dir: Path) -> int:
    """The newest step this run snapshotted in RAM since its last start from step 0, where its account
    says it is unfinished (a finished run gave its snapshots back); 0 if none. Asked where nothing was
    found to resume: a memory-only run whose snapshots went with a reboot started again from step 0
    without a word."""
    try:
        records = history(run_dir)
    except (OSError, ValueError, ConfigError):  # (no log: a fresh run dir)
        return 0
    fresh = max((i for i, r in enumerate(records) if r.get("event") == "start" and r.get("step") == 0), default=0)
    # Taken and not failed (an async snapshot's `held` is logged only as the next one starts: a reboot before
    # that leaves none, so a snapshot taken counts; one killed in its first seconds is counted too, a refusal
    # where nothing was held, rather than a fresh start over what was)
    steps: list[int] = []
    for r in records[fresh:]:  # (in order: a failure cancels the latest snapshot of its step, not a later one)
        if r.get("event") == "memory_snapshot":
            steps.append(r.get("step", 0))
        elif r.get("event") == "memory_snapshot_failed" and r.get("step") in steps:
            del steps[len(steps) - 1 - steps[::-1].index(r["step"])]
    account = read_account(run_dir) or {}
    return 0 if account.get("run_complete") or not steps else max(steps)


def named_resume_problem(mode: str) -> str | None:
    """What is wrong with run.resume naming a checkpoint folder (None: nothing, or not a path).
    A run dir given there (as `convert` and `generate` take one) is named as such, with the fix."""
    if mode in ("auto", "latest", "never"):
        return None
    named = Path(mode)
    if not named.is_dir():
        typo = difflib.get_close_matches(mode, ("auto", "latest", "never"), n=1)  # (a keyword mistyped)
        pruned = not named.exists() and not typo
        gone = "does not exist (a checkpoint pruned by checkpoint.keep?)" if pruned else "is not a checkpoint folder"
        return f"run.resume={mode!r} {gone}; valid: auto, latest, never, or the path of a checkpoint folder"
    if (named / MANIFEST).is_file():
        return None
    if (named / "checkpoints").is_dir():
        return (f"run.resume={mode!r} is a run dir, not a checkpoint folder: to resume that run, give "
                f"--run.dir={mode} (it resumes its newest checkpoint); to start another run from one of "
                f"its checkpoints, name it: --resume {named / 'checkpoints' / 'step-N'}")
    steps = sorted(p.name for p in named.glob("step-*") if (p / MANIFEST).is_file())
    if steps:
        return f"run.resume={mode!r} is a folder of checkpoints; name one of them: --resume {named / steps[-1]}"
    return (f"run.resume={mode!r} holds no checkpoint (no {MANIFEST}); valid: auto, latest, never, or the path "
            "of a checkpoint folder (runs/NAME/checkpoints/step-N)")


def _raise(problem: str | None) -> None:
    if problem:
        raise ConfigError(problem)


def _appears(path: Path, wait_s: float = 10.0) -> bool:
    """Whether the folder is there, waiting a little for a shared file system's name cache
    (listing the parent asks the server again)."""
    deadline = time.monotonic() + wait_s
    while not path.is_dir():
        if time.monotonic() > deadline:
            return False
        try:
            os.listdir(path.parent)
        except OSError:
            pass
        time.sleep(0.5)
    return True


def agree_on_resume(chosen: Path | None, rank: int, world_size: int, sees=_appears) -> Path | None:
    """Rank 0's choice of checkpoint, for every rank (collective when world_size > 1).

    Each rank lists and verifies the checkpoints itself; on shared storage whose name cache
    lags (NFS, Lustre) one may still miss the newest rename and choose an older one, and the
    ranks would then restore different steps. Rank 0, which seals checkpoints, decides; a rank
    that cannot see its choice stops every rank with one line instead of loading another."""
    if world_size == 1:
        return chosen
    import torch.distributed as dist

    picks: list = [None] * world_size
    dist.all_gather_object(picks, None if chosen is None else str(chosen))
    decided = None if picks[0] is None else Path(picks[0])
    visible: list = [None] * world_size
    dist.all_gather_object(visible, decided is None or sees(decided))
    blind = [r for r, ok in enumerate(visible) if not ok]
    if blind:
        raise on_every_rank(CheckpointError(f"rank 0 resumes from {decided}, which rank(s) {blind} cannot see: "
                                            "run.dir must be on storage every node shares"))
    return decided


def rank0_decides(value, rank: int, world_size: int):
    """Rank 0's `value` on every rank (collective when world_size > 1): for choices each rank
    could make from shared storage, where a lagging name cache would split the ranks between
    two code paths, one of them collective."""
    if world_size == 1:
        return value
    import torch.distributed as dist

    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Each launcher's job id and the count of its restarts (run_lock.launcher_ids names the ids).
def saved_by_this_job(path: Path) -> bool:
    """Whether the checkpoint was saved by this job as the launcher that restarted it knows the
    job (meta.json holds the launchers' ids): a restart of a `resume=never` run goes on from
    those, never from another run's, such as an earlier torchrun launch of one Slurm job."""
    try:
        saved = json.loads((path / "meta.json").read_text(encoding="utf-8")).get("launchers") or {}
    except (OSError, ValueError, AttributeError):
        return False
    ids = launcher_ids()
    return any(restarted_by(counter) and ids.get(key) and saved.get(key) == ids[key] for key, counter in LAUNCHERS)


def memory_tier_resumable(cfg: Config) -> bool:
    """Whether the in-memory snapshots may be resumed from: by `auto`/`latest`, and by any restart of the
    job (its snapshots are of this job: taken after the named checkpoint, or since the fresh start of
    `never`). A first start, fresh or from a named checkpoint, leaves their history."""
    return cfg.run.resume in ("auto", "latest") or restarted()


def saved_step(path: Path) -> int:
    """The step a checkpoint holds, from its manifest (a named, renamed or converted folder may have
    any name); its name's where the manifest cannot be read."""
    try:
        return int(json.loads((path / MANIFEST).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return step_of(path)


def _meta_field(path: Path | str | None, key: str):
    """`key` of the meta.json a checkpoint holds; None where there is none or it cannot be read (a moved
    folder, an older checkpoint)."""
    try:
        return json.loads((Path(path) / "meta.json").read_text(encoding="utf-8"))[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_config(path: Path | str | None) -> dict:
    """The config the run that saved checkpoint `path` launched with; {} where not recorded."""
    config = _meta_field(path, "config")
    return config if isinstance(config, dict) else {}


def saved_world_size(path: Path | str | None) -> int | None:
    """The world size checkpoint `path` was saved at, None where not recorded."""
    world = _meta_field(path, "world_size")
    return world if isinstance(world, int) else None


def saved_early_stop(path: Path | str | None) -> int | None:
    """The evaluations in a row without a lower eval loss when checkpoint `path` was saved, where that ended
    its run early (train.early_stop_patience: the dry run's "nothing to train"); None otherwise."""
    trend = _meta_field(path, "eval_trend")
    if isinstance(trend, dict) and trend.get("early_stopped") and isinstance(trend.get("evaluations_since_lowest"),
                                                                             int):
        return trend["evaluations_since_lowest"]
    return None


def settings_changed(saved: dict, cfg: Config, stand_in: bool = False) -> dict[str, list]:
    """{"section.key": [saved, now]} of what this launch changed from the config a checkpoint was
    saved under (config_changes), less the run dir's copy of the starting weights' tokenizer
    standing in for theirs (`stand_in`): no change of the user's."""
    changed = config_changes(saved, cfg.to_dict())
    if stand_in:
        changed.pop("data.tokenizer", None)
    return changed


# The data settings that decide which tokens and sequences a run reads.
DATA_KEYS = ("path", "mix", "tokenizer", "vocab_size", "val_fraction", "split", "val_path", "text_field", "format",
             "add_bos")


def data_changes(path: Path | str | None, cfg: Config, stand_in: bool = False) -> str:
    """The data settings changed since checkpoint `path` was saved ("data.vocab_size=4096 -> 2048"),
    "" for none: what a refusal of its vocabulary or sequence count names (it named other keys).
    Paths are compared as the files they name (runs/x and ./runs/x are one); `stand_in`: the run
    dir's copy of the starting weights' tokenizer stands in for theirs (not the user's change)."""
    if path is None:
        return ""
    saved, now = _data_files(saved_config(path).get("data")), _data_files(cfg.to_dict()["data"])
    if stand_in:
        saved.pop("tokenizer", None), now.pop("tokenizer", None)
    changed = config_changes({"data": saved}, {"data": now}) if saved else {}
    return ", ".join("data.mix changed" if k == "data.mix" else f"{k}={old!r} -> {new!r}"
                     for k, (old, new) in changed.items() if k[5:] in DATA_KEYS)


def _data_files(data) -> dict:
    """A [data] section with its paths as the files they name (a relative path from here)."""
    if not isinstance(data, dict):
        return {}
    real = lambda p: os.path.realpath(p) if isinstance(p, str) and p else p  # noqa: E731
    mix = [{**m, "path": real(m.get("path"))} if isinstance(m, dict) else m for m in data.get("mix") or []]
    return {**data, "path": real(data.get("path")), "tokenizer": real(data.get("tokenizer")), "mix": mix,
            **({"val_path": real(data["val_path"])} if "val_path" in data else {})}


def get_rng_state() -> dict:
    """This rank's generators: CPU, Python and its own GPU's (not every visible GPU's: a resume
    may see fewer, e.g. one GPU a task under Slurm)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):  # older checkpoints saved every visible GPU's
        index = torch.cuda.current_device()
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda)
