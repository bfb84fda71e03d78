"""Where a run's state is kept and found again: checkpoints on disk (sync or async) and
the in-memory tier. The trainer says when to save and hands over its own small state;
this decides how, logs what each save cost, and finds the newest state to restore.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardline.config import Config
from shardline.errors import CheckpointError, on_every_rank
from shardline.optim import init_optimizer_state
from shardline.parallel.dims import ParallelDims
from shardline.parallel.distributed import ProcessInfo, agreed
from shardline.resilience.async_checkpoint import AsyncSaver
from shardline.resilience.checkpoint import Checkpointer, step_dir_name, step_of
from shardline.resilience.recovery import rank0_decides, saved_step
from shardline.resilience.save_failures import any_rank, storage_error
from shardline.resilience.faults import FaultInjector
from shardline.resilience.memory_tier import MemoryTier, run_root

RUN_ID = "memory_tier.json"  # in the run dir: which run the in-memory snapshots belong to


def memory_rank_dir(cfg: Config, rank: int) -> Path | None:
    """This rank's folder of the in-memory tier, or None when the tier is off."""
    c = cfg.checkpoint
    return MemoryTier.rank_dir(run_root(Path(cfg.run.dir), c.memory_dir), rank) if c.memory_interval else None


def folder_bytes(*folders: Path) -> int:
    """The bytes the files under these folders hold (a checkpoint's, set-aside's)."""
    return sum(f.stat().st_size for folder in folders for f in folder.rglob("*") if f.is_file())


def refuse_no_room(cfg: Config, found: Path | None, root: Path) -> None:
    """A resumed run whose checkpoint disk has less space free than its newest checkpoint holds: its
    next save would be refused after training to it, as the last launch's likely was, and under
    torchrun's restarts the same steps trained again and again. Refused before it trains; not a run
    with nothing left to train, nor where the file system reports no size (some FUSE mounts). A save
    cut short at the step it saves next counts as free: that save removes it first."""
    if found is None or not cfg.checkpoint.interval or not found.is_dir() or not os.access(root, os.W_OK):
        return  # (a folder not writable: the lock's check says so)
    every, last, at = cfg.checkpoint.interval, cfg.train.last_step, saved_step(found)  # (a named folder's: manifest)
    if at >= last:
        return
    cut = root / f"{step_dir_name(min(last, (max(at, 0) // every + 1) * every))}.tmp"
    try:
        need, usage = folder_bytes(found), shutil.disk_usage(root)
        free = usage.free + (folder_bytes(cut) if cut.is_dir() else 0)
    except OSError:  # (a listing the storage refuses: the save says so, as before)
        return
    if usage.total and free < need:
        raise CheckpointError(f"no space to save on {root}: {_size(free)} free, and a checkpoint of this run takes "
                              f"~{_size(need)} ({found.name}); free space (e.g. in checkpoints/set-aside/) and rerun, "
                              "or train without saving (checkpoint.interval=0)")


