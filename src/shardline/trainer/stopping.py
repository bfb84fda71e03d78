"""What the trainer does when every rank agreed to stop (SIGTERM, SIGUSR1, a first Ctrl-C): save the
step it stopped after, wherever the run keeps its state, and say in one line what a rerun resumes.

A mixin of Trainer (trainer/loop.py), whose state it works on: the checkpoint tiers, the watchdog
guard, the metrics log and the step counter; what a rollback left unsaved is anomalies.py's.
"""

from __future__ import annotations

from shardline.resilience.checkpoint import step_dir_name


class StopOnRequest:
    def _stop_on_request(self, signal_name: str, saved: bool | None) -> str:
        """Every rank agreed to stop after this step: save it (unless just saved; None: right after a
        rollback, whose own re-save may have landed); returns the one line to stop with."""
        self.tiers.ending_at = self.step  # a save of this step refused (drained now, or below) is not retried
        self.guard.drain(self.step)  # what is held and landed so far, counted: then this save's own outcome
        after_rollback, saved = saved is None, not self._rolled_back_unsaved if saved is None else saved
        if not self.cfg.checkpoint.interval:  # (after a rollback the snapshots lack it: the batches to skip named)
            every = self.cfg.checkpoint.memory_interval
            # RAM is all a rerun has: this step, not the last multiple of `every` (not in place of the snapshot
            # a rollback just restored: a write that fails midway would lose it)
            if every and self.step % every and not after_rollback:
                self.guard.watched("snapshot", self.step, "checkpoint", self.snapshot_to_memory)
                self.guard.drain(self.step)
            self.metrics.event("preempted", step=self.step, signal=signal_name, checkpoint=None)
            kept = self._held_for_rerun()
            return f"{signal_name} at step {self.step}; checkpoint.interval=0, so nothing was saved to disk{kept}"
        landed = self.tiers.landed
        if not saved:
            self.guard.watched("save", self.step, "checkpoint", self.save_checkpoint)
        self.guard.drain(self.step)  # an async save must be on disk before the process ends
        path = self.checkpointer.root / step_dir_name(self.step)
        # The storage refused it (logged as checkpoint_failed); a re-save after a rollback leaves the older copy.
        if not path.is_dir() or not (saved or self.tiers.landed > landed):
            self.metrics.event("preempted", step=self.step, signal=signal_name, checkpoint=None)
            return (f"{signal_name} at step {self.step}; its checkpoint could not be written (see checkpoint_failed)"
                    + self._unsaved_rollback())
        self.metrics.event("preempted", step=self.step, signal=signal_name, checkpoint=str(path))
        return (f"{signal_name} at step {self.step}; state saved; rerun the same command (from Python: train a new "
                "Trainer of the same config) to resume")
