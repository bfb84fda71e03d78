"""State-dict adapter: shardline Llama parameter names <-> Hugging Face LlamaForCausalLM names.

shardline's Llama uses the same "rotate half" rotary layout as transformers, so tensors
map one to one (no q/k permutation); only the names differ. shardline.interop reads and
writes HF folders through this table.
"""

from __future__ import annotations

import re

from shardline.errors import CheckpointError

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",  # Qwen2 (qkv_bias)
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3 (qk_norm)
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def hf_param_name(name: str) -> str:
    """The HF Llama tensor name of shardline parameter `name`."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}"
    raise CheckpointError(f"model parameter {name!r} has no Hugging Face Llama counterpart")
