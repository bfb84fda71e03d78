"""Expert parallelism: each of the ep ranks holds n_experts / ep experts (contiguous
blocks: rank r has experts r*n/ep .. (r+1)*n/ep - 1), and tokens travel to them.

A rank's MoE layer sorts its (token, slot) rows by expert, so the rows for rank r form
one contiguous run. Dispatch:
1. all-to-all of the per-expert counts (so every rank knows the split sizes it gets);
2. all-to-all of the rows (variable sizes), which arrive grouped by source rank, then
   by local expert; they are regrouped by local expert for one grouped matmul;
3. the experts run; the inverse regrouping and all-to-all send the results home.
The backward is the same exchange reversed (autograd through `_Exchange`). Per layer
a rank sends and receives about top_k x tokens x dim elements each way, twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardline.models.moe.layer import GroupedExperts


class _Exchange(torch.autograd.Function):
    """all_to_all_single with variable row counts; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class ExpertParallel:
    """MoEFeedForward.dispatch across the ep group (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.n_local = n_experts // self.ep

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        send_counts = counts.view(self.ep, self.n_local)  # row r: my rows for rank r's experts
        recv_counts = torch.empty_like(send_counts)  # row r: rank r's rows for my experts
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()  # the one host sync
        arrived = _Exchange.apply(x, send, recv, self.group)
        # Arrived rows: by source rank, then by local expert. Regroup by local expert.
        local_expert = torch.arange(self.n_local, device=x.device).repeat(self.ep)
        by_expert = torch.argsort(torch.repeat_interleave(local_expert, recv_counts.flatten()), stable=True)
        y = experts(arrived[by_expert], recv_counts.sum(0))
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        return _Exchange.apply(y[back], recv, send, self.group)
