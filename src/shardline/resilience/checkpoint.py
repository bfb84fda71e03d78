"""Atomic, verifiable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `<run_dir>/checkpoints/step-000020/`:

    state/              DCP folder: model and optimizer, keyed by parameter name
                        (so a later run may load it under another parallel layout)
    trainer/rank0.pt    per-rank trainer state: step, scheduler, loss scaler, data position, RNG states
    meta.json           the model shape and the run's config (for convert and tools)
    manifest.json       written last: step, kind (full | weights), every file with
                        its size and sha256

It is written to `step-000020.tmp/` and renamed when complete, so a crash mid-save leaves the previous
checkpoints untouched; a folder without a valid manifest is never loaded. Only the newest `keep` checkpoints
are kept (not counting one a start found invalid, left in place: it would cost a valid one), and the best
eval loss's (`keep_also`). Its tensors are read through safe_load.py: a checkpoint someone else gave runs no
code; a manifest naming a file outside its folder is malformed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from shardline.errors import CheckpointError, CheckpointUnreadable, links_outside, outside_folder
from shardline.resilience.model_state import capture_state, keep_own_group_names, restore_state
from shardline.resilience.safe_load import load_state, single_process_ok
from shardline.resilience.save_failures import WriteCutShort, agree_on_failure, storage_error

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
VISIBLE_WAIT_S = 30.0  # how long the writer waits to see the files other nodes wrote (_wait_visible)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


DELETING = ".deleting"  # a save's older folder of the same step, renamed aside (_rename_into_place)
PRUNING = ".pruning"  # an old checkpoint being removed by prune (renamed first)


def _finished(folder: Path) -> bool:
    """Not a save in progress (.tmp) nor a removal in progress (.deleting)."""
    return not folder.name.endswith((".tmp", DELETING, PRUNING))


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(folder: Path) -> int:
    """The step of a checkpoint folder's name (step-000012, step-1000000.tmp: 12, 1000000);
    -1 for a name that holds none. Folders sort by it, not by name: past 999,999 steps the
    names grow a digit."""
    digits = folder.name.removeprefix("step-").split(".")[0]
    return int(digits) if digits.isdigit() else -1


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = {rel: (int(meta["size"]), str(meta["sha256"])) for rel, meta in manifest["files"].items()}
        if any(outside_folder(rel) for rel in files):
            raise ValueError(f"it names a file outside the checkpoint ({next(filter(outside_folder, files))!r})")
        if not isinstance(manifest["step"], int) or isinstance(manifest["step"], bool) or manifest["step"] < 0:
            raise ValueError(f"step {manifest['step']!r} is not a step number")
        if manifest.get("kind", "full") not in ("full", "weights"):  # (what load reads: an edit there misled it)
            raise ValueError(f"kind {manifest['kind']!r} is neither full nor weights")
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:  # ValueError: bad JSON or bytes
        raise CheckpointError(f"checkpoint {path} has a malformed {MANIFEST}: {type(e).__name__}: {e}") from None
    if path.name.startswith("step-") and step_of(path) not in (-1, manifest["step"]):  # (renamed, or edited)
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST} says step {manifest['step']}, its name another")
    for rel, (size, sha256) in files.items():
        f = path / rel
        try:
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path} is missing {rel}")
            if links_outside(path, f):  # (its manifest's hashes, its maker's, would vouch for any file)
                raise CheckpointError(f"checkpoint {path}: {rel} links to {f.resolve()}, outside the checkpoint")
            if f.stat().st_size != size:
                raise CheckpointError(f"checkpoint {path}: {rel} is {f.stat().st_size} bytes, manifest says {size}")
            if _sha256(f) != sha256:
                raise CheckpointError(f"checkpoint {path}: {rel} is corrupted (sha256 mismatch)")
        except OSError as e:  # EIO, a stale NFS handle, no permission: unreadable, not known to be bad
            raise CheckpointUnreadable(f"checkpoint {path}: cannot read {rel} ({e.strerror or e}); the storage "
                                       "failed, so the run stops instead of passing over it") from None
    return manifest


def write_checkpoint(final: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     trainer_state: dict[str, Any] | None, meta: dict[str, Any], rank: int = 0,
                     is_writer: bool = True, before_seal=None, parents: bool = True) -> None:
    """Write a checkpoint folder atomically; without an optimizer, weights only. `meta` (JSON: the model
    shape, the config) goes to meta.json: tools such as `convert` rebuild the model without the run's config."""
    write_state(final, step, capture_state(model, optimizer), trainer_state, meta, rank, is_writer, before_seal,
                parents=parents)


