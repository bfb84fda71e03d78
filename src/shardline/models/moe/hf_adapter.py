"""State-dict adapter: shardline MoE parameter names <-> Hugging Face Mixtral and Qwen3-MoE names.

Attention, norms, embedding and output keep Llama's names (models/llama/hf_adapter.py);
Qwen3-MoE adds a norm on each query and key head. The routed feed-forward differs:
shardline stacks the experts into one [n_experts, out, in] tensor per projection (what a
grouped matmul and expert parallelism want), while the hub's checkpoints hold one tensor
per expert. One shardline parameter therefore maps to n_experts HF tensors, stacked on
dim 0 in expert order; the orientation ([out, in], as nn.Linear) is the same, so no
transpose is needed. Per MoE layer i:

    shardline                                 Mixtral (model.layers.{i}.)        Qwen3-MoE (model.layers.{i}.)
    feed_forward.router.gate.weight           block_sparse_moe.gate.weight       mlp.gate.weight
    feed_forward.experts.w1 [E, ffn, dim]     block_sparse_moe.experts.{j}.w1    mlp.experts.{j}.gate_proj
    feed_forward.experts.w3 [E, ffn, dim]     block_sparse_moe.experts.{j}.w3    mlp.experts.{j}.up_proj
    feed_forward.experts.w2 [E, dim, ffn]     block_sparse_moe.experts.{j}.w2    mlp.experts.{j}.down_proj
    attention.{q,k}_norm.weight               (none)                             self_attn.{q,k}_norm.weight

(each HF name ends in `.weight`). These per-expert names are what transformers 4.x
modeling code uses and what transformers 5 both saves and converts on load (it fuses
the experts internally), so a folder written with them loads in either.
The router's `expert_bias` buffer (auxiliary-loss-free balancing) has no HF counterpart.
"""

from __future__ import annotations

import re

from shardline.errors import CheckpointError
from shardline.models.llama.hf_adapter import hf_param_name
from shardline.models.llama.model import ModelArgs

FAMILIES = ("mixtral", "qwen3_moe")
_MOE_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
_EXPERT_NAMES = {
    "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
    "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_DISPLAY = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}


def hf_family(args: ModelArgs) -> str:
    """The HF model_type that holds an MoE shape exactly ("mixtral" or "qwen3_moe").

    Qwen3-MoE is the one with per-head q/k norms (and it alone allows dense first layers
    and unnormalised top-k weights); Mixtral has none of the three. Neither has shared
    experts, sigmoid routing or a routed-output scale.
    """
    m = args.moe
    if m is None:
        raise CheckpointError("the model is dense: it has no Mixtral or Qwen3-MoE counterpart (export it as Llama)")
    unsupported = [f"{key}={value!r}" for key, value, ok in (
        ("shared_experts", m.shared_experts, m.shared_experts == 0),
        ("router", m.router, m.router == "softmax"),
        ("route_scale", m.route_scale, m.route_scale == 1.0)) if not ok]
    mixed = (f"; and first_dense_layers={m.first_dense_layers}, norm_topk={m.norm_topk} without qk_norm fit "
             "neither (Mixtral has no dense layers and normalises top-k; Qwen3-MoE has qk_norm=true): train with "
             "moe.first_dense_layers=0 and moe.norm_topk=1 for Mixtral, or model.qk_norm=1 for Qwen3-MoE"
             if not args.qk_norm and (m.first_dense_layers or not m.norm_topk) else "")
    if unsupported:  # (every blocker at once: one retrained for the first met the next)
        raise CheckpointError(f"moe {', '.join(unsupported)} has no Hugging Face Mixtral or Qwen3-MoE "
                              "counterpart (they need shared_experts=0, router='softmax', route_scale=1: train "
                              f"with moe.shared_experts=0, moe.router='softmax', moe.route_scale=1){mixed}")
    if mixed:
        raise CheckpointError(f"moe {mixed.removeprefix('; and ')}")
    return "qwen3_moe" if args.qk_norm else "mixtral"


def hf_param_names(name: str, family: str, n_experts: int) -> str | list[str]:
    """The HF tensor(s) of shardline parameter `name`: one name, or a list of one per expert.

    A list means the parameter is the HF tensors stacked on dim 0, expert j at index j.
    """
    m = _LAYER_RE.fullmatch(name)
    if m:
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in ("attention.q_norm.weight", "attention.k_norm.weight") and family == "qwen3_moe":
            return prefix + "self_attn." + rest.removeprefix("attention.")
        block = prefix + _MOE_BLOCK[family]
        if rest == "feed_forward.router.gate.weight":
            return f"{block}.gate.weight"
        if rest.startswith("feed_forward.experts."):
            hf = _EXPERT_NAMES[family].get(rest.removeprefix("feed_forward.experts."))
            if hf is not None:
                return [f"{block}.experts.{j}.{hf}.weight" for j in range(n_experts)]
        if rest.startswith("feed_forward.w") and family == "mixtral":
            raise CheckpointError(f"model parameter {name!r} belongs to a dense feed-forward, which Mixtral "
                                  "does not have (every Mixtral layer is a mixture of experts)")
    try:
        return hf_param_name(name)
    except CheckpointError:
        raise CheckpointError(f"model parameter {name!r} has no Hugging Face {_DISPLAY[family]} "
                              "counterpart") from None
