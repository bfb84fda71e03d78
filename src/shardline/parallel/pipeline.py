"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into `pp x pp_virtual_stages` stages of whole blocks. Each rank keeps
one pruned Llama holding exactly the blocks of its stages (plus the embedding on the
first stage and the norm and output on the last): optimizer, checkpoints, init and
gradient clipping use it unchanged, and parameter names stay those of the full model,
so checkpoints reshard to any other layout. The pipeline stages are thin views over
its modules.

Stage placement (shardline.layout, shared with the planner): looped (rank r holds
stages r, r + pp, ...) for gpipe, 1f1b and interleaved 1F1B; V-shaped (rank r holds
stages r and 2 pp - 1 - r) for the zero-bubble ZBV and DualPipeV schedules, which need
the first and last stage together.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from shardline.layout import SINGLE_STAGE, V_SHAPED, head_cost, split_layers, stages_of_rank
from shardline.models.llama import Llama, ModelArgs

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
_CUSTOM_NODES_SINCE = (2, 13)  # the first torch seen to run a weight pass through custom autograd nodes
# By default a schedule's step returns the last stage's outputs, so it keeps every micro-batch's
# (the logits, under an unchunked loss) until the next step: m x tokens x vocabulary. Where this
# torch's schedules take `return_outputs`, they keep none (its value is unused here).
_NO_OUTPUTS = ({"return_outputs": False} if all("return_outputs" in inspect.signature(cls.step).parameters
                                                for cls in (ScheduleGPipe, ScheduleInterleaved1F1B)) else {})


def split_backward_takes_custom_nodes(torch_version: str = torch.__version__) -> bool:
    """Whether this torch's split backward (zbv, dualpipev) runs its weight pass through a
    custom autograd node (a compiled region, a float8 Linear's matmul): 2.13 does; 2.11's
    `autograd.grad` reads the node's `_input_metadata`, which such nodes refuse."""
    major_minor = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return major_minor >= _CUSTOM_NODES_SINCE


def prune(model: Llama, keep_layers: set[int], first: bool, last: bool) -> None:
    """Drop (in place, on meta) every block and end piece this rank does not run."""
    for name in list(model.layers.keys()):
        if int(name) not in keep_layers:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None


def _tied(model: nn.Module) -> bool:
    """Whether the model's embedding and output head are one weight (other modules: no)."""
    return getattr(getattr(model, "args", None), "tie_embeddings", False)


def tied_copy(model: Llama) -> nn.Parameter | None:
    """The output head's own copy of a tied embedding, else None.

    With tied embeddings the embedding and the output head are one weight. Two cases
    hold it as two parameters, a copy named `output.weight`:
    - a pipeline's last stage on another rank than the first (the looped schedules);
    - a rank holding both ends in two stages (V-shaped schedules) under FSDP, which
      shards each stage as its own unit and cannot share a parameter between units
      (hold_tied_copy).
    The copy starts equal (init_weights gives a tied output the embedding's value), takes
    the summed gradient of both ends (sync_tied_gradient), so identical AdamW updates
    keep it equal; the norm counts the weight once and checkpoints keep one optimizer
    state for it, the embedding's.
    """
    if not _tied(model) or model.output is None:
        return None
    return model.output.weight if model.tok_embeddings is None or getattr(model, "tie_held_apart", False) else None


def hold_tied_copy(model: Llama) -> None:
    """Give a tied output head that shares this rank's embedding a parameter of its own
    (on meta, before the model is laid out; see tied_copy)."""
    if _tied(model) and None not in (model.output, model.tok_embeddings):
        model.output.weight = nn.Parameter(torch.empty_like(model.tok_embeddings.weight))
        model.tie_held_apart = True


@torch.no_grad()
def sync_tied_gradient(model: Llama, embedding_group) -> None:
    """Sum the tied weight's gradient over its two ends: in place where this rank holds
    both, else by the embedding group's all-reduce between the two ranks.

    Both ends are laid out alike (FSDP shards both over dp_shard by rows, TP splits
    both by vocabulary rows), so once each gradient has its parameter's layout the
    local shards hold the same rows and add up elementwise. Ranks holding neither end,
    or one parameter for both, have nothing to do.
    """
    if not _tied(model):
        return
    embedding, copy = model.tok_embeddings, tied_copy(model)
    if embedding is not None and copy is not None:  # both ends here, two parameters
        total, other = _local_grad(embedding.weight), _local_grad(copy)
        total.add_(other)
        other.copy_(total)
    elif embedding_group is not None and (embedding is None) != (model.output is None):  # one end here
        grad = _local_grad(copy if embedding is None else embedding.weight)
        if grad.device.type == "cpu" and dist.get_backend(embedding_group) == "nccl":  # offloaded to the host
            on_device = grad.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_device, group=embedding_group)
            grad.copy_(on_device)
        else:
            dist.all_reduce(grad, group=embedding_group)