def write_state(final: Path, step: int, state: dict[str, Any], trainer_state: dict[str, Any] | None,
                meta: dict[str, Any], rank: int = 0, is_writer: bool = True, before_seal=None,
                group: dist.ProcessGroup | None = None, parents: bool = True) -> None:
    """Write captured state as the checkpoint folder `final` (all ranks call it). `group` carries this
    save's collectives: an asynchronous save passes its own, so its thread never shares one with training.
    parents=False makes the folder above `final` (a run's checkpoints/) but not its own parent: a run dir
    moved or removed while a save was due fails the save instead of being recreated at the old path."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        failure = None
        try:
            if is_writer:
                shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash mid-save
                if not parents:
                    tmp.parent.mkdir(exist_ok=True)
                tmp.mkdir(parents=parents)
        except Exception as e:
            failure = e
        agree_on_failure(failure, group, tmp)  # the folder exists before any rank writes into it
        with single_process_ok():
            dcp.save(state, checkpoint_id=str(tmp / "state"), process_group=group)  # agrees on its own errors
        failure = None
        try:
            if trainer_state is not None:
                (tmp / "trainer").mkdir(exist_ok=True)
                torch.save(trainer_state, tmp / "trainer" / f"rank{rank}.pt")
                _fsync(tmp / "trainer" / f"rank{rank}.pt")  # by its writer: the sealer's listing may not show it
        except Exception as e:
            failure = e
        agree_on_failure(failure, group, tmp)  # every rank's files are on disk before the manifest lists them
        failure = None
        try:
            if before_seal is not None:
                before_seal()  # fault injection: a crash here must leave only a .tmp folder behind
            if is_writer:
                ranks = (dist.get_world_size(group) if dist.is_initialized() else 1) if trainer_state is not None else 0
                _seal(tmp, final, step, "full" if "optim" in state else "weights", meta, ranks)
        except Exception as e:
            failure = e
        agree_on_failure(failure, group, tmp)  # nobody moves on (or reads it back) before it is complete
    except (Exception, CheckpointException) as e:
        cause = storage_error(e, tmp)  # (told now: the partial folder's removal frees the space that ran out)
        if cause is None:
            raise
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind
        if isinstance(cause, WriteCutShort):
            raise cause from e  # (torch's writer's RuntimeError: the OSError it stands for)
        raise


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data: a power loss must not find a name the disk never held."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(tmp: Path, final: Path, step: int, kind: str, meta: dict[str, Any], trainer_ranks: int = 0) -> None:
    """Write meta and the manifest (last), then rename the folder into place, all flushed first (DCP its
    files, each rank its trainer state). The manifest covers every file the ranks wrote (`_written`)."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    for f in [tmp / "meta.json", *(d for d in (tmp / "state", tmp / "trainer") if d.is_dir())]:
        _fsync(f)  # the folders' entries too: DCP renames its .metadata into place
    written = _written(tmp, trainer_ranks)
    _wait_visible(tmp, written)
    names = {f.relative_to(tmp).as_posix() for f in tmp.rglob("*") if f.is_file()} | set(written)
    files = {name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in sorted(names)}
    manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "kind": kind, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    try:
        _rename_into_place(tmp, final)
    finally:
        _fsync(final.parent)


def _written(tmp: Path, trainer_ranks: int) -> dict[str, int]:
    """The files every rank of the save wrote, each with the least size it must have: DCP's data files as
    its metadata records them (not listed), and each rank's trainer state. On a shared file system the
    writer's listing of a folder others wrote into may lag (NFS caches it): the manifest must not miss one."""
    need = {"state/.metadata": 1, **{f"trainer/rank{r}.pt": 1 for r in range(trainer_ranks)}}
    for info in dcp.FileSystemReader(str(tmp / "state")).read_metadata().storage_data.values():
        name = f"state/{info.relative_path}"
        need[name] = max(need.get(name, 1), info.offset + info.length)
    return need


