"""Per-step bookkeeping of a mixture-of-experts model, for the training loop.

Each step: give the layers' balancing losses their gradient scale (that of the loss,
1 / global sequences x the fp16 loss scale: the losses are per-sequence sums), then sum
each layer's expert load over the ranks that hold distinct tokens and move the
auxiliary-loss-free bias with it; at a logging step, report the load imbalance
(busiest expert over the mean, worst layer), dropped token slots and the balance loss.

Each layer runs exactly one counted forward per micro-batch of this rank. A pipeline
schedule's first step runs one more, on the first stage's real input or on empty
tensors, to infer shapes; when a layer reports one forward too many, the first is
taken out, so the counts, and the bias updated from them, match one process exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.models.llama import ModelArgs
from shardline.models.moe.layer import moe_layers, update_bias
from shardline.parallel.collectives import reduce_over
from shardline.parallel.dims import ParallelDims


class ExpertBalance:
    def __init__(self, model: nn.Module, dims: ParallelDims, global_batch: int, args: ModelArgs | None = None,
                 seq_len: int = 0):
        self.layers = moe_layers(model)  # this rank's (a pipeline stage holds some of them)
        self.dims, self.global_batch = dims, global_batch
        index = {id(m): int(name) for name, block in getattr(model, "layers", {}).items() for m in block.modules()}
        self.ids = [index.get(id(layer)) for layer in self.layers]  # (global: a stage keeps model.layers' keys)
        self.n_layers = args.n_layers if args is not None and None not in self.ids else 0
        # (token, slot) pairs a step routes over every MoE layer (the whole model's, whichever stage logs): what
        # dropped_share counts the dropped against
        moe = args.moe if args is not None else None
        self.slots = global_batch * seq_len * moe.top_k * args.n_moe_layers if moe else 0
        self.forwards = dims.layout.micro_batches(global_batch)  # counted forwards per layer and step
        self.loads: torch.Tensor | None = None  # [layers, experts] of the last step, summed over ranks

    def begin_step(self, loss_scale: torch.Tensor) -> None:
        for layer in self.layers:
            layer.aux_grad_scale.copy_(loss_scale.detach() / self.global_batch)
            for buffer in (layer.load, layer.dropped, layer.aux_value, layer.forwards):
                buffer.zero_()

    def end_step(self) -> None:
        """Sum the step's expert load over the batch's ranks (one small all-reduce)."""
        if not self.layers:
            return
        for layer in self.layers:
            # 1 where the layer ran a schedule's shape-inference forward, else 0: a mask, not
            # an `if`, so the step never waits for the device to say which.
            extra = (layer.forwards == self.forwards + 1).to(layer.first.dtype)
            n = layer.moe.n_experts
            layer.load -= extra * layer.first[:n]
            layer.dropped -= extra * layer.first[n]
            layer.aux_value += torch.where(extra > 0, torch.zeros_like(layer.aux_value), layer.first[n + 1])
        loads = torch.stack([layer.load for layer in self.layers])
        self.loads = reduce_over(self.dims, self.dims.batch_dim, loads, "sum")

    def update_biases(self, skipped: bool, flagged: torch.Tensor | None = None) -> None:
        """Move the expert biases by the step's load, as the optimizer moves the weights: not
        on a step whose update was skipped (an fp16 overflow, an anomaly; `flagged`: the
        device check's 1.0/0.0 verdict, applied without reading it), whose load a NaN or a
        spike may have thrown anywhere."""
        if skipped or self.loads is None:
            return
        for layer, load in zip(self.layers, self.loads):
            if layer.moe.bias_update_rate:
                update_bias(layer, load, flagged)

    def _by_layer(self, device: torch.device) -> torch.Tensor | None:
        """[n_layers] the busiest expert's load over the mean in each of this rank's MoE layers, at its
        global index (0 elsewhere: a pipeline's stages sum theirs, a stage of dense layers alone adding
        zeros); None, alike on every rank, where the model does not say its layers' indices."""
        if not self.n_layers:
            return None
        out = torch.zeros(self.n_layers, device=device)
        if self.layers and self.loads is not None:
            out[self.ids] = self.loads.max(1).values / self.loads.mean(1).clamp(min=1e-9)
        return out

    def log_values(self) -> dict[str, float]:
        """The last step's load imbalance, dropped slots (and their share of the step's) and mean
        balance loss per sequence (all ranks)."""
        device = self.layers[0].load.device if self.layers else torch.device("cpu")
        imbalance = torch.zeros((), device=device)
        sums = torch.zeros(2, device=device)
        if self.layers and self.loads is not None:
            imbalance = (self.loads.max(1).values / self.loads.mean(1).clamp(min=1e-9)).max()
            sums = torch.stack([sum(layer.dropped for layer in self.layers),
                                sum(layer.aux_value for layer in self.layers)]).float()
            sums = reduce_over(self.dims, self.dims.batch_dim, sums, "sum")
        by_layer = self._by_layer(device)
        if self.dims.pp > 1:  # each stage holds other layers
            imbalance = reduce_over(self.dims, "pp", imbalance, "max")
            sums = reduce_over(self.dims, "pp", sums, "sum")
            by_layer = reduce_over(self.dims, "pp", by_layer, "sum") if by_layer is not None else None
        return {"expert_load_max": imbalance.item(), "dropped_tokens": sums[0].item(),
                **({"expert_load_by_layer": {str(i): round(v, 4) for i, v in enumerate(by_layer.tolist()) if v}}
                   if by_layer is not None else {}),
                **({"dropped_share": sums[0].item() / self.slots} if self.slots else {}),
                "aux_loss": sums[1].item() / self.global_batch}
