"""Asynchronous checkpoints (checkpoint.mode = async): snapshot, then persist in the background.

Training stalls only while the state is copied to host memory; a background thread
then writes the copy with the same atomic, checksummed layout as a synchronous save.
At most one save is in flight (the next one waits for it), and since the thread
writes a private copy, a save never races the next optimizer step. Its collectives
run on a process group of their own, so they never interleave with training's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from shardline.resilience.background import BackgroundWork
from shardline.resilience.checkpoint import Checkpointer, step_dir_name, write_state
from shardline.resilience.model_state import capture_state
from shardline.resilience.save_failures import storage_error


def snapshot(obj: Any) -> Any:
    """A host-memory copy of a state dict (DTensors keep their layout and mesh, with shards copied
    to the host: `.to` on the DTensor, as torch's own checkpoint staging does; `DTensor.from_local`
    would move each shard back to the mesh's GPU, a second copy of the state in device memory)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class AsyncSaver:
    def __init__(self, checkpointer: Checkpointer, group=None):
        self.checkpointer, self.group = checkpointer, group
        self._work = BackgroundWork("async-save")

    def save(self, step: int, model, optimizer, trainer_state: dict, meta: dict,
             before_seal=None) -> tuple[Path, float]:
        """Snapshot now, write later; returns the checkpoint's future path and the stall."""
        self.wait()
        begin = time.perf_counter()
        state = snapshot(capture_state(model, optimizer))
        stall = time.perf_counter() - begin
        final = self.checkpointer.root / step_dir_name(step)
        self._work.start(lambda: self._write(final, step, state, trainer_state, meta, before_seal))
        return final, stall

    def _write(self, final, step, state, trainer_state, meta, before_seal) -> dict:
        c = self.checkpointer
        try:
            write_state(final, step, state, trainer_state, meta, c.rank, c.is_writer, before_seal, self.group,
                        parents=False)  # (a run dir moved while it was due: this save fails, the next stops the run)
        except (Exception, CheckpointException) as e:
            if storage_error(e, final) is None:
                raise
            return {"step": step, "path": str(final), "error": e}  # the disk refused it: the caller decides
        if c.is_writer:
            c.prune(final)
        return {"step": step, "path": str(final)}

    def peek(self) -> list[dict]:
        """The saves whose writes finished since last peeked at, without waiting (wait() returns them too)."""
        return self._work.peek()

    def wait(self) -> list[dict]:
        """Block until the save in flight is on disk; returns the saves completed since last asked
        ({"step", "path", "background_s"})."""
        return self._work.wait()
