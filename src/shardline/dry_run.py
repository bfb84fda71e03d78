"""`shardline train --dry-run [--world-size N]`: a launch of N ranks checked on this machine.

It runs the launch's own checks (`shardline.preflight`: config, model shape, data files, layout, the
machine-dependent rules assuming GPUs unless run.device = cpu, and which checkpoint a resume would take)
for N ranks without a process group, without writing anything, then prints the resolved layout, which
layers each pipeline rank holds and the planner's memory estimate of the busiest rank. A mistake is the
one-line error a launch would stop with. Not checked: what needs the tokenized corpus (a BPE that would
be trained at launch, and whether the data fills one sequence) and the machines themselves.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from shardline import layout as layouts
from shardline.config import Config
from shardline.data import build_data
from shardline.data.loader import data_summary
from shardline.data.shards import id_bound, is_prepared, read_manifest
from shardline.data.tokenizer import load_tokenizer
from shardline.data.overlaps import overlapping_sources, val_path_in_training_data
from shardline.launch_notes import (FP32_ON_GPU, context_extension, lr_high_for_trained_weights, lr_low_for_new_weights,
                                    unused_settings, vocab_rows_added, warmup_covers_run)
from shardline.devices import DATASHEETS, local_datasheet, native_bf16
from shardline.errors import ConfigError
from shardline.layout.degrees import shard_degree
from shardline.interop.hf import check_hf_weights
from shardline.models.attention import describe_attention
from shardline.models.flops import num_params
from shardline.optim import lr_multiplier, next_lr_change, wsd_decay_steps
from shardline.parallel.compile import describe as describe_compile
from shardline.planner.estimate import estimate
from shardline.planner.hardware import Hardware, cuda_index, get_hardware, with_local_memory
from shardline.planner.layout import Workload
from shardline.planner.report import MEMORY_TERMS, attention_words, mfu_over_words, mfu_words, scores_words
from shardline.planner.microbatch_comm import ep_placement
from shardline.planner.attention import mask_hint
from shardline.planner.memory import GiB
from shardline.planner.offload import OFFLOADED, OUTSIDE_DEVICE, node_ranks
from shardline.resilience.checkpoint import verify
from shardline.resilience.recovery import (data_changes, saved_config, saved_early_stop, saved_step,
                                          saved_world_size, settings_changed)
from shardline.resilience.resume_checks import check_saved_position
from shardline.preflight import (Preflight, bos_setting, check_config, check_device, check_layout_before_data,
                                 check_resume, check_rollback_target, check_resume_fits, preflight, resolve_epochs,
                                 use_model_tokenizer)


def dry_run(cfg: Config, world: int, gpu: str | None = None, world_given: bool = True) -> tuple[str, bool]:
    """(the report of a checked launch on `world` ranks, whether the memory estimate fits);
    raises what the launch would raise (`world_given`: by --world-size or $WORLD_SIZE, else 1)."""
    asked, (on_gpu, gpu_bf16) = cfg.train.precision, _gpu_with_bf16(cfg, gpu, world)
    cfg.train.settle_precision(on_gpu, gpu_bf16)
    check_config(cfg)
    stand_in = use_model_tokenizer(cfg)
    if not world_given:  # degrees that need more processes than the one assumed: say how to give them
        try:
            shard_degree(cfg, world)
        except ConfigError as e:
            raise ConfigError(f"{e} (the dry run checked one process: give --world-size N for the launch's)") from None
    check_layout_before_data(cfg, world)
    data, folder_tokenizer = data_summary(cfg)
    bundle = build_data(cfg) if cfg.train.epochs else None  # the steps follow from the sequences: read (and
    if bundle is not None:  # tokenize) the data as the launch does; a resume's position is then checked with it
        resolve_epochs(cfg, len(bundle.train))
    resume = check_resume(cfg, bundle, stand_in is not None)
    check_rollback_target(cfg, resume)
    if cfg.model.hf_path and resume is None:  # the launch reads its weights: a folder without them fails there
        check_hf_weights(cfg.model.hf_path)
    if cfg.model.init_from and resume is None and stand_in is None:  # ... and verifies a checkpoint's files
        verify(Path(cfg.model.init_from))
    vocab, tokenizer, add_bos = _tokenizer_vocab(cfg, folder_tokenizer)
    launch = preflight(cfg, world, vocab)
    known = bool(cfg.data.tokenizer or folder_tokenizer)  # else the size of a BPE trained at launch, estimated
    changed = data_changes(resume, cfg, stand_in is not None)
    check_resume_fits(resume, launch.model_args, cfg.train.steps, add_bos, vocab_known=known, data_changed=changed,
                      epochs=cfg.train.epochs)
    prepared = all(is_prepared(path) for path in [s.path for s in cfg.data.mix] or [cfg.data.path])
    if resume and (changed or prepared) and bundle is None:  # data settings changed (tokenized here), or shards
        _check_resumed_data(cfg, world, resume, changed, stand_in is not None)  # read at no cost: as the launch
    check_device(cfg, launch.layout, on_cuda=cfg.run.device != "cpu", node_paths=False, fp8_target=_fp8_target(gpu))
    target = ("" if cfg.run.device != "auto" or torch.cuda.is_available() else
              " (as a CUDA launch: run.device=auto, and this machine has no GPU, where it would train on the "
              "CPU; --run.device=cpu checks that)")
    read = prepared or (cfg.train.epochs and not resume)  # (train.epochs: the data was read and checked above)
    raw = "" if read else (" (raw data: the launch, which tokenizes it, checks its held-out size"
                           + (", its chat reply tokens" if cfg.data.chat else "")
                           + (", and its tokens against the checkpoint's" if resume and not changed else "") + ")")
    lines = [f"dry run: {world} rank(s); config, data and layout pass the launch checks{target}{raw}",
             _model_line(cfg, launch), f"data      {data}; "
             f"tokenizer {tokenizer}",
             f"run       {cfg.run.dir}: " + (f"resumes from {resume}" if resume else "starts at step 0"),
             *_resume_lines(cfg, resume, stand_in is not None, world, world_given),
             *_note_lines(cfg, resume is not None, launch, vocab, known),
             *([f"          {stand_in}"] if stand_in else []), *_layout_lines(cfg, launch),
             _precision_line(cfg, asked, on_gpu, gpu_bf16)]
    memory, fits = _memory_lines(cfg, launch, gpu)
    return "\n".join([*lines, *memory]), fits


def _check_resumed_data(cfg: Config, world: int, resume: Path, changed: str, stand_in: bool) -> None:
    """The launch's checks of a resume against the data it reads (its sequences, vocabulary and
    tokens' fingerprint): run here where that costs nothing (prepared folders) or where data
    settings changed since the checkpoint, which tokenizes raw files (a dry run passed what the
    launch, minutes later, refused). Raw files edited in place are found by the launch only."""
    data = build_data(cfg)
    args = preflight(cfg, world, data.vocab_size).model_args
    check_resume_fits(resume, args, cfg.train.steps, bos_setting(cfg, data.tokenizer), data_changed=changed,
                      epochs=cfg.train.epochs)
    check_saved_position(resume, cfg, len(data.train), data.position_state(), stand_in)


def _resume_lines(cfg: Config, resume: Path | None, stand_in: bool, world: int, world_given: bool) -> list[str]:
    """What a resume changes from the checkpoint's run (the launch's optim_changed and
    config_changed events; a world size only where one was given), and whether anything is left to train."""
    if resume is None:
        return []
    saved, step, saved_world = saved_config(resume), saved_step(resume), saved_world_size(resume)
    changes = settings_changed(saved, cfg, stand_in)
    world_changed = saved_world not in (None, world)
    if world_changed and world_given:
        changes["world_size"] = [saved_world, world]
    said = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
    lines = [f"          changed since it: {said}"] if changes else []
    if world_changed and not world_given:
        lines.append(f"          saved on {saved_world} ranks (give --world-size N to check the launch's)")
    last, patience, since = cfg.train.last_step, cfg.train.early_stop_patience, saved_early_stop(resume)
    ended_early = bool(patience) and since is not None and since >= patience and step < last  # (its run is over)
    jump = next_lr_change(step, saved, cfg.train.steps, cfg.optim)
    if jump and step < last and not ended_early:
        lines.append(f"          lr of the next update (step {step + 1}): {jump[0]:.3g} -> {jump[1]:.3g} (the "
                     "schedule is computed from step 0 with the new settings)")
    if ended_early:
        lines.append(f"          nothing to train: it stopped early at step {step}, {since} evaluation(s) without a "
                     f"lower eval loss (train.early_stop_patience={patience}: raise it, or 0, to train on)")
    elif step >= last:
        given = f"train.steps, from train.epochs={cfg.train.epochs:g}" if cfg.train.epochs else "train.steps"
        lines.append(f"          nothing to train: it is at step {step}, the run ends at {last} ({given}"
                     + (", train.stop_at_step)" if cfg.train.stop_at_step else ")"))
    return lines


def _note_lines(cfg: Config, resumes: bool, launch: Preflight, vocab: int, known: bool) -> list[str]:
    """What the launch would note as likely mistakes (launch_notes: settings it never reads, a
    fine-tune's lr on random weights, which a resume's are not), and a preset's vocabulary far
    past the tokenizer's (a plan's config without the model's tokenizer: rows never trained)."""
    unused = ", ".join(f"{key} ({why})" for key, why in unused_settings(cfg, launch.layout).items())
    lines = [f"notes     set but unused: {unused}"] if unused else []
    rows = launch.model_args.vocab_size
    if rows > 2 * vocab and not (cfg.model.hf_path or cfg.model.init_from or resumes):
        lines.append(f"notes     the model's vocabulary of {rows:,} rows is far past the tokenizer's {vocab:,} tokens: "
                     "the rest are never trained (give data.tokenizer the model's own tokenizer.json"
                     + (f", or data.vocab_size={rows} for a BPE trained up to that size)" if not known else ")"))
    sources, why = overlapping_sources(cfg)
    if sources:
        lines.append(f"notes     two sources overlap, {sources}: {why}")
    inside = val_path_in_training_data(cfg)
    if inside:
        lines.append(f"notes     data.val_path={cfg.data.val_path} is (inside) {inside}: the eval loss is a "
                     "training loss")
    added = vocab_rows_added(cfg, launch.model_args, resumes)
    if added:
        unused = f"; {added[1] - vocab:,} rows no token of the tokenizer uses" if vocab < added[1] else ""
        lines.append(f"notes     {added[1] - added[0]:,} vocabulary rows added to the starting weights' {added[0]:,} "
                     f"(the embedding's and the output's, at the mean of theirs){unused}")
    extended = context_extension(cfg)  # (as the launch notes it)
    if extended:
        lines.append(f"notes     train.seq_len={extended['seq_len']:,} is {extended['note']} (trained for "
                     f"{extended['trained_positions']:,})")
    if lr_high_for_trained_weights(cfg):
        start = cfg.model.hf_path or cfg.model.init_from
        lines.append(f"notes     optim.lr={cfg.optim.lr:g} on trained weights ({start}): a pretraining lr, which "
                     "undoes what they learned; fine-tunes commonly take 1e-5 to 1e-4 (configs/finetune.toml)")
    if lr_low_for_new_weights(cfg, resumes):
        lines.append(f"notes     optim.lr={cfg.optim.lr:g} on random weights (no model.hf_path or model.init_from): "
                     "a fine-tune's lr, which barely moves a new model")
    return lines


