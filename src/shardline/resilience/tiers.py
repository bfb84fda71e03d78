"""Where a run's state is kept and found again: checkpoints on disk (sync or async) and
the in-memory tier. The trainer says when to save and hands over its own small state;
this decides how, logs what each save cost, and finds the newest state to restore.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from shardline.config import Config
from shardline.errors import CheckpointError
from shardline.optim import init_optimizer_state
from shardline.parallel.dims import ParallelDims
from shardline.parallel.distributed import ProcessInfo
from shardline.resilience.async_checkpoint import AsyncSaver
from shardline.resilience.checkpoint import Checkpointer
from shardline.resilience.save_failures import storage_error
from shardline.resilience.faults import FaultInjector
from shardline.resilience.memory_tier import MemoryTier, run_root


def memory_rank_dir(cfg: Config, rank: int) -> Path | None:
    """This rank's folder of the in-memory tier, or None when the tier is off."""
    c = cfg.checkpoint
    return MemoryTier.rank_dir(run_root(Path(cfg.run.dir), c.memory_dir), rank) if c.memory_interval else None


class StateTiers:
    def __init__(self, cfg: Config, proc: ProcessInfo, dims: ParallelDims, checkpointer: Checkpointer,
                 fingerprint: str, faults: FaultInjector, log: Callable[..., None]):
        """log(event, **fields): where save and snapshot events go (the run's metrics)."""
        c = cfg.checkpoint
        self.cfg, self.checkpointer, self.faults = cfg, checkpointer, faults
        self.saver = AsyncSaver(checkpointer, dims.checkpoint_group) if c.mode == "async" else None
        self.memory_background = c.memory_mode == "async"
        self.memory = None
        if c.memory_interval:
            self.memory = MemoryTier(run_root(Path(cfg.run.dir), c.memory_dir), proc.rank, proc.world_size,
                                     proc.local_world_size, c.memory_redundancy, fingerprint)
        self.log = log

    # ---- saving -----------------------------------------------------------------------

    def save(self, step: int, model, optimizer, trainer_state: dict, meta: dict) -> Path | None:
        """A checkpoint on disk; returns once training may go on (async: after the host copy).

        None when the storage refused a synchronous save and checkpoint.on_error = continue."""
        fail_midway = lambda: self.faults.during_save(step)  # noqa: E731
        if self.saver is None:
            try:
                path, seconds = self.checkpointer.save(step, model, optimizer, trainer_state, meta, fail_midway)
            except (Exception, CheckpointException) as e:
                self._refused(step, e, model)
                return None
            self.log("checkpoint", step=step, path=str(path), mode="sync", stall_s=round(seconds, 3))
            self.faults.after_save(step, path)
            return path
        self._drain_disk()
        path, stall = self.saver.save(step, model, optimizer, trainer_state, meta, fail_midway)
        self.log("checkpoint", step=step, path=str(path), mode="async", stall_s=round(stall, 4))
        return path

    def _refused(self, step: int, error: BaseException, model) -> None:
        """A save the storage refused (disk full, read-only, ...): its partial folder is already
        gone; log it and go on (the next interval retries), or stop, by checkpoint.on_error.
        Errors that are not the storage's propagate unchanged."""
        cause = storage_error(error)
        if cause is None:
            raise error
        root = self.checkpointer.root
        if cause.errno == errno.ENOSPC:
            free = shutil.disk_usage(root.parent if not root.exists() else root).free
            need = self._checkpoint_bytes(model)
            what = f"no space left on {root} (needs ~{need / 1e9:.2f} GB, {free / 1e9:.2f} GB free)"
        else:
            what = f"cannot write {root}: {cause.strerror or cause}"
        message = f"checkpoint of step {step} failed: {what}"
        if self.cfg.checkpoint.on_error == "stop":
            raise CheckpointError(message + "; stopping (checkpoint.on_error=stop), earlier checkpoints are intact")
        self.log("checkpoint_failed", step=step, error=what, action="continue; retried at the next interval")

    def _checkpoint_bytes(self, model) -> float:
        """The size of the newest checkpoint, else ~16 bytes per parameter (weights, Adam m and v, slack)."""
        newest = self.checkpointer.latest_valid()
        if newest is not None:
            return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
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

    def _drain_disk(self) -> None:
        for done in self.saver.wait() if self.saver is not None else ():
            if "error" in done:
                self._refused(done["step"], done["error"], None)
                continue
            self.log("checkpoint_persisted", step=done["step"], path=done["path"],
                     background_s=round(done["background_s"], 3))
            self.faults.after_save(done["step"], Path(done["path"]))

    def _drain_memory(self) -> None:
        for done in self.memory.wait() if self.memory is not None else ():
            self._log_held(done)

    def _log_held(self, stats: dict) -> None:
        extra = {"background_s": round(stats["background_s"], 3)} if "background_s" in stats else {}
        self.log("memory_snapshot_held", step=stats["step"], redundancy=self.cfg.checkpoint.memory_redundancy,
                 own_mib=round(stats["own_bytes"] / 2**20, 2),
                 redundancy_mib=round(stats["redundancy_bytes"] / 2**20, 2), **extra)

    def report_stale_memory(self) -> None:
        """Name the RAM other (e.g. crashed, abandoned) runs' snapshots still hold on this node."""
        held = self.memory.others_bytes() if self.memory is not None else 0
        if held:
            self.log("stale_memory_snapshots", gib=round(held / 2**30, 3), folder=str(self.memory.root.parent),
                     hint="snapshots of other runs in shared memory; remove the folders of runs that are over")

    def finish(self) -> None:
        """The run is over (complete, or halted with its state on disk): give the RAM back."""
        self.drain()
        if self.memory is not None:
            self.memory.clear()

    # ---- restoring --------------------------------------------------------------------

    def resume_source(self, disk: Path | None, use_memory: bool):
        """What a starting run restores (see newest()); `use_memory` false (a fresh run, or a
        first start from a named checkpoint: recovery.memory_tier_resumable) clears the
        snapshots held, which are of a history the run leaves."""
        if self.memory is not None and not use_memory:
            self.memory.clear()
        return self.newest(disk, use_memory=use_memory)

    def newest(self, disk: Path | None, use_memory: bool = True):
        """The in-memory snapshot (step, payload, sources) when it is at least as new as
        the disk checkpoint `disk`, else `disk` (None when there is neither).

        Collective when the memory tier is on: every rank reports what it holds and
        lost snapshots are rebuilt from the survivors.
        """
        self.drain()
        memory = self.memory.recover() if self.memory is not None and use_memory else None
        if memory is not None and (disk is None or memory[0] >= self.checkpointer.verify(disk)["step"]):
            return memory
        return disk

    def restore(self, found, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, Any]]:
        """Load model and optimizer from what newest() found; returns its name and the trainer state."""
        init_optimizer_state(optimizer)
        if isinstance(found, Path):
            return str(found), self.checkpointer.load(found, model, optimizer)
        step, payload, sources = found
        rebuilt = {r: src for r, src in sources.items() if src != "own"}
        name = f"memory tier step {step}" + (f" (rebuilt {rebuilt})" if rebuilt else "")
        return name, MemoryTier.load_into(payload, model, optimizer)