def _local_grad(end: nn.Parameter) -> torch.Tensor:
    """This rank's part of `end`'s gradient, laid out as the parameter is."""
    if end.grad is None:  # an end that saw no token still takes its partner's gradient
        end.grad = torch.zeros_like(end)
    if isinstance(end.grad, DTensor) and end.grad.placements != end.placements:
        # TP's vocab-parallel embedding leaves a replicated gradient: keep this rank's rows.
        end.grad = end.grad.redistribute(end.device_mesh, end.placements)
    return end.grad.to_local() if isinstance(end.grad, DTensor) else end.grad


class StageModule(nn.Module):
    """One pipeline stage: a view over some modules of the rank's pruned Llama."""

    def __init__(self, model: Llama, layer_ids: list[int], first: bool, last: bool, document_mask: bool,
                 positions: torch.Tensor):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self._rotary = model.rotary
        self._mask = model.attention_mask  # the model's, or the one its parallel plan installed (cp)
        self._loss = model.loss  # the last stage scores labels with it when given them (chunked loss)
        self.document_mask = document_mask
        # Fixed, not read from h: under sequence parallelism a stage receives only its
        # slice of the sequence, while rotary tables and masks span all of it; under
        # context parallelism these are this rank's tokens' places in the sequence.
        self.positions = positions

    def forward(self, h, doc_ids=None, labels=None):
        """The stage's output; on the last stage, given labels, their summed loss instead of logits."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        if self.positions.device != h.device:  # once: a host-to-device copy every micro-batch waits on the GPU
            self.positions = self.positions.to(h.device)
        cos, sin = self._rotary(self.positions, h.device)
        mask = self._mask(doc_ids if self.document_mask else None)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.output is not None and labels is not None:
            # Shape [1], not a scalar: the schedule concatenates the micro-batches' outputs.
            return self._loss(self.norm(h), self.output, labels).reshape(1)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


class Pipeline:
    """The stages this rank runs and the schedule that drives them."""

    def __init__(self, model: Llama, args: ModelArgs, pp_rank: int, pp: int, virtual: int, schedule: str,
                 n_microbatches: int, document_mask: bool, positions: torch.Tensor):
        n_stages = pp * (2 if schedule in V_SHAPED else virtual)
        self.layer_split = split_layers(args.n_layers, n_stages, head_cost(args))
        self.stage_ids = stages_of_rank(pp_rank, pp, virtual, schedule)
        self.pp, self.n_stages, self.schedule_name, self.n_microbatches = pp, n_stages, schedule, n_microbatches
        self.has_first, self.has_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        local_layers = {i for s in self.stage_ids for i in self.layer_split[s]}
        prune(model, local_layers, self.has_first, self.has_last)
        self.modules = [StageModule(model, self.layer_split[s], s == 0, s == n_stages - 1, document_mask, positions)
                        for s in self.stage_ids]

    def use_loss(self, loss) -> None:
        """The model's loss as it is now: train.compile replaces it (a compiled cross-entropy)
        after the stages took the one it had, which the last stage scores a chunked loss with."""
        for module in self.modules:
            module._loss = loss

    def build_schedule(self, device, pp_group, loss_fn):
        """loss_fn(output, labels, n_tokens): a micro-batch's loss, given the labelled tokens
        of the whole step that run() was called with; the output is the last stage's logits,
        or its summed loss when run() hands the stages the labels."""
        stages = [PipelineStage(m, s, self.n_stages, device, group=pp_group)
                  for m, s in zip(self.modules, self.stage_ids)]
        for stage in stages:
            _no_warm_up_sends_to_self(stage)
            _gathered_for_split_backward(stage)
        cls = SCHEDULES[self.schedule_name]
        # The schedule's loss function is fixed here, while the step's token count changes:
        # run() records it for this wrapper to pass on.
        self.step_tokens = 1

        def step_loss(logits, labels):
            return loss_fn(logits, labels, self.step_tokens)

        # scale_grads=False: the loss function already returns each micro-batch's share
        # of the global mean, so the summed gradients need no further division.
        if self.schedule_name in SINGLE_STAGE:
            self.schedule = cls(stages[0], self.n_microbatches, loss_fn=step_loss, scale_grads=False)
        else:
            self.schedule = cls(stages, self.n_microbatches, loss_fn=step_loss, scale_grads=False)
        return self.schedule

    def run(self, batch: dict, doc_mask: bool, n_tokens: int, loss_in_stage: bool = False) -> list:
        """Forward and backward of one rank's batch; returns the last stage's losses.

        n_tokens: labelled tokens of the whole step, which the loss function divides by.
        loss_in_stage: every stage gets the labels, and the last one returns their summed
        loss (its model's loss, e.g. chunked) instead of the logits."""
        self.step_tokens = n_tokens
        losses: list = []
        args = (batch["input_ids"],) if self.has_first else ()
        kwargs = _stage_kwargs(batch, doc_mask, loss_in_stage)
        target = batch["labels"] if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, **kwargs, **_NO_OUTPUTS)
        return losses

    def owner(self, stage: int) -> int:
        """pp rank that runs `stage`."""
        if self.schedule_name in V_SHAPED:
            return stage if stage < self.pp else self.n_stages - 1 - stage
        return stage % self.pp

    @torch.no_grad()
    def forward_only(self, batch: dict, doc_mask: bool, pp_group, loss_in_stage: bool = False) -> torch.Tensor | None:
        """Logits of a batch (summed loss with loss_in_stage, see run), stage after stage, on
        the last stage's rank (None elsewhere).

        Evaluation does not go through the training schedule: not every schedule
        offers a forward-only mode (the V-shaped ones fail in torch 2.13), and
        plain point-to-point sends are the same for all of them.
        """
        me = dist.get_rank(pp_group)
        kwargs = _stage_kwargs(batch, doc_mask, loss_in_stage)
        h = batch["input_ids"]
        for stage in range(self.n_stages):
            if stage not in self.stage_ids:
                continue
            if stage > 0 and self.owner(stage - 1) != me:
                h = _recv(dist.get_global_rank(pp_group, self.owner(stage - 1)), pp_group, h.device)
            h = self.modules[self.stage_ids.index(stage)](h, **kwargs)
            if stage < self.n_stages - 1 and self.owner(stage + 1) != me:
                _send(h, dist.get_global_rank(pp_group, self.owner(stage + 1)), pp_group)
        return h if self.has_last else None


