"""Apply a parallel layout to a model built on the meta device, then materialize it.

Order (as in torchtitan): pipeline split -> tensor parallel -> activation
checkpointing -> data parallel (FSDP2 / HSDP, or DDP). Parameters are initialised
after sharding, each rank writing only its shard, with the same values the
single-process model would get.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from shardline.config import Config
from shardline.models.llama import Llama, ModelArgs
from shardline.parallel.activation_checkpoint import apply_ac
from shardline.parallel.data_parallel import apply_ddp, apply_fsdp
from shardline.parallel.dims import ParallelDims
from shardline.parallel.pipeline import V_SHAPED, Pipeline
from shardline.parallel.tensor_parallel import apply_tp


@dataclass
class BuiltModel:
    model: Llama  # this rank's parameters (pruned to its stages under pp): optimizer, checkpoints
    forward: nn.Module | None  # the module to call (a DDP wrapper, or model); None under pp
    pipeline: Pipeline | None  # the stages and schedule under pp


def assign_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Store a full (unsharded) value into a parameter, keeping only this rank's shard."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so each slices its own
        # shard locally and no collective runs.
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def parallelize(model: Llama, args: ModelArgs, dims: ParallelDims, cfg: Config, device: torch.device) -> BuiltModel:
    """Lay out `model` (on meta) in place by `dims`, then initialise it."""
    p = cfg.parallel
    pipeline = None
    if dims.pp > 1:
        pipeline = Pipeline(model, args, dims.submesh("pp").get_local_rank(), dims.pp, p.pp_virtual_stages,
                            p.pp_schedule, dims.pp_microbatches(cfg), cfg.train.document_mask, cfg.train.seq_len)
    if dims.tp > 1:
        apply_tp(model, dims.submesh("tp"), p.sequence_parallel, p.loss_parallel)
    apply_ac(model, cfg.memory.activation_checkpoint, cfg.memory.ac_every)
    use_ddp = (dims.ddp or dims.zero1) and dims.tp == 1 and dims.pp == 1
    if dims.dp > 1 and not use_ddp:
        roots = pipeline.modules if pipeline else [model]
        apply_fsdp(model, roots, dims, cfg.train.precision, cfg.memory.cpu_offload)
    init_device = "cpu" if cfg.memory.cpu_offload and dims.dp > 1 else device
    model.init_weights(seed=cfg.train.seed, device=init_device, assign=assign_full_value)
    forward = None if pipeline else (apply_ddp(model, dims, device) if use_ddp else model)
    return BuiltModel(model, forward, pipeline)


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, e.g. read from an HF folder, into a sharded model."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def build_model(cfg: Config, args: ModelArgs, dims: ParallelDims, device: torch.device) -> BuiltModel:
    """Built on meta, laid out by `dims`, initialised, and loaded from model.hf_path or
    model.init_from when set."""
    from shardline.models.factory import build_meta_model
    from shardline.resilience.checkpoint import load_weights

    model = build_meta_model(args)
    if dims.world_size > 1:
        # Tied ends on two pp ranks need a group to sum the tied gradient (V-shaped
        # schedules put both ends on pp rank 0, where the tie stays one parameter).
        dims.build_mesh(device, embedding_group=args.tie_embeddings and cfg.parallel.pp_schedule not in V_SHAPED)
    built = parallelize(model, args, dims, cfg, device)
    if cfg.model.hf_path:
        _load_hf(model, cfg.model.hf_path, sharded=dims.world_size > 1)
    if cfg.model.init_from:
        load_weights(Path(cfg.model.init_from), model)  # DCP reshards to any layout
    return built


def _load_hf(model: nn.Module, path: str, sharded: bool) -> None:
    from shardline.interop.hf import from_hf_pretrained, load_hf_weights

    if not sharded:
        load_hf_weights(model, path)
        return
    # Each rank reads the full HF weights on CPU and keeps its shard: simple, and fine for
    # fine-tuning-sized models; a rank-0 read + broadcast would use less host memory.
    full, _ = from_hf_pretrained(path)
    load_full_state_dict(model, full.state_dict())