def _size(n: float) -> str:
    """Bytes for a reader, in the largest unit that fits (7.4 MB, not 0.01 GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class StateTiers:
    def __init__(self, cfg: Config, proc: ProcessInfo, dims: ParallelDims, checkpointer: Checkpointer,
                 fingerprint: str, faults: FaultInjector, log: Callable[..., None]):
        """log(event, **fields): where save and snapshot events go (the run's metrics)."""
        c = cfg.checkpoint
        self.cfg, self.checkpointer, self.faults, self.proc = cfg, checkpointer, faults, proc
        self.fingerprint = fingerprint
        self.saver = AsyncSaver(checkpointer, dims.checkpoint_group) if c.mode == "async" else None
        self._group = dims.checkpoint_group
        self.memory_background = c.memory_mode == "async"
        self.landed = 0  # disk saves known to be on disk (an async one once its write finished)
        self.ending_at: int | None = None  # the step the run ends after (its last, a stop's, a halt's): set by the
        # trainer; a save of it that the storage refuses has no next interval to retry it
        self.held = 0  # memory snapshots known to be held (an async one once every rank holds it)
        self._saved_model = None  # the model an async save is writing (its size, where the storage refuses it)
        self.unsaved_end = ""  # why the step the run ends after could not be saved (the storage refused it)
        self.unsaved_cause: OSError | None = None  # the storage's error behind it
        self.refused: set[int] = set()  # the steps whose saves the storage refused (an async one's found later)
        self.taken_by: Callable[[], str] = str  # who took the run dir's lock over, in words ("": none; the guard's)
        self.memory = None
        if c.memory_interval:
            self.memory = MemoryTier(run_root(Path(cfg.run.dir), c.memory_dir), proc.rank, proc.world_size,
                                     proc.local_world_size, c.memory_redundancy, fingerprint)
        self.log = log

    # ---- saving -----------------------------------------------------------------------

    def save(self, step: int, model, optimizer, trainer_state: dict, meta: dict) -> Path | None:
        """A checkpoint on disk; returns once training may go on (async: after the host copy).

        None when the storage refused a synchronous save and checkpoint.on_error = continue."""
        fail_midway = lambda: self._may_seal(step)  # noqa: E731
        if self.saver is None:
            try:
                path, seconds = self.checkpointer.save(step, model, optimizer, trainer_state, meta, fail_midway)
            except (Exception, CheckpointException) as e:
                self._refused(step, e, model)
                return None
            if self.proc.world_size > 1:  # the writer's tail (pruning, minutes on slow storage) ends the save
                dist.barrier(group=self._group)  # on every rank: not waited for after it, under the step's limit
            self.log("checkpoint", step=step, path=str(path), mode="sync", stall_s=round(seconds, 3))
            self.landed += 1
            self.faults.after_save(step, path)
            return path
        self._drain_disk()
        self._saved_model = model  # (a save refused in the background: its size, said by _refused)
        path, stall = self.saver.save(step, model, optimizer, trainer_state, meta, fail_midway)
        self.log("checkpoint", step=step, path=str(path), mode="async", stall_s=round(stall, 4),
                 on_disk=False)  # (yet: checkpoint_persisted says when it is, after the step its write ends in)
        return path

    def say_landed(self) -> None:
        """checkpoint_persisted for an async save whose write has finished, asked after each step without
        waiting: said at the next save, a crash before it left the log saying a sealed checkpoint never
        landed. Only the log: `landed` and the drill's after_save wait for the drain, where every rank
        counts alike (a write ends on each rank at its own time)."""
        for done in self.saver.peek() if self.saver is not None else ():
            if "error" not in done:  # (a refusal is the drain's: every rank decides it at one step)
                self._say_persisted(done)

    def _say_persisted(self, done: dict) -> None:
        self.log("checkpoint_persisted", step=done["step"], path=done["path"],
                 background_s=round(done["background_s"], 3))

    def _may_seal(self, step: int) -> None:
        """Before a save's folder is sealed (every rank; the failure is agreed): the fault drill's crash,
        and a run dir another launch took over meanwhile (an async save in flight then): not sealed
        there, nor older checkpoints pruned, beside that launch's."""
        self.faults.during_save(step)
        if self.taken_by():
            raise CheckpointError(f"{self.taken_by()}: the save of step {step} was not sealed, nor older ones pruned")

    def _refused(self, step: int, error: BaseException, model) -> None:
        """A save the storage refused (disk full, read-only, ...): its partial folder is already
        gone; log it and go on (the next interval retries), or stop, by checkpoint.on_error.
        Errors that are not the storage's propagate unchanged."""
        root = self.checkpointer.root
        cause = storage_error(error, root)
        if cause is None:
            raise error
        self.refused.add(step)  # (a best the trainer named there is no best: trainer/intervals.py)
        if cause.errno == errno.ENOSPC:
            free = shutil.disk_usage(root.parent if not root.exists() else root).free
            need = self._checkpoint_bytes(model)
            keep, held = self.cfg.checkpoint.keep, len(self.checkpointer.list())
            best = self.cfg.checkpoint.keep_best  # (the best eval loss's folder kept beside them)
            what = (f"no space left on {root} (needs ~{_size(need)}, {_size(free)} free; with checkpoint.keep={keep} "
                    f"{'and keep_best ' * best}the disk holds up to {keep + 1 + best} at once, the next written before "
                    "the oldest goes: "
                    + ("lower keep or " if keep > 1 and held > 1 else "")  # (one held: a lower keep frees nothing)
                    + "free space, e.g. in checkpoints/set-aside/)")
        else:
            what = f"cannot write {root}: {cause.strerror or cause}"
        message = f"checkpoint of step {step} failed: {what}"
        if self.cfg.checkpoint.on_error == "stop":  # (the event first: a requeue script reads why the run ended)
            self.log("checkpoint_failed", step=step, error=what, action="stop (checkpoint.on_error=stop)")
            kept = "earlier checkpoints are intact" if self.checkpointer.list() else "none was saved before it"
            # (from the storage's error: a transient one, EIO say, exits TRY_LATER (75) whether the save was sync,
            # failing inside its except, or async, found at the next save)
            raise on_every_rank(CheckpointError(f"{message}; stopping (checkpoint.on_error=stop), {kept}")) from cause
        if step != self.ending_at:  # (a run going on for days without a save: the newest one says since when)
            newest = [p.name for p in self.checkpointer.list()] or ["none"]
            action = f"continue; retried at the next interval; newest on disk: {newest[-1]}"
        else:  # no next interval: what a rerun would resume is older (or in RAM: the memory tier keeps it)
            saved = self.checkpointer.list()
            fix = "free space" if cause.errno == errno.ENOSPC else "make it writable"
            action = (f"none: the run ends here; a rerun resumes {saved[-1].name if saved else 'nothing on disk'}"
                      + (" (or a newer in-memory snapshot)" if self.memory is not None else "")
                      + f": {fix} and rerun to save this state")
            self.unsaved_end = f"checkpoint of step {step} failed: {what}; {action.removeprefix('none: ')}"
            self.unsaved_cause = cause  # (the run's end raises from it: a transient one exits TRY_LATER)
        self.log("checkpoint_failed", step=step, error=what, action=action)

    def _checkpoint_bytes(self, model) -> float:
        """The size of the newest checkpoint, else ~16 bytes per parameter (weights, Adam m and v, slack)."""
        with contextlib.suppress(OSError):  # the newest sealed one's files, not hashed (minutes at 70B)
            saved = self.checkpointer.list()
            if saved:
                return folder_bytes(saved[-1])
        return 16.0 * sum(p.numel() for p in model.parameters()) if model is not None else 0.0

    def snapshot(self, step: int, model, optimizer, trainer_state: dict) -> None:
        """An in-memory snapshot with its replica or parity (in the background under memory_mode=async)."""
        self._drain_memory()
        stats = self.memory.save(step, model, optimizer, trainer_state, self.memory_background)
        self.log("memory_snapshot", step=step, mode="async" if self.memory_background else "sync",
                 stall_s=round(stats["stall_s"], 4))
        if not self.memory_background:
            self._log_held(stats)

    def drain(self) -> None:
        """Wait for every save in flight and log what each one took and holds."""
        self._drain_disk()
        self._drain_memory()

    def drain_disk(self) -> None:
        """Wait for the disk save in flight, if any: its outcome known (a refusal in `refused`)."""
        self._drain_disk()

    def _drain_disk(self) -> None:
        for done in self.saver.wait() if self.saver is not None else ():
            if "error" in done:
                self._refused(done["step"], done["error"], self._saved_model)
                continue
            if not done.get("peeked"):  # (said already by say_landed)
                self._say_persisted(done)
            self.landed += 1
            self.faults.after_save(done["step"], Path(done["path"]))

    def _drain_memory(self) -> None:
        for done in self.memory.wait() if self.memory is not None else ():
            self._log_held(done)

    def _log_held(self, stats: dict) -> None:
        if "error" in stats:  # every rank dropped the step's files; the older snapshots stay
            last = stats["step"] == self.ending_at  # a stop's own snapshot: no next one
            self.log("memory_snapshot_failed", step=stats["step"], error=stats["error"],
                     action="none: the run ends here; a rerun resumes its disk save of this step if one "
                     "lands, else an older snapshot" if last and self.cfg.checkpoint.interval else
                     "none: the run ends here, trained to its end (checkpoint.interval=0: its snapshots go with "
                     "it, nothing is kept)" if last and stats["step"] >= self.cfg.train.steps else
                     "none: the run ends here; a rerun resumes an older snapshot" if last else
                     "continue; the next snapshot tries again")
            return
        self.held += 1
        extra = {"background_s": round(stats["background_s"], 3)} if "background_s" in stats else {}
        redundancy = self.cfg.checkpoint.memory_redundancy if self.proc.world_size > 1 else "none (one process)"
        self.log("memory_snapshot_held", step=stats["step"], redundancy=redundancy,
                 own_mib=round(stats["own_bytes"] / 2**20, 2),
                 redundancy_mib=round(stats["redundancy_bytes"] / 2**20, 2), **extra)

    def report_stale_memory(self) -> None:
        """Name the RAM other (e.g. crashed, abandoned) runs' snapshots still hold on this node."""
        held = self.memory.others_bytes() if self.memory is not None else 0
        if held:
            self.log("stale_memory_snapshots", gib=round(held / 2**30, 3), folder=str(self.memory.root.parent),
                     hint="snapshots of other runs in shared memory; remove the folders of runs that are over")

    def finish(self, complete: bool = True) -> None:
        """The run is over: give the RAM back, unless the snapshots hold a state newer than any
        checkpoint on disk. A run stopped early (a signal, a halt) under checkpoint.interval=0, or
        any run whose last save the storage refused (checkpoint.on_error=continue), would
        otherwise leave a rerun only an older state, or none. A run that reached its last step
        (`complete`) saved it to disk unless the storage refused; under checkpoint.interval=0 it
        never saves, and its snapshots go."""
        self.drain()
        if self.memory is None:
            return
        held = self.memory.newest_held() if not complete or self.cfg.checkpoint.interval else None
        saved = self.checkpointer.list()  # complete ones (sealed with their manifest), by step
        # The writer's listing (it sealed them; another node's cached one may lag).
        disk = rank0_decides(step_of(saved[-1]) if saved else 0, self.proc.rank, self.proc.world_size)
        keep = held is not None and held > disk
        if self.proc.world_size > 1:  # decided together: a rank's files hold its peers' replica or parity
            keep = any_rank(keep, self.memory.group)
        if not keep:
            self.memory.clear()

    # ---- restoring --------------------------------------------------------------------

    def resume_source(self, disk: Path | None, use_memory: bool, check=None, passed_over: list | None = None):
        """What a starting run restores (see newest()); `use_memory` false (a fresh run, or a
        first start from a named checkpoint: recovery.memory_tier_resumable) clears the
        snapshots held, which are of a history the run leaves. Called with the run dir locked."""
        if self.memory is not None:
            run_id, new, use_memory = self._run_id(use_memory)
            self.memory.fingerprint = f"{self.fingerprint}\nrun {run_id}"
            use_memory = use_memory and not new
            if not use_memory:
                self.memory.clear()
        found = self.newest(disk, use_memory=use_memory, check=check, passed_over=passed_over)
        if self.memory is None:
            self._drop_left_snapshots(found)
        return found

    def _drop_left_snapshots(self, found: Path | None) -> None:
        """This launch keeps no snapshots (checkpoint.memory_interval=0): those an earlier launch of the
        run dir left in this node's RAM, under the same checkpoint.memory_dir, go. Newer than what it
        resumes, they are a history it leaves, which a later launch with the tier on would resume;
        older, RAM held for nothing past the run's end. Every rank lists its node's before any removes
        the run's folder there; rank 0 says which were newer, on any node."""
        root = run_root(Path(self.cfg.run.dir), self.cfg.checkpoint.memory_dir)

        def held() -> list[int]:
            with contextlib.suppress(OSError):
                return sorted({int(f.stem.split("-", 1)[1]) for f in root.glob("rank*/own-*.json")
                               if f.stem.split("-", 1)[1].isdigit()})
            return []
        steps = held()
        if self.proc.world_size > 1:  # (a collective: listed everywhere before any removal)
            everyone: list = [None] * self.proc.world_size
            dist.all_gather_object(everyone, steps, group=self._group)
            steps = sorted({step for listed in everyone for step in listed})
        shutil.rmtree(root, ignore_errors=True)
        resumed = saved_step(found) if found is not None else 0
        newer = [step for step in steps if step > resumed]
        if newer:
            self.log("memory_snapshots_dropped", step=resumed, steps=newer, folder=str(root),
                     why="checkpoint.memory_interval=0 in this launch, which " + (
                         f"resumed step {resumed} from disk" if found is not None else "starts from step 0")
                     + ": the snapshots an earlier launch took after that are a history it leaves")

    def _run_id(self, use_memory: bool) -> tuple[str, bool, bool]:
        """(the run dir's id, whether it was just made, `use_memory` as rank 0 has it). The snapshots
        are keyed by the run dir's path, which outlives the folder: a run dir deleted and made again
        is a new run, not one to resume from RAM. Rank 0 reads or writes it; every rank gets its
        answer, and rank 0's `use_memory` (a restart as each agent counts it: a node relaunched by
        hand beside restarted ones counts none, and its ranks must not clear while theirs recover)."""
        answer: list = [None]
        if self.proc.rank == 0:
            answer[0] = self._read_or_make_run_id(Path(self.cfg.run.dir) / RUN_ID)
            answer[0] = answer[0] if isinstance(answer[0], str) else (*answer[0], use_memory)
        if self.proc.world_size > 1:
            torch.distributed.broadcast_object_list(answer, src=0, group=self.memory.group)
        if isinstance(answer[0], str):  # on every rank alike
            raise on_every_rank(CheckpointError(answer[0]))
        return answer[0]

    @staticmethod
    def _read_or_make_run_id(path: Path) -> tuple[str, bool] | str:
        """The id, a new one when the file is absent or damaged, or the error (a file that exists
        but cannot be read now, e.g. a stale NFS handle, is no new run: its snapshots stay)."""
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["run"]), False
        except FileNotFoundError:
            pass
        except OSError as e:
            return f"cannot read {path} ({e.strerror or e}); the in-memory snapshots are kept: start again"
        except (ValueError, KeyError, TypeError):
            pass
        run_id, tmp = uuid.uuid4().hex, path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"run": run_id}), encoding="utf-8")
            tmp.replace(path)  # whole or absent, never torn
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return f"cannot write {path} ({e.strerror or e}), which names the run its in-memory snapshots belong to"
        return run_id, True

    def newest(self, disk: Path | None, use_memory: bool = True, check=None, passed_over: list | None = None):
        """The in-memory snapshot (step, payload, sources) when it is at least as new as
        the disk checkpoint `disk`, else `disk` (None when there is neither). `passed_over` gets
        this rank's snapshots newer than that which could not be used (damaged, another layout),
        before `check` judges what was found: a start that falls back past them says so.

        Collective when the memory tier is on: every rank reports what it holds and
        lost snapshots are rebuilt from the survivors.
        """
        self.drain()
        memory = self.memory.recover() if self.memory is not None and use_memory else None
        # (agreed: a rank whose view of the shared storage lags fails with its peers, not alone)
        disk_step = agreed(lambda: self.checkpointer.verify(disk)["step"], self.proc.world_size) if disk else 0
        found = memory if memory is not None and memory[0] >= disk_step else disk
        if self.memory is not None and use_memory and passed_over is not None:  # (recover() took stock)
            after = memory[0] if found is memory and memory is not None else disk_step
            mine = [f"the in-memory snapshot of step {step} (rank {self.proc.rank}) is {why}"
                    for step, why in sorted(self.memory.unusable.items()) if step > after]
            if self.proc.world_size > 1:  # every rank's, for rank 0's log (a refusal is agreed apart)
                everyone: list = [None] * self.proc.world_size
                dist.all_gather_object(everyone, mine, group=self.memory.group)
                mine = [problem for problems in everyone for problem in problems]
            passed_over += mine
        if check is not None:  # a refusal of what was found (agreed) comes before any snapshot is dropped
            agreed(lambda: check(found), self.proc.world_size)
        if self.memory is not None:  # newer snapshots (partial, or of another layout): a history left
            self.memory.discard_after(memory[0] if memory is not None and found is memory else disk_step)
        return found

    def restore(self, found, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, Any]]:
        """Load model and optimizer from what newest() found; returns its name and the trainer state."""
        init_optimizer_state(optimizer)
        if isinstance(found, Path):
            return str(found), self.checkpointer.load(found, model, optimizer)
        step, payload, sources = found
        rebuilt = {r: src for r, src in sources.items() if src != "own"}
        name = f"memory tier step {step}" + (f" (rebuilt {rebuilt})" if rebuilt else "")
        return name, MemoryTier.load_into(payload, model, optimizer)