def _tokenizer_vocab(cfg: Config, folder_tokenizer: str = "") -> tuple[int, str, bool | None]:
    """(vocabulary size, what the report says of the tokenizer, data.add_bos where it decides tokens)."""
    path = cfg.data.tokenizer or folder_tokenizer  # a prepared folder fixes its tokenizer
    if path:
        tok = load_tokenizer(path)
        size = id_bound(tok)  # as the launch sizes the embedding: one past the largest id
        return size, f"{path} ({size:,} tokens)", bos_setting(cfg, tok)
    return cfg.data.vocab_size, (f"a byte-level BPE of up to {cfg.data.vocab_size:,} tokens, trained at launch "
                                 "(not checked here: its exact size)"), None  # (a BPE of ours has no BOS)


def _model_line(cfg: Config, launch: Preflight) -> str:
    a = launch.model_args
    name = cfg.model.hf_path or cfg.model.init_from or cfg.model.preset
    line = (f"model     {name}: {num_params(a) / 1e6:,.1f} M parameters, {a.n_layers} layers, dim {a.dim}, "
            f"{a.n_heads} heads ({a.kv_heads} kv), vocab {a.vocab_size:,}")
    if a.moe is not None:
        line += (f"; {a.moe.n_experts} experts, top {a.moe.top_k}, {num_params(a, active=True) / 1e6:,.1f} M "
                 "active per token")
    return line


