"""The mixture-of-experts feed-forward: router, grouped experts, shared experts, balancing.

A token's output is the weighted sum of its top_k routed experts (plus the shared ones).
Tokens are sorted by expert so every expert runs one matmul over all of its tokens
(torch._grouped_mm where the device has it, a loop of matmuls elsewhere), then the
results are scattered back and mixed. Where the experts live is the parallel plan's
business: `MoEFeedForward.dispatch` runs the experts on expert-sorted tokens, locally
here; expert parallelism replaces it with an all-to-all to the ranks holding them.

Balancing, both optional and both independent of the layout:
- the Switch/GShard loss  coef * sum_i f_i P_i  per *sequence* (f_i: the share of the
  sequence's routed slots that went to expert i, times n_experts; P_i: its mean router
  probability), plus the router z-loss; they reach the gradient through `AttachAux`, so
  no caller has to add them to the loss, and a pipeline stage in the middle trains them
  too. Computed per sequence, they do not change with micro-batching or data
  parallelism; ranks holding parts of a sequence (`seq_group`) share its counts.
- the auxiliary-loss-free bias (DeepSeek-V3): a per-expert bias added to the scores
  only for choosing experts, moved after each step towards equal load
  (`update_bias`, fed the step's load summed over every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardline.models.llama.model import FeedForward, ModelArgs
from shardline.models.moe.args import MoEArgs


class Router(nn.Module):
    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.n_experts, bias=False)
        # Persistent: a resumed run continues with the balance it had reached.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T, E] fp32, scores [T, E], chosen experts [T, K], their weights [T, K])."""
        m = self.moe
        # Routing in fp32, autocast or not: near-ties must not flip with the compute dtype
        # (a bf16 matmul changed 3% of the top-8 choices of 128 experts). Under tensor
        # parallelism the gate is a replicated DTensor: every tp rank routes the same tokens.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), _local(self.gate.weight).float())
        scores = logits.softmax(-1) if m.router == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias.detach() if m.bias_update_rate else scores
        chosen = choose.topk(m.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if m.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights * m.route_scale


class GroupedExperts(nn.Module):
    """n SwiGLU experts stored as stacked [n, out, in] weights (HF's per-expert orientation)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by expert, counts [n] tokens per (local) expert -> [N, dim]."""
        # Expert parallelism holds the weights as DTensors (sharded by expert): the local
        # experts are what this rank computes. Under CUDA autocast the residual stream is fp32,
        # but the grouped GEMM, which autocast does not cast for, runs in its dtype (bf16).
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        w1, w3, w2 = (_local(w).to(x.dtype) for w in (self.w1, self.w3, self.w2))
        if grouped_mm_usable(x):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)) * torch._grouped_mm(
                x, w3.transpose(1, 2), offs=offs)
            return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        return loop_experts(x, counts, w1, w3, w2)


