"""Parameter and FLOP counts: the single source for MFU everywhere (trainer, planner).

FLOPs per token for training follow the PaLM convention:
6 N + 12 L d s, with N the parameters that take part in matmuls (the embedding
lookup is not a matmul, the output projection is), L layers, d the attention width
(heads x head_dim), s the sequence length. No causal discount, no recompute.
"""

from __future__ import annotations

from shardline.models.llama import ModelArgs


def num_params(args: ModelArgs, *, exclude_embedding: bool = False) -> int:
    """Parameters of the model; a tied output shares the embedding's weight."""
    d, hd = args.dim, args.head_size
    attn = d * args.n_heads * hd * 2 + d * args.kv_heads * hd * 2  # wq, wo, wk, wv
    ffn = 3 * d * args.ffn_dim
    per_layer = attn + ffn + 2 * d  # two RMSNorm weights
    embedding = args.vocab_size * d
    output = 0 if args.tie_embeddings else args.vocab_size * d
    total = args.n_layers * per_layer + d + embedding + output
    return total - embedding if exclude_embedding else total


def matmul_params(args: ModelArgs) -> int:
    """Parameters used in matmuls: all but the embedding lookup and the norm weights.

    A tied output still performs its matmul, so it counts once here.
    """
    d = args.dim
    norms = args.n_layers * 2 * d + d
    lookup = 0 if args.tie_embeddings else args.vocab_size * d
    return num_params(args) - norms - lookup


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward matmuls) + 12 L d s (attention)."""
    attn_width = args.n_heads * args.head_size
    return 6.0 * matmul_params(args) + 12.0 * args.n_layers * attn_width * seq_len
