"""What the trainer does with an anomalous step: skip it, roll back to the newest saved state
without its batch, or halt with that state saved (anomaly.action), and the device-side check
whose verdicts are read later.

A mixin of Trainer (trainer/loop.py), whose state it works on: the optimizer, scaler and
schedule, the checkpoint tiers, the watchdog guard, the metrics log and the step counter.
"""

from __future__ import annotations

import contextlib
import time

import torch

from shardline.data.sampler import batch_index
from shardline.errors import AnomalyHalt, CheckpointError, on_every_rank
from shardline.parallel.distributed import agreed, say_for_node
from shardline.resilience.checkpoint import step_dir_name
from shardline.resilience.recovery import agree_on_resume, rank0_decides


class AnomalyResponse:
    def _step_checked_on_device(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor):
        """The update gated by the device's verdict; no host sync. Anomalies are reported
        when the verdicts are next read (report_device_anomalies)."""
        loss = self.guard.faults.corrupt_loss(step, self.runner.global_loss(loss))
        self.optimizer.found_inf = self.anomaly.gate(step, loss, grad_norm)
        try:
            self.apply_update()
        finally:
            self.optimizer.found_inf = None
        self.step = step
        return loss, grad_norm, "updated"

    def report_device_anomalies(self) -> None:
        """Read the device's verdicts since last asked (one host sync) and report the anomalies
        (the host check has none pending: it reports each one at once)."""
        for event in self.anomaly.drain():
            event["action"] = "skip"
            self.anomaly_events.append(event)
            self.guard.goodput.reclassify(event["step"], "anomaly_skipped")
            if self._skips_stuck(event["step"]):
                self._halt({**event, "action": "halt", "reason": self._stuck_reason(event["anomaly"])})
            self.metrics.event("anomaly", **event, checked_on="device")

    def _skips_stuck(self, step: int) -> bool:
        """Whether `step` makes anomaly.max_consecutive anomalous steps in a row. Skipping keeps
        the weights, so a loss level that moved up for good (an update that went wrong) is
        flagged at every later step and the run would train on nothing to its end."""
        last, run = self._anomaly_streak
        self._anomaly_streak = (step, run + 1 if step == last + 1 else 1)
        limit = self.cfg.anomaly.max_consecutive
        return bool(limit) and self._anomaly_streak[1] >= limit

    def _stuck_reason(self, kind: str) -> str:
        step, run = self._anomaly_streak
        if run == 1:  # (no streak to judge: the setting halts at the first)
            what = "non-finite" if kind.startswith("nonfinite") else "a loss spike"
            return (f"anomaly.max_consecutive=1 halts at the first anomalous step (step {step}: {what}); raise it "
                    "to skip such steps, or use anomaly.action=rollback")
        streak = f"{run} anomalous steps in a row (steps {step - run + 1}-{step})"
        if kind.startswith("nonfinite"):  # no threshold makes a NaN healthy: the weights or the lr diverged
            return (f"{streak}, the last non-finite: "
                    "skipping cannot get past weights or a learning rate that diverged; use anomaly.action=rollback, "
                    "a lower optim.lr, or train.grad_clip")
        return (f"{streak}: skipping cannot get past a loss "
                "level that moved; use anomaly.action=rollback, a higher anomaly.spike_zscore, or "
                "anomaly.max_consecutive=0 to keep skipping")

    def _detect_anomaly(self, loss: float, grad_norm: torch.Tensor) -> tuple[str, float] | None:
        # Under fp16 an infinite gradient is the loss scaler's business (it skips and
        # lowers the scale); any other precision treats it as an anomaly.
        norm = 0.0 if self.scaler.enabled else grad_norm.item()
        return self.anomaly.gate(self.step + 1, loss, norm)

    def _handle_anomaly(self, step: int, kind: str, value: float, loss: float) -> bool:
        """Apply anomaly.action; True when the run rolled back (the step is redone)."""
        action, spent = self.cfg.anomaly.action, None
        if action == "rollback" and self.rollbacks >= self.cfg.anomaly.max_rollbacks:
            action = "halt"  # the fault keeps coming back: stop instead of looping
            most = self.cfg.anomaly.max_rollbacks
            spent = ("anomaly.max_rollbacks=0 allows no rollback" if not most else
                     f"the run has rolled back {self.rollbacks} times (anomaly.max_rollbacks={most}): the fault "
                     "keeps coming back; look at the data and settings, or raise it")
        spike = kind == "loss_spike"  # (its measure is the z-score, beside the loss the log shows)
        event = {"step": step, "anomaly": kind, **({"zscore": value, "loss": loss} if spike else {"value": value}),
                 "action": action}
        if spent:
            event["reason"] = spent
        if action == "skip" and self._skips_stuck(step):
            event.update(action="halt", reason=self._stuck_reason(kind))
            action = "halt"
        self.anomaly_events.append(event)
        if action == "halt":
            self._halt(event)
        if action == "rollback":
            if self._roll_back(step, event):
                return True
            event["action"] = "skip (no checkpoint to roll back to)"
        self.metrics.event("anomaly", **event)
        self.scaler.skip()
        self._end_step()
        return False

    def _roll_back(self, step: int, event: dict) -> bool:
        """anomaly.action=rollback: the newest saved state (disk or RAM) put back, the batch that gave
        the anomaly added to the skipped ones; False where nothing is saved to roll back to."""
        started = time.perf_counter()
        with self.guard.phase("restore", step):  # watched as a start-up restore is, not as a step
            self.tiers.drain()
            # agreed: one node's storage error (a stale handle) stops every rank, not its own alone
            invalid: list[str] = []  # named as a resume names them: the rollback passes over them
            latest = agreed(lambda: self.checkpointer.latest_valid(lambda p, e: invalid.append(str(e))),
                            self.proc.world_size)
            for problem in invalid:
                self.metrics.event("invalid_checkpoint", step=step, error=problem)
            latest = agree_on_resume(latest, self.proc.rank, self.proc.world_size)
            target = self.tiers.newest(latest)
            if target is not None:
                skipped = batch_index(step - 1, self.skipped_batches)  # the batch that gave the anomaly
                self.skipped_batches = sorted({*self.skipped_batches, skipped})
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.skip()
                name = self._restore(target)
                self.eval_owed = False  # this attempt computed (or resumed at and evaluated) that step
        if target is not None:
            self.rollbacks = self.rollbacks + 1
            self._saves_at_rollback = (self.tiers.landed, self.tiers.held, self.step)
            cost = time.perf_counter() - started
            self.guard.goodput.add("recovery", cost)
            self.guard.goodput.last_step = self.step  # (progress.json's step: the state it went back to)
            self.metrics.event("anomaly", **event, to_step=self.step, checkpoint=name,
                               skipped_batch=skipped, cost_s=round(cost, 3))
            self.metrics.rewind(self.step)
            if self.cfg.checkpoint.interval:  # on disk at once: a crash before the next save lost the batch
                self._save_rollback()  # skipped and the budget
            return True
        return False

    def _save_rollback(self) -> None:
        """The rolled-back state saved again, with the batch it skips and the budget it spent. Once on
        disk, the snapshots in RAM of that step and before go: a restart prefers RAM on a tie, and
        theirs predate the rollback. Refused under checkpoint.on_error=stop: the batches to skip named."""
        landed = self.tiers.landed
        try:
            self.guard.watched("save", self.step, "recovery", self.save_checkpoint)
            self.guard.drain(self.step)  # (async: landed or refused here, rollbacks are rare)
        except CheckpointError as e:
            named = CheckpointError(f"{e}; that copy predates the rollback to step {self.step}: {self._skip_advice()}")
            raise on_every_rank(named, e.every_rank) from e
        if self.tiers.memory is not None and self.tiers.landed > landed:
            self.tiers.memory.discard_through(self.step)

    @property
    def _rolled_back_unsaved(self) -> bool:
        """A rollback and no save on disk since (an async one counts once its write finished: a
        refused one leaves the older copy of that step, without the rollback)."""
        return self._saves_at_rollback is not None and self.tiers.landed == self._saves_at_rollback[0]

    @property
    def _snapshot_since_rollback(self) -> bool:
        """An in-memory snapshot taken since the last rollback: it holds the batches that skipped."""
        return self._saves_at_rollback is not None and self.tiers.held > self._saves_at_rollback[1]

    def _skip_advice(self) -> str:
        return f"rerun with train.skip_batches={sorted(self.skipped_batches)} to keep out the batches it skipped"

    def _unsaved_rollback(self) -> str:
        """What a stop or halt whose save was refused adds when what a rerun resumes predates a rollback
        (no save on disk since, nor an in-memory snapshot): it would train the batches it skipped again."""
        if not self._rolled_back_unsaved or (self.cfg.checkpoint.memory_interval and self._snapshot_since_rollback):
            return ""
        return f"; what is on disk predates the rollback to step {self._saves_at_rollback[2]}: {self._skip_advice()}"

    def _held_for_rerun(self) -> str:
        """What a halt without disk saves leaves in RAM. The snapshots are not written again here:
        right after a rollback the state is the snapshot's own step, and rewriting a step in place
        loses it where the write fails. Held from before the rollback, they lack the batches it
        skipped (and its budget): the rerun is told to skip them."""
        if not self.cfg.checkpoint.memory_interval:
            return ""
        if self._saves_at_rollback is None or self._snapshot_since_rollback:
            return "; the in-memory snapshots stay for a rerun"
        return f"; the in-memory snapshots stay for a rerun, but predate the rollback: {self._skip_advice()}"

    def _halt(self, event: dict) -> None:
        """Save the last consistent state (before the bad update) and stop with a report. The save's
        collectives are watched as a phase ("halt"): a peer lost meanwhile is a hang report, not a
        wait for the process group's timeout."""
        self.metrics.event("anomaly", **event)
        self.optimizer.zero_grad(set_to_none=True)
        saved, failure, landed = None, None, None
        try:  # each wait its own phase, under its own long timeout, as a save and a drain are elsewhere
            with self.guard.phase("halt", self.step):
                self.tiers.drain()  # this step's interval save may still be in flight (refused: saved again below)
            self.tiers.ending_at = self.step  # a save of this step refused from here on has no next interval
            with self.guard.phase("halt", self.step):
                this_step = self.checkpointer.root / step_dir_name(self.step)
                # the state before the bad step may be on disk already; rank 0, which seals checkpoints,
                # decides for all (a lagging name cache on another rank would skip the collective save). Not
                # after a rollback since the last save: that state lacks the rollback and the batch it skipped,
                # and a restart from it would get the budget and the bad batch back.
                on_disk = this_step in self.checkpointer.list() and not self._rolled_back_unsaved
                if rank0_decides(on_disk, self.proc.rank, self.proc.world_size):
                    saved = this_step
                elif self.cfg.checkpoint.interval:
                    landed, saved = self.tiers.landed, self.save_checkpoint()
            with self.guard.phase("halt", self.step):
                self.tiers.finish(complete=False)  # RAM freed unless it holds a state newer than the disk's
        except CheckpointError as e:  # checkpoint.on_error=stop: the halt is still what is reported
            failure = e
        with contextlib.suppress(Exception):  # a last report failing to write (a full disk) must not hide the halt
            self.guard.stop_watching()
        # a refused save (on_error=continue) returns none, or (async) leaves none or an older copy of the step
        written = saved is not None and saved.is_dir() and (landed is None or self.tiers.landed > landed)
        where = (f"state before that step saved to {saved}" if written
                 else "nothing saved to disk (checkpoint.interval=0)" + self._held_for_rerun()
                 if not self.cfg.checkpoint.interval
                 else f"the state before that step could not be saved ({failure or 'see checkpoint_failed'})"
                 + self._unsaved_rollback())
        with contextlib.suppress(Exception):
            self.metrics.event("halt", step=event["step"], checkpoint=str(saved) if written else None)
            self.metrics.close()
        self.lock.release()
        say_for_node(self.proc, f"ended at step {self.step}: halted ({event['anomaly']} at step {event['step']})")
        why = f"; {event['reason']}" if "reason" in event else ""
        batch = batch_index(event["step"] - 1, self.skipped_batches)  # what train.skip_batches takes, not the step
        value = f"z-score {event['zscore']:.4g}, loss {event['loss']:.4g}" if "zscore" in event else \
            f"value {event['value']:.4g}"
        raise AnomalyHalt(f"{event['anomaly']} ({value}) at step {event['step']}; "
                          f"{where}; anomalies this run: {len(self.anomaly_events)}{why}; the step's batch: {batch} "
                          "(as train.skip_batches counts them)") from failure