def _optim_line(cfg: Config) -> str:
    """The learning rate's curve, the decay, the clip and the seeds: what an ablation varies, said before it runs."""
    o, t = cfg.optim, cfg.train
    seeds = f"seed {t.seed}" + (f", data order {t.data_seed}" if t.data_seed != -1 else " (weights and data order)")
    curve = (" (as long as the run: the lr peaks at its last step, never decaying)" if warmup_covers_run(cfg) else
             f", then {o.schedule}" + ("" if o.schedule == "constant" else f" down to {o.min_lr_ratio:g} x lr"))
    if o.schedule == "wsd" and not warmup_covers_run(cfg):
        asked, given = wsd_decay_steps(t.steps, o)
        curve += f" over the last {given} step(s)" + (f" ({asked} asked: the decay starts after the warm-up)"
                                                       if given < asked else "")
    if o.schedule == "rsqrt" and not warmup_covers_run(cfg):  # a floor it may never reach, not an end point
        at = math.ceil(o.warmup_steps / o.min_lr_ratio ** 2) if o.min_lr_ratio > 0 else 0
        if at - 1 > o.warmup_steps and lr_multiplier(at - 2, t.steps, o) <= o.min_lr_ratio:  # (a rounded-up ratio)
            at -= 1
        reach = f"from step {at}" if at <= t.steps else f"not reached by step {t.steps}"
        last = lr_multiplier(t.steps - 1, t.steps, o)
        curve = (f", then rsqrt (lr x sqrt({o.warmup_steps} / step)) to {last:.3g} x lr at the last step, "
                 + (f"floor {o.min_lr_ratio:g} x lr {reach}" if at else "no floor"))
    clip = f"weight decay {o.weight_decay:g}, " + (f"grad clip {t.grad_clip:g}" if t.grad_clip else "no grad clip")
    return f"optim     lr {o.lr:g}, {o.warmup_steps} warm-up step(s){curve}; {clip}; {seeds}"


