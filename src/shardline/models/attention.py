"""Attention kernels for packed documents (`train.attention`): which one runs, the mask
it needs, and the core that runs it.

A packed sequence holds several documents and a token attends only to earlier tokens
of its own document. Three ways to compute that:

- sdpa: F.scaled_dot_product_attention with a dense [b, 1, s, s] mask (additive, in the
  compute dtype, on a CPU, shared by every layer; boolean elsewhere), or
  is_causal without documents (the model's own core, models/llama/model.py). Runs
  anywhere; but on CUDA a mask rules out the flash kernel, and the mask is O(s^2).
- flex: FlexAttention with a BlockMask made once per forward from the document ids
  and shared by every layer: 128 x 128 blocks no pair of one document reaches are
  skipped, blocks inside one document run without the mask. Compiled on CUDA.
  FlexAttention has no backward on CPU (torch 2.13), so preflight refuses it there.
- varlen: varlen_attn (flash) on the documents laid end to end, [tokens, heads, d] with
  cumulative lengths, causal inside each. CUDA and half precision only.

Document ids are contiguous runs, non-decreasing along a row (data/packing.py numbers
documents in stream order and lays a chat row's out in it): the block classification and the cumulative lengths rely
on it. The builder (models/llama/parallelize.py) installs the choice the way context
parallelism installs its own: `model.attention_mask` and every `Attention.core`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shardline.models.llama.model import sdpa_attention, sdpa_document_mask

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

KERNELS = ("sdpa", "flex", "varlen")
BLOCK = 128  # FlexAttention's default block size
_NEEDS_CUDA = {"flex": "FlexAttention has no backward on CPU in torch 2.13",
               "varlen": "varlen_attn's flash kernel runs on CUDA only"}


def resolve_attention(choice: str, document_mask: bool, on_cuda: bool, ring: int = 1) -> str:
    """The kernel `train.attention = choice` runs: one of KERNELS, or "context" under a
    context-parallel ring (`ring` > 1: its own blocks, parallel/context; preflight refuses
    flex/varlen there). Under Ulysses alone (cp_mode=ulysses) the whole sequence is local
    after the all-to-all, and the kernel chosen here runs on it.

    auto: on CUDA, flex for packed documents and SDPA's causal flash kernel without them;
    on CPU, SDPA. Flex rather than varlen for documents: on one H200 at the 1B shape they ran
    within 1% of each other (benchmarks/RESULTS.md), and flex also takes fp32, and its block
    mask needs no host sync where varlen needs the longest document's length.
    """
    if ring > 1:
        return "context"
    if choice != "auto":
        return choice
    return "flex" if on_cuda and document_mask else "sdpa"


def describe_attention(choice: str, document_mask: bool, on_cuda: bool, ring: int = 1, ulysses: int = 1) -> str:
    """What a launch attends with, for the dry run: the kernel, its mask, and the key that chose it."""
    kernel = resolve_attention(choice, document_mask, on_cuda, ring)
    how = {"sdpa": "dense document mask" if document_mask else "causal, no mask",
           "flex": "block mask from document ids" if document_mask else "causal block mask",
           "varlen": "cumulative document lengths" if document_mask else "one document per row",
           "context": "context parallelism's ring (parallel/context)"}[kernel]
    where = f", after Ulysses' all-to-all over {ulysses} ranks" if ulysses > 1 and kernel != "context" else ""
    return f"{kernel}: {how}{where} (train.attention={choice}, {'CUDA' if on_cuda else 'CPU'})"


def config_problem(choice: str, precision: str) -> str | None:
    """What the config alone rules out for `train.attention` (one line), else None. With
    context parallelism it is a layout rule (layout.NOT_BUILT), which the planner shares."""
    if choice == "varlen" and varlen_attn is None:
        return (f"train.attention='varlen' needs torch.nn.attention.varlen (torch >= 2.10; this is "
                f"{torch.__version__}); use one of auto, sdpa, flex")
    if choice == "varlen" and precision == "fp32":
        return ("train.attention='varlen' needs train.precision bf16, fp16 or fp8 (its flash kernel has no "
                "fp32) and a CUDA device (train.precision=auto settles fp32 on a CPU); use one of auto, sdpa, flex "
                "(on a CPU: auto, sdpa)")
    return None


def device_problem(choice: str, on_cuda: bool) -> str | None:
    """What training on this machine rules out for `train.attention` (one line), else None."""
    if choice in _NEEDS_CUDA and not on_cuda:
        return (f"train.attention={choice!r} trains on CUDA only ({_NEEDS_CUDA[choice]}); on CPU use one of "
                "auto, sdpa")
    return None


def attention_core(kernel: str, on_cuda: bool) -> "DenseAttention | FlexAttention | VarlenAttention":
    """The object behind a kernel name: `mask(doc_ids)` once per forward, `attend(q, k, v, mask)`
    in every block. Context parallelism runs it after Ulysses' all-to-all too."""
    if kernel not in KERNELS:  # (a kernel named in the config and not here would train as SDPA, in silence)
        raise ValueError(f"attention kernel {kernel!r} has no core: one of {', '.join(KERNELS)}")
    if kernel == "flex":
        return FlexAttention(compiled=on_cuda)
    return VarlenAttention() if kernel == "varlen" else DenseAttention()


