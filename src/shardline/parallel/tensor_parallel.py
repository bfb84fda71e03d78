"""Tensor parallelism (Megatron 1-D) with sequence parallelism and loss parallelism.

q/k/v and w1/w3 are split by output columns, o and w2 by input rows, so each block
needs one reduction after attention and one after the feed-forward. With sequence
parallelism the norms and residual stream stay sharded along the sequence and those
reductions become reduce-scatters (plus all-gathers before the column-parallel
layers) — the same bytes as an all-reduce, a t-th of the activation memory. The
output projection is split over the vocabulary; with loss parallelism the
cross-entropy runs on the vocab-sharded logits without gathering them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


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
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            # Gather the sequence before the column-parallel projections. Only x is a
            # DTensor; the rotary tables and the mask are plain, identical on every rank.
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                   desired_input_layouts=(Replicate(), None, None, None),
                                                   use_local_output=True)
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
