"""Parameter and FLOP counts: the single source for MFU everywhere (trainer, planner).

FLOPs per token for training follow the PaLM convention:
6 N + 12 L d s, with N the parameters that take part in matmuls (the embedding
lookup is not a matmul, the output projection is), L layers, d the attention width
(heads x head_dim), s the sequence length. No causal discount, no recompute. In a
mixture-of-experts model N counts the *active* parameters: the router, the top_k
routed experts a token goes through and the shared experts.
"""

from __future__ import annotations

from shardline.models.llama import ModelArgs


def num_params(args: ModelArgs, *, active: bool = False) -> int:
    """Parameters of the model; a tied output shares the embedding's weight.

    active=True: those one token uses (in an MoE layer, top_k of the routed experts).
    """
    d, hd = args.dim, args.head_size
    attn = d * args.n_heads * hd * 2 + d * args.kv_heads * hd * 2  # wq, wo, wk, wv
    qk_norm = 2 * hd if args.qk_norm else 0
    qk_norm += (args.n_heads + 2 * args.kv_heads) * hd if args.qkv_bias else 0  # and the q, k, v biases
    ffn = args.n_layers * 3 * d * args.ffn_dim
    if args.moe is not None:
        dense = args.moe.first_dense_layers
        ffn = dense * 3 * d * args.ffn_dim + (args.n_layers - dense) * moe_ffn_params(args, active)
    embedding = args.vocab_size * d
    output = 0 if args.tie_embeddings else args.vocab_size * d
    total = args.n_layers * (attn + qk_norm + 2 * d) + ffn + d + embedding + output  # 2 d: the block norms
    return total


def moe_ffn_params(args: ModelArgs, active: bool = False) -> int:
    """One MoE feed-forward: router, routed experts (all, or top_k when active), shared experts."""
    m, d = args.moe, args.dim
    routed = (m.top_k if active else m.n_experts) * 3 * d * m.expert_ffn_dim
    return d * m.n_experts + routed + m.shared_experts * 3 * d * m.expert_ffn_dim


def matmul_params(args: ModelArgs) -> int:
    """Active parameters used in matmuls: all but the embedding lookup, the norm weights and the biases.

    A tied output still performs its matmul, so it counts once here.
    """
    d = args.dim
    norms = args.n_layers * (2 * d + (2 * args.head_size if args.qk_norm else 0)) + d
    norms += args.n_layers * (args.n_heads + 2 * args.kv_heads) * args.head_size if args.qkv_bias else 0
    lookup = 0 if args.tie_embeddings else args.vocab_size * d
    return num_params(args, active=True) - norms - lookup


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward matmuls) + 12 L d s (attention)."""
    attn_width = args.n_heads * args.head_size
    return 6.0 * matmul_params(args) + 12.0 * args.n_layers * attn_width * seq_len


def ffn_width(args: ModelArgs, active: bool = True) -> float:
    """Mean feed-forward hidden width per block, for models that size a block by one SwiGLU.

    Dense: ffn_dim. MoE: what a token computes through (active: top_k + shared experts'
    widths) or what the block holds (all experts), averaged with the dense first blocks.
    The planner prices a block with it (GEMM FLOPs, activations, parameters).
    """
    moe = getattr(args, "moe", None)
    if moe is None:
        return args.ffn_dim
    routed = moe.top_k if active else moe.n_experts
    width = (routed + moe.shared_experts) * moe.expert_ffn_dim
    dense = moe.first_dense_layers
    return (dense * args.ffn_dim + (args.n_layers - dense) * width) / args.n_layers
