"""What a run saves beyond the weights, and how a run is put back from a saved state.

A mixin of Trainer (trainer/loop.py), whose state it works on: the model, optimizer,
schedule, loss scaler, anomaly detector, data position and RNG. A resumed run must go on
exactly, so everything a step depends on is in `_trainer_state`, and `_restore` checks
that the saved position still means the same data before it goes on from it. What a start
checks before it chooses and puts back a state (`_check_inputs`: its files, data, layout and
the checkpoint to resume) is here too, run by every rank before its first collective, and what
it writes to the run dir then (`_open_run_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from pathlib import Path

import torch

from shardline.config import save_config
from shardline.config.job import trained_settings
from shardline.data import build_data, tokenizer_file
from shardline.data.sampler import EVAL_ORDER
from shardline.data.tokenizer import save_tokenizer
from shardline.data.validation import held_out_note
from shardline.errors import CheckpointError, ConfigError, DataError, on_every_rank
from shardline.interop.weights import copy_starting_files
from shardline.devices import host_memory_problem, native_bf16
from shardline.launch_notes import launch_notes
from shardline.layout import pipeline_ranks
from shardline.metrics import MetricsLogger
from shardline.models.attention import resolve_attention
from shardline.models.flops import num_params
from shardline.models.factory import args_to_json
from shardline.optim import apply_hyperparameters, next_lr_change, schedule_settings
from shardline.parallel.compile import describe as describe_compile
from shardline.parallel.distributed import agreed, ranks_differing, say_for_node
from shardline.parallel.float8 import precompute_scales
from shardline.profiling import StepProfiler
from shardline.preflight import (Preflight, bos_setting, check_config, check_device, check_layout_before_data,
                                 check_resume_fits, check_rollback_target, preflight, resolve_epochs,
                                 use_model_tokenizer)
from shardline.resilience.recovery import (data_changes, get_rng_state, restarted, resume_path, set_rng_state,
                                          settings_changed)
from shardline.resilience.resume_checks import (check_data_position, check_saved_position, check_skip_batches,
                                               check_steps_ahead)
from shardline.data.validation import SPLIT_RULE, split_rule
from shardline.resilience.run_lock import launcher_ids
from shardline.resilience.tiers import folder_bytes, refuse_no_room
from shardline.version import version

REPLIES_MISSING = 0.1  # the share of chat sequences without a reply token past which a launch says so
PADDING_HIGH = 0.3  # the share of chat sequences' tokens that are padding past which a launch says so
REPEATS_SAID = 4  # a mixture source's epochs over the run past which a launch says so


NODE_LOCAL = {"run": ("device",), "data": ("path", "tokenizer"), "model": ("hf_path", "init_from"),
              "memory": ("ssd_offload_dir",), "checkpoint": ("memory_dir",)}


def shared_settings(cfg) -> dict:
    """The config every rank must hold alike: without the paths a node may give its own (its local
    copy of the data or the weights, its scratch disk; what they hold is compared apart), a
    mixture's sources by their weights only."""
    settings = cfg.to_dict()
    for section, keys in NODE_LOCAL.items():
        for key in keys:
            settings[section].pop(key, None)
    settings["data"]["mix"] = [source["weight"] for source in settings["data"]["mix"]]
    if cfg.train.epochs:  # derived from the data read: a rank that read other data is named as such (identity)
        settings["train"].pop("steps", None)
    return settings


