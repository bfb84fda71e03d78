"""A Llama-family decoder that reads like the paper.

RMSNorm, rotary position embedding (Llama-3 frequency scaling optional), SwiGLU
feed-forward, multi-head / grouped-query / multi-query attention with an explicit
head_dim, optional tied embeddings. Attention runs through
F.scaled_dot_product_attention by default; the builder may install FlexAttention or
varlen attention instead (train.attention, models/attention.py).

Rotary embedding uses the "rotate half" layout (first half of each head pairs with
the second half), the same as HF transformers, so HF weights load without permuting
q/k projections.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardline.errors import ModelError
from shardline.models.loss import LinearCrossEntropy
from shardline.models.moe.args import MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = None  # None: multi-head (n_kv_heads = n_heads)
    head_dim: int | None = None  # None: dim // n_heads
    ffn_dim: int = 0  # hidden size of the SwiGLU feed-forward
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None leaves frequencies as they are.
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm on each query and key head before the rotary embedding (Qwen3)
    qkv_bias: bool = False  # bias terms on the query, key and value projections (Qwen2)
    moe: MoEArgs | None = None  # a routed feed-forward (models/moe); None: dense
    # Attention to the last this many tokens only (Mistral 7B v0.1's 4096, Phi-3-mini's 2047), as the
    # weights were trained; None: the whole sequence. The model attends to the whole sequence, which
    # is the window's result for sequences of at most this many tokens: runs are held to that.
    sliding_window: int | None = None

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model); the layout rules read it."""
        return self.moe.n_experts if self.moe else 0

    @property
    def n_moe_layers(self) -> int:
        """Blocks with a routed feed-forward: all past the dense first ones (0: a dense model)."""
        return self.n_layers - self.moe.first_dense_layers if self.moe else 0

    @property
    def moe_top_k(self) -> int:
        return self.moe.top_k if self.moe else 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def validate(self) -> list[str]:
        """Return the problems with this shape (empty when it is buildable)."""
        problems = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads > 0 and self.n_heads % self.kv_heads:
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.head_dim is None and self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        if self.head_size % 2:
            problems.append(f"head_dim={self.head_size} must be even for rotary embeddings")
        if self.moe is not None:
            problems += self.moe.validate(self.n_layers)
        for name in ("rope_theta", "norm_eps"):  # (NaN fails too: a run of NaN losses, each step skipped)
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0" + " (rms_norm_eps in HF's config.json)"
                                * (name == "norm_eps"))
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window={self.sliding_window} must be >= 1 (or none)")
        return problems


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the autocast dtype: the mean of squares underflows in bf16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 scaling if configured.

    In fp32, as Meta's and Hugging Face's code computes them: the frequencies pretrained
    weights were trained with (a float64 computation moves a third of them by an ulp, which
    grows to ~1e-2 rad of angle at position 128k)."""
    half = args.head_size // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, 2 * half, 2, dtype=torch.int64).float() / (2 * half)))
    if args.rope_scaling is None:
        return inv_freq
    s = dict(args.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
    # and the band between is interpolated smoothly (Llama 3.1 report).
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, scaled, out)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x [b, h, s, d] by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_size
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        # The attention core (q, k, v, mask) -> out: the builder may replace it with another
        # kernel (models/attention.py) or a parallel plan's (context parallelism installs one
        # that spans the ranks holding the rest of the sequence).
        self.core = sdpa_attention
        self.window = args.sliding_window

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        if self.window is not None and s > self.window and not getattr(self.core, "windowed", False):
            raise ValueError(f"{s} tokens are past this model's sliding window of {self.window}: it attends to the "
                             f"whole sequence, the window's result up to {self.window} tokens only (generate's cache "
                             "applies the window)")
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of q [b, h, s, d] on k/v [b, hk, s, d]; mask [b, 1, s, s], boolean or
    additive (sdpa_document_mask; None: causal)."""
    # The number of heads is read from the tensors, not from the config, so a
    # tensor-parallel shard (fewer local heads) runs this same code.
    group = q.shape[1] // k.shape[1]
    if group > 1 and not sdpa_takes_gqa(q, mask):
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        group = 1
    # A branch, not enable_gqa=(q heads != k heads): under torch.compile with symbolic sizes
    # that comparison is a SymBool, which SDPA refuses (a graph break); a branch is settled
    # with a guard.
    gqa = {"enable_gqa": True} if group > 1 else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **gqa)


