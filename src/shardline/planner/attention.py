"""Which attention kernel a workload runs, and how much of the s x s score matrix it computes.

The trainer picks its kernel with `train.attention` (models/attention.py); the planner
resolves the choice with the trainer's own function, `resolve_attention`, for the target
it prices (a GPU entry of the table is CUDA, "cpu" is not), so the two cannot disagree.

Work is counted in 128 x 128 tiles, the granularity the kernels skip at:

* sdpa with a document mask: a dense [b, 1, s, s] mask, so the efficient-attention kernel
  computes every score (fraction 1) and the mask is an activation of b·s² bytes on a GPU
  (boolean), 4·b·s² on a CPU (additive in the compute dtype, shared by the layers; 2·b·s² under
  bf16 or fp16).
* a cp ring (parallel/context/ring.py): chunk pairs wholly in the future are skipped, with or
  without documents, and a pair inside one document runs unmasked or causal: half the
  scores for one document per row (more skipped with several, which is not priced).
* sdpa without one (is_causal, flash), and flex or varlen with one document per row: the
  causal triangle in whole tiles, (n + 1) / 2n of s² with n = ceil(s / 128): 0.5 plus the
  diagonal tiles' upper halves.
* flex with documents: the BlockMask skips every tile no pair of one document reaches.
  Tile (i, j), j < i, runs iff one document spans from the end of key tile j to the start
  of query tile i; diagonal tiles always run.
* varlen with documents: each document (its part inside the row) is its own causal
  problem of T = ceil(l / 128) tiles a side, T (T + 1) / 2 tiles; documents shorter than a
  tile still pay a whole one.

Assumption about the data: documents have exponentially distributed lengths of mean L
(`Workload.mean_doc_tokens`), laid end to end in one stream that rows cut at arbitrary
offsets (data/packing.py): document starts are a Poisson process of rate 1/L along a row.
It is the maximum-entropy length distribution for a known mean and gives closed forms;
a heavier tail (real corpora) puts more tokens in long documents, so the skip is
somewhat smaller than priced. L unknown (0) means one document per row: the plain causal
case, the most work flex or varlen can do. The exact share of pairs in one document,
causal, is (1/x)(1 - (1 - e^-x)/x) with x = s/L: 1/2 as L -> inf, L/s for L << s (twice
the L/2s of equal lengths: E[l²] = 2L² for exponential lengths).

MFU does not see any of this: model FLOPs (models/flops.py) count all s² scores of every
row (12·L·d·s per token, the PaLM convention), whichever kernel runs. Only the planner's
step time shrinks with the skipped tiles, so a kernel that skips more shows a higher MFU.
The efficiency a computed tile reaches is the device's attn_eff for every kernel (only
the dense-mask path is calibrated: calibrate/ops.py).
"""

from __future__ import annotations

import functools
import math

from shardline.models.attention import BLOCK, resolve_attention
from shardline.layout import Layout
from shardline.planner.activations import dtype_bytes
from shardline.planner.hardware import Hardware
from shardline.planner.layout import Workload


def kernel(work: Workload, hw: Hardware, ring: int = 1) -> str:
    """The kernel `work.attention` resolves to on `hw`: sdpa, flex, varlen, or context (a cp
    ring, ring > 1; under Ulysses alone the kernel runs on the gathered sequence)."""
    return resolve_attention(work.attention, work.document_mask, on_cuda=hw.name != "cpu", ring=ring)


def computed_fraction(kernel_: str, seq_len: int, document_mask: bool, mean_doc_tokens: float = 0.0) -> float:
    """Share of the s x s scores the kernel computes (before context parallelism's imbalance)."""
    if kernel_ == "context":  # the ring's own causal skip, at chunk granularity (compute.layer_times); under
        return 0.5  # documents it skips more (pairs no document spans): one document per row assumed, as flex
    if kernel_ == "sdpa":
        return 1.0 if document_mask else causal_tiles(seq_len)
    docs = mean_doc_tokens if document_mask else 0.0
    if kernel_ == "flex":
        return flex_tiles(seq_len, docs)
    if kernel_ == "varlen":
        return varlen_tiles(seq_len, docs)
    raise ValueError(f"train.attention kernel {kernel_!r} is unknown: one of sdpa, flex, varlen, context "
                     "(auto resolves to one)")


def dense_mask(kernel_: str, document_mask: bool) -> bool:
    """Whether the kernel needs the dense [b, 1, s, s] mask (flex's BlockMask and varlen's
    cumulative lengths are O(b (s/128)²) and O(documents): nothing to count; a cp ring builds a
    chunk pair's mask as the pair runs and again in its backward, and holds none)."""
    return document_mask and kernel_ == "sdpa"


