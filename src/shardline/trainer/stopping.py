"""How a launch ends: what the trainer does when every rank agreed to stop (SIGTERM, SIGUSR1, a first
Ctrl-C: save the step it stopped after, wherever the run keeps its state, and say in one line what a
rerun resumes), and the end's account (the `end` event and what the launch leaves unsaid otherwise).

A mixin of Trainer (trainer/loop.py), whose state it works on: the checkpoint tiers, the watchdog
guard, the metrics log and the step counter; what a rollback left unsaved is anomalies.py's.
"""

from __future__ import annotations

import sys

from shardline.errors import Preempted
from shardline.parallel.distributed import say_for_node
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

    def _finish(self, stopped: str | None, first: int) -> None:
        """The launch's end: its account (the end event), what it leaves unsaid otherwise, and what it
        lets go of (the log, the data's readers, the run dir's lock)."""
        self.profiler.close(self.step)  # a run stopped inside the profiled steps writes those it ran
        self.report_device_anomalies()
        early = self.early_stopped_at is not None  # (the run is over there: nothing left to requeue)
        last = self.step >= self.cfg.train.steps or early
        summary = self.guard.finish(self.step, complete=stopped is None, last=last,
                                    exit_code=Preempted.exit_code if stopped else 0)
        # (what a requeue script reads: the end of a stop or of a refused last save is no run's end)
        outcome = "stopped" if stopped else "save_refused" if self.tiers.unsaved_end else \
            "early_stopped" if early else "complete" if last else "stop_at_step"
        self.metrics.event("end", step=self.step, outcome=outcome, overflow_skipped_steps=self.scaler.skipped_steps,
                           anomalies=len(self.anomaly_events), rollbacks=self.rollbacks, **summary)
        say_for_node(self.proc, f"ended at step {self.step}: {outcome}")
        if self.guard.goodput and self.guard.goodput.stale and not self.tiers.unsaved_end:  # (rank 0's: else exit 2)
            print(f"shardline: warning: {self.run_dir / 'progress.json'} could not be written at the end "
                  f"({self.guard.goodput.stale}): it still says an earlier state of this run", file=sys.stderr)
        overflowed = self.scaler.overflow_warning()
        if overflowed and self.proc.is_main:
            print(f"shardline: warning: {overflowed}", file=sys.stderr, flush=True)
        if early and self.proc.is_main:
            print(f"shardline: note: {self.early_stop_line()}", file=sys.stderr, flush=True)
        if not self.cfg.checkpoint.interval and stopped is None and self.step >= first and self.proc.is_main:
            print(f"shardline: note: checkpoint.interval=0: the weights trained to step {self.step} were not saved",
                  file=sys.stderr, flush=True)  # (said at the start too, and by a stop's line)
        self.close()  # (the log, the data's readers, the run dir's lock: let go)