def _wait_visible(tmp: Path, need: dict[str, int], wait_s: float | None = None) -> None:
    """Until each file is there at its size, listing its folder again (which asks the server anew)."""
    deadline = time.monotonic() + (wait_s := VISIBLE_WAIT_S if wait_s is None else wait_s)
    while True:
        missing = [n for n, size in need.items() if not ((tmp / n).is_file() and (tmp / n).stat().st_size >= size)]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint {tmp}: {missing[0]} (of {len(missing)} file(s) other ranks wrote) is "
                                  f"not there, or short, as the writer sees the folder after {wait_s:.0f} s")
        for folder in {(tmp / n).parent for n in missing}:
            with contextlib.suppress(OSError):
                os.listdir(folder)
        time.sleep(0.2)


def _rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():  # an older save of the same step (after a rollback, or a halt's save)
        # Renamed aside, not deleted first: between the two renames no folder of this step is complete
        # (Checkpointer.repair_interrupted_seal() puts one back after a crash there).
        old = final.with_name(final.name + DELETING)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        _fsync(final.parent)  # both renames on disk before the old copy goes
        shutil.rmtree(old, ignore_errors=True)
        return
    tmp.rename(final)


def read_meta(path: Path) -> dict[str, Any]:
    verify(path)
    return json.loads((path / "meta.json").read_text(encoding="utf-8"))


