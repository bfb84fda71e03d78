"""What a launch tells its user as it starts: what it does that the user may not expect
(an assumed CPU peak, an unknown GPU's, idle GPUs, a pretraining lr on trained weights, a
shape the HF export refuses, ...). Events, logged once; nothing here is refused (that is
preflight.py's)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from shardline.config import Config
from shardline.data import tokenizer_file
from shardline.data.chat_template import chat_template_for
from shardline.data.encode import CHAT_END, CHAT_START
from shardline.data.overlaps import overlapping_sources, val_path_in_training_data
from shardline.data.shards import is_prepared
from shardline.data.validation import split_by_prepare, val_format
from shardline.data.tokenizer import KNOWN_EOS, eos_id
from shardline.devices import CPU_PEAK_ASSUMED, cpu_has_amx, cpu_load, mfu_peak_dtype
from shardline.errors import DataError, ShardlineError
from shardline.interop.hf_config import hf_export_problem, read_hf_config, read_hf_fields
from shardline.layout import IDLE_AT_DEGREE_ONE, Layout
from shardline.models.llama import ModelArgs
from shardline.optim import wsd_decay_steps
from shardline.parallel.slurm import tasks_left_idle
from shardline.interop.convert import checkpoint_tokenizer, other_tokenizer
from shardline.interop.hf_files import TOKENIZER_NAME
from shardline.interop.model_shape import starting_rows, starting_shape
from shardline.models.factory import args_from_json
from shardline.models.moe.args import balance_coef_from_hf
from shardline.resilience.recovery import restarted


# Above this a run from trained weights likely undoes their training: fine-tunes commonly take
# 1e-5 to 1e-4 (the default optim.lr, 3e-3, suits the tiny preset trained from scratch).
FINE_TUNE_LR_LIMIT = 1e-3
FP32_ON_GPU = ("train.precision=fp32 on a GPU: its matmuls run at the fp32 peak, ~15x under the bf16 one on an H100 "
               "(TF32 is off); train.precision=bf16 (or auto) is the usual choice")


def context_extension(cfg: Config) -> dict | None:
    """The context_extended note's fields where train.seq_len is past the positions the starting weights
    were trained for (model.hf_path or init_from), else None: RoPE as the config sets it, no scaling added."""
    start = cfg.model.hf_path or cfg.model.init_from
    trained = _trained_positions(cfg) if start and Path(start).is_dir() else 0
    if not trained or cfg.train.seq_len <= trained:
        return None
    own = _start_theta(cfg)
    theta = ("RoPE as the weights had it: a higher model.rope_theta raises its base frequency (the adjusted-"
             "base-frequency recipe)" if not cfg.model.rope_theta or cfg.model.rope_theta == own else
             f"model.rope_theta={cfg.model.rope_theta:g} " + ("raises" if own and cfg.model.rope_theta > own
                                                             else "sets") + " RoPE's base frequency"
             + (f" (theirs: {own:g})" if own else ""))
    return {"seq_len": cfg.train.seq_len, "trained_positions": trained,
            "note": f"past the positions the starting weights were trained for; {theta}, and no RoPE scaling is "
                    "added; the export records the longer max_position_embeddings"}


def launch_notes(cfg: Config, device_type: str, peak: float | None, world_size: int, gpu_name: str = "",
                 gpus: int = 0, model: ModelArgs | None = None, tokenizer=None,
                 resumed: bool = False, layout: Layout | None = None, gpu_bf16: bool = False) -> list[tuple[str, dict]]:
    """(event, fields) of what a launch does that its user may not expect, logged as it starts:
    nothing is refused. `peak`: the device's peak TFLOP/s (None: unknown, so no MFU); on CUDA,
    `gpu_name` is the device's name, `gpus` the number of GPUs the machine shows and `gpu_bf16` whether
    it computes bf16 itself (devices.native_bf16); `model` the shape the run trains; `tokenizer` the one
    it tokenizes with; `resumed`: it resumes a checkpoint."""
    notes = []
    problem = hf_export_problem(model) if model is not None else None
    if problem:  # it trains, but only the export would say so, after the run
        notes.append(("not_exportable_to_hf", {"reason": f"{problem}: `shardline convert to-hf` will refuse "
                                                         "this run's checkpoints"}))
    if cfg.memory.cpu_offload and device_type == "cpu":  # allowed: it runs the path a GPU runs
        notes.append(("cpu_offload_saves_nothing",
                      {"reason": "the states are in host memory already; FSDP2's offload path runs unpinned"}))
    if cfg.memory.ssd_offload_dir:  # and what puts the moments back in RAM, which the user may not expect
        copies = [k for k, on in (("checkpoint.mode=async", cfg.checkpoint.mode == "async"),
                                  ("the in-memory tier", cfg.checkpoint.memory_interval > 0)) if on]
        notes.append(("ssd_offload", {"folder": cfg.memory.ssd_offload_dir,
                                      "moments": "AdamW's, in unlinked files mapped from there (host RAM: cache)",
                                      **({"ram_copies": f"{' and '.join(copies)} copy them into RAM at each save"}
                                         if copies else {})}))
    if not cfg.checkpoint.interval:  # allowed (a benchmark, a drill), but nothing of the run outlives it
        kept = ("the in-memory snapshots go when it finishes" if cfg.checkpoint.memory_interval
                else "no state is saved at all")
        notes.append(("no_disk_checkpoints", {"reason": f"checkpoint.interval=0: nothing is written to disk and "
                                                        f"{kept}: the trained weights are not kept"}))
    if cfg.checkpoint.memory_interval and world_size == 1:  # (allowed: RAM outlives the process, a restart reads it)
        notes.append(("memory_snapshots_unguarded", {
            "memory_redundancy": cfg.checkpoint.memory_redundancy, "why": "one process has no peer to hold a "
            "replica or parity: each snapshot is held once, in this node's RAM (a crash of the process leaves it, "
            "a loss of the node does not)"}))
    if warmup_covers_run(cfg):
        notes.append(("warmup_cut", {"warmup_steps": cfg.optim.warmup_steps, "steps": cfg.train.steps,
                                     "why": "the warm-up covers every step: the lr is still rising at the last "
                                            "step (at most peaking there)" + (", never decaying" * (
                                                cfg.optim.schedule != "constant")) + " (lower optim.warmup_steps)"}))
    elif cfg.optim.schedule == "wsd" and (decay := wsd_decay_steps(cfg.train.steps, cfg.optim))[1] < decay[0]:
        notes.append(("wsd_decay_cut", {"decay_steps": decay[1], "asked": decay[0], "why": (
            f"optim.decay_fraction={cfg.optim.decay_fraction} asks for {decay[0]} decay steps of {cfg.train.steps}; "
            f"the decay starts after the {cfg.optim.warmup_steps} warm-up steps, so it takes {decay[1]}")}))
    if device_type == "cpu" and not cfg.metrics.peak_tflops:  # so a CPU's mfu is not read as a GPU's
        notes.append(("mfu_peak_assumed", {"peak_tflops": peak, **({"ranks": world_size, "job_peak_tflops": round(
            peak * world_size, 4)} if world_size > 1 else {}), "why": CPU_PEAK_ASSUMED}))  # (mfu divides by the job's)
    host = os.cpu_count() or 1  # (the load average is the host's: its cores, not this process's affinity)
    if device_type == "cpu" and (load := cpu_load()) >= host + 1:  # (a step's time moved 17x on 2 cores)
        notes.append(("cpu_busy", {"load": round(load, 2), "cores": host, "why": "more runnable work than "
                                   "cores (this job's own ranks and workers count too): tokens/s and mfu move with "
                                   "it (a benchmark wants idle cores)"}))
    if device_type == "cpu" and cfg.train.precision in ("bf16", "fp16") and not cpu_has_amx(cfg.train.precision):
        # (allowed: it runs what a GPU runs; with AMX tiles for the dtype it is the faster one)
        notes.append(("half_precision_on_cpu", {"precision": cfg.train.precision, "why": "often slower than fp32 "
                      "on a CPU without AMX tiles for it (fp16 matmuls without avx512_fp16 many times slower): the "
                      "casts and the element-wise work cost more than the 16-bit matmuls save (train.precision=fp32 "
                      "on a CPU)"}))
    if device_type == "cpu" and cfg.train.precision == "fp8":  # (allowed: the float8 path, checked on a CPU)
        notes.append(("fp8_emulated", {"why": "float8 matmuls are emulated on a CPU (quantised, multiplied in fp32): "
                      "for testing only, slower than fp32; real fp8 needs a GPU of compute capability >= 8.9"}))
    if device_type == "cuda" and cfg.train.precision == "fp32" and gpu_bf16:  # (allowed: a numerics check, say)
        notes.append(("fp32_on_gpu", {"why": FP32_ON_GPU}))
    if peak is None and device_type == "cuda":
        notes.append(("mfu_unknown", {"device": gpu_name,
                                      "fix": f"set metrics.peak_tflops to its dense "
                                             f"{mfu_peak_dtype(cfg.train.precision)} peak (TFLOP/s); until then "
                                             "the log has no mfu"}))
    if device_type == "cuda" and world_size == 1 and gpus > 1:
        notes.append(("one_gpu_of_several", {"gpus": gpus, "fix": f"torchrun --nproc_per_node={gpus} -m shardline "
                                             "train ... trains on all of them"}))
    if world_size == 1 and (tasks := tasks_left_idle(os.environ)):
        notes.append(("slurm_tasks_unused", {"tasks": tasks, "fix": "this process runs in the batch script's own "
                      f"shell, not as an srun task: it trains alone; `srun python -m shardline train ...` runs the "
                      f"job's {tasks} tasks as its ranks (examples/slurm/train.sbatch)"}))
    no_eos = tokenizer is not None and eos_id(tokenizer, tokenizer_file(cfg.data)) is None
    if no_eos and "text" in cfg.data.formats():  # (chat: the template's)
        notes.append(("no_end_of_document_token", {
            "tokenizer": cfg.data.tokenizer or "the run's own",
            "why": f"none of {', '.join(KNOWN_EOS)} is a token of it, nor an eos_token its tokenizer_config.json "
                   "names: documents are packed with nothing between them, and generate stops only at its length"}))
    if cfg.data.chat and tokenizer is not None and _no_template(tokenizer_file(cfg.data)):
        pieces = [m for m in (CHAT_START, CHAT_END) if tokenizer.token_to_id(m) is None]
        notes.append(("chat_as_chatml", {
            "why": "no chat template beside the tokenizer (tokenizer_config.json's chat_template, chat_template.jinja)",
            **({"markers": f"{' and '.join(pieces)} are no tokens of this vocabulary: learned as pieces"}
               if pieces else {}), "export": "convert to-hf writes the ChatML template into the HF folder"}))
    start = cfg.model.hf_path or cfg.model.init_from
    extended = context_extension(cfg)
    if extended:  # allowed: RoPE reaches any position, as configured
        notes.append(("context_extended", extended))
    notes += _routing_notes(model, start_moe(cfg) if start else None)
    notes += _hf_balance_note(cfg, model)
    own = _own_tokenizer(cfg) if start and cfg.data.tokenizer else None
    if own is not None and other_tokenizer(own, Path(cfg.data.tokenizer)):
        notes.append(("tokenizer_not_the_weights", {
            "tokenizer": cfg.data.tokenizer, "theirs": str(own),
            "why": "its ids may name other rows of the embedding than the weights learned; unset data.tokenizer "
                   "to use theirs"}))
    rows = vocab_rows_added(cfg, model, resumed)
    if rows:  # asked for; but how the rows start is ours to say
        notes.append(("vocab_grown", {
            "rows": f"{rows[0]} -> {rows[1]}", "weights": start,
            "new_rows": "the embedding's and the output's start at the mean of the weights' rows, as transformers' "
                        "resize_token_embeddings starts them; the export's config.json says the new vocab_size",
            **({"unused_rows": f"{rows[1] - tokens} rows no token of the tokenizer ({tokens} tokens) uses: rounding "
                               "up, or is data.tokenizer the one with the added tokens?"}
               if tokenizer is not None and (tokens := tokenizer.get_vocab_size()) < rows[1] else {})}))
    if lr_high_for_trained_weights(cfg):
        notes.append(("lr_high_for_trained_weights", {
            "lr": cfg.optim.lr, "weights": start,
            "fix": "fine-tunes commonly take optim.lr 1e-5 to 1e-4"}))
    if lr_low_for_new_weights(cfg, resumed):
        notes.append(("lr_low_for_new_weights", {
            "lr": cfg.optim.lr, "why": "no model.hf_path or model.init_from: the weights start at random, which "
                                       "pretraining lrs (8e-5 to 3e-3) move; a fine-tune's config needs its weights"}))
    f = cfg.faults
    drills = [k for k, armed in (("kill_rank", f.kill_rank >= 0), ("hang_rank", f.hang_rank >= 0),
                                 ("slow_rank", f.slow_rank >= 0), ("nan_step", f.nan_step),
                                 ("spike_step", f.spike_step), ("overflow_step", f.overflow_step),
                                 ("corrupt_checkpoint_step", f.corrupt_checkpoint_step),
                                 ("fail_save_step", f.fail_save_step), ("refuse_save_step", f.refuse_save_step))
              if armed]
    if resumed and drills and not restarted():  # a torchrun restart or a requeue skips them; a hand relaunch does not
        notes.append(("drills_armed_on_resume", {
            "faults": ", ".join(f"faults.{k}" for k in drills),
            "why": "a relaunch by hand is a first attempt: the drills fire again (a step's where it is still ahead, a "
                   "phase's, faults.hang_phase, at once); "
                   "relaunch with --run.dir alone (the saved config drops them) to go on without"}))
    if cfg.train.epochs:  # (a train.steps given too is replaced)
        notes.append(("steps_from_epochs", {"epochs": cfg.train.epochs, "steps": cfg.train.steps,
                                            "why": "train.epochs sets the run's length; train.steps follows"}))
    inside = val_path_in_training_data(cfg)
    if inside:  # allowed (a training loss measured on purpose), but rarely meant
        notes.append(("evaluates_on_training_data", {"val_path": cfg.data.val_path, "inside": inside,
                                                      "why": "the eval loss is then a training loss"}))
    sources, why = overlapping_sources(cfg)
    if sources:  # allowed (an oversampling by paths), but rarely meant
        notes.append(("mixture_sources_overlap", {"sources": sources, "why": why}))
    unused = unused_settings(cfg, layout)
    if unused:
        notes.append(("settings_unused", unused))
    return notes


# Below this a run from random weights barely moves (Llama 3 405B pretrained at 8e-5; fine-tunes take 1e-5 to 2e-5).
PRETRAIN_LR_FLOOR = 5e-5


def warmup_covers_run(cfg: Config) -> bool:
    """The warm-up is as long as the run or longer: the lr peaks at the last step, never decaying
    (the warmup_cut note, the dry run's optim line)."""
    return cfg.optim.warmup_steps >= cfg.train.steps


def lr_high_for_trained_weights(cfg: Config) -> bool:
    """A pretraining lr on trained weights (the launch note and the dry run's line): the fine-tune's
    config forgotten, most likely; such an lr undoes what the weights learned in a few steps."""
    return bool(cfg.model.hf_path or cfg.model.init_from) and cfg.optim.lr > FINE_TUNE_LR_LIMIT


def lr_low_for_new_weights(cfg: Config, resumed: bool) -> bool:
    """A fine-tune's lr on random weights: a fine-tune's config launched without its weights, most
    likely (a resumed run's weights are trained, and a lowered lr there is the user's)."""
    return not (cfg.model.hf_path or cfg.model.init_from or resumed) and cfg.optim.lr < PRETRAIN_LR_FLOOR


def unused_settings(cfg: Config, layout: Layout | None = None) -> dict[str, str]:
    """{key: why} of the settings given other than their defaults that this config never reads (a
    recipe without fp8, ac_every without selective checkpointing): said, as a likely mistake.
    `layout`: the one resolved on the launch's world (parallel.zero where nothing is sharded)."""
    given, default = cfg.to_dict(), Config().to_dict()
    c, p = cfg.checkpoint, cfg.parallel
    rules = [("fp8", ("recipe", "fsdp_all_gather"), cfg.train.precision != "fp8", "train.precision is not fp8"),
             ("memory", ("ac_every",), cfg.memory.activation_checkpoint != "selective",
              "memory.activation_checkpoint is not selective"),
             ("optim", ("decay_fraction",), cfg.optim.schedule != "wsd", "optim.schedule is not wsd"),
             ("optim", ("min_lr_ratio",), cfg.optim.schedule == "constant", "optim.schedule=constant has no floor"),
             *(("parallel", keys, getattr(p, degree) == 1, f"parallel.{degree}=1")
               for degree, keys in IDLE_AT_DEGREE_ONE.items()),
             ("parallel", ("cp_balance",), p.cp > 1 and p.cp_mode == "ulysses",
              "parallel.cp_mode=ulysses has no ring to balance"),
             ("checkpoint", ("keep", "mode", "on_error"), not c.interval, "checkpoint.interval=0"),
             ("train", ("early_stop_min_delta",), not cfg.train.early_stop_patience,
              "train.early_stop_patience=0: no early stop"),
             ("checkpoint", ("keep_best",), not cfg.train.eval_interval, "train.eval_interval=0: no evaluation ranks "
              "the checkpoints"),
             ("checkpoint", ("memory_redundancy", "memory_mode"), not c.memory_interval,  # (memory_dir: read to
              "checkpoint.memory_interval=0"),  # drop an earlier launch's snapshots there)
             ("watchdog", ("long_timeout_s",), not cfg.watchdog.timeout_s, "watchdog.timeout_s=0"),
             ("data", ("text_field",), not _reads_text_field(cfg), "chat data reads each record's 'messages'"
              if "text" not in cfg.data.formats() else "the data is prepared: `shardline prepare --text-field` read "
              "its text" if split_by_prepare(cfg) else "each text source of data.mix names its own text_field"),
             ("data", ("format",), bool(cfg.data.mix) and all(s.format for s in cfg.data.mix) and not (
                 cfg.data.val_path and len(set(cfg.data.formats())) > 1),  # (data.val_path's, then)
              "every data.mix source sets its own format"),
             ("data", ("vocab_size",), bool(cfg.data.tokenizer or cfg.model.hf_path or cfg.model.init_from),
              "the tokenizer given (data.tokenizer, or the starting weights') has its vocabulary: data.vocab_size "
              "sizes a BPE trained at launch (model.vocab_size: the model's rows)"),
             ("model", ("preset",), bool(cfg.model.hf_path or cfg.model.init_from),
              "the starting weights (model.hf_path, model.init_from) give the model's shape"),
             ("data", ("split",), split_by_prepare(cfg) or bool(cfg.data.val_path) or not cfg.data.val_fraction,
              "the data holds nothing out here, or its prepared folder's split is its own"),
             ("data", ("val_fraction",), split_by_prepare(cfg) or bool(cfg.data.val_path),
              "data.val_path is the held-out data" if cfg.data.val_path else
              "the data is prepared: `shardline prepare --val-fraction` fixed its held-out split"),
             ("train", ("skip_batches",), min(cfg.train.skip_batches, default=0) >= cfg.train.steps,
              f"the run reads batches 0..{cfg.train.steps - 1}: every one named lies past them"),
             ("parallel", ("zero",), layout is not None and layout.dp_mode in ("ddp", "single")
              and not cfg.memory.ssd_offload_dir,
              "nothing is sharded: dp_shard x cp = 1, so DDP or one rank")]
    return {f"{section}.{key}": why for section, keys, idle, why in rules if idle
            for key in keys if given[section][key] != default[section][key]}


def _reads_text_field(cfg: Config) -> bool:
    """Whether any source reads data.text_field: a raw text one without a text_field of its own in
    data.mix (a prepared folder's text was read by prepare), or a text data.val_path."""
    d = cfg.data
    sources = [(s.path, s.text_field) for s in d.mix] or [(d.path, "")]
    return any(fmt == "text" and not name and not is_prepared(path) for fmt, (path, name) in
               zip(d.formats(), sources)) or bool(d.val_path and val_format(cfg) == "text")


ROUTING = ("top_k", "norm_topk", "router", "route_scale", "capacity_factor")  # what mixes the experts' outputs


def _start_shape(cfg: Config) -> ModelArgs | None:
    """The starting weights' shape, None for none or one that cannot be read (the launch says why)."""
    try:
        return starting_shape(cfg.model)
    except (OSError, ValueError, KeyError, TypeError, ShardlineError):
        return None


def _start_theta(cfg: Config) -> float:
    shape = _start_shape(cfg)
    return float(shape.rope_theta) if shape is not None else 0.0


def start_moe(cfg: Config):
    """The starting weights' router settings (MoEArgs), None for a dense start or none that can be read."""
    shape = _start_shape(cfg)
    return shape.moe if shape is not None else None


def _hf_balance_note(cfg: Config, model: ModelArgs | None) -> list[tuple[str, dict]]:
    """An HF MoE folder's router_aux_loss_coef, which its fine-tune here does not apply (its balance loss starts
    off): said with the moe.aux_loss_coef that weighs the same loss, where none is set (the log read aux 0)."""
    if not cfg.model.hf_path or model is None or model.moe is None or model.moe.aux_loss_coef:
        return []
    with contextlib.suppress(OSError, ValueError, TypeError, ShardlineError):
        coef = float(read_hf_fields(cfg.model.hf_path).get("router_aux_loss_coef") or 0.0)
        if coef > 0:
            layers = model.n_layers - model.moe.first_dense_layers
            return [("balance_loss_off", {"router_aux_loss_coef": coef, "why": (
                "the HF folder's balance loss weight is not applied (transformers applies it only with "
                f"output_router_logits): moe.aux_loss_coef={balance_coef_from_hf(coef, model.moe.top_k, layers):.4g} "
                "weighs the same loss here")})]
    return []


def _routing_notes(model: ModelArgs | None, theirs) -> list[tuple[str, dict]]:
    """[moe] overrides that change how starting weights mix their experts (their outputs change before
    any step, where [model] shape overrides are refused), and a renormalised top-1 router, which the
    loss cannot move (every token's weight is 1): only a balance loss trains it, as in transformers."""
    if model is None or model.moe is None or theirs is None:
        return []
    mine, notes = model.moe, []
    changed = {k: [getattr(theirs, k), getattr(mine, k)] for k in ROUTING if getattr(theirs, k) != getattr(mine, k)}
    if changed:
        notes.append(("routing_changed", {**changed, "why": "the starting weights mix their experts otherwise now: "
                                                            "their outputs change before the first step"}))
    if mine.top_k == 1 and mine.norm_topk:
        notes.append(("router_trained_by_balance_alone", {
            "why": "top_k=1 with renormalised weights gives every token the weight 1, so the loss cannot move the "
                   "router: " + ("moe.aux_loss_coef or moe.z_loss_coef trains it" if mine.aux_loss_coef or
                                 mine.z_loss_coef else "it stays as the starting weights have it (no balance loss)")}))
    return notes


def _no_template(tokenizer_path: str) -> bool:
    """Whether chat data renders as ChatML here (a template that cannot be read is the data's own
    error, not a note's)."""
    try:
        return chat_template_for(tokenizer_path) is None
    except DataError:
        return False


def _trained_positions(cfg: Config) -> int:
    """The sequence length the starting weights were trained at: an HF folder's positions, or the
    seq_len of the run that saved a checkpoint (its meta.json alone: no file is hashed again); 0 unknown."""
    m = cfg.model
    try:
        if m.hf_path:
            return read_hf_config(m.hf_path).max_seq_len
        meta = json.loads((Path(m.init_from) / "meta.json").read_text(encoding="utf-8"))
        recorded = args_from_json(meta["model_args"]).max_seq_len  # (an HF folder's positions, or a preset's)
        run = meta.get("config", {})  # none in a checkpoint converted from HF
        trained = run.get("train", {}).get("seq_len") or recorded
        started = run.get("model", {}).get("hf_path") or run.get("model", {}).get("init_from")
        return int(max(trained, recorded) if started else trained)  # a fine-tune keeps its weights' reach
    except (OSError, ValueError, KeyError, TypeError, ShardlineError):
        return 0


def _own_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer.json the starting weights came with, where there is one."""
    m = cfg.model
    own = Path(m.hf_path) / TOKENIZER_NAME if m.hf_path else checkpoint_tokenizer(Path(m.init_from))
    return own if own is not None and own.is_file() else None


def vocab_rows_added(cfg: Config, model: ModelArgs | None, resumed: bool) -> tuple[int, int] | None:
    """(the starting weights' vocabulary rows, the model's) where the start adds rows, else None."""
    if model is None or resumed or not cfg.model.vocab_size or not (cfg.model.hf_path or cfg.model.init_from):
        return None
    try:
        rows = starting_rows(cfg.model)
    except (OSError, ValueError, KeyError, TypeError, ShardlineError):
        return None
    return (rows, model.vocab_size) if model.vocab_size > rows else None


