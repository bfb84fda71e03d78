"""Llama's parallel plan: pipeline split -> tensor parallel -> activation checkpointing
-> data parallel (FSDP2 / HSDP, or DDP), in torchtitan's order, then initialisation.

Tensor parallelism (Megatron 1-D) with sequence parallelism and loss parallelism:

q/k/v and w1/w3 are split by output columns, o and w2 by input rows, so each block
needs one reduction after attention and one after the feed-forward. With sequence
parallelism the norms and residual stream stay sharded along the sequence and those
reductions become reduce-scatters (plus all-gathers before the column-parallel
layers) — the same bytes as an all-reduce, a t-th of the activation memory. The
output projection is split over the vocabulary; with loss parallelism the
cross-entropy runs on the vocab-sharded logits without gathering them.

Under train.precision=fp8 the block projections are Float8Linear (converted on meta,
before this) and take the same plain styles under both recipes: each casts its DTensor
operands with scales reduced across tp, so ranks quantise as one process would; torchao's
float8 styles are not used (their float8 all-gather cannot run on gloo; parallel/float8.py).
"""

from __future__ import annotations

import re

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardline.config import Config
from shardline.errors import ModelError
from shardline.layout import V_SHAPED
from shardline.models.attention import attention_core, resolve_attention, use_attention
from shardline.models.factory import build_meta_model
from shardline.models.flops import num_params
from shardline.models.llama.model import FeedForward, Llama, ModelArgs
from shardline.models.loss import LinearCrossEntropy
from shardline.parallel import float8
from shardline.parallel.activation_checkpoint import apply_ac
from shardline.parallel.compile import apply_compile, options as compile_options
from shardline.parallel.context.attention import ContextParallel
from shardline.parallel.context.sharding import SequenceSplit
from shardline.parallel.data_parallel import apply_ddp, apply_fsdp
from shardline.parallel.dims import ParallelDims
from shardline.parallel.parallelize import BuiltModel, assign_full_value
from shardline.parallel.pipeline import Pipeline, hold_tied_copy


def build_model(cfg: Config, args: ModelArgs, dims: ParallelDims, device: torch.device,
                family_plan: Callable[[Llama], None] | None = None) -> BuiltModel:
    """Built on meta, laid out by `dims` and initialised (starting weights are loaded
    afterwards, by shardline.interop.weights). `family_plan`: what a family built on
    Llama's blocks adds (e.g. expert parallelism), run after tensor parallelism, before
    activation checkpointing wraps the blocks and data parallelism shards them."""
    model = build_meta_model(args)
    held, counted = sum(p.numel() for p in model.parameters()), num_params(args)  # (on meta: no memory)
    if held != counted:  # (a module added to the model, not to the count: MFU, the planner and the logs read it)
        raise ModelError(f"the model holds {held:,} parameters where models/flops.num_params counts {counted:,}: "
                         "a module added to the model needs its count there too")
    if dims.needs_mesh:
        # Tied ends on two pp ranks need a group to sum the tied gradient (V-shaped
        # schedules put both ends on pp rank 0, where the tie stays one parameter).
        dims.build_mesh(device, embedding_group=args.tie_embeddings and cfg.parallel.pp_schedule not in V_SHAPED)
    return parallelize(model, args, dims, cfg, device, family_plan)


def parallelize(model: Llama, args: ModelArgs, dims: ParallelDims, cfg: Config, device: torch.device,
                family_plan: Callable[[Llama], None] | None = None) -> BuiltModel:
    """Lay out `model` (on meta) in place by `dims`, then initialise it."""
    p = cfg.parallel
    pipeline = context = None
    use_ddp = (dims.ddp or dims.zero1) and dims.tp == 1 and dims.pp == 1 and not dims.zero1_scatters
    # Offload is FSDP2's, so it shards at any degree (one rank too: Layout.offload_fsdp).
    fsdp = dims.data_parallel_wrap and not use_ddp and not dims.zero1_scatters  # that optimizer reduces (zero1.py)
    model.loss = LinearCrossEntropy(cfg.train.loss_chunk_tokens)  # before the pipeline's stages copy it
    if cfg.train.precision == "fp8":  # on meta, before anything lays the Linear layers out
        float8.convert(model, cfg.fp8.recipe, emulate=device.type != "cuda",
                       fsdp_all_gather=cfg.fp8.fsdp_all_gather and fsdp and not cfg.memory.cpu_offload,
                       split_backward=dims.layout.split_backward, tp=dims.tp, shard=dims.dp_shard * dims.cp)
    if dims.cp > 1:  # before the pipeline cuts the model: its stages take the cp attention and mask
        context = apply_cp(model, dims, cfg.train.seq_len, cfg.train.attention, cfg.train.document_mask, device)
    else:  # the same, for the kernel train.attention picks (a ring has its own; preflight refuses flex/varlen there)
        use_attention(model, cfg.train.attention, cfg.train.document_mask, device)
    if dims.pp > 1:
        positions = context.local_positions() if context else torch.arange(cfg.train.seq_len)
        pipeline = Pipeline(model, args, dims.submesh("pp").get_local_rank(), dims.pp, p.pp_virtual_stages,
                            p.pp_schedule, dims.layout.pp_microbatches, cfg.train.document_mask, positions)
        if fsdp:  # each stage is an FSDP unit: a V shape's two ends of a tied weight get a parameter each
            hold_tied_copy(model)
    if dims.tp > 1:
        apply_tp(model, dims.submesh("tp"), p.sequence_parallel, p.loss_parallel)
    if family_plan is not None:
        family_plan(model)
    if dims.tp > 1:
        refuse_unplanned(model, p.sequence_parallel)
    # Compile after AC (the checkpoint traced with the block), except under tp, where the
    # checkpoint wraps the compiled forward (parallel/compile.py); always before FSDP (hooks outside).
    compiled = compile_options(dims.layout, cfg.memory.activation_checkpoint)
    if cfg.train.compile and compiled["forward_only"]:
        apply_compile(model, **compiled)
    apply_ac(model, cfg.memory.activation_checkpoint, cfg.memory.ac_every)
    if cfg.train.compile and not compiled["forward_only"]:
        apply_compile(model, **compiled)
    if cfg.train.compile and pipeline is not None:  # its stages took the loss before it was compiled
        pipeline.use_loss(model.loss)
    if fsdp:
        roots = pipeline.modules if pipeline else [model]
        apply_fsdp(model, roots, dims, cfg.train.precision, cfg.memory.cpu_offload)
    offload = fsdp and cfg.memory.cpu_offload  # the states live on the host, the buffers on the device
    model.init_weights(seed=cfg.train.seed, device="cpu" if offload else device, assign=assign_full_value)
    if offload:
        move_buffers(model, device)
    forward = None if pipeline else (apply_ddp(model, dims, device) if use_ddp else model)
    return BuiltModel(model, forward, pipeline, context)