def loop_experts(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """The reference: one SwiGLU per expert over its rows (any device and dtype)."""
    outs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
            for e, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on Hopper+ in bf16 and, in recent torch, on the CPU in fp32."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu" and x.dtype == torch.float32


def local_experts(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert is on this rank: run them on the sorted tokens."""
    return experts(x, counts)


@torch.compiler.disable
def run_experts(dispatch, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`dispatch(experts, x, counts)`, always eager under train.compile: the grouped GEMM's
    fake kernel takes only bf16 (fp32 cannot be traced) and expert parallelism's all-to-all
    needs split sizes read on the host; the rest of the block compiles around this call."""
    return dispatch(experts, x, counts)


def _local(t: torch.Tensor) -> torch.Tensor:
    # isinstance, not hasattr(t, "to_local"): train.compile traces the former correctly.
    return t.to_local() if isinstance(t, DTensor) else t


class AttachAux(torch.autograd.Function):
    """Pass `out` through unchanged; in backward give `aux` the gradient `scale`.

    This trains a layer's balancing loss as if it were added to the step's loss (whose
    gradient scale, 1 / sequences x the fp16 loss scale, the trainer sets each step),
    from wherever the layer sits, a pipeline's middle stage included.
    """

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.save_for_backward(scale)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        (scale,) = ctx.saved_tensors
        return grad_out, scale.to(grad_out.device).float(), None


class MoEFeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        moe = args.moe
        self.moe = moe
        self.router = Router(args.dim, moe)
        self.experts = GroupedExperts(moe.n_experts, args.dim, moe.expert_ffn_dim)
        self.shared = FeedForward(args.dim, moe.shared_experts * moe.expert_ffn_dim) if moe.shared_experts else None
        # Set by the parallel plan: how sorted tokens reach their experts, and the ranks that
        # hold other tokens of this rank's sequences (context parallelism).
        self.dispatch = local_experts
        self.seq_group: dist.ProcessGroup | None = None
        # Non-persistent bookkeeping of the current step (see shardline.parallel.expert.balance).
        # The balancing losses' gradient scale stays 0 (those losses off) until the trainer's
        # ExpertBalance.begin_step sets it: a loop of one's own must set it too.
        self.register_buffer("aux_grad_scale", torch.zeros(()), persistent=False)
        self.register_buffer("load", torch.zeros(moe.n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("aux_value", torch.zeros(()), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64), persistent=False)
        # The first counted forward of the step on its own: a pipeline schedule's first step
        # runs one extra forward to infer shapes, which the bookkeeping then takes out.
        self.register_buffer("first", torch.zeros(moe.n_experts + 2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # a pipeline stage inferring shapes on meta tensors (older torch)
            return torch.empty_like(x)
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        logits, scores, chosen, weights = self.router(flat)
        out, dropped = self.route(flat, chosen, weights)
        out = out.view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        aux = self.balance_loss(logits, scores, chosen, b, s)
        if self.training:
            self.count(chosen, dropped, aux)
        if aux is not None and torch.is_grad_enabled():
            out = AttachAux.apply(out, aux, self.aux_grad_scale)
        return out

    @torch.compiler.disable  # eager under train.compile: _counting asks autograd's state, a host value
    @torch.no_grad()
    def count(self, chosen: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Add one forward's expert load, dropped slots and balance loss to the step's
        (not while activation checkpointing recomputes the forward)."""
        if not _counting():
            return
        load = torch.bincount(chosen.flatten(), minlength=self.moe.n_experts).to(self.load.dtype)
        aux = aux.detach() if aux is not None else torch.zeros((), device=load.device)
        this = torch.cat([load, dropped.reshape(1).to(load.dtype), aux.reshape(1).to(load.dtype)])
        self.first.copy_(torch.where(self.forwards == 0, this, self.first))  # no host sync
        self.load += load
        self.dropped += dropped
        # The first forward's loss joins at the step's end unless it was a pipeline's shape-inference pass
        # (ExpertBalance.end_step): on uninitialised inputs it may be NaN, which no subtraction takes out.
        self.aux_value += torch.where(self.forwards == 0, torch.zeros_like(this[-1]), this[-1])
        self.forwards += 1

    def route(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """Routed experts' mixed output [T, d], and the number of (token, slot) pairs dropped."""
        n = self.moe.n_experts
        expert_of = chosen.flatten()  # slot j of token t is entry t * top_k + j
        order = torch.argsort(expert_of, stable=True)  # by expert, tokens in order within one
        # Not bincount: its output length depends on the data, which train.compile cannot trace.
        counts = expert_of.new_zeros(n).index_add_(0, expert_of, torch.ones_like(expert_of))
        dropped = torch.zeros((), device=flat.device)
        # Evaluation and generation are dropless: a capacity cut depends on which tokens share the
        # micro-batch, so a held-out loss would change with the batch size (or a short last batch).
        cap = self.moe.capacity(flat.shape[0]) if self.training else 0
        if cap:  # each expert keeps its first `cap` tokens
            starts = counts.cumsum(0) - counts
            rank_in_expert = torch.arange(order.numel(), device=flat.device) - starts[expert_of[order]]
            order = order[rank_in_expert < cap]
            dropped = (counts - counts.clamp(max=cap)).sum().float()
            counts = counts.clamp(max=cap)
        token_of = order // self.moe.top_k
        y = run_experts(self.dispatch, self.experts, flat[token_of], counts)
        mixed = y.float() * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).index_add(0, token_of, mixed)
        return out.to(flat.dtype), dropped

    def balance_loss(self, logits, scores, chosen, b: int, s: int) -> torch.Tensor | None:
        """This rank's part of the micro-batch's summed per-sequence balancing losses (None: off).

        Linear in this rank's tokens once the sequences' expert counts are shared, so the
        parts held by ranks splitting a sequence add up to its loss.
        """
        m = self.moe
        if not (m.aux_loss_coef or m.z_loss_coef):
            return None
        seq_tokens = s * (dist.get_world_size(self.seq_group) if self.seq_group is not None else 1)
        total = logits.new_zeros(())
        if m.aux_loss_coef:
            counts = torch.zeros(b, m.n_experts, device=logits.device)
            counts.scatter_add_(1, chosen.view(b, -1), torch.ones_like(chosen.view(b, -1), dtype=counts.dtype))
            if self.seq_group is not None:
                dist.all_reduce(counts, group=self.seq_group)
            probs = scores if m.router == "softmax" else scores / scores.sum(-1, keepdim=True)
            share = counts * m.n_experts / (m.top_k * seq_tokens)
            total = total + m.aux_loss_coef * (share * probs.view(b, s, -1).sum(1)).sum() / seq_tokens
        if m.z_loss_coef:
            total = total + m.z_loss_coef * logits.logsumexp(-1).square().sum() / seq_tokens
        return total


def _counting() -> bool:
    """False while activation checkpointing recomputes a forward inside backward (counted once)."""
    return torch._C._current_graph_task_id() == -1


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


@torch.no_grad()
def update_bias(layer: MoEFeedForward, load: torch.Tensor, flagged: torch.Tensor | None = None) -> None:
    """Move the expert bias one step towards equal load (DeepSeek-V3's sign update); not where
    `flagged` (a device 0-dim tensor, 1 or 0) is 1, decided without a host read (a select, so
    a non-finite step never leaks through a multiplication by 0)."""
    bias = layer.router.expert_bias
    step = layer.moe.bias_update_rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
    bias += step if flagged is None else torch.where(flagged.to(bias.device) > 0, torch.zeros_like(step), step)


@torch.no_grad()
def choices_the_bias_changes(model: nn.Module, tokens: torch.Tensor) -> list[float]:
    """For each MoE layer, the share of `tokens` ([B, S] ids) whose chosen experts differ without
    the routers' balancing bias, on the model's own forward (its bias kept): what an export to a
    format with no such bias (HF's Mixtral, Qwen3-MoE) changes. A hook on each router compares
    the top-k of its scores alone with the top-k it chose. Run in eval mode (dropless, as HF's
    models are; the step's bookkeeping untouched), the model's mode put back after."""
    shares: list[float] = []
    training = model.training

    def compare(router: Router, inputs, out) -> None:
        scores, chosen = out[1], out[2]
        bare = scores.topk(router.moe.top_k, dim=-1).indices
        shares.append((bare.sort(-1).values != chosen.sort(-1).values).any(-1).float().mean().item())

    hooks = [layer.router.register_forward_hook(compare) for layer in moe_layers(model)]
    try:
        model.eval()(tokens)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    return shares
