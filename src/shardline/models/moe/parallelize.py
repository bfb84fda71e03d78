"""The mixture-of-experts plan: Llama's (pipeline cut, tensor parallel, activation
checkpointing, FSDP/HSDP) plus where the routed experts live.

Expert parallelism (ep > 1): each ep rank holds n_experts / ep experts. Their weights
become DTensors sharded on the expert dimension over the "ep" mesh, so checkpoints hold
every expert at its global index and resume under any ep. FSDP then shards them over
"efsdp" (the ranks of dp_shard x cp that hold the same experts), while every other
weight is sharded over all of dp_shard x cp as usual. An expert's gradient already
carries the tokens of the whole ep group (they came to it through the all-to-all), so
it is summed over efsdp (and dp_replicate) only, never over ep.

Tensor parallelism does not split the experts (not built: ep with tp is rejected by the
layout rules). Under context parallelism each MoE layer shares its sequences' expert
counts over the cp group (the per-sequence balance loss needs the whole sequence).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from shardline.config import Config
from shardline.models.llama.model import Llama, ModelArgs
from shardline.models.llama.parallelize import build_model as build_llama
from shardline.models.moe.layer import MoEFeedForward, moe_layers
from shardline.parallel.data_parallel import _PARAM_DTYPES, _sum_gradients
from shardline.parallel.dims import ParallelDims
from shardline.parallel.expert.dispatch import ExpertParallel
from shardline.parallel.parallelize import BuiltModel


def build_model(cfg: Config, args: ModelArgs, dims: ParallelDims, device: torch.device) -> BuiltModel:
    return build_llama(cfg, args, dims, device, family_plan=lambda model: apply_moe(model, dims, cfg))


def apply_moe(model: Llama, dims: ParallelDims, cfg: Config) -> None:
    for layer in moe_layers(model):
        if dims.cp > 1:
            layer.seq_group = dims.submesh("cp").get_group()
        if dims.ep > 1:
            apply_ep(layer, dims, cfg.train.precision)


def apply_ep(layer: MoEFeedForward, dims: ParallelDims, precision: str) -> None:
    """Split the layer's routed experts over ep, route tokens to them, shard them over the rest of dp_shard."""
    ep_mesh = dims.submesh("ep")
    experts = layer.experts
    for name, param in list(experts.named_parameters()):
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)  # on meta: no data moves
        experts.register_parameter(name, torch.nn.Parameter(sharded))
    layer.dispatch = ExpertParallel(ep_mesh.get_group(), layer.moe.n_experts)
    mesh = dims.submesh("dp_replicate", "efsdp") if dims.dp_replicate > 1 else dims.submesh("efsdp")
    mp = MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES[precision], reduce_dtype=torch.float32)
    _sum_gradients(fully_shard(experts, mesh=mesh, mp_policy=mp, reshard_after_forward=dims.zero == 3))
