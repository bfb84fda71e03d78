"""When a step's memory peaks: the moments whose live bytes the planner compares.

memory.py adds up every term a rank may hold. Some of them are never alive together,
and the trainer's order of work says which:

* Gradients. The trainer sets them to None after each optimizer step (zero_grad with
  set_to_none), so a step of one micro-batch starts its backward with none: they grow
  as the backward frees activations. Its peak is then the larger of the backward's start
  (every activation and the loss's buffers; of the gradients only the output
  projection's, the first computed) and its end (every gradient, no activation). With
  gradient accumulation (more micro-batches), a pipeline (its stages accumulate over
  micro-batches) or DDP (its reducer's buckets, of which the gradients are views, are
  allocated up front) they are all there throughout.
* Autocast's weight copies (`params` without FSDP's sharding). Autocast caches the
  compute-dtype copy of each weight until the forward ends; after it, a copy lives on only
  where a matmul saved it for backward (a compiled block saves them too). A fully
  checkpointed block saves only its input, an op-checkpointed one recomputes the casts,
  so its copies are gone when the backward starts (recomputing the block makes them again,
  one block at a time: `recompute`). The forward's end, which still holds them but not yet
  the loss's gradient, is then a moment of its own; not for compiled blocks, whose casts are
  ops of their graph (no cache), alive one block at a time. float8's Linear layers cast the
  fp32 weights themselves (saving the weight, not a copy), so where float8 converts every
  Linear of the blocks, no block has a copy at any moment.
* The loss's buffers and the recomputation. The backward of a micro-batch begins with the
  loss's: the logits and their gradient are freed once the output projection's backward has
  read them, before the last block is recomputed. So a checkpointed step's start is two
  moments, the loss's backward (no recompute yet) and the first recompute (no logits left;
  the hidden states' gradient, one h-wide tensor, is not counted). Not under GPipe, whose
  last stage holds every micro-batch's loss buffers until its backwards (both stay counted:
  an over-count of at most the smaller), nor under a split backward (zbv, dualpipev), whose
  output projection keeps the logits' gradient for its weight pass.
* On a CPU the planner keeps the sum of every term: what it is checked against there is
  the process's peak RSS, and the C allocator keeps freed pages for reuse rather than
  returning them, so memory a moment frees still counts.
"""

from __future__ import annotations

from shardline.planner.activations import dtype_bytes, float8_every_linear


def moments(parts: dict[str, float], head_grads: float | None, dropped_copies: float,
            forward_logits: float | None, loss_first: bool) -> list[dict[str, float]]:
    """The breakdowns of the moments that may hold the peak (memory.memory_breakdown takes the largest).

    parts: every term as if alive at once. head_grads: gradient bytes alive as the backward
    starts when the step starts it with none (the output projection's), None when all are
    (accumulation, pipeline, DDP); the backward's end then holds all of them, and of the weight
    copies those the start holds (an upper bound: the others' are freed too). dropped_copies:
    weight-copy bytes of checkpointed blocks, gone by the backward. forward_logits: the loss's
    bytes at the forward's end; None where no cache holds the copies to it (compiled blocks
    cast in their graph, one block's at a time). loss_first: the loss's buffers are freed
    before any block is recomputed (loss_freed_first), so the backward's start splits in two.
    """
    start = dict(parts)
    start["params"] = parts["params"] - dropped_copies
    if head_grads is not None:
        start["grads"] = min(head_grads, parts["grads"])
    split = loss_first and parts["recompute"] > 0 and parts["logits"] > 0
    out = [dict(start, recompute=0.0), dict(start, logits=0.0)] if split else [start]
    if dropped_copies and forward_logits is not None:
        forward_end = dict(parts, logits=forward_logits, recompute=0.0)
        if head_grads is not None:
            forward_end["grads"] = 0.0
        out.append(forward_end)
    if head_grads is not None:
        out.append(dict(parts, params=start["params"], activations=0.0, logits=0.0))  # recompute: the
        # first block's, rerun while the other blocks' gradients exist (an upper bound)
    return out


def largest(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    """The breakdown with the most bytes (the first of equals)."""
    return max(breakdowns, key=lambda b: sum(b.values()))


def head_grads(work, layout, zero: int, last: bool) -> float | None:
    """Gradient bytes alive as the backward starts when a step starts it with none (see the
    module docstring): the output projection's weight gradient on the last stage (its shard
    under zero >= 2). None when every gradient is there all along: accumulation, a pipeline,
    DDP's buckets (ZeRO-1 runs under DDP without tp, pp or ep), or a runtime whose buffer
    holds them (Runtime.grads_on_demand)."""
    ddp_buckets = layout.dp_mode == "ddp" or (layout.dp_mode == "zero1" and not layout.zero1_scatters)
    if (not work.runtime.grads_on_demand or layout.micro_batches(work.global_batch) > 1 or layout.pp > 1
            or ddp_buckets):
        return None
    if not last:
        return 0.0
    shard = layout.shard_degree if zero >= 2 else 1
    return work.runtime.grad_bytes * work.model.vocab_size * work.model.dim / layout.tp / shard


def float8_blocks(work, layout) -> bool:
    """Whether float8 converts every Linear of the blocks (activations.float8_every_linear's
    rule): those Linear layers multiply the fp32 weights cast by float8 itself, eager or compiled,
    so autocast never makes (or caches) a compute-dtype copy of a block's weight."""
    return work.precision == "fp8" and float8_every_linear(work.model, layout.tp)


def dropped_copies(work, layout, zero: int, layers: int, per_layer: float) -> float:
    """Bytes of autocast's weight copies the checkpointed blocks of a stage no longer hold when the
    backward starts (full and op: every block, op's policy recomputes casts; selective: every
    `ac_every`-th; not op under tp with compile, whose checkpoint wraps compiled code). Only where
    `params` holds autocast's copies: one device, DDP, ZeRO-1 (zero=2 keeps FSDP's gathered
    weights from forward to backward instead). Not under a pipeline: its schedule runs every
    micro-batch's forward and backward inside one autocast region, so the cache holds them all.
    Under float8_blocks none is ever made, whatever the mode or the pipeline: every block's."""
    mode = layout.activation_checkpoint
    if work.precision == "fp32" or not work.runtime.weight_casts or zero >= 2:
        return 0.0
    if float8_blocks(work, layout):
        return dtype_bytes(work.precision) * layers * per_layer
    if layout.pp > 1 or mode == "none" or (mode == "op" and work.compiled and layout.tp > 1):
        return 0.0
    checkpointed = layers / layout.ac_every if mode == "selective" else layers
    return dtype_bytes(work.precision) * checkpointed * per_layer


def busiest(work, layout, parts: dict[str, float], zero: int, stage, per_layer: float,
            loss_forward: float) -> dict[str, float]:
    """The breakdown of the moment of `stage`'s rank that holds the most (see moments): per_layer, a
    block's parameters whose copies autocast would make; loss_forward, the loss's bytes at the
    forward's end (loss_terms), which only an eager block's cached copies share a moment with."""
    cached = not (work.compiled_blocks(layout) or float8_blocks(work, layout))
    return largest(moments(parts, head_grads(work, layout, zero, stage.last),
                           dropped_copies(work, layout, zero, stage.layers, per_layer),
                           (loss_forward if stage.last else 0.0) if cached else None, loss_freed_first(layout)))


def loss_freed_first(layout) -> bool:
    """Whether a micro-batch's loss buffers are gone before its first block is recomputed (see the
    module docstring): not under GPipe's pipeline, nor a split backward."""
    return not layout.split_backward and (layout.pp == 1 or layout.pp_schedule != "gpipe")