def refuse_unplanned(model: nn.Module, sequence_parallel: bool) -> None:
    """Under sequence parallelism every parameter is a DTensor its plan laid out. One no style
    reached stays a plain tensor on each rank whose module sees this rank's tokens alone, so its
    gradient differs across the tp ranks and their copies drift apart, in silence. Without it the
    norms stay plain on the replicated stream, as one process computes them; but one inside a block's
    attention or feed-forward sees this rank's heads or columns alone, and drifts the same way (a
    module is planned by its name: a bare parameter goes in a small module of its own)."""
    inside = re.compile(r"(^|\.)layers\.\d+\.(attention|feed_forward)\.")
    plain = [name for name, param in model.named_parameters()
             if not isinstance(param, DTensor) and (sequence_parallel or inside.search(name))]
    if plain:
        raise ModelError(f"parameter {plain[0]} has no tensor-parallel layout ({len(plain)} such): a module added "
                         "to the model needs its entry in apply_tp's plan in models/llama/parallelize.py (a norm: "
                         "SequenceParallel; a projection: ColwiseParallel or RowwiseParallel; a bare parameter: "
                         "wrapped in a module of its own)"
                         + (", or parallel.sequence_parallel=false" if sequence_parallel and not inside.search(plain[0])
                            else ""))


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (the rotary frequencies, ...) to the compute device: FSDP2 moves only the
    parameters it manages, and under offload the model was materialised on the host."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def apply_cp(model: Llama, dims: ParallelDims, seq_len: int, attention: str, document_mask: bool,
             device: torch.device) -> ContextParallel:
    """Every attention core spans the cp ranks; the mask becomes what that core needs. Under
    Ulysses alone the kernel `attention` resolves to runs on the gathered sequence."""
    lay = dims.layout
    ring, ulysses = lay.cp_degrees
    on_cuda = device.type == "cuda"
    kernel = resolve_attention(attention, document_mask, on_cuda, ring)
    local = attention_core(kernel, on_cuda) if kernel != "context" else None
    context = ContextParallel(SequenceSplit(seq_len, ring, ulysses, lay.cp_balance), dims.submesh("cp").get_group(),
                              dims.submesh("cp_ring").get_group() if ring > 1 else None,
                              dims.submesh("cp_ulysses").get_group() if ulysses > 1 else None, local)
    model.attention_mask = context.mask
    for block in model.layers.values():
        block.attention.core = context.attend
    return context


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    seq = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
        "norm": SequenceParallel() if sequence_parallel else None,
    }
    # A pipeline stage may lack the embedding or the output head.
    top = {name: style for name, style in top.items() if style is not None and getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    if model.args.tie_embeddings and None not in (model.output, model.tok_embeddings) and not model.tie_held_apart:
        # Each style made its module's weight a DTensor of its own (both Shard(0): by vocabulary);
        # tied again, FSDP sees one parameter, not one gathered and reduced twice per step.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if hasattr(block.attention, "q_norm"):
            # The q/k norms see this rank's heads only ([b, h, s, d]: dim 1): a weight replicated
            # over tp whose gradient is summed over the ranks' heads, as one process computes it.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        dense = isinstance(block.feed_forward, FeedForward)  # another family's feed-forward has its own plan
        if dense:
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                         "feed_forward.w2": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            # Gather the sequence before the column-parallel projections. Only x is a
            # DTensor; the rotary tables and the mask are plain, identical on every rank.
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                   desired_input_layouts=(Replicate(), None, None, None),
                                                   use_local_output=True)
            if dense:
                plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Replicate(),), use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
