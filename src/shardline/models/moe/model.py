"""A mixture-of-experts decoder: Llama's blocks with a routed feed-forward.

Every block from `first_dense_layers` on swaps its SwiGLU for `MoEFeedForward`; the
attention, norms, embedding and output are Llama's, so every parallel plan of the dense
family (FSDP, pipeline cuts, activation checkpointing, context parallelism) applies
unchanged, and expert parallelism only adds where the experts live.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.models.llama.model import Llama, ModelArgs
from shardline.models.moe.layer import MoEFeedForward, moe_layers


class MoETransformer(Llama):
    def __init__(self, args: ModelArgs):
        if args.moe is None:
            raise ValueError("MoETransformer needs ModelArgs.moe")
        super().__init__(args)

    def feed_forward_of(self, layer: int) -> nn.Module | None:
        return MoEFeedForward(self.args) if layer >= self.args.moe.first_dense_layers else None

    @torch.no_grad()
    def init_weights(self, seed: int = 0, device: str | torch.device = "cpu", assign=None) -> None:
        super().init_weights(seed, device, assign)
        for layer in moe_layers(self):  # buffers left empty by materialising the meta model
            for buffer in (layer.router.expert_bias, layer.aux_grad_scale, layer.load, layer.dropped,
                           layer.aux_value, layer.forwards, layer.first):
                buffer.zero_()
