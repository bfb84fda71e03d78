"""The shape of a mixture-of-experts feed-forward (no torch: layout rules and the planner read it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardline.config.sections import MOE_ROUTERS as ROUTERS


@dataclass(frozen=True)
class MoEArgs:
    """Routed experts (top_k of n_experts per token), optional shared experts, balancing.

    `router`: softmax scores over all experts (Mixtral, Qwen3-MoE) or independent sigmoid
    scores (DeepSeek-V3); either way the top_k scores are the tokens' mixing weights,
    renormalised to sum to one when `norm_topk`. The per-expert bias (auxiliary-loss-free
    balancing) only shifts which experts are chosen, never the weights.
    `capacity_factor` 0 is dropless; c > 0 lets each expert take ceil(c * tokens * top_k /
    n_experts) of a micro-batch's tokens and drops the rest (they skip the routed experts), in
    training only: evaluation and generation are dropless.
    """

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    shared_experts: int = 0  # always-on experts, as one SwiGLU of shared_experts x expert_ffn_dim
    first_dense_layers: int = 0  # the first layers keep a dense feed-forward (DeepSeek-V3: 3)
    router: str = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0  # multiplies the routed output (DeepSeek-V3: 2.5)
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.0  # Switch/GShard balance loss, per sequence, summed over layers
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE): mean squared log-sum-exp of router logits
    bias_update_rate: float = 0.0  # auxiliary-loss-free balancing: bias step per update, 0 = off

    def validate(self, n_layers: int) -> list[str]:
        problems = []
        if self.n_experts < 1 or self.expert_ffn_dim < 1:
            problems.append(f"moe needs n_experts >= 1 and expert_ffn_dim >= 1, got {self.n_experts}, "
                            f"{self.expert_ffn_dim}")
        if not 1 <= self.top_k <= max(self.n_experts, 1):
            problems.append(f"moe top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.router not in ROUTERS:
            problems.append(f"moe router={self.router!r} must be one of {', '.join(ROUTERS)}")
        if not 0 <= self.first_dense_layers < n_layers:  # (all of them dense: an MoE model of no MoE block)
            problems.append(f"moe.first_dense_layers={self.first_dense_layers} must be in 0..{n_layers - 1}, below "
                            f"model.n_layers={n_layers}: at {n_layers} no block has experts (lower it, or train a "
                            "dense preset)")
        for key in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "shared_experts"):
            if getattr(self, key) < 0:
                problems.append(f"moe {key}={getattr(self, key)} must be >= 0")
        return problems

    def capacity(self, tokens: int) -> int:
        """Slots per expert for `tokens` tokens (0: no limit)."""
        if not self.capacity_factor:
            return 0
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)


# HF's balance coefficient (router_aux_loss_coef) and ours weigh losses of different scale:
# ours is 1 per MoE layer at perfect balance and summed over layers (MoEFeedForward.balance_loss),
# HF's load_balancing_loss_func is top_k at balance with every layer's tokens pooled. These two
# convert a coefficient so that it pulls as hard on the other loss.


def balance_coef_from_hf(router_aux_loss_coef: float, top_k: int, moe_layers: int) -> float:
    return router_aux_loss_coef * top_k / moe_layers


def balance_coef_to_hf(aux_loss_coef: float, top_k: int, moe_layers: int) -> float:
    return aux_loss_coef * moe_layers / top_k
