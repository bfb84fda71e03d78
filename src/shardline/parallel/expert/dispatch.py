"""Where the routed experts run: split over the ep ranks and, under tensor parallelism,
over the tp ranks too (each expert whole on one rank; ep-major blocks: ep rank r holds
experts r*n/ep .. (r+1)*n/ep - 1, and tp rank t of it the t-th tp-th of that block).

A rank's MoE layer sorts its (token, slot) rows by expert. With ep > 1 the rows for ep
rank r form one contiguous run, and:
1. an all-to-all of the per-expert counts tells every rank the split sizes it gets;
2. an all-to-all of the rows (variable sizes) brings them, grouped by source rank then
   by local expert; they are regrouped by local expert;
3. the experts run; the inverse regrouping and all-to-all send the results home.
The backward is the same exchange reversed (autograd through `_Exchange`). Per layer a
rank sends and receives about top_k x tokens x dim elements each way, twice.

With tp > 1 the tp ranks of a group hold the same tokens (tensor parallelism gathers
the sequence before the feed-forward), so no tokens need to move between them: each runs
its own experts on their rows and one all-reduce over tp sums the rows (`_SumOverTP`,
whose backward passes the gradient through, like a row-parallel layer). The rows' input
gradient is summed over tp the other way (`_CopyToTP`), since each rank only
backpropagates through its own experts.
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


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ExpertParallel:
    """MoEFeedForward.dispatch across the ep group and/or the tp group (see the module doc)."""

    def __init__(self, n_experts: int, ep_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None = None):
        self.ep_group, self.tp_group = ep_group, tp_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.n_local = n_experts // self.ep  # the experts of this ep rank (over all its tp ranks)

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return self._run_local(experts, x, counts)
        send_counts = counts.view(self.ep, self.n_local)  # row r: my rows for ep rank r's experts
        recv_counts = torch.empty_like(send_counts)  # row r: rank r's rows for my experts
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        # The one host sync: the exchange's split sizes, and (under tp) this tp rank's row range.
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1), self._tp_bounds(recv_counts.sum(0))]).tolist()
        send, recv, bounds = sizes[:self.ep], sizes[self.ep:2 * self.ep], sizes[2 * self.ep:]
        arrived = _Exchange.apply(x, send, recv, self.ep_group)
        # Arrived rows: by source rank, then by local expert. Regroup by local expert.
        local_expert = torch.arange(self.n_local, device=x.device).repeat(self.ep)
        by_expert = torch.argsort(torch.repeat_interleave(local_expert, recv_counts.flatten()), stable=True)
        y = self._run_local(experts, arrived[by_expert], recv_counts.sum(0), bounds)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        return _Exchange.apply(y[back], recv, send, self.ep_group)

    def _tp_bounds(self, counts: torch.Tensor) -> torch.Tensor:
        """[first, end) of the rows (sorted by local expert, `counts` per expert) that this tp
        rank's experts take; empty without tp."""
        if self.tp == 1:
            return counts.new_zeros(0)
        t, per_tp = dist.get_rank(self.tp_group), self.n_local // self.tp
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return starts[[t * per_tp, (t + 1) * per_tp]]

    def _run_local(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor,
                   bounds: list[int] | None = None) -> torch.Tensor:
        """Rows sorted by this ep rank's experts -> their outputs (summed over the tp ranks' experts).
        `bounds`: _tp_bounds already read on the host (else read here: one sync)."""
        if self.tp == 1:
            return experts(x, counts)
        t, per_tp = dist.get_rank(self.tp_group), self.n_local // self.tp
        lo, hi = bounds if bounds else self._tp_bounds(counts).tolist()
        x = _CopyToTP.apply(x, self.tp_group)
        y = x.new_zeros(x.shape[0], x.shape[1])
        y = torch.cat([y[:lo], experts(x[lo:hi], counts[t * per_tp:(t + 1) * per_tp]), y[hi:]])
        return _SumOverTP.apply(y, self.tp_group)