class SavedState:
    def _set_aside_newer(self, found) -> list[Path]:
        """Move the checkpoints newer than what this run resumes (`found`: a path, a memory
        snapshot or None) out of its way: they belong to a history it leaves, and a restart
        after a failed restore would otherwise resume them. Returns where they went."""
        if found is None:
            step = 0
        else:
            step = found[0] if isinstance(found, tuple) else self.checkpointer.verify(found)["step"]
        return self.checkpointer.set_aside_after(step)

    def _agreed_inputs(self) -> tuple[Preflight, Path | None]:
        """_check_inputs on every rank, a refusal anywhere every rank's; then the config and the data
        every rank read compared: a listing of shared storage that lags on one node (a relaunch
        not seeing the run's saved config.toml; fewer documents), or a file still being written,
        gave a rank another layout (a hang) or other batches than its peers (in silence)."""
        launch, found = agreed(self._check_inputs, self.proc.world_size)
        settings = shared_settings(self.cfg)
        settings["run"]["dir"] = self._run_dir_as_given  # (made absolute here, against each rank's own cwd)
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        if ranks_differing(digest, self.proc.world_size):
            whole = ranks_differing(settings, self.proc.world_size)  # (rarely: the whole settings)
            rank, theirs, first = whole[0] if whole else (-1, {}, {})
            keys = [f"{s}.{k}" for s in first for k in first[s] if theirs.get(s, {}).get(k) != first[s][k]]
            raise on_every_rank(ConfigError(
                f"rank {rank} runs another config than rank 0 ({', '.join(keys[:5])} differ): every rank must read "
                "the same config (a relaunch reads the run dir's config.toml where it sees checkpoints: run.dir on "
                "storage every node shows alike, or give --config)"))
        differ = ranks_differing(self.data.identity(), self.proc.world_size)
        if differ:
            rank, theirs, first = differ[0]
            raise on_every_rank(DataError(f"rank {rank} read other data than rank 0 ({theirs}; rank 0: {first}): "
                                          "the data must be the same files on every node (complete, and listed "
                                          "alike)"))
        return launch, found

    def _check_inputs(self) -> tuple[Preflight, Path | None]:
        """Everything a start checks before its first collective, on each rank: the starting
        files, the layout, the data, the model and the checkpoint to resume; returns (the launch,
        the checkpoint or None). Build runs it under `agreed`: a node's own files (a folder
        missing on one node, a lagging listing of shared storage) can refuse on some ranks only."""
        cfg = self.cfg
        check_config(cfg)  # a named --resume folder is looked for on this node's storage too
        self._stand_in = use_model_tokenizer(cfg)  # the starting weights gone: this run's checkpoint stands in
        check_layout_before_data(cfg, self.proc.world_size)  # a wrong layout fails before the data is read
        self.data = build_data(cfg)
        resolve_epochs(cfg, len(self.data.train))  # (train.epochs: the steps of that many passes)
        launch = preflight(cfg, self.proc.world_size, self.data.vocab_size)
        if self.device.type == "cpu" and (problem := host_memory_problem(
                num_params(launch.model_args), self.proc.local_world_size, self.proc.world_size)):
            raise ConfigError(problem)  # (before the model is built: the kernel's kill says nothing)
        found = self._choose_resume(launch.model_args)
        refuse_no_room(cfg, found, self.checkpointer.root)  # (its next save would be refused, after training to it)
        check_rollback_target(cfg, found)
        check_device(cfg, launch.layout, on_cuda=self.device.type == "cuda")
        return launch, found

    def _choose_resume(self, model_args, repaired: bool = False) -> Path | None:
        """The checkpoint to resume (resume_path), checked to fit this run (check_resume_fits) and
        its data (check_saved_position; first under train.epochs, whose steps follow the data and
        batch: a change of those is the cause to name); rank 0's choice is every rank's later."""
        found, self._invalid_checkpoints = resume_path(self.cfg, self.checkpointer, repaired=repaired)
        position = lambda: check_saved_position(found, self.cfg, len(self.data.train),  # noqa: E731
                                                self.data.position_state(), bool(self._stand_in))
        if self.cfg.train.epochs:  # (its steps follow the data and batch: a change of those is the cause to name)
            position()
        check_resume_fits(found, model_args, self.cfg.train.steps, bos_setting(self.cfg, self.data.tokenizer),
                          data_changed=data_changes(found, self.cfg, bool(self._stand_in)),
                          epochs=self.cfg.train.epochs)
        if not self.cfg.train.epochs:
            position()
        return found

    def _write_run_files(self, resumed: str | None) -> None:
        """The config, the tokenizer and the starting weights' files, into the run dir."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resumed is None or self.step < self.last_step:  # (a launch with nothing to train leaves the run's)
                save_config(self.cfg, self.run_dir / "config.toml")
            save_tokenizer(self.data.tokenizer, self.run_dir / "tokenizer.json")
            copy_starting_files(self.cfg.model, tokenizer_file(self.cfg.data), self.run_dir)
        except OSError as e:  # (the storage's: a full disk, a read-only folder; or a starting file unreadable)
            if e.filename and not Path(e.filename).is_relative_to(self.run_dir):  # (a starting file, read)
                raise OSError(e.errno, f"{e.strerror or e}: cannot copy {e.filename} into the run dir") from e
            space = "free space there, or give another run.dir"
            fix = {errno.ENOSPC: space, errno.EDQUOT: space, errno.EROFS: "give a writable run.dir"}.get(e.errno)
            raise OSError(e.errno, f"{e.strerror or e}: cannot write the run's files into {self.run_dir}"
                                   + (f" ({e.filename})" if e.filename else "") + (f": {fix}" if fix else "")) from e

    def _open_run_dir(self, resumed: str | None) -> None:
        """Written once the lock is held and the state put back: the config, the tokenizer and the
        starting weights' files; the log, opened with what this launch found and chose."""
        agreed(lambda: self._write_run_files(resumed), self.proc.world_size)  # (a full disk: one line, every rank)
        # Held open, so the folder's identity holds where a file system renumbers what it forgets (FUSE, autofs):
        # each save checks the path still names it
        self._run_dir_fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        cfg = self.cfg
        self.metrics = MetricsLogger(self.run_dir, cfg.metrics.progress, cfg.metrics.tensorboard,
                                     cfg.train.steps, self.step, self.proc.is_main, cfg.train.last_step)
        self.metrics.unowned = lambda: bool(self.lock.lost)
        self.metrics.event("start", step=self.step, run_dir=str(self.run_dir),  # (the launch's first record)
                           params=num_params(self.model_args),  # the whole model's
                           world_size=self.proc.world_size, layout=self.dims.layout.describe(),
                           device=str(self.device), precision=cfg.train.precision,
                           attention=resolve_attention(cfg.train.attention, cfg.train.document_mask,
                                                       self.device.type == "cuda", self.dims.layout.cp_degrees[0]),
                           compile=describe_compile(cfg.train.compile, self.dims.layout,
                                                    cfg.memory.activation_checkpoint, self.model_args.moe),
                           tokens_per_step=cfg.train.global_batch_size * cfg.train.seq_len,
                           **({"pipeline": [{"rank": r.rank, "layers": list(r.layer_ids), "embedding": r.first,
                                             "output": r.last} for r in pipeline_ranks(
                               self.model_args, lay.pp, lay.pp_virtual_stages, lay.pp_schedule)]}
                              if (lay := self.dims.layout).pp > 1 else {}),  # (which layers each pp rank holds)
                           threads=torch.get_num_threads(), torch=torch.__version__,  # (both move the numbers)
                           shardline=version(),  # (the code that trained it: a commit where run from a checkout)
                           **({"launchers": ids} if (ids := launcher_ids()) else {}))  # (whose records: never's)
        say_for_node(self.proc, f"joined the run in {self.run_dir} at step {self.step} ({self.proc.world_size} ranks): "
                                "rank 0's node logs its progress, and metrics.jsonl there")
        for problem in self._invalid_checkpoints:
            self.metrics.event("invalid_checkpoint", step=self.step, error=problem)
        for folder in self._repaired:  # (rank 0's list: the writer repairs)
            self.metrics.event("checkpoint_repaired", step=self.step, checkpoint=str(folder),
                               why="a save was cut between its two renames: the folder put back in place")
        if self._stand_in:
            self.metrics.event("starting_weights_gone", step=self.step, note=self._stand_in)
        if self._set_aside and self.proc.is_main:  # newer ones: a history this run leaves (kept: the user's to remove)
            held, size = [p for p in self._set_aside[0].parent.iterdir() if p.is_dir()], 0
            with contextlib.suppress(OSError):  # (a folder the user removes meanwhile: its size is not worth a stop)
                size = folder_bytes(*held)
            self.metrics.event("checkpoints_set_aside", step=self.step, moved=[str(p) for p in self._set_aside],
                               held=len(held), held_gib=round(size / 2**30, 3))
        self.guard.open(self.run_dir, self.metrics.event, resumed is None and not restarted(), trained_settings(cfg))
        if self.guard.goodput.reset:  # the earlier launches' time is not in this account
            self.metrics.event("progress_reset", step=self.step, reason=self.guard.goodput.reset,
                               note="the goodput account starts again from this launch")
        if self.allocator:
            self.metrics.event("allocator", step=self.step, setting=self.allocator)
        gpu = (torch.cuda.get_device_name(self.device), torch.cuda.device_count()) if self.device.type == "cuda" else ()
        for note, fields in launch_notes(self.cfg, self.device.type, self.peak_tflops, self.proc.world_size, *gpu,
                                         model=self.model_args, tokenizer=self.data.tokenizer,
                                         resumed=resumed is not None, layout=self.dims.layout,
                                         gpu_bf16=self.device.type == "cuda" and native_bf16()):
            self.metrics.event(note, step=self.step, **fields)
        described = self.data.describe(self.cfg.train.steps)
        self.metrics.event("data", step=self.step, **described)
        if described.get("sequences_without_replies", 0) >= REPLIES_MISSING:  # (a share of steps that train nothing)
            self.metrics.event("replies_missing", step=self.step, share=described["sequences_without_replies"],
                               conversations_cut=described["conversations_cut"],
                               why="those sequences hold conversations with no assistant turn, or cut before their "
                                   "reply (train.seq_len): they cost steps and train nothing")
        if described["sequences"] < self.cfg.train.global_batch_size:  # (sampled again within one step)
            self.metrics.event("batch_repeats_data", step=self.step, sequences=described["sequences"],
                               global_batch_size=self.cfg.train.global_batch_size,
                               why="the training data holds fewer sequences than a step reads: each step reads some "
                                   "twice; give more data, or a smaller train.seq_len or train.global_batch_size")
        if described.get("conversations_cut", 0) >= REPLIES_MISSING * described.get("conversations", 0) > 0:
            self.metrics.event("conversations_cut_many", step=self.step, cut=described["conversations_cut"],
                               of=described["conversations"],
                               why="longer than a sequence: their rest past train.seq_len is not trained on (a later "
                                   "reply lost)")
        if described.get("padding", 0) >= PADDING_HIGH:  # (whole conversations a sequence: the rest is padding)
            seq, pad = self.cfg.train.seq_len, described["padding"]
            self.metrics.event("padding_high", step=self.step, padding=pad, why=(
                f"{pad:.0%} of the chat sequences' tokens (train.seq_len={seq}) are padding, compute spent on no "
                "token (each holds whole conversations, and the next one did not fit): a longer train.seq_len packs "
                "more of them into one"))
        repeated = {name: s["epochs"] for name, s in described.get("sources", {}).items() if s["epochs"] > REPEATS_SAID}
        if repeated:  # (an over-weighted small source: its documents read many times, said in the data event alone)
            self.metrics.event("source_repeated", step=self.step, epochs=repeated, why=(
                f"read more than {REPEATS_SAID} times over the run (its weight against its size): data repeated past "
                "~4 epochs trains less than new data does; a lower weight, or more of that data"))
        held = held_out_note(self.cfg, self.data.train, self.data.val)
        if held:
            self.metrics.event("held_out_large", step=self.step, **held)
        self.profiler = StepProfiler(self.cfg.metrics.profile_steps, self.run_dir, self.proc.rank, self.device,
                                     self.step, self.cfg.train.steps, self.metrics.event)
        if self._lock_taken_over:
            self.metrics.event("run_dir_lock_taken_over", step=self.step, reason=self._lock_taken_over)
        if resumed is not None:
            behind = 0 < self.cfg.train.stop_at_step < self.step < self.cfg.train.steps  # (a stale early stop)
            done = {"note": f"train.stop_at_step={self.cfg.train.stop_at_step} is behind the step resumed: nothing to "
                            "train (raise it, or 0: to train.steps)" if behind else
                    f"nothing to train: {self.early_stop_line()}" if self.early_stopped_at is not None else
                    "train.steps (or stop_at_step) reached: nothing to train"} if self.step >= self.last_step else {}
            self.metrics.event("resume", step=self.step, checkpoint=resumed,
                               recomputed_steps=self.guard.goodput.recomputed_from(self.step), **done)
            if self._eval_changed:  # (saved before the evaluation read sequences spread over the split)
                self.metrics.event("eval_changed", step=self.step, note=self._eval_changed)
            if self._optim_changes:  # {key: [saved, now]}: the config's values apply from here on
                self.metrics.event("optim_changed", step=self.step, **self._optim_changes)
            if self._config_changes:  # {section.key: [saved, now]}: what else this launch changed
                self.metrics.event("config_changed", step=self.step, **self._config_changes)
        elif self.guard.goodput.high_water:  # this run's account goes on (a restart), with nothing saved to resume
            self.metrics.event("starts_over", step=0, recomputed_steps=self.guard.goodput.high_water, why=(
                "no saved state of this run was found (none was saved or kept, or a save in flight when it stopped "
                "never landed, or it was removed): its steps are trained again") + (
                "; it had trained to its end" if self.guard.goodput.was_complete else ""))

    def _layout_fingerprint(self) -> str:
        """What in-memory snapshots (local shards) are only valid for: this layout and model
        (offload included: at shard degree 1 it turns DDP into FSDP2)."""
        layout = {"world": self.proc.world_size, "parallel": self.cfg.parallel.__dict__,
                  "cpu_offload": self.cfg.memory.cpu_offload,
                  "model": args_to_json(self.model_args)}
        return json.dumps(layout, sort_keys=True, default=str)

    def _restore(self, found) -> str:
        """Load everything a saved state holds (weights, optimizer, schedule, RNG, the data position after
        checking it against the data read) and note what the config changed since; returns its name."""
        name, state = self.tiers.restore(found, self.model, self.optimizer)
        check_data_position(name, state["data"], len(self.data.train), self.cfg.train.order_seed,
                            self.cfg.train.global_batch_size, self.data.position_state(),
                            seed_key=self.cfg.train.order_seed_key, split=split_rule(self.cfg))
        check_steps_ahead(name, state["step"], self.cfg.train.steps, self.cfg.train.epochs)
        self.step = state["step"]
        self.scheduler.load_state_dict(state["scheduler"])
        self._optim_changes = apply_hyperparameters(self.optimizer, self.scheduler, self.cfg.optim)
        now = schedule_settings(self.cfg.train.steps, self.cfg.optim)  # the lr curve from here on
        self._optim_changes.update({k: [v, now[k]] for k, v in state.get("schedule", {}).items() if now.get(k) != v})
        jump = next_lr_change(self.step, state.get("config", {}), self.cfg.train.steps, self.cfg.optim)
        # Named as config_changed names keys (optim.lr, train.steps): the saved schedule's names stay bare
        self._optim_changes = {k if "." in k else f"optim.{k}": v for k, v in self._optim_changes.items()}
        if jump and self._optim_changes:  # (the lr of the next update, as the saved run had it and now)
            self._optim_changes["next_lr"] = jump
        # The rest of the config a resume changed (optim and the schedule's train.steps: said above).
        self._config_changes = {k: v for k, v in settings_changed(state.get("config", {}), self.cfg,
                                                                  bool(self._stand_in)).items()
                                if k not in self._optim_changes}
        if state.get("world_size", self.proc.world_size) != self.proc.world_size:  # (dp_shard=-1 hides it)
            self._config_changes["world_size"] = [state["world_size"], self.proc.world_size]
        self.scaler.load_state_dict(state["scaler"])
        self.anomaly.load_state_dict(state.get("anomaly", {}))
        # The run's rollback budget and skip streak go on across restarts (a requeued job must not get a
        # fresh budget each time); a rollback's own count is this attempt's, never lowered by an older state.
        handled = state.get("anomaly_handling", {})
        self.rollbacks = max(self.rollbacks, handled.get("rollbacks", 0))
        self._anomaly_streak = tuple(handled.get("streak", self._anomaly_streak))
        saved = state["data"].get("skipped_batches", [])
        check_skip_batches(name, self.step, saved, self.cfg.train.skip_batches)
        self.skipped_batches = sorted(set(saved) | set(self.skipped_batches))
        set_rng_state(state["rng"])
        self.eval_owed = state.get("eval_owed", False)
        self._restore_eval_record(state)  # (intervals.py: the best eval loss, the trend, an early stop)
        if self.cfg.train.precision == "fp8":  # a rollback: the scales precomputed are the discarded weights'
            precompute_scales(self.model)
        return name

    def save_checkpoint(self) -> Path | None:
        """A checkpoint of this step on disk (StateTiers.save; async where configured): the weights and
        optimizer, the trainer state (step, data position, RNGs, detectors), and the config and model
        shape a resume or an export reads; its path, or None where the storage refused it."""
        self.refuse_ended("save_checkpoint()")
        self.report_device_anomalies()  # the saved detector state and events agree
        agreed(self._check_run_dir, self.proc.world_size)
        if self.cfg.checkpoint.keep_best:  # (the state below names the best on disk: an async one refused since, not)
            self._forget_refused_best()
        meta = {"model_args": args_to_json(self.model_args), "config": self.cfg.to_dict(), "hf": self.hf_fields,
                "launchers": launcher_ids(),  # a restart of a resume=never run resumes only its own job's
                "world_size": self.proc.world_size,  # (a dry run's resume says a change: dp_shard=-1 hides it)
                "eval_trend": {"evaluations_since_lowest": self.eval_trend[2],  # (the dry run's "nothing to
                               "early_stopped": self.early_stopped_at is not None}}  # train" after an early stop)
        return self.tiers.save(self.step, self.model, self.optimizer, self._trainer_state(), meta)

    def _check_run_dir(self) -> None:
        """The run dir is still the folder this launch opened: one moved or removed while the run
        trained would have its next save recreate an empty folder at the old path, the run split in
        two (its log, config and checkpoints in one, the newer checkpoints in the other)."""
        try:
            held, now = os.fstat(self._run_dir_fd), os.stat(self.run_dir)
            same = (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
        except OSError:
            same = False
        if self.lock.lost:  # (rank 0's: a same-job launch on another host took the lock it no longer saw touched)
            raise CheckpointError(f"{self.lock.lost_line()}: stopping before a save lands over its checkpoints")
        if not same:
            raise CheckpointError(f"the run dir {self.run_dir} was moved or removed while the run trained (its log "
                                  "and checkpoints went with it): stopping before a save lands apart from them; "
                                  "relaunch with --run.dir where it is now (it resumes the newest checkpoint "
                                  "there, if any)")

    def snapshot_to_memory(self) -> None:
        """This step into the in-memory tier, its detector state and events current, as a save's."""
        self.report_device_anomalies()
        self.tiers.snapshot(self.step, self.model, self.optimizer, self._trainer_state())

    def _trainer_state(self) -> dict:
        """Everything beyond model and optimizer that a resumed run needs to continue exactly."""
        data = {**self.data.sampler.state_dict(self.step), **self.data.position_state(),
                "skipped_batches": self.skipped_batches, "split": split_rule(self.cfg) or SPLIT_RULE}  # (none before)
        if not self.proc.is_main:  # the files' stamps once a checkpoint (a resume's checks read rank 0's)
            data.pop("files", None)
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "data": data, "rng": get_rng_state(), "anomaly": self.anomaly.state_dict(),
                "anomaly_handling": {"rollbacks": self.rollbacks, "streak": list(self._anomaly_streak)},
                "schedule": schedule_settings(self.cfg.train.steps, self.cfg.optim), "eval_owed": self.eval_owed,
                "eval_trend": list(self.eval_trend),
                "best_eval": list(self.best_eval) if self.cfg.checkpoint.keep_best else [float("inf"), 0],
                "early_stopped": self.early_stopped_at is not None, "eval_order": EVAL_ORDER,
                "config": self.cfg.to_dict(), "world_size": self.proc.world_size}