def sdpa_takes_gqa(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the SDPA kernel these inputs get takes K/V with fewer heads (enable_gqa) itself.

    Elsewhere torch would fall back to the math kernel (O(s^2) memory), so K/V are
    repeated to the query heads instead. The CPU flash kernel takes it with a mask or
    without, fp32 or bf16, forward and backward (profiled on torch 2.13: no math
    fallback, no K/V copies). On CUDA only the flash kernel is relied on (half
    precision, no mask); torch documents GQA for flash and math there.
    """
    if q.device.type == "cpu":
        return True
    return mask is None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(args.dim, args.ffn_dim)

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size < 1:  # (a preset's 0: the tokenizer's size, filled in by interop.model_shape)
            raise ModelError(f"ModelArgs.vocab_size={args.vocab_size}: give the tokenizer's size "
                             "(dataclasses.replace(args, vocab_size=N), or model_shape(cfg.model, N))")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."L-1" keeps parameter names stable when a pipeline
        # stage deletes the layers it does not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, self.feed_forward_of(i))
                                     for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # A layout may keep the tied output as a copy of the embedding on one rank (a V-shaped
        # pipeline under FSDP: parallel/pipeline.py's hold_tied_copy); init_weights keeps it apart.
        self.tie_held_apart = False
        self.register_buffer("inv_freq", rope_frequencies(args), persistent=False)
        # How forward scores labels: the builder may set a chunked one (models/loss.py).
        self.loss = LinearCrossEntropy()

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] for input_ids [batch, seq]; given labels [batch, seq],
        their summed fp32 cross-entropy instead (self.loss: chunked, it never holds all logits).

        doc_ids [batch, seq] (optional) marks which packed document each token belongs to;
        a token then attends only to earlier tokens of its own document. positions [seq]
        (optional, default 0..seq-1) are the tokens' places in the sequence, for the
        rotary embedding: a rank holding a slice of the sequence passes its own.
        """
        h = self.tok_embeddings(input_ids)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=h.device)  # made there: no host-to-device copy
        cos, sin = self.rotary(positions, h.device)
        mask = self.attention_mask(doc_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        h = self.norm(h)
        return self.output(h) if labels is None else self.loss(h, self.output, labels)

    def feed_forward_of(self, layer: int) -> nn.Module | None:
        """The feed-forward of block `layer`; None: the dense SwiGLU (another family overrides this)."""
        return None

    def attention_mask(self, doc_ids: torch.Tensor | None):
        """What each attention core gets as its mask, made once per forward for every layer; the
        builder replaces this with the mask its core needs (it goes with Attention.core)."""
        return sdpa_document_mask(doc_ids) if doc_ids is not None else None

    def rotary(self, positions: torch.Tensor, device: torch.device):
        pos = positions.to(device=device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq.to(device))
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, device: str | torch.device = "cpu", assign=None) -> None:
        """Materialize (if built on meta) and initialise every parameter.

        Each parameter's values come from its own generator, seeded by (seed, name) on
        the CPU, so they do not depend on the device, on the order of parameters, or on
        which parameters a rank holds: a sharded or pipelined model gets exactly the
        values of the single-process one. `assign(param, full_value)` stores a full
        value into a parameter (the parallel layer passes one that keeps only the
        local shard); by default it is a plain copy.
        """
        if any(t.is_meta for t in self.parameters()) or self.inv_freq.is_meta:
            self.to_empty(device=device)
            if self.args.tie_embeddings and None not in (self.output, self.tok_embeddings) and not self.tie_held_apart:
                self.output.weight = self.tok_embeddings.weight  # to_empty gives each module its own tensor
        self.inv_freq = rope_frequencies(self.args).to(self.inv_freq.device)
        assign = assign or (lambda p, value: p.copy_(value))
        for name, p in self.named_parameters():
            # A tied output held apart from its embedding (a model cut into pieces keeps a
            # copy of it) starts from the embedding's value.
            if self.args.tie_embeddings and name == "output.weight":
                name = "tok_embeddings.weight"
            assign(p, initial_value(name, tuple(p.shape), self.args.n_layers, seed))


def initial_value(name: str, shape: tuple[int, ...], n_layers: int, seed: int) -> torch.Tensor:
    """The initial fp32 value of parameter `name`: scaled normal, as in GPT-2/Llama.

    Matmul weights get N(0, 0.02); the projections that write into the residual stream
    (wo, w2, the experts' w2) are scaled by 1/sqrt(2 * n_layers) so the residual variance does not grow
    with depth. Norm weights start at one, bias terms at zero.
    """
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask [b, 1, s, s]: True where query i may attend to key j.

    j <= i (causal) and both tokens belong to the same packed document.
    """
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def sdpa_document_mask(doc_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The document mask SDPA gets, made once per forward for every layer. On a CPU an additive
    mask [b, 1, s, s] (0 where attended, -inf elsewhere) in the dtype SDPA computes in (autocast's,
    else fp32): torch's CPU kernel turns a boolean mask into that itself in each call, and autocast
    casts an fp32 one, and either keeps each layer's copy for backward, 2-4 bytes a score a layer
    (a 2-layer model at seq 32768 held 8 GiB of them); given one of its own dtype, every layer
    shares it, with the same results bit for bit. Elsewhere the boolean mask (on CUDA, an additive
    mask's kernels and memory are not checked here). `dtype`: the compute dtype, where no autocast
    says it (calibrate's timed kernel)."""
    mask = document_causal_mask(doc_ids)
    if mask.device.type != "cpu":
        return mask
    if dtype is None:
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))
