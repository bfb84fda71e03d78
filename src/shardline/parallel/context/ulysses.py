"""Ulysses (DeepSpeed-Ulysses): trade the sequence split for a head split, and back.

Before attention an all-to-all turns q/k/v [b, h, s/U, d] (this rank's tokens, every
head) into [b, h/U, s, d] (every token of the group, a U-th of the heads), so plain
attention runs locally; after it the inverse all-to-all brings the output back. Each
all-to-all moves (U-1)/U of the tensor; per layer q, k, v and the output: about
4 x (U-1)/U x b x s/U x h x d elements per rank, whatever the sequence length's
share of the compute, which is why it suits fast links (inside a node).

GQA: K/V travel with their kv heads when U divides them; otherwise each kv head is
first repeated to the query heads it serves (more traffic, the same result).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    u = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, u, h // u, s, d).transpose(0, 1).contiguous()  # chunk j: head group j, to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # chunk j: rank j's tokens of my head group
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    u = dist.get_world_size(group)
    b, hu, su, d = x.shape
    send = x.reshape(b, hu, u, su // u, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # chunk j: head group j of my tokens
    return recv.transpose(0, 1).reshape(b, u * hu, su // u, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (_heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, h, s/U, d] sequence-sharded -> [b, h/U, s, d] head-sharded (differentiable)."""
    return _AllToAll.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, h/U, s, d] head-sharded -> [b, h, s/U, d] sequence-sharded (differentiable)."""
    return _AllToAll.apply(x, group, False)


def kv_for_ulysses(k: torch.Tensor, v: torch.Tensor, n_heads: int, u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V whose head count U divides: as they are, or each kv head repeated to its query heads."""
    if k.shape[1] % u == 0:
        return k, v
    group = n_heads // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
