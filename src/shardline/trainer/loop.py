"""The training loop: data -> forward/backward -> optimizer -> metrics -> checkpoint.

Read `build()` (the model, optimizer, data and the state a run resumes), then `_train()`, the loop (`train()` wraps
it with the cleanup an error needs, `close()`); what one rank computes of a step (forward, loss, backward) is
step.py's StepRunner, what a checkpoint holds beyond the weights and how a run is put back from one is state.py's,
and what is done with an anomalous step (skip, rollback, halt) is anomalies.py's, the log line, evaluation, save and
memory snapshot due after a step are intervals.py's, and what a stop request saves is stopping.py's. The loss of a
step is the mean over every labelled token of the global batch, whatever the micro-batching, so neither gradient
accumulation nor any parallel layout changes a number.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path

import numpy as np
import torch

from shardline.config import Config, GivenConfig, expand_home, refuse_changed_since
from shardline.data.sampler import batch_index
from shardline.devices import native_bf16, peak_tflops
from shardline.errors import (AnomalyHalt, CheckpointError, ConfigError, Interrupted, Preempted, exit_code,
                              interrupted, on_every_rank)
from shardline.interop.weights import load_starting_weights, starting_hf_fields
from shardline.models.flops import flops_per_token
from shardline.models.llama.parallelize import build_model
from shardline.models.moe.parallelize import build_model as build_moe_model
from shardline.optim import build_optimizer, build_scheduler
from shardline.parallel.collectives import clip_grad_norm
from shardline.parallel.dims import ParallelDims
from shardline.parallel.distributed import agreed, init_distributed, lost_peer, pick_device
from shardline.parallel.expert.balance import ExpertBalance
from shardline.parallel.float8 import precompute_scales
from shardline.parallel.pipeline import tied_copy
from shardline.parallel.zero1 import reduce_gradients
from shardline.precision import LossScaler
from shardline.preflight import gone_start_checkpoint
from shardline.profiling import configure_allocator, forget_allocator_env
from shardline.resilience.anomaly import build_anomaly_check
from shardline.resilience.checkpoint import Checkpointer
from shardline.resilience.guard import RunGuard
from shardline.resilience.recovery import (agree_on_resume, memory_tier_resumable, rank0_decides,
                                          refuse_fresh_over_invalid, saved_step)
from shardline.resilience.run_lock import RunLock
from shardline.trainer.anomalies import AnomalyResponse
from shardline.trainer.intervals import IntervalWork, LogWindow
from shardline.trainer.state import SavedState
from shardline.trainer.stopping import StopOnRequest
from shardline.trainer.step import StepRunner


class Trainer(SavedState, AnomalyResponse, StopOnRequest, IntervalWork):
    """One run of a config: `Trainer(cfg).build()` sets up the layout, model, data and run dir (and
    resumes what the dir holds), `train()` trains to train.steps. See the module docstring."""

    def __init__(self, cfg: Config, started: float | None = None, start_verified: bool = False):
        """`started`: when this launch began, for the run's goodput account (its start-up time): the
        CLI gives the process's start, imports included; by default, now (a notebook's Trainer is not
        charged for the time the kernel sat idle before it). `start_verified`: every rank has verified
        model.init_from already (shardline eval's choice of a run dir's newest valid checkpoint hashed it)."""
        if not isinstance(cfg, Config):  # (a dict of sections: an AttributeError on its first use)
            raise ConfigError(f"Trainer takes a Config (load_config, or from_dict of a dict), not {type(cfg).__name__}")
        cfg.check_sections()  # those that involve the layout, the data and the model come in build()
        self._given, cfg = GivenConfig(cfg), copy.deepcopy(cfg)  # (what it settles: not the caller's)
        expand_home(cfg)  # (load_config did; paths set in code since have not been)
        self._run_dir_as_given = str(cfg.run.dir)  # (the ranks compare it as given: their cwds may be spelled apart)
        cfg.run.dir = os.path.abspath(cfg.run.dir)  # the folder meant now, whatever a notebook's later chdir
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.device = pick_device(cfg.run.device)
        self.step = 0  # optimizer updates completed
        self.started = time.time() if started is None else started
        self.start_verified = start_verified
        self._invalid_checkpoints: list[str] = []
        self._repaired: list[Path] = []  # checkpoint folders a save cut between its two renames left, put back
        self._optim_changes, self._config_changes = {}, {}  # (dict[str, list] each: what a resume changed)
        self.anomaly_events: list[dict] = []
        self._anomaly_streak = (-1, 0)  # (last anomalous step, how many in a row up to it)
        self._saves_at_rollback: tuple | None = None  # (tiers.landed, tiers.held, its step) at the last rollback
        self.eval_owed = False  # a stop skipped this step's evaluation: a resumed run makes it up first
        self.ended = False  # train() ended or close() ran: evaluate() and save_checkpoint() refused (intervals.py)
        self.evaluated = (0, 0)  # the last evaluation's sequences and scored tokens (intervals.py's evaluate)
        self.evaluated_by_source: dict[str, float] = {}  # a mixture's: each source's eval loss in it
        self.best_eval = (float("inf"), 0)  # the lowest eval loss so far and its step (checkpoint.keep_best)
        self._bests_before: list[tuple[float, int]] = []  # this launch's bests each replaced (an async refusal's)
        self.eval_trend = (float("inf"), 0, 0)  # the lowest eval loss, its step, the evaluations since (early stop)
        self.early_stopped_at: int | None = None  # the step train.early_stop_patience ended the run at
        self._eval_changed = ""  # a resumed checkpoint's evaluation read other sequences: why its record was reset

    # ---- building -------------------------------------------------------------------

    def build(self) -> "Trainer":
        """Everything that can fail on user input happens here, before the run dir is touched. A build
        that fails lets go of what it took (the data folders' reader locks, the run dir's lock)."""
        self._given.refuse_changed("Trainer(cfg) was made")  # (an edit meant for this Trainer, not passed over)
        try:
            return self._build()
        except BaseException:  # (a notebook keeps the failed Trainer in its traceback: nothing held by it)
            self.close(failed=True)  # whatever the build reached: readers, group, lock, log, watchdog
            raise

    def _build(self) -> "Trainer":
        cfg = self.cfg  # the allocator before CUDA starts; in build(), whose end or failure takes it out again
        self.allocator, self._allocator_env = configure_allocator(self.device, cfg.memory.expandable_segments)
        self.proc = init_distributed(self.device)
        if self.device.type == "cuda" and (self.device.index is None or self.proc.world_size > 1):
            self.device = torch.device("cuda", self.proc.local_rank)  # one GPU a rank; cuda:N picks one alone
        if self.device.type == "cuda":  # FSDP2 and float8 read the current device
            torch.cuda.set_device(self.device)
        if cfg.train.precision == "auto":  # bf16 on a GPU that has it, else fp32: asked of this rank's own card,
            on_gpu = self.device.type == "cuda"  # once the allocator is configured (CUDA starts here)
            cfg.train.settle_precision(on_gpu, on_gpu and native_bf16())
        torch.manual_seed(cfg.train.seed)
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep, self.proc.rank, self.proc.is_main)
        # The input checks (files, data, layout, resume, this node's device and folders): a refusal on any rank,
        # one node's missing folder say, stops every rank in one line instead of leaving them in a collective.
        launch, resume_from = self._agreed_inputs()  # (it reads the data: self.data, state.py's _check_inputs)
        self.model_args, self.dims = launch.model_args, ParallelDims(launch.layout)
        build = build_moe_model if self.model_args.moe else build_model  # (offload: one process gets a mesh too)
        built = build(cfg, self.model_args, self.dims, self.device)
        # A fresh start as far as rank 0 can tell yet (the ranks agree: loading init_from is collective)
        # loads now, so a bad folder fails before the lock; a resume does not load what it replaces.
        starting_loaded = rank0_decides(resume_from is None, self.proc.rank, self.proc.world_size)
        if starting_loaded:
            load_starting_weights(cfg.model, built.model, self.dims.mesh is not None, self.start_verified)
        self.hf_fields = starting_hf_fields(cfg.model, gone_start_checkpoint(cfg))  # dtype, special tokens: for export
        # The parameters (optimizer, checkpoints, clipping), and how to run them (runner): a
        # module to call (DDP-wrapped or not; train.compile compiled its blocks) or, under pp,
        # the pipeline schedule.
        self.model = built.model
        self.scaler = LossScaler(self.device, cfg.train.precision, agree=self.proc.world_size > 1)
        self.runner = StepRunner(cfg, built, self.dims, self.device, self.scaler)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.dims.zero1_mesh(),
                                         self.dims.zero1_shard_dim, self.dims.zero1_expert_cut(),
                                         cfg.memory.ssd_offload_dir, self.proc.rank, self.proc.world_size)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.steps, cfg.optim)
        self.guard = RunGuard(cfg, self.proc, self.dims, self.checkpointer, self._layout_fingerprint(), self.started,
                              self.device)
        self.tiers = self.guard.tiers  # where state is saved and found again
        self.anomaly = build_anomaly_check(cfg, launch.layout, self.optimizer, self.device)
        self.skipped_batches, self.rollbacks = list(cfg.train.skip_batches), 0
        self.flops_per_token = flops_per_token(self.model_args, cfg.train.seq_len)  # active parameters under MoE
        moe = self.model_args.moe
        self.experts = ExpertBalance(self.model, self.dims, cfg.train.global_batch_size, self.model_args,
                                     cfg.train.seq_len) if moe else None
        self.peak_tflops = cfg.metrics.peak_tflops or peak_tflops(self.device, cfg.train.precision)
        # One run per run dir: locked once every input check has passed, before anything there is written or
        # restored (the resume is chosen again: the checkpoints may have changed)
        self.lock = RunLock(self.run_dir)
        self._lock_taken_over = self.lock.acquire_for_job(self.proc.is_main, self.proc.world_size)
        self._repaired = agreed(self.checkpointer.repair_interrupted_seal, self.proc.world_size)
        # Chosen again, by every rank, a refusal agreed: a run finishing in this dir may have saved since, or
        # the repair put one back (what was hashed then is not hashed again).
        resume_from = agreed(lambda: self._choose_resume(self.model_args, repaired=self.proc.is_main),
                             self.proc.world_size)
        # a hang's exit frees the run dir for the rerun; a lock taken over stops the run at once
        self.guard.watch(before_exit=self.lock.release, lock_lost=self.lock.lost_line)
        # A hang here is reported after the step of the checkpoint this rank chose (0: none; a newer snapshot
        # in RAM may win).
        with self.guard.phase("restore", max(saved_step(resume_from), 0) if resume_from else 0):
            resume_from = agree_on_resume(resume_from, self.proc.rank, self.proc.world_size)
            # read (hashed: cached where this rank chose it) by every rank before the tiers' collectives
            agreed(lambda: resume_from is None or self.checkpointer.verify(resume_from), self.proc.world_size)
            found = self.tiers.resume_source(resume_from, memory_tier_resumable(cfg), check=lambda got: (
                refuse_fresh_over_invalid(cfg.run.resume, got, self._invalid_checkpoints, self.checkpointer.root)),
                passed_over=self._invalid_checkpoints)  # (unusable snapshots: said, and refused as those)
            self._set_aside = agreed(lambda: self._set_aside_newer(found), self.proc.world_size)  # before it
            resumed = self._restore(found) if found is not None else None
            if found is None and not starting_loaded:  # the checkpoint chosen before the lock is gone:
                load_starting_weights(cfg.model, self.model, self.dims.mesh is not None, self.start_verified)
        self._open_run_dir(resumed)
        self._as_built = copy.deepcopy(cfg)  # what train() trains: a change after build() is refused there
        return self

    # ---- the loop -------------------------------------------------------------------

    @property
    def last_step(self) -> int:
        """The step this launch trains to: train.steps, or train.stop_at_step before it, or the step where
        train.early_stop_patience ended the run (a resume of it: nothing to train)."""
        return min(self.cfg.train.last_step, self.cfg.train.steps if self.early_stopped_at is None
                   else self.early_stopped_at)

    def train(self) -> dict:
        """Train to train.steps (or stop_at_step); returns the last logged metrics."""
        if getattr(self, "lock", None) is None:  # (never built, or its build() failed before the run dir's lock)
            raise ConfigError("this Trainer is not built: call build() first (Trainer(cfg).build().train()); after "
                              "a build() that failed, build a new one")
        try:
            agreed(self._check_lock_held, self.proc.world_size)  # a refusal on rank 0 is every rank's
        except Exception:
            self.close()  # (what it still holds: a lock taken over is not ours to remove, see RunLock.release)
            raise
        try:
            return self._train()
        except BaseException as error:
            if self.proc.world_size == 1:  # a save in flight is still worth finishing: a rerun resumes from it
                with contextlib.suppress(Exception):  # (not with ranks: its collectives may wait on a lost peer)
                    self.guard.drain(self.step)
            with contextlib.suppress(Exception):  # progress.json's last word (rank 0's); a stop's is "ended"
                self.guard.goodput.fail(after_end=not isinstance(error, Preempted), exit_code=exit_code(error))
            self.close(failed=True, error=error)  # an error, a halt or Ctrl-C
            raise

    def close(self, failed: bool = False, error: BaseException | None = None) -> None:
        """Free what build() took: a lone process's save in flight (waited for), the watchdog (its last
        reports; `failed`: this rank failed) and the signal handlers, the trace so far, the log's files
        (TensorBoard's writer thread), the data folders' reader locks, a one-process group it holds, the
        allocator variable it wrote and the run dir's lock; each one's own failure keeps none of the next.
        train() closes on its way out; a Trainer built and not trained (a look at the model) is closed
        here or by `with`. Idempotent. `error`: what ended the run, the log's last word (`failed`)."""
        self.ended = True  # (evaluate() and save_checkpoint() refused from here on: no log, no lock)
        for close in (lambda: self.proc.world_size > 1 or self.tiers.drain(),  # (a save in flight: its group kept)
                      lambda: self.guard.stop_watching(failed=failed), lambda: self.profiler.close(self.step),
                      lambda: self._say_failed(error), lambda: self.metrics.close(), lambda: self.data.release(),
                      lambda: self.dims.release(), lambda: forget_allocator_env(self._allocator_env)):
            with contextlib.suppress(Exception):  # (AttributeError: a build that stopped before it made one)
                close()
        if getattr(self, "lock", None) is not None:
            self.lock.release()
        if getattr(self, "_run_dir_fd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._run_dir_fd)
            self._run_dir_fd = None

    def _say_failed(self, error: BaseException | None) -> None:
        """Rank 0's `failed` event: a crash read as a cut-off metrics.jsonl to a requeue script. Not for a
        stop, a halt or a hang, which have their own (nor for a rank that lost its peer to another's hang)."""
        if error is None or isinstance(error, (Preempted, AnomalyHalt, SystemExit)) or interrupted(error) or \
                getattr(getattr(self.guard, "watchdog", None), "responding", False):
            return
        first, peer = (str(error).strip().splitlines() or [""])[0][:300], lost_peer(error)
        self.metrics.event("failed", step=self.step, error=peer or f"{type(error).__name__}: {first}",
                           lost_peer=peer is not None)

    def _check_lock_held(self) -> None:
        if self.proc.is_main and not self.lock.held:
            raise ConfigError("this Trainer has trained or was closed, freeing its run dir: build a new one to train")
        if self.proc.is_main and not self.lock.still_held():  # (taken over by a later Trainer of this process)
            raise ConfigError(f"run dir {self.run_dir} was taken over since this Trainer was built (by a later one, "
                              "or another run): build a new Trainer to train in it")
        self._given.refuse_changed("build()")  # (the caller's object: the Trainer trains its own copy)
        refuse_changed_since(getattr(self, "_as_built", None), self.cfg)  # (None: a failed build)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=kind is not None)

    def _train(self) -> dict:
        cfg = self.cfg
        self.guard.start(nothing_to_train=self.step >= self.last_step, step=self.step)
        if self.eval_owed and cfg.train.eval_interval and self.step < self.last_step:  # what a stop skipped
            self._evaluate_owed()  # (for its save); it may end the run here (train.early_stop_patience)
        stop = self.last_step
        window, last, stopped, request, first, warm_s = LogWindow(), {}, None, None, self.step + 1, 0.0
        while self.step < stop:
            step = self.step + 1  # the 1-based number of the step being computed, as logged
            started, accounted = self.guard.begin_step(step), self.guard.goodput.accounted()
            with self.profiler.step(step):
                loss_value, grad_norm, outcome = self.train_step()
            if outcome == "rolled_back":  # self.step moved back to the checkpoint's; a stop is not put off
                rollback = self.guard.goodput.accounted() - accounted  # (its restore and re-save)
                self.guard.goodput.add("anomaly_skipped", time.perf_counter() - started - rollback)  # the bad step
                self.profiler.after_step(step)  # a window ending here is written: the steps that led to it
                window.restart()
                request = self.guard.stop_requested()
                if request:  # (by rollbacks to come): that state saved again, with the batch it skips
                    stopped = self._stop_on_request(request, saved=None)  # (unless the rollback's re-save landed)
                    break
                continue
            self.guard.step_done(step, started, outcome)
            request = self.guard.stop_requested()  # the first collective after the step: a slow peer's wait here
            window.took(1, paused_s=self.profiler.after_step(step))  # a trace written: not training either
            if outcome == "overflow":
                self.metrics.event("skipped_step", step=step, reason="fp16 overflow",
                                   loss_scale=self.scaler.scaler.get_scale())
            if step == first and step % cfg.metrics.log_interval and step != stop and not request:  # warm-up
                warm_s = self._clock() - window.start  # (its own time: a stop asked in its eval or save logs it)
                window.restart(self._clock())  # (compile, caches): the first window starts after it
            logged = step % cfg.metrics.log_interval == 0 or step == stop or bool(request)  # (a stop's steps too)
            if logged:
                last = self._log_train(loss_value, grad_norm, self._clock() - window.start, window.steps)
                window.restart()
            request, paused_s = self._evaluate_and_save(step, stop, request)
            window.took(0, paused_s)  # evaluation and saves are not training: out of the window
            self.guard.end_step(step)
            early = self.early_stopped_at == step  # (its evaluation decided it, the same on every rank)
            if (request or early) and step < stop:  # on the last step the run simply ends
                if not logged:  # (asked in the evaluation or the save: the steps since the last line)
                    seconds, steps = (self._clock() - window.start, window.steps) if window.steps else (warm_s, 1)
                    last = self._log_train(loss_value, grad_norm, seconds, steps)
                if early:  # (a stop asked as well: the run is over anyway, its step saved)
                    break
                every = cfg.checkpoint.interval
                stopped = self._stop_on_request(request, saved=bool(every) and step % every == 0)
                break
        self._finish(stopped, first)
        if stopped:
            raise (Interrupted if request == "SIGINT" else Preempted)(stopped)
        if self.tiers.unsaved_end:  # (checkpoint.on_error=continue): trained, but what it trained is not kept
            raise on_every_rank(CheckpointError(self.tiers.unsaved_end)) from self.tiers.unsaved_cause  # (all ranks;
            # a transient cause, EIO say, exits TRY_LATER: a requeue retries it)
        return last

    def train_step(self) -> tuple[float | torch.Tensor, torch.Tensor, str]:
        """One step: gradients, the anomaly check, then the update (or the anomaly's action).

        Returns the global loss (a float; a device tensor under the device check, unread), the
        gradient norm, and the outcome: "updated", "overflow" (fp16 scaler skipped the update),
        "anomaly" (skipped by anomaly.action) or "rolled_back" (to a checkpoint's step).
        """
        step = self.step + 1
        loss, grad_norm = self.compute_gradients()
        if self.anomaly.on_device:
            return self._step_checked_on_device(step, loss, grad_norm)
        loss_value = self.guard.faults.corrupt_loss(step, self.runner.global_loss(loss).item())
        anomaly = self._detect_anomaly(loss_value, grad_norm)
        if anomaly is not None and self._handle_anomaly(step, *anomaly, loss=loss_value):
            return loss_value, grad_norm, "rolled_back"
        outcome = "anomaly" if anomaly is not None else "overflow" if self.apply_update() else "updated"
        if anomaly is None:  # a healthy step ends a streak (the halted step redone after a resume, too)
            self._anomaly_streak = (-1, 0)
        self.step = step
        return loss_value, grad_norm, outcome

    def compute_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over this rank's share of the step's global batch.

        Returns this rank's share of the global mean loss and the global gradient norm, before the
        clip. The gradients are clipped in place, or (the default fused AdamW, on the GPU or the host)
        left unclipped: the optimizer scales them as it steps (clip_grad_norm's defer_to, optim/fused.py).
        """
        self.model.train()
        micro, n_tokens = self.guard.reads(self._step_batch)()  # it reads too: the labels it counts
        if self.experts:  # the balancing losses' gradients are scaled as the loss's are
            self.experts.begin_step(self.scaler.scale(torch.ones((), device=self.device)))
        loss = self.runner.forward_backward_step(micro, self.guard.reads(self.data.train.batch), n_tokens)
        if self.experts:
            self.experts.end_step()
        self.guard.faults.corrupt_gradients(self.step + 1, self.model, every_rank=not self.scaler.enabled)  # (drill)
        reduce_gradients(self.optimizer, self.dims.zero1_scatters)  # ZeRO-1: its slices (under tp/pp, summed)
        self.scaler.unscale_(self.optimizer)
        return loss, clip_grad_norm(self.model, self.cfg.train.grad_clip, self.dims,
                                    counted_elsewhere=tied_copy(self.model), defer_to=self.optimizer)

    def _step_batch(self) -> tuple[list[np.ndarray], int]:
        """This rank's micro-batches of the step's global batch, and the labelled tokens of all of it.

        Every rank counts the labelled tokens of the whole global batch from the data
        itself (each holds the dataset), so the global mean needs no collective. A batch with
        none (chat data whose windows hold no assistant turn) counts one: loss and gradients 0
        (the log's labelled_tokens says 0).
        """
        sampler, batch = self.data.sampler, batch_index(self.step, self.skipped_batches)
        micro = sampler.rank_micro_batches(batch, self.dims.dp_rank(), self.dims.dp, self.cfg.train.micro_batch_size)
        self.labelled_tokens = self.data.train.count_labels(sampler.global_batch(batch))
        return micro, max(self.labelled_tokens, 1)

    def apply_update(self) -> bool:
        """Optimizer and schedule step; True when the fp16 loss scaler skipped the update."""
        skipped = self.scaler.step(self.optimizer)
        if self.experts:  # the biases move with the weights (anomalies.py sets found_inf)
            self.experts.update_biases(skipped, getattr(self.optimizer, "found_inf", None))
        if self.cfg.train.precision == "fp8":  # weights FSDP gathers in float8: their scales, one all-reduce
            precompute_scales(self.model)
        self._end_step()
        return skipped

    def _end_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # (after a skipped update too: torch's warning of that order is filtered, see step.py)

    def _clock(self) -> float:
        """The time once the device ran what the host queued (a step without a host sync returns at its launches)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


