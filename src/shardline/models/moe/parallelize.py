"""The mixture-of-experts plan: Llama's (pipeline cut, tensor parallel for attention and
the dense blocks, activation checkpointing, FSDP/HSDP) plus where the routed experts live.

The routed experts are split, each expert whole, over the ep ranks and, under tensor
parallelism, also over the tp ranks: weights become DTensors sharded on the expert
dimension over "ep", "tp" or both (flattened ep-major as "ep_tp"), so checkpoints hold
every expert at its global index and resume under any ep or tp. Tokens reach them
through `ExpertParallel` (an all-to-all over ep; an all-reduce over tp, whose ranks
already hold the same tokens). FSDP then shards expert weights over "efsdp" (the ranks of
dp_shard x cp that hold the same experts; not the cp ranks when ep borrows them, see
parallel/dims.py), every other weight over all of dp_shard x cp.
An expert's gradient already carries the tokens of the whole ep group (they came to it
through the all-to-all), so it is summed over efsdp (and dp_replicate) only, never over
ep or tp. Under ZeRO-1 the experts stay whole (no FSDP) and the optimizer does that sum,
cutting their states over efsdp (parallel/zero1.py).

Under tp the MoE feed-forward takes the whole sequence (gathered from the sequence-
parallel shards, as the dense feed-forward's input is) and gives each rank its shard of
the output back; the router is replicated, the shared experts are split Megatron-style
(columns, then rows; under fp8 they are Float8Linear in these same plain styles, see
parallel/float8.py). Under context parallelism each MoE layer shares its sequences'
expert counts over the cp group (the per-sequence balance loss needs the whole sequence).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from shardline.config import Config
from shardline.models.llama.model import Llama, ModelArgs
from shardline.models.llama.parallelize import build_model as build_llama
from shardline.models.moe.layer import MoEFeedForward, moe_layers
from shardline.parallel.data_parallel import fsdp_policies, sum_gradients
from shardline.parallel.dims import ParallelDims
from shardline.parallel.expert.dispatch import ExpertParallel
from shardline.parallel.parallelize import BuiltModel


def build_model(cfg: Config, args: ModelArgs, dims: ParallelDims, device: torch.device) -> BuiltModel:
    return build_llama(cfg, args, dims, device, family_plan=lambda model: apply_moe(model, dims, cfg))


def apply_moe(model: Llama, dims: ParallelDims, cfg: Config) -> None:
    for layer in moe_layers(model):
        if dims.cp > 1:
            layer.seq_group = dims.submesh("cp").get_group()
        if dims.tp > 1:
            apply_tp_moe(layer, dims.submesh("tp"), cfg.parallel.sequence_parallel)
        if dims.ep > 1 or dims.tp > 1:
            split_experts(layer, dims, cfg.train.precision, cfg.memory.cpu_offload)


def apply_tp_moe(layer: MoEFeedForward, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Whole sequence in, this rank's sequence shard out; shared experts split by columns then rows."""
    seq = Shard(1) if sequence_parallel else Replicate()
    style = PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                     use_local_input=True, output_layouts=(Replicate(),),
                                     desired_output_layouts=(seq,), use_local_output=True)
    parallelize_module(layer, tp_mesh, style)
    gate = layer.router.gate
    gate.weight = torch.nn.Parameter(distribute_tensor(gate.weight.data, tp_mesh, [Replicate()], src_data_rank=None))
    if layer.shared is not None:
        parallelize_module(layer.shared, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                                   "w2": RowwiseParallel(output_layouts=Replicate())})


def split_experts(layer: MoEFeedForward, dims: ParallelDims, precision: str, cpu_offload: bool) -> None:
    """Each expert whole on one rank of ep x tp; tokens routed to it; FSDP over the rest
    (with the other units' offload policy, so offloaded runs keep the experts on the host too)."""
    name = "ep_tp" if dims.ep > 1 and dims.tp > 1 else ("ep" if dims.ep > 1 else "tp")
    mesh = dims.submesh(name)
    experts = layer.experts
    for pname, param in list(experts.named_parameters()):
        sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)  # on meta: no data moves
        experts.register_parameter(pname, torch.nn.Parameter(sharded))
    layer.dispatch = ExpertParallel(layer.moe.n_experts, dims.submesh("ep").get_group() if dims.ep > 1 else None,
                                    dims.submesh("tp").get_group() if dims.tp > 1 else None)
    if not dims.data_parallel_wrap:
        return  # no data parallelism: nothing else shares these experts (offload is FSDP2's: a unit of one)
    if dims.zero1:
        return  # ZeRO-1 keeps them whole; its optimizer sums their gradients (over efsdp under ep, zero1.py)
    shard = "efsdp" if dims.ep > 1 else ("dp_shard_cp" if dims.cp > 1 else "dp_shard")
    mesh = dims.submesh("dp_replicate", shard) if dims.dp_replicate > 1 else dims.submesh(shard)
    sum_gradients(fully_shard(experts, reshard_after_forward=dims.zero == 3,
                              **fsdp_policies(mesh, precision, cpu_offload)))
