"""What is due after a step: its log line, the evaluation, the checkpoint save and the memory snapshot, and
how a stop request changes them (skipped, or an evaluation ended between its micro-batches:
the grace before a kill is the save's).

A mixin of Trainer (trainer/loop.py), whose state it works on: the config, the data, the step
runner, the watchdog guard and the metrics log.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from shardline.data.mixture import MixedSequences
from shardline.data.sampler import EVAL_ORDER, batch_index, eval_sequences
from shardline.errors import ConfigError
from shardline.metrics import mfu, peak_memory_gib
from shardline.optim import lr_multiplier
from shardline.parallel.collectives import reduce_over
from shardline.resilience.checkpoint import step_dir_name


class LogWindow:
    """The training time between two log lines, which tokens/s and MFU are measured over: evaluation,
    saves and profiler traces are taken out, and a launch's first step (compile, caches) unless logged."""

    def __init__(self):
        self.restart()

    def restart(self, at: float | None = None) -> None:
        self.start, self.steps = time.perf_counter() if at is None else at, 0

    def took(self, steps: int, paused_s: float = 0.0) -> None:
        self.steps += steps
        self.start += paused_s


class IntervalWork:
    def _log_train(self, loss: float | torch.Tensor, grad_norm: torch.Tensor, seconds: float, steps: int) -> dict:
        """The train record of the `steps` since the last one, trained in `seconds` (evaluations and saves out)."""
        self.report_device_anomalies()
        lr = self.scheduler.base_lrs[0] * lr_multiplier(self.step - 1, self.cfg.train.steps, self.cfg.optim)
        per_step = self.cfg.train.global_batch_size * self.cfg.train.seq_len  # (a resume keeps both)
        tokens_per_s = steps * per_step / seconds
        memory = peak_memory_gib(self.device)  # the maximum over ranks of each figure
        peaks = dict(zip(memory, reduce_over(self.dims, None, torch.tensor([*memory.values()]), "max").tolist()))
        return self.metrics.log(  # (float(loss), .item(): under the device anomaly check the steps' only host sync)
            "train", step=self.step, loss=float(loss), lr=lr, **self.data.log_fields(self.step, self.skipped_batches),
            grad_norm=grad_norm.item(), tokens=self.step * per_step, tokens_per_s=tokens_per_s,  # (tokens: trained)
            mfu=mfu(tokens_per_s, self.flops_per_token, self.peak_tflops, self.proc.world_size),
            **peaks, step_time_s=seconds / steps,
            epoch=self.data.sampler.epoch_of(batch_index(self.step, self.skipped_batches)),  # batches drawn
            **(self.experts.log_values() if self.experts else {}),
            **({"labelled_tokens": self.labelled_tokens} if self.data.chat_template else {}),  # (the last step's)
            **({"loss_scale": self.scaler.scaler.get_scale()} if self.scaler.enabled else {}))  # fp16's, now

    def _evaluate_and_save(self, step: int, stop: int, request: str | None) -> tuple[str | None, float]:
        """The evaluation, save and memory snapshot due after `step`, each a watched phase
        (watchdog.long_timeout_s: a first eval that compiles, or a slow save, is not a hung
        step). A stop request skips the evaluation (the grace before the kill is for the save),
        or ends it between its micro-batches, and is asked again after them. Returns the request
        and the seconds they took."""
        cfg, best = self.cfg, None
        due = bool(cfg.train.eval_interval) and (step % cfg.train.eval_interval == 0 or step == stop)
        save = cfg.checkpoint.interval and (step % cfg.checkpoint.interval == 0 or step == stop)
        snapshot = cfg.checkpoint.memory_interval and (step % cfg.checkpoint.memory_interval == 0 or (
            step == stop < cfg.train.steps and not cfg.checkpoint.interval))  # (a stop_at_step: RAM alone holds it)
        if not request and step < stop and (due or save or snapshot):  # asked right after the step, then
            request = self.guard.stop_requested()  # again: a signal that landed while it was logged skips the eval
        stopping = bool(request) and step < stop
        self.tiers.ending_at = step if stopping or step == stop else None  # no next interval retries its save
        evaluate, self.eval_owed = due and not stopping, due and stopping  # (what a save here records)
        # Stopping with a disk save to come: no snapshot before it, the grace before the kill is short.
        snapshot = snapshot and not (stopping and cfg.checkpoint.interval)
        if not (evaluate or save or snapshot):
            return request, 0.0
        paused = self._clock()
        if evaluate and cfg.checkpoint.keep_best:  # (an async save of a best the storage refused since: not one)
            self._forget_refused_best()
        if evaluate:  # (ended where a stop comes in it: owed, as if skipped; the stop's save comes next, no snapshot)
            stoppable = self.guard.asked_to_stop if step < stop else None  # (eval's time)
            loss = self.guard.watched("eval", step, "eval", lambda: self.evaluate(stoppable))
            if loss is None:
                self.eval_owed, self.tiers.ending_at = True, step
                snapshot = snapshot and not cfg.checkpoint.interval
            else:  # (the same loss on every rank: reduced, so the same decisions)
                if self._stalled(loss, step) and step < stop:  # the run ends here, this step saved
                    save, self.tiers.ending_at = bool(cfg.checkpoint.interval), step
                if cfg.checkpoint.keep_best and loss < self.best_eval[0]:
                    best, save = loss, True  # (saved here, if not due anyway; the best once that save is not refused)
        before = self.best_eval  # (a best is in the state its own save holds: a resume from it, or --best, names it)
        self.best_eval = (best, step) if best is not None else before
        saved = save and self.guard.watched("save", step, "checkpoint", self.save_checkpoint) is not None
        if best is not None and saved:
            self._new_best(best, step, before)
        else:  # (a refused save is no best: the one before stays)
            self.best_eval = before
        if snapshot:
            self.guard.watched("snapshot", step, "checkpoint", self.snapshot_to_memory)
        if not request and step < stop:
            request = self.guard.stop_requested()
        return request, self._clock() - paused

    def _new_best(self, loss: float, step: int, before: tuple[float, int]) -> None:
        """The lowest eval loss so far, at `step`, whose save was not refused: its checkpoint is kept past
        checkpoint.keep until a lower one's lands (prune: an async write in flight or failed keeps the one
        before), as a fine-tune's best point, which the newest checkpoints may not hold. `before`: the best
        it replaces, the best again if the storage refuses this one's async write (_forget_refused_best)."""
        self.best_eval, self._bests_before = (loss, step), [*self._bests_before, before]
        folder = self.checkpointer.root / step_dir_name(step)
        self.checkpointer.keep_also.append(folder)
        if self.checkpointer.is_writer:  # (the save's own prune kept the one before: it was the best then)
            self.checkpointer.prune()
        self.metrics.event("best_checkpoint", step=step, eval_loss=loss, checkpoint=str(folder))

    def _forget_refused_best(self) -> None:
        """The best before a best whose async write the storage refused after it was named (said by its
        checkpoint_failed event): the save in flight waited for first, so a later state names the best on disk."""
        self.tiers.drain_disk()
        while self.best_eval[1] in self.tiers.refused and self._bests_before:
            self.best_eval = self._bests_before.pop()

    def _evaluate_owed(self) -> None:
        """The evaluation a stop skipped, made up first by the resumed run, and ranked as any other for
        checkpoint.keep_best (its step saved again, on every rank alike, whether or not the stop's save or
        a snapshot in RAM was what the run resumed)."""
        loss = self.guard.watched("eval", self.step, "eval", self.evaluate)
        self.eval_owed = False
        if loss is None:
            return
        best, before = self.cfg.checkpoint.keep_best and loss < self.best_eval[0], self.best_eval
        ends = self._stalled(loss, self.step) and bool(self.cfg.checkpoint.interval)  # (saved again: to say so)
        self.best_eval = (loss, self.step) if best else before  # (in the state its save holds, as above)
        saved = (best or ends) and self.guard.watched("save", self.step, "checkpoint", self.save_checkpoint) is not None
        if best and saved:
            self._new_best(loss, self.step, before)
        else:
            self.best_eval = before

    def _stalled(self, loss: float, step: int) -> bool:
        """This evaluation's loss into the run's trend: a loss lower than the lowest so far by more than
        train.early_stop_min_delta is the new lowest, any other finite one more evaluation without it. True,
        the run ending at `step` (early_stopped_at), once train.early_stop_patience of those come in a row:
        a fine-tune past its best point, whose later steps only overfit."""
        t, (lowest, at, since) = self.cfg.train, self.eval_trend
        if not math.isfinite(loss):  # (a diverged model's: no evidence of a best point passed; the anomaly check's)
            return False
        self.eval_trend = (loss, step, 0) if loss < lowest - t.early_stop_min_delta else (lowest, at, since + 1)
        if not t.early_stop_patience or self.eval_trend[2] < t.early_stop_patience or step >= t.steps:
            return False  # (at the run's last step: nothing left to stop)
        self.early_stopped_at = step
        self.metrics.event("early_stop", step=step, lowest_eval_loss=self.eval_trend[0], lowest_at=self.eval_trend[1],
                           evaluations_since=self.eval_trend[2], patience=t.early_stop_patience,
                           min_delta=t.early_stop_min_delta)
        return True

    def _restore_eval_record(self, state: dict) -> None:
        """The best eval loss (checkpoint.keep_best), the trend and an early stop, from a checkpoint's trainer
        state. A run that stopped early stays stopped while its count still reaches the patience (a launch
        that raises it trains on); a count that reached it at the run's last step stopped nothing. A state
        saved before the evaluation read sequences spread over the split (EVAL_ORDER) scored others: its
        losses are not compared with this launch's (the best's folder stays kept until a new best lands)."""
        best = tuple(state.get("best_eval", (float("inf"), 0)))
        # (a launch with keep_best off saves none: the folder it named may be pruned since. Not judged by the
        # folder's presence, which ranks on a shared store may see apart: their saves would then differ)
        self.best_eval = best if self.cfg.checkpoint.keep_best and best[1] else (float("inf"), 0)
        self._bests_before = []  # (a rollback's state names its best: those replaced since are not the run's)
        self.checkpointer.keep_also = [self.checkpointer.root / step_dir_name(best[1])] if self.best_eval[1] else []
        self.eval_trend = tuple(state.get("eval_trend", (float("inf"), 0, 0)))  # (none saved before 2026-12-08)
        if state.get("eval_order") != EVAL_ORDER and (self.best_eval[1] or self.eval_trend[1]):
            self._eval_changed = ("the checkpoint's evaluations read the held-out split's first sequences; from here "
                                  "on they read sequences spread over it: the best eval loss and the evaluations "
                                  "since it (checkpoint.keep_best, train.early_stop_patience) count anew")
            self.best_eval, self.eval_trend = (float("inf"), self.best_eval[1]), (float("inf"), 0, 0)  # (its folder
            # stays kept, across resumes too, until a new best lands)
        patience = self.cfg.train.early_stop_patience
        ended = state.get("early_stopped", False) and patience and self.eval_trend[2] >= patience
        self.early_stopped_at = self.step if ended else None

    def early_stop_line(self) -> str:
        """What ended the run early, and how to train on (the launch's last note; a resume's note)."""
        t, (lowest, at, since) = self.cfg.train, self.eval_trend
        margin = f"more than {t.early_stop_min_delta:g} " if t.early_stop_min_delta else ""
        best = self.checkpointer.root / step_dir_name(self.best_eval[1]) if self.best_eval[1] else None
        return (f"stopped early at step {self.early_stopped_at}: {since} evaluation{'s' * (since != 1)} in a row "
                f"without an eval loss {margin}below {lowest:.4f} (step {at}) (train.early_stop_patience="
                f"{t.early_stop_patience}){f'; the best checkpoint: {best}' if best else ''}; to train on, raise it "
                f"past {since} (or 0: off) and rerun")

    def evaluate(self, stop: Callable[[], bool] | None = None) -> float | None:
        """Mean loss over eval_batches global batches of the held-out split, spread over it (eval_sequences),
        shared by the data-parallel ranks: the same sequences, so the same number, whatever the layout. A
        mixture's sources are scored apart (each its own micro-batches), their losses logged beside the
        whole's. None, logging nothing, where `stop` (asked of every rank alike between micro-batches) said to
        stop."""
        self.refuse_ended("evaluate()")
        self.evaluated, self.evaluated_by_source = (0, 0), {}  # (an evaluation stopped midway scored none)
        t, val = self.cfg.train, self.data.val
        self.model.eval()
        chosen = eval_sequences(val, t.eval_batches * t.global_batch_size)
        mixed = isinstance(val, MixedSequences) and bool(self.data.source_names) and not self.cfg.data.val_path
        parts = val.by_source(chosen) if mixed else [(None, chosen)]
        scored = {}  # source -> (summed loss, labelled tokens)
        for source, part in parts:  # (the same parts on every rank: the data is every rank's)
            micro = [part[i:i + t.micro_batch_size] for i in range(0, len(part), t.micro_batch_size)]
            total = self.runner.eval_loss_total(micro, val.batch, stop)
            if total is None:
                return None
            scored[source] = (total.item(), val.count_labels(part) if len(part) else 0)
        labelled = sum(n for _, n in scored.values())
        loss = sum(total for total, _ in scored.values()) / max(labelled, 1)
        self.evaluated = (len(chosen), labelled)  # (sequences, tokens scored): what `shardline eval` says
        names, counts = self.data.source_names, dict(parts)  # (how many sequences each source's loss rests on)
        if mixed:
            self.evaluated_by_source = {names[k]: total / max(n, 1) for k, (total, n) in scored.items()}
        self.metrics.log("eval", step=self.step, eval_loss=loss, eval_ppl=math.exp(min(loss, 50.0)),
                         eval_sequences=self.evaluated[0],
                         **({"eval_loss_by_source": self.evaluated_by_source,
                             "eval_sequences_by_source": {names[k]: len(counts[k]) for k in scored}} if mixed else {}))
        return loss

    def refuse_ended(self, what: str) -> None:
        """After train() or close() a Trainer has let go of its log and run dir: an evaluation would log
        nowhere, a save land in a run dir another launch may hold by now."""
        if self.ended:
            raise ConfigError(f"{what} after this Trainer's train() or close(): it let go of its log and run dir; "
                              "build a new Trainer on the run dir (it resumes the newest checkpoint), or run "
                              "shardline eval on it")