def use_attention(model: nn.Module, choice: str, document_mask: bool, device: torch.device) -> str:
    """Install the kernel `choice` resolves to on `model` (every block's core and the model's
    mask), before a pipeline cuts it: its stages build their mask with the model's. Returns
    the kernel; sdpa keeps the model's own core and mask."""
    on_cuda = device.type == "cuda"
    kernel = resolve_attention(choice, document_mask, on_cuda)
    if kernel == "sdpa":
        return kernel
    impl = attention_core(kernel, on_cuda)
    model.attention_mask = impl.mask
    for block in model.layers.values():
        block.attention.core = impl.attend
    return kernel


class DenseAttention:
    """SDPA with the dense [b, 1, s, s] document mask (None: causal): the model's own core,
    as an object with the others' `mask` / `attend`."""

    def mask(self, doc_ids: torch.Tensor | None) -> torch.Tensor | None:
        return sdpa_document_mask(doc_ids) if doc_ids is not None else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return sdpa_attention(q, k, v, mask)


# ---- flex -----------------------------------------------------------------------------


def document_mask_mod(doc_ids: torch.Tensor) -> Callable:
    """FlexAttention's mask_mod: query q may see key k of row b when k <= q in one document."""
    def mask_mod(b, h, q, k):
        return (q >= k) & (doc_ids[b, q] == doc_ids[b, k])
    return mask_mod


def causal_mask_mod(b, h, q, k):
    """FlexAttention's mask_mod of one document per row."""
    return q >= k


def document_block_mask(doc_ids: torch.Tensor, block: int = BLOCK, mask_mod: Callable | None = None) -> BlockMask:
    """The BlockMask of doc_ids [b, s], from each block's first and last document alone
    (O(b (s/block)^2), never the [s, s] mask).

    Key block j < query block i holds a pair of one document iff its last document is the
    query block's first (documents only grow along a row); the diagonal always does. A block
    is full (no mask_mod needed) when both blocks are whole and within one document.
    `mask_mod` (default document_mask_mod(doc_ids)) decides inside the other blocks.
    """
    b, s = doc_ids.shape
    n = -(-s // block)
    starts = torch.arange(n, device=doc_ids.device) * block
    first, last = doc_ids[:, starts], doc_ids[:, (starts + block).clamp(max=s) - 1]
    qi, kj = starts[:, None] // block, starts[None, :] // block
    reach = (kj <= qi) & (last[:, None, :] >= first[:, :, None])
    whole_blocks = (qi < n - 1) & (kj < n - 1) if s % block else torch.ones_like(reach[0])
    full = (kj < qi) & whole_blocks & (first[:, None, :] == last[:, :, None])
    return BlockMask.from_kv_blocks(*_block_lists(reach & ~full), *_block_lists(full), BLOCK_SIZE=block,
                                    mask_mod=mask_mod or document_mask_mod(doc_ids), seq_lengths=(s, s))


def _block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, nq, nk] booleans -> BlockMask's counts [b, 1, nq] and key-block indices [b, 1, nq, nk]
    (the marked ones first, in order)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), order[:, None].contiguous()