def _precision_line(cfg: Config, asked: str, on_gpu: bool, gpu_bf16: bool) -> str:
    """The precision the launch trains in, with what comes with it (fp16's loss scaling, fp8's recipe and
    a CPU's emulation) and a chunked loss; fp32 on a GPU with bf16 of its own gets the launch note's advice
    (not on an older card, where bf16 is emulated and slower than fp32)."""
    settled, chunk = cfg.train.precision, cfg.train.loss_chunk_tokens
    loss = f"; the loss {chunk:,} tokens at a time (train.loss_chunk_tokens: no whole fp32 logits)" if chunk else ""
    if asked == "auto":
        return f"precision {settled} (train.precision=auto: bf16 on a GPU with it, else fp32){loss}"
    if settled == "fp32" and on_gpu and gpu_bf16:  # (as the launch notes it: fp32_on_gpu)
        return f"precision fp32 ({FP32_ON_GPU}){loss}"
    if settled == "fp16":
        return ("precision fp16 (dynamic loss scaling from 2**16, a resume from its saved scale: an overflowing "
                f"step is skipped, the scale halved; doubled after 2000 steps without one){loss}")
    if settled == "fp8":
        return (f"precision fp8 (torchao float8, fp8.recipe={cfg.fp8.recipe}; the output layer and the router in bf16"
                + ("; emulated on a CPU: for testing only)" if not on_gpu else ")") + loss)
    return f"precision {settled}{loss}"