def _no_warm_up_sends_to_self(stage: PipelineStage) -> None:
    """Leave out the warm-up send/recv pairs a stage would exchange with its own rank.

    A V-shaped schedule puts two adjacent stages on one rank, which pass activations in
    memory; only the schedule's first step sends each neighbour a dummy tensor to open the
    links, to this rank too. torch 2.11's gloo cannot send to its own rank ("Pair is not
    connected"; 2.13's can), and a link to oneself needs no opening."""
    warm_up = getattr(stage, "_get_init_p2p_neighbors_ops", None)  # torch's private hook; absent: nothing to do
    if warm_up is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in warm_up() if op.group_peer != stage.group_rank]


def _gathered_for_split_backward(stage: PipelineStage) -> None:
    """Gather the stage's FSDP weights before each input-gradient pass of a split backward.

    The zero-bubble schedules (zbv, dualpipev) split a micro-batch's backward in two: the
    input-gradient pass records which graph nodes lead to the stage's parameters, as
    `stage.submod.parameters()` lists them at that moment, and the later weight-gradient
    pass computes gradients only for those. Under zero=3 FSDP has swapped its gathered
    weights back for the sharded ones after forward, which the forward graph never used:
    nothing is recorded and the weight gradients are silently lost (measured: the last
    stage's blocks got none, gradient norms 10% low). Gathering first registers the weights
    the graph used; the pipeline keeps them gathered through backward anyway (it turns off
    FSDP's reshard after backward until the last micro-batch)."""
    input_pass = stage.backward_one_chunk

    def gathered(*args, full_backward: bool = True, **kwargs):
        if not full_backward:
            for module in stage.submod.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        return input_pass(*args, full_backward=full_backward, **kwargs)

    stage.backward_one_chunk = gathered


def _stage_kwargs(batch: dict, doc_mask: bool, loss_in_stage: bool) -> dict:
    """What every stage gets besides its input: the document ids, and the labels when the
    last stage computes the loss itself (the others ignore them)."""
    kwargs = {"doc_ids": batch["doc_ids"]} if doc_mask else {}
    return {**kwargs, "labels": batch["labels"]} if loss_in_stage else kwargs


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _send(t: torch.Tensor, dst: int, group) -> None:
    t = t.to_local() if isinstance(t, DTensor) else t
    header = torch.tensor([_DTYPES.index(t.dtype), t.ndim, *t.shape], dtype=torch.int64, device=t.device)
    dist.send(torch.tensor([len(header)], device=t.device), dst, group=group)
    dist.send(header, dst, group=group)
    dist.send(t.contiguous(), dst, group=group)


def _recv(src: int, group, device) -> torch.Tensor:
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=group)
    header = torch.empty(int(n), dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, shape = _DTYPES[int(header[0])], header[2:].tolist()
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src, group=group)
    return t