class FlexAttention:
    """FlexAttention over packed documents: `mask` replaces Llama.attention_mask (one
    BlockMask per forward for every layer), `attend` each Attention.core.

    On CUDA flex_attention is compiled once, here, and held by this object (eager, it
    materialises the scores: correct, but as slow as the math kernel); on CPU it runs
    eagerly, forward only (what the CPU tests use).
    """

    def __init__(self, compiled: bool, block: int = BLOCK):
        self.block = block
        # Static shapes: a run has one sequence length, and dynamic flex compiles slower.
        self._flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        self._causal: dict[tuple[int, torch.device], BlockMask] = {}  # masks without documents, by length

    def mask(self, doc_ids: torch.Tensor | None) -> BlockMask | None:
        return document_block_mask(doc_ids, self.block) if doc_ids is not None else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | None) -> torch.Tensor:
        """q [b, h, s, d], k/v [b, hk, s, d] (heads read from the tensors: tp shards run this too)."""
        if mask is None:
            mask = self._causal_mask(q.shape[-2], q.device)
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # a branch: see sdpa_attention
        return self._flex(q, k, v, block_mask=mask, **gqa)

    def _causal_mask(self, s: int, device: torch.device) -> BlockMask:
        """One document per row: a batch-1 mask (it broadcasts), made once per length."""
        key = (s, device)
        if key not in self._causal:
            one_document = torch.zeros(1, s, dtype=torch.long, device=device)
            self._causal[key] = document_block_mask(one_document, self.block, causal_mask_mod)
        return self._causal[key]


# ---- varlen ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedDocuments:
    """varlen's mask: the batch's documents laid end to end (a row's end also ends its last one)."""

    cu_seqlens: torch.Tensor  # [n_documents + 1] int32: where each document starts, then the total
    max_len: int  # the longest document


def packed_documents(doc_ids: torch.Tensor) -> PackedDocuments:
    """Cumulative document lengths of doc_ids [b, s], flattened row after row (one host sync,
    for the longest length, once per forward)."""
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    index = starts.flatten().nonzero().flatten()
    cu = torch.cat([index, index.new_tensor([b * s])]).to(torch.int32)
    return PackedDocuments(cu, int((cu[1:] - cu[:-1]).max()))


def _varlen_options() -> tuple[dict, bool]:
    """How this torch's varlen_attn is told "causal" (window_size from 2.11, is_causal in 2.10),
    and whether it takes enable_gqa."""
    params = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return causal, "enable_gqa" in params


class VarlenAttention:
    """varlen_attn over packed documents: `mask` gives PackedDocuments, `attend` flattens the
    batch to [b * s, heads, d]. `kernel` (default varlen_attn) is replaceable so the CPU
    tests can check the layout with a reference."""

    def __init__(self, kernel: Callable | None = None):
        self._kernel = kernel or varlen_attn
        self._causal, self._gqa = _varlen_options() if kernel is None else ({}, True)

    def mask(self, doc_ids: torch.Tensor | None) -> PackedDocuments | None:
        return packed_documents(doc_ids) if doc_ids is not None else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PackedDocuments | None) -> torch.Tensor:
        """q [b, h, s, d], k/v [b, hk, s, d] -> [b, h, s, d]."""
        b, h, s, d = q.shape
        if mask is None:  # one document per row
            mask = PackedDocuments(torch.arange(0, b * s + 1, s, dtype=torch.int32, device=q.device), s)
        group = h // k.shape[1]
        if group > 1 and not self._gqa:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = {"enable_gqa": True} if group > 1 and self._gqa else {}
        out = self._kernel(_flat(q), _flat(k), _flat(v), mask.cu_seqlens, mask.cu_seqlens, mask.max_len,
                           mask.max_len, **self._causal, **gqa)
        return out.view(b, s, h, d).transpose(1, 2)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [b * s, h, d]."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)