def _layout_lines(cfg: Config, launch: Preflight) -> list[str]:
    lay, t = launch.layout, cfg.train
    lines = [f"layout    {lay.describe()}",
             f"          dp_replicate={lay.dp_replicate} dp_shard={lay.dp_shard} cp={lay.cp} tp={lay.tp} "
             f"pp={lay.pp} ep={lay.ep} zero={lay.zero}" + (" (nothing sharded)" * (lay.dp_mode in ("ddp", "single")))
             + (f"; rank order pp, dp_replicate, dp_shard, cp, tp: a tp group is {lay.tp} consecutive ranks (one "
                "node's, where tp divides a node's GPUs)") * (lay.tp > 1),
             f"batch     {t.global_batch_size} sequences x {t.seq_len} tokens per step; each of {lay.dp} "
             f"data-parallel rank(s) runs {lay.micro_batches(t.global_batch_size)} micro-batch(es) of "
             f"{lay.micro_batch_size}; {t.steps} steps" + (f" (train.epochs={t.epochs:g})" if t.epochs else ""),
             _optim_line(cfg),
             f"attention {describe_attention(t.attention, t.document_mask, cfg.run.device != 'cpu', *lay.cp_degrees)}",
             f"compile   {describe_compile(t.compile, lay, cfg.memory.activation_checkpoint, launch.model_args.moe)}"]
    if launch.model_args.moe is not None:
        lines.append(_experts_line(launch.model_args.moe, lay))
    if lay.pp > 1:  # (pipeline keys at pp=1: the notes line names them, not refused: a pp config debugged at pp=1)
        lines.append(f"pipeline  {lay.pp_schedule}, {lay.n_stages} stages, {lay.pp_microbatches} micro-batches "
                     "per step")
        for r in layouts.pipeline_ranks(launch.model_args, lay.pp, lay.pp_virtual_stages, lay.pp_schedule):
            ends = " + ".join(e for e, held in (("embedding", r.first), ("output", r.last)) if held)
            lines.append(f"  pp rank {r.rank}: stages {list(r.stages)}, layers {_ranges(r.layer_ids)}"
                         + (f" + {ends}" if ends else ""))
    return lines


def _experts_line(moe, lay) -> str:
    """Where a mixture's routed experts live: how many a rank holds (ep), the ranks their weights
    (or ZeRO-1's optimizer states) are cut over (efsdp: dp_shard x cp / ep), and how they route."""
    how = ("dropless" if not moe.capacity_factor else f"capacity x{moe.capacity_factor:g}") + \
        f", {moe.shared_experts} shared" * bool(moe.shared_experts)
    held = (f"{moe.n_experts // lay.ep} a rank over ep={lay.ep} (tokens reach them by all-to-all)" if lay.ep > 1
            else "not split by expert (parallel.ep=1): laid out as the other weights")
    cut = "optimizer states" if lay.dp_mode == "zero1" else "weights"
    where = f"; their {cut} cut over efsdp={lay.efsdp} rank(s)" if lay.efsdp > 1 else ""
    return f"experts   {moe.n_experts} routed, top-{moe.top_k}, {how}; {held}{where}"


def _compile_pricing(work: Workload, layout) -> str:
    """How the estimate prices train.compile under this layout (empty when it is off)."""
    if not work.compiled:
        return ""
    blocks = ("blocks as compiled (fused element-wise work, the compiler's saved set)" if work.compiled_blocks(layout)
              else "blocks as eager (their Linear layers run eagerly under this schedule)" if layout.split_backward
              else "blocks as eager (the ring's attention runs eagerly between compiled parts)")
    loss = "the loss compiled" if work.compiled_loss(layout) else "the loss eager (loss parallelism)"
    return f" (train.compile priced: {blocks}, {loss}; checked against one H200 run)"


def _memory_lines(cfg: Config, launch: Preflight, gpu: str | None) -> tuple[list[str], bool]:
    hw = _device(cfg, gpu, launch.layout.world)
    doc_tokens, doc_source = _mean_doc_tokens(cfg)
    work = Workload.from_config(cfg, launch.model_args, doc_tokens)
    e = estimate(work, launch.layout, hw)
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in e.memory.items() if k not in OUTSIDE_DEVICE) + "".join(
        f"; offloaded to the {where} {e.memory[k] / GiB:.2f}" for k, where in OFFLOADED if e.memory.get(k))
    fits = "fits" if e.fits else "DOES NOT FIT"
    if not e.host_ok and e.memory["total"] <= e.capacity:  # (each rank fits; the node's host memory does not)
        ranks, host = node_ranks(launch.layout, hw), hw.network.host_mem_gib
        fits += (f" the host: {ranks} ranks share its {host:.1f} GiB (90% usable)" if hw.name == "cpu" else
                 f" the host memory of a node ({host:.0f} GiB) with its {ranks} ranks' offloaded states")
    return [f"memory    on the busiest rank on {hw.name}, planner estimate (GiB): {parts}",
            f"          total {e.memory['total'] / GiB:.2f} of {e.capacity / GiB:.1f}: {fits}; "
            f"{'predicted' if e.fits else 'were it to fit,'} {e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}%"
            + (f", pipeline bubble {100 * e.bubble_share:.1f}% of the step" if e.bubble_share else "")
            + _compile_pricing(work, launch.layout) + _cpu_guess(hw),
            f"          {MEMORY_TERMS}",
            f"          {mfu_words(work)}", *(f"          {line}" for line in mfu_over_words(e.mfu)
                                              + scores_words(work, hw, launch.layout.cp_degrees[0])),
            f"          {attention_words(work, hw, launch.layout.cp_degrees[0])}{doc_source if doc_tokens else ''}",
            *(f"          {x}" for x in (ep_placement(launch.layout, hw, getattr(work.model, "n_experts", 0)), "" if
              e.fits else mask_hint(work, launch.layout, hw.name != "cpu", e.memory["total"])) if x)], e.fits