def load_weights(path: Path | str, model: torch.nn.Module, verified: bool = False) -> None:
    """Load only the model weights of any checkpoint (full or weights-only) in place.
    `verified`: the caller has just verified it (hashing every file again takes minutes at 70B)."""
    if not verified:
        verify(Path(path))  # (a str from a caller too)
    state = {"model": get_model_state_dict(model)}
    load_state(Path(path), state)
    set_model_state_dict(model, state["model"])


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int, rank: int = 0, is_writer: bool = True):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.rank, self.is_writer = keep, rank, is_writer
        self._verified: dict[str, tuple[tuple, dict[str, Any]]] = {}  # path: (files' stat, manifest)
        self.failed: set[str] = set()  # folders latest_valid found invalid: not counted by prune (module doc)
        self.keep_also: list[Path] = []  # the best eval losses' folders, oldest first (checkpoint.keep_best's)

    def verify(self, path: Path) -> dict[str, Any]:
        """verify(path), hashed once while its files stay as they were: a resume asks three times
        (the newest valid, the tiers' choice, the load), and each pass reads every byte, minutes
        for a large checkpoint on shared storage."""
        try:
            stamp = tuple(sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in path.rglob("*")))
        except OSError:
            stamp = None
        seen = self._verified.get(str(path))
        if stamp is not None and seen is not None and seen[0] == stamp:
            return seen[1]
        manifest = verify(path)
        if stamp is not None:
            self._verified[str(path)] = (stamp, manifest)
        return manifest

    def list(self) -> list[Path]:
        """Complete-looking checkpoints (renamed, with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if p.is_dir() and _finished(p) and (p / MANIFEST).is_file()]
        return sorted(found, key=step_of)

    def latest_valid(self, on_invalid=None) -> Path | None:
        """The newest checkpoint that verifies; `on_invalid(path, error)` hears of the others,
        a finished folder whose manifest is gone included (half-written ones end in .tmp)."""
        folders = [p for p in self.root.glob("step-*") if p.is_dir() and _finished(p)] if self.root.is_dir() else []
        for path in sorted(folders, key=step_of, reverse=True):
            try:
                self.verify(path)
                return path
            except CheckpointUnreadable as e:
                if path.exists() or not self.root.is_dir():  # (the folder gone, not its mount: a prune's rename)
                    raise  # passing over it would resume an older one, or start over and set the history aside
                if on_invalid is not None:  # (gone while read: renamed away by a prune, not the storage failing)
                    on_invalid(path, e)
            except CheckpointError as e:
                self.failed.add(str(path))
                if on_invalid is not None:
                    on_invalid(path, e)
        return None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], meta: dict[str, Any], before_seal=None) -> tuple[Path, float]:
        """Write the checkpoint of `step`; returns its path and the seconds it took."""
        begin = time.perf_counter()
        final = self.root / step_dir_name(step)
        write_checkpoint(final, step, model, optimizer, trainer_state, meta, self.rank, self.is_writer, before_seal,
                         parents=False)  # (the run dir is the launch's: never made again by a save)
        if self.is_writer:
            self.prune(final)
        return final, time.perf_counter() - begin

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load model and optimizer in place; returns this rank's trainer state."""
        if self.verify(path).get("kind", "full") != "full":
            raise CheckpointError(f"checkpoint {path} holds weights only; start a run from it with "
                                  f"--model.init_from={path} instead of resuming")
        state = capture_state(model, optimizer)
        own_groups = [g["params"] for g in state["optim"]["param_groups"]]
        load_state(path, state)
        keep_own_group_names(state["optim"], own_groups)
        restore_state(model, optimizer, state)
        rank_file = path / "trainer" / f"rank{self.rank}.pt"
        if not rank_file.is_file():
            rank_file = path / "trainer" / "rank0.pt"  # resumed with more ranks than were saved
        return torch.load(rank_file, weights_only=True)

    def set_aside_after(self, step: int) -> list[Path]:
        """Move the checkpoints of steps after `step` (a run resumed from an older one, or past
        invalid newer ones) into checkpoints/set-aside/: they belong to a history this run
        abandons, and left in place a later restart would resume from them and pruning would
        count them. Nothing is deleted. Returns where they went."""
        if not self.is_writer or not self.root.is_dir():
            return []
        moved = []
        for path in sorted(self.root.glob("step-*"), key=step_of):
            if path.is_dir() and _finished(path) and step_of(path) > step:
                target = self.root / "set-aside" / path.name
                while target.exists():
                    target = target.with_name(target.name + "-again")
                target.parent.mkdir(exist_ok=True)
                path.rename(target)
                moved.append(target)
        return moved

    def interrupted_seals(self) -> list[Path]:
        """Folders a second save of a step renamed aside whose step has no folder (read only)."""
        if not self.root.is_dir():
            return []
        asides = sorted(self.root.glob(f"step-*{DELETING}"))
        return [a for a in asides if not a.with_name(a.name.removesuffix(DELETING)).exists()]

    def repair_interrupted_seal(self) -> list[Path]:
        """Put back a checkpoint whose second save of a step was cut between its two renames
        (_seal: the old folder renamed aside, the new one not yet into place): the new one when
        its manifest verifies, else the old one if it does. Writer only, with the run dir locked
        (a live save's window must not be "repaired"). Returns the folders put back."""
        if not self.is_writer:
            return []
        restored = []
        for aside in self.interrupted_seals():
            final = aside.with_name(aside.name.removesuffix(DELETING))
            for candidate in (final.with_name(final.name + ".tmp"), aside):
                try:
                    verify(candidate)
                except CheckpointUnreadable:
                    raise  # not known to be bad: the start stops in one line, as a resume does
                except CheckpointError:
                    continue  # half-written, or half-deleted (an older version's prune left these too)
                candidate.rename(final)
                restored.append(final)
                break
        return restored

    def prune(self, written: Path | None = None) -> None:
        """Keep the newest `keep`, the newest of `keep_also` on disk and the folder just `written` (an anomaly
        halt's re-save of an older step, beside a newer folder that failed to verify, was the one removed). A
        folder is renamed before it is removed, so an interruption never leaves a half-deleted checkpoint that
        looks complete; leftovers go next time, as do a repaired seal's asides and older saves a crash cut short.

        Best effort, never raising: it runs on the writer alone after a save every rank agreed had
        landed (its peers wait for it). What cannot be listed, renamed or checked now stays for later."""
        try:
            self.repair_interrupted_seal()
            asides = [*self.root.glob(f"step-*{DELETING}")]  # what repair did not need
        except Exception:  # noqa: BLE001 - unchecked: one may be a step's only copy
            asides = []
        with contextlib.suppress(Exception):  # a listing the storage refuses (a stale handle): next time
            self.failed.discard(str(written))  # (saved again: this one is valid)
            counted = [p for p in self.list() if str(p) not in self.failed]
            best = next((p for p in reversed(self.keep_also) if p in counted), None)  # (newer: not landed, refused)
            for old in [p for p in counted[: -self.keep] if p not in (written, best)]:
                with contextlib.suppress(OSError):
                    old.rename(old.with_name(old.name + PRUNING))
            cut = [t for t in self.root.glob("step-*.tmp") if written and step_of(t) < step_of(written)]  # (repaired)
            for gone in [*self.root.glob(f"step-*{PRUNING}"), *asides, *cut]:
                shutil.rmtree(gone, ignore_errors=True)
