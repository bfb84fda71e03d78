"""Apply a parallel layout to a model built on the meta device, then materialize it.

Order (as in torchtitan): tensor parallel -> activation checkpointing -> data
parallel (FSDP2 / HSDP, or DDP). Parameters are initialised after sharding, each rank
writing only its shard, with the same values the single-process model would get.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from shardline.config import Config
from shardline.parallel.activation_checkpoint import apply_ac
from shardline.parallel.data_parallel import apply_ddp, apply_fsdp
from shardline.parallel.dims import ParallelDims
from shardline.parallel.tensor_parallel import apply_tp


def assign_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Store a full (unsharded) value into a parameter, keeping only this rank's shard."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so each slices its own
        # shard locally and no collective runs.
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config, device: torch.device) -> nn.Module:
    """Shard/wrap `model` (on meta) in place and initialise it; returns the module to call.

    The returned module is `model` itself except under DDP, whose wrapper owns the
    gradient all-reduce; parameters are shared, so optimizers and checkpoints use `model`.
    """
    if dims.tp > 1:
        apply_tp(model, dims.submesh("tp"), cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel)
    apply_ac(model, cfg.memory.activation_checkpoint, cfg.memory.ac_every)
    use_ddp = dims.ddp and dims.tp == 1 and dims.pp == 1
    if dims.dp > 1 and not use_ddp:
        apply_fsdp(model, dims, cfg.train.precision, cfg.memory.cpu_offload)
    init_device = "cpu" if cfg.memory.cpu_offload and dims.dp > 1 else device
    model.init_weights(seed=cfg.train.seed, device=init_device, assign=assign_full_value)
    return apply_ddp(model, dims, device) if use_ddp else model


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, e.g. read from an HF folder, into a sharded model."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def build_model(cfg: Config, args, dims: ParallelDims, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """(model, module to call): built on meta, laid out by `dims`, initialised, and loaded
    from model.hf_path / model.init_from when set."""
    from shardline.models.factory import build_meta_model
    from shardline.resilience.checkpoint import load_weights

    model = build_meta_model(args)
    if dims.world_size > 1:
        dims.build_mesh(device)
    wrapped = parallelize(model, dims, cfg, device)
    if cfg.model.hf_path:
        _load_hf(model, cfg.model.hf_path, sharded=dims.world_size > 1)
    if cfg.model.init_from:
        load_weights(Path(cfg.model.init_from), model)  # DCP reshards to any layout
    return model, wrapped


def _load_hf(model: nn.Module, path: str, sharded: bool) -> None:
    from shardline.interop.hf import from_hf_pretrained, load_hf_weights

    if not sharded:
        load_hf_weights(model, path)
        return
    # Each rank reads the full HF weights on CPU and keeps its shard: simple, and fine for
    # fine-tuning-sized models; a rank-0 read + broadcast would use less host memory.
    full, _ = from_hf_pretrained(path)
    load_full_state_dict(model, full.state_dict())