def _cpu_guess(hw: Hardware) -> str:
    """A CPU's speeds are the planner's uncalibrated guesses, off by a few times from host to host
    (a GPU's come from its datasheet and measured efficiencies): said where the figure is."""
    if hw.name != "cpu":
        return ""
    return (" (this CPU's speed is an uncalibrated guess, often a few times off: `shardline calibrate` "
            "measures it, `shardline estimate --profile` prices with that)")


def _mean_doc_tokens(cfg: Config) -> tuple[float, str]:
    """(mean training-document length, where it comes from) for the planner's attention price:
    a single prepared folder records its documents and tokens in its manifest; raw files are
    not tokenized here and mixtures mix several lengths, so those leave it unknown (0)."""
    paths = [s.path for s in cfg.data.mix] or [cfg.data.path]
    if len(paths) == 1 and is_prepared(paths[0]):
        train = read_manifest(Path(paths[0]))["splits"]["train"]
        tokens = sum(shard["tokens"] for shard in train["shards"])
        if train["documents"]:
            return tokens / train["documents"], f", from {paths[0]}'s manifest"
    return 0.0, ""


def _fp8_target(gpu: str | None) -> str | None:
    """--gpu's problem with fp8 ('' none), judged on its datasheet instead of this machine's card
    (a dry run on an A100 login node for H100s, or the reverse); None without --gpu."""
    if gpu is None or gpu not in DATASHEETS:
        return None
    if DATASHEETS[gpu].peak_tflops.get("fp8"):
        return ""
    return (f"train.precision=fp8 needs float8 GEMMs (compute capability >= 8.9, Ada/Hopper); --gpu {gpu} has "
            "none; use train.precision=bf16")


def _gpu_with_bf16(cfg: Config, gpu: str | None, ranks: int = 1) -> tuple[bool, bool]:
    """(whether the launch trains on a GPU, whether that GPU has bf16): train.precision=auto's choice,
    for the device the estimate prices (_device: --gpu's, else this machine's, else an assumed H100)."""
    if gpu:
        return gpu != "cpu", bool(get_hardware(gpu).peak_tflops.get("bf16"))
    if cfg.run.device == "cpu":
        return False, False
    if not torch.cuda.is_available():  # (priced as an assumed H100)
        return True, True
    return True, native_bf16(cuda_index(cfg.run.device, ranks))  # (the card _device prices)


def _device(cfg: Config, gpu: str | None, ranks: int = 1) -> Hardware:
    """The hardware to estimate memory for: --gpu's table entry, else this machine's card (its
    own memory: names match a table entry by a part, and an A100-SXM4-40GB is an "A100" as the
    80 GB entry is, a GH200 an "H200"), else an assumed H100."""
    if gpu:
        return get_hardware(gpu)
    if cfg.run.device == "cpu":
        return get_hardware("cpu")
    if not torch.cuda.is_available():
        return dataclasses.replace(get_hardware("h100-sxm"), name="h100-sxm (assumed; pass --gpu TYPE)")
    index = cuda_index(cfg.run.device, ranks)
    card = torch.cuda.get_device_name(index)
    sheet = local_datasheet(card)
    table = get_hardware(sheet.name if sheet else "h100-sxm")
    hw = with_local_memory(table, index)
    if sheet is not None and hw is table:
        return hw
    speeds = "" if sheet else ", an H100's speeds assumed; pass --gpu TYPE"
    return dataclasses.replace(hw, name=f"{card} ({hw.mem_gib:.1f} GiB{speeds})")


def _ranges(ids: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 6) -> '0-2, 5-6'."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)
