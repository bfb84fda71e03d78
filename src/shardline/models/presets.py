"""Named model shapes. Published ones match their HF config.json files (the MoE balance
loss's coefficient rescaled to our normalisation of that loss).

`tiny` takes its vocabulary size from the tokenizer (vocab_size=0 here means
"fill in from the tokenizer"); the Llama shapes keep their published vocabulary.
"""

from __future__ import annotations

from shardline.errors import ConfigError
from shardline.models.llama import ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.args import balance_coef_from_hf

_LLAMA31_SCALING = (
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192.0),
)
_LLAMA32_SCALING = (
    ("factor", 32.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192.0),
)

PRESETS: dict[str, ModelArgs] = {
    # ~5.2 M parameters with a 4096-token vocabulary: trains on two CPU cores.
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=0, ffn_dim=768,
                      max_seq_len=1024, rope_theta=10000.0),
    "llama3.2-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             ffn_dim=8192, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                             max_seq_len=131072, tie_embeddings=True),
    # HuggingFaceTB/SmolLM-135M: a Llama shape, 134.5 M parameters (its output tied to the embedding).
    "smollm-135m": ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, ffn_dim=1536,
                             rope_theta=10000.0, max_seq_len=2048, tie_embeddings=True),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                            ffn_dim=28672, rope_theta=500000.0, max_seq_len=8192),
    "llama3-405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                             ffn_dim=53248, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                             max_seq_len=131072),
    # Mixture-of-experts. tiny-moe: 8 experts (2 per token) plus one shared, a dense first
    # block, the balance loss on; 8.8 M parameters (4096 vocabulary), 5.3 M active per token.
    "tiny-moe": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=0, ffn_dim=768,
                          max_seq_len=1024, rope_theta=10000.0,
                          moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=256, shared_experts=1,
                                      first_dense_layers=1, aux_loss_coef=0.01)),
    "mixtral-8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=14336,
                              rope_theta=1e6, max_seq_len=32768,
                              moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=14336,
                                          aux_loss_coef=balance_coef_from_hf(0.02, top_k=2, moe_layers=32))),
    "qwen3-moe-30b-a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                                   vocab_size=151936, ffn_dim=6144, norm_eps=1e-6, rope_theta=1e6,
                                   max_seq_len=40960, qk_norm=True,
                                   moe=MoEArgs(n_experts=128, top_k=8, expert_ffn_dim=768,
                                               aux_loss_coef=balance_coef_from_hf(0.001, top_k=8, moe_layers=48))),
}


def get_preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ConfigError(f"model.preset={name!r} is invalid: one of {', '.join(PRESETS)}")  # (as preflight's)
    return PRESETS[name]
