"""Ring attention (pass-KV): each rank keeps its queries; K/V blocks travel the ring.

At step j, ring rank i holds the K/V of ring shard (i - j) mod R. It starts sending
that block on to rank i+1 (and receiving the next from rank i-1) before it computes
attention of its queries against the block, so the transfer overlaps the compute.
Each block gives a partial output and the log-sum-exp of its scores; partials merge
exactly (the online softmax of flash attention):

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward (flash attention's, block by block) sends the K/V round the ring once
more; each block's dK/dV accumulator follows it one step behind, so it travels while
the next block computes, every rank adds its queries' share, and one last hop takes
the finished dK/dV home. Only q, k, v, the output and
its log-sum-exp are kept for it: each block's probabilities are recomputed, so the
activation memory of attention is O(s/C) per rank, not a score matrix.

A block whose keys all come after every query (causal) or share no document with
them is skipped: no FLOPs (it still passes on, for the ranks that need it). One inside
a single document needs no document mask and runs as an unmasked or causal block.
Masked scores use a large finite negative instead of -inf, so a query row with no
allowed key in a block gives a finite lse that the merge weighs by exp(-1e30) = 0,
and no NaN reaches the gradients.

Each block runs on a fused kernel where one applies (blocks.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardline.parallel.context.blocks import MASKED, block_backward, block_forward


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, as one."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)), lse


class Ring:
    """The ring group of one cp ring: neighbours as global ranks."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_shift(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send `send` to the next rank and receive the previous rank's; returns the receive
        buffer and the transfers to wait on before reading it."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    """Forward: merge the blocks as they come round. Backward: the blocks come round again
    (recomputing each one's probabilities from the saved output and log-sum-exp, so no
    score matrix is kept between forward and backward), each with the gradient of its
    K/V accumulated so far; after the last step the gradients go one hop further, home."""

    @staticmethod
    def forward(ctx, q, k, v, ring, plan, scale):
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], MASKED, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            if step + 1 < ring.size:
                nxt, works = ring.start_shift(kv)  # in flight while this block computes
            for qs, ks, kind in plan.pairs(step):
                o, s = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], plan.mask(step, qs, ks, kind),
                                     kind == CAUSAL, scale)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, s)
            if step + 1 < ring.size:
                _wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plan, ctx.scale = ring, plan, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, plan, scale = ctx.ring, ctx.plan, ctx.scale
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O), the softmax backward's correction
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        incoming = None  # the current block's dK/dV accumulated by the ranks before, in flight
        for step in range(ring.size):
            if step + 1 < ring.size:
                nxt, works = ring.start_shift(kv)  # K/V move on while their gradient is computed
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # this rank's share
            for qs, ks, kind in plan.pairs(step):
                dq_b, dk_b, dv_b = block_backward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                                  plan.mask(step, qs, ks, kind), kind == CAUSAL, scale,
                                                  grad_out[:, :, qs], out[:, :, qs], lse[:, :, qs], delta[:, :, qs])
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if incoming is not None:  # it travelled while this rank computed its share
                _wait(incoming[1])
                dkv += incoming[0]
            # The block's gradient so far follows the block (after the last step: home), and
            # the next block's arrives, during the next step's compute.
            incoming = ring.start_shift(dkv)
            if step + 1 < ring.size:
                _wait(works)
                kv = nxt
        _wait(incoming[1])
        dkv = incoming[0]  # this rank's own K/V: every rank's share, summed round the ring
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


FULL, CAUSAL, MASK = "full", "causal", "mask"  # what a block pair needs: nothing masked, the diagonal, a mask


class RingPlan:
    """Which (query run, key run) pairs each ring step computes and what each needs masked:
    the same for every layer of a forward and for the backward, so it is made once per
    forward (one host sync for document masks, not one per layer and block). Masks are
    rebuilt from the document ids when used, so none is kept between forward and backward.
    """

    def __init__(self, ring: Ring, q_pos, kv_pos, q_doc, kv_doc, device, on_device=None):
        """q_pos: this rank's ring shard's positions; kv_pos[i]: ring shard i's (host tensors);
        q_doc [b, sq], kv_doc[i] [b, sk]: document ids, or None (one document); on_device: q_pos
        and kv_pos on `device`, where the masks are made (copied here when not given)."""
        self.q_pos, self.q_doc, self.device = q_pos, q_doc, device or torch.device("cpu")
        self.sources = [(ring.rank - step) % ring.size for step in range(ring.size)]
        self.kv_pos, self.kv_doc = kv_pos, kv_doc
        self._q_dev, self._kv_dev = on_device or (q_pos.to(self.device), [p.to(self.device) for p in kv_pos])
        self._steps = []
        for source in self.sources:
            pairs = []
            for qa, qb in runs(q_pos):
                for ka, kb in runs(kv_pos[source]):
                    kind = self._kind(slice(qa, qb), slice(ka, kb), source)
                    if kind is not None:
                        pairs.append((slice(qa, qb), slice(ka, kb), kind))
            self._steps.append(pairs)

    def pairs(self, step: int) -> list:
        return self._steps[step]

    def _kind(self, qs: slice, ks: slice, source: int) -> str | None:
        q_pos, k_pos = self.q_pos[qs], self.kv_pos[source][ks]
        if int(k_pos.min()) > int(q_pos.max()):
            return None  # every key is after every query
        if self.q_doc is not None:
            one, shared = torch.stack([self._one_document(qs, ks, source),
                                       self._allowed(qs, ks, source).any()]).tolist()  # one host sync
            if not one:
                return MASK if shared else None
        if int(k_pos.max()) <= int(q_pos.min()):
            return FULL  # every key is at or before every query
        return CAUSAL if torch.equal(q_pos, k_pos) else MASK

    def _one_document(self, qs: slice, ks: slice, source: int) -> torch.Tensor:
        """Whether, in every sequence, the queries and keys of the pair are all of one document:
        then the document mask masks nothing the causal one does not, and the pair runs
        unmasked or causal (on a GPU the flash kernel, not the efficient one with a bias)."""
        q, k = self.q_doc[:, qs], self.kv_doc[source][:, ks]
        first = q[:, :1]
        return (q == first).all() & (k == first).all()

    def mask(self, step: int, qs: slice, ks: slice, kind: str):
        return self._allowed(qs, ks, self.sources[step]) if kind == MASK else None

    def _allowed(self, qs: slice, ks: slice, source: int) -> torch.Tensor:
        """[b, sq, sk]: causal, and within a document when there are documents."""
        q_pos, k_pos = self._q_dev[qs], self._kv_dev[source][ks]  # on the device: no copy per block
        allowed = (k_pos[None, :] <= q_pos[:, None])[None]
        if self.q_doc is not None:
            allowed = allowed & (self.q_doc[:, qs, None] == self.kv_doc[source][:, None, ks])
        return allowed


@torch.compiler.disable
def ring_attention(q, k, v, ring: Ring, plan: RingPlan, scale: float):
    """Causal attention of this rank's queries on the keys of every ring shard.

    Always eager, also inside a compiled block (`train.compile`): the ring is a host-driven
    loop of point-to-point sends that dynamo does not trace, and left to itself it breaks
    the block at each send and compiles the pieces between them (16 graphs for 4 blocks at
    ring 2, resumed mid-loop, against 10 with this one break around the whole ring); the
    code before and after the ring stays compiled, and the ring's block kernels are fused
    ones already wherever a fused kernel applies (see the module doc).

    q [b, h, sq, d], k/v [b, hk, sk, d] of this ring rank's shard. Returns the output
    [b, h, sq, d] in q's dtype.

    Work is done per pair of contiguous runs (a zigzag shard is two chunks): a pair
    whose keys all follow its queries, or that shares no document, is skipped, so
    under zigzag every rank computes 2R + 1 chunk pairs, where a contiguous split
    makes the last rank compute 4R.
    """
    return _RingAttention.apply(q, k, v, ring, plan, scale)


def runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) index ranges of the contiguous position runs of a shard."""
    breaks = [0] + [int(i) + 1 for i in torch.nonzero(pos[1:] != pos[:-1] + 1).flatten()] + [len(pos)]
    return list(zip(breaks[:-1], breaks[1:]))