def document_mask_bytes(work: Workload, layout: Layout, on_cuda: bool) -> float:
    """A micro-batch's dense [b, 1, s, s] document mask, where the kernel `work.attention` resolves to
    needs one. A ring holds none (it builds each chunk pair's as it runs); under Ulysses alone the mask
    spans the gathered sequence, s x s on every rank, however many. A score's bytes: a CPU's mask is
    additive in the compute dtype (models/llama sdpa_document_mask), a GPU's boolean."""
    kernel = resolve_attention(work.attention, work.document_mask, on_cuda, layout.cp_degrees[0])
    score = 1.0 if on_cuda else dtype_bytes(work.precision)
    return score * layout.micro_batch_size * work.seq_len ** 2 if dense_mask(kernel, work.document_mask) else 0.0


def mask_hint(work: Workload, layout: Layout, on_cuda: bool, total: float) -> str:
    """Where the dense document mask is a quarter or more of a rank's memory, what shrinks it (the
    other ways a misfit line names, activation checkpointing, a chunked loss, more cp under Ulysses,
    leave it whole); "" elsewhere."""
    mask = document_mask_bytes(work, layout, on_cuda)
    if mask < total / 4:
        return ""
    ring = "parallel.cp_mode=ring" if layout.cp > 1 else "parallel.cp=N with parallel.cp_mode=ring"
    return (f"the dense s x s document mask takes {mask / 2**30:.2f} GiB of it, whole on each rank but under a ring: "
            f"{ring} builds it a chunk pair at a time, train.document_mask=false drops it"
            + (", train.attention=flex or varlen needs none" if on_cuda else ""))


def causal_tiles(seq_len: int, block: int = BLOCK) -> float:
    """One causal document per row, in whole tiles: (n + 1) / 2n."""
    n = -(-seq_len // block)
    return (n + 1) / (2 * n)


@functools.lru_cache(maxsize=256)
def flex_tiles(seq_len: int, mean_doc_tokens: float, block: int = BLOCK) -> float:
    """Expected share of tiles the BlockMask runs; a key tile `g` tiles back needs no document
    start among the (g - 1)·block + 1 positions between it and the query tile."""
    if not _has_documents(seq_len, mean_doc_tokens):
        return causal_tiles(seq_len, block)
    n, rate = -(-seq_len // block), 1.0 / mean_doc_tokens
    below = sum((n - g) * math.exp(-rate * ((g - 1) * block + 1)) for g in range(1, n))
    return (n + below) / n**2


@functools.lru_cache(maxsize=256)
def varlen_tiles(seq_len: int, mean_doc_tokens: float, block: int = BLOCK) -> float:
    """Expected share of tiles varlen runs: sum over a row's document pieces of T(T+1)/2,
    T = ceil(piece / block), over (s / block)²."""
    if not _has_documents(seq_len, mean_doc_tokens):
        return causal_tiles(seq_len, block)
    n, rate, s = -(-seq_len // block), 1.0 / mean_doc_tokens, float(seq_len)
    tiles = sum(t * (t + 1) / 2 * (_pieces_up_to(min(t * block, s), s, rate)
                                   - _pieces_up_to((t - 1) * block, s, rate)) for t in range(1, n + 1))
    tiles += n * (n + 1) / 2 * math.exp(-rate * s)  # no document starts inside the row
    return tiles * block**2 / seq_len**2


def _pieces_up_to(length: float, s: float, rate: float) -> float:
    """Expected number of a row's document pieces no longer than `length` (< s): pieces inside
    the row (both ends starts: density (s - l) r² e^-rl) and the two cut by its ends (r e^-rl each)."""
    decay = math.exp(-rate * length)
    return rate * s * (1 - decay) - (1 - decay * (1 + rate * length)) + 2 * (1 - decay)


def within_document_share(seq_len: int, mean_doc_tokens: float) -> float:
    """The exact causal within-document share of s² (no tiles): what an ideal kernel computes."""
    if not _has_documents(seq_len, mean_doc_tokens):
        return 0.5
    x = seq_len / mean_doc_tokens
    return (1 - (1 - math.exp(-x)) / x) / x


def _has_documents(seq_len: int, mean_doc_tokens: float) -> bool:
    """Documents shorter than ~1000 rows (L > 1000 s leaves under 0.02% of pairs cut): priced."""
    return 0 < mean_doc_tokens < 1000 * seq_len
