"""torch.compile per transformer block, plus the loss (`train.compile`).

Compiling block by block (torchtitan's way) instead of the whole model keeps every
layout working: each block is compiled in place (`nn.Module.compile`), so parameter
names, tensor-parallel hooks, the activation-checkpoint wrapper (traced as part of the
block; under tp wrapped around it), FSDP units (applied after, outside the compiled code) and pipeline stages (views
over the same blocks) stay as they are, and the blocks of one shape share one compiled
graph. The loss's cross-entropy is compiled too; the output projection runs eagerly.

What is compiled, by layout:
- tp = 1, dense: the whole block (norms, attention, feed-forward, residuals) and the
  cross-entropy.
- tp > 1 (with or without sequence parallelism): still the whole block, its
  redistributions (the sequence all-gather before attention and the feed-forward, the
  reduce-scatter or all-reduce after) traced in as functional collectives. The one
  change: the embedding's output is resolved before the first block sees it. The
  row-parallel embedding hands out its local tensor as an AsyncCollectiveTensor (its
  reduction is issued async); a compiled block that takes one as input resolves it
  itself, and the gradient it returns for it then reaches the embedding's
  redistribution as a plain tensor instead of a DTensor, so backward fails (torch 2.13).
  Resolving it eagerly (one copy of the embedding output) keeps autograd's chain intact.
- tp > 1 with activation checkpointing: the block's forward is compiled before the
  checkpoint wraps it, so the checkpoint runs eagerly around compiled code (recomputing
  it in backward). Traced into the compiled block instead, the checkpoint of a tp block
  saves the DeviceMesh among its tensors for backward, which AOTAutograd rejects
  (torch 2.13).
- tp > 1, any block: AOTAutograd's on-disk cache is turned off (process-wide). It keys
  graphs by what does not tell the tp ranks apart, so a rank can load a graph another
  rank compiled, with that rank's local slice baked in (seen with MoE under sequence
  parallelism: a second run trained off eager's losses). Inductor's cache stays on.
- tp > 1 with loss parallelism: the cross-entropy stays eager. It runs on vocab-sharded
  DTensor logits through the `loss_parallel` context's own ops, which the compiled
  graph does not go through: compiled, the loss comes out wrong (not an error).
- zero-bubble pipeline schedules (zbv, dualpipev): the block's Linear layers run eagerly,
  between compiled regions (norms, rotary, the attention core, SwiGLU's product, the
  residual adds). Those schedules split a micro-batch's backward into an input-gradient
  pass and a weight pass, which reaches each weight through autograd's graph. A compiled
  region is one autograd node whose backward computes every gradient of the region at
  once, so a whole compiled block runs its full backward in both passes: on one dense
  block on the CPU the split backward took 2.01-2.04x one backward, against 1.06-1.08x
  eager (benchmarks/RESULTS.md), which undoes what the schedule saves. With the Linear
  layers outside, their weight gradients are eager matmuls the weight pass runs alone; the
  regions it runs again hold only norm weights and, under MoE, the router's gate (called
  as F.linear, a dim x experts matmul): 1.02-1.09x. Module calls around a break run
  eagerly with their hooks, tensor parallelism's included (tp 2 with sequence parallelism
  under dualpipev trains like eager: tests/distributed/test_compile_parallel.py; with loss
  parallelism under zbv, checked by hand). Under fp8 those eager Linear layers are
  float8 ones that compute only the gradient a pass asks for (parallel/float8.py); their
  casts are not fused then.
  AOTAutograd's buffer donation is turned off as well
  (process-wide): the input pass keeps the graph (`retain_graph=True`) for the weight
  pass, and a compiled backward that donated its saved buffers refuses that (torch 2.13:
  "compiled with non-empty donated buffers"); the cost is the buffers' reuse inside the
  backward. The compile cache's key is tagged too (`torch.compiler.config.cache_key_tag`):
  inductor's FX graph cache does not key a backward by its donated buffers and serves a
  donating kernel, compiled for the same code by an earlier run with donation, to a
  compile without it; under a split backward that kernel overwrites saved activations the
  weight pass then reads: wrong weight gradients, no error (torch 2.13; seen in CI when
  these schedules compiled whole blocks, the graphs an earlier 1F1B run had cached). The
  regions no longer match 1F1B's whole-block graphs, so the tag is a guard for any graph
  both share. On torch before 2.13 the weight pass itself fails on compiled code (torch
  2.11: `autograd.grad` reads `_input_metadata` of the compiled function's backward node,
  which refuses it), so preflight refuses compile with those schedules there
  (`config_problem`); 2.12 is untested.
- context parallelism: under a ring (ring or hybrid mode) the ring's attention runs
  eagerly between the compiled code before and after it (`parallel/context/ring.py::
  ring_attention`, disabled for the compiler): its point-to-point sends do not trace
  (tested). Under Ulysses alone the block compiles whole, its all-to-alls traced in as
  functional collectives (checked by hand: no break, eager's losses; so was hybrid).
- mixture of experts: the block compiles around the routed experts; the experts with
  their token exchange run eagerly (`models/moe/layer.py::run_experts`): the grouped
  GEMM's fake kernel accepts only bf16 (fp32 on the CPU runs eagerly, not traced), and
  expert parallelism's all-to-all takes split sizes read on the host; the load
  bookkeeping too (it asks autograd's state). Router, balance loss, token sort and mix,
  shared experts, attention and norms are compiled.
"""

from __future__ import annotations

import dataclasses

import torch
import torch._functorch.config
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from shardline.layout import SPLIT_BACKWARD, Layout
from shardline.models.loss import cross_entropy_sum
from shardline.parallel.pipeline import split_backward_takes_custom_nodes


_NO_DONATION_TAG = "shardline-no-donated-buffers"  # in the compile cache's key without donation (module doc)


def config_problem(enabled: bool, pp: int, schedule: str, torch_version: str = torch.__version__) -> str | None:
    """What the config alone rules out for `train.compile` (`enabled`) on this torch (one line), else None."""
    if enabled and pp > 1 and schedule in SPLIT_BACKWARD and not split_backward_takes_custom_nodes(torch_version):
        return (f"train.compile=true with parallel.pp_schedule={schedule!r} needs torch >= 2.13 (this is "
                f"{torch_version}: its split backward fails on compiled blocks); use pp_schedule 1f1b, gpipe or "
                "interleaved_1f1b, or train.compile=false")
    return None


def options(lay: Layout, activation_checkpoint: str) -> dict[str, bool]:
    """apply_compile's keywords for this layout: the one place that decides how blocks are
    compiled under it (the parallel plan applies them, describe() words them)."""
    tp = lay.tp > 1
    return {"tensor_parallel": tp, "loss_parallel": tp and lay.loss_parallel, "split_backward": lay.split_backward,
            "forward_only": tp and activation_checkpoint != "none"}


def describe(enabled: bool, lay: Layout, activation_checkpoint: str, moe: bool) -> str:
    """What `train.compile` compiles under this layout, in one line (--dry-run, the run's log)."""
    if not enabled:
        return "off (train.compile=false)"
    how = options(lay, activation_checkpoint)
    if how["split_backward"]:
        blocks = (f"each block between its Linear layers, which run eagerly ({lay.pp_schedule}'s weight pass then "
                  "computes only their weight gradients)")
    elif how["forward_only"]:
        blocks = "each block's forward, inside its activation checkpoint"
    else:
        blocks = "each transformer block whole"
    experts = "; routed experts eager" if moe else ""
    ring = "; the cp ring's attention eager" if lay.cp_degrees[0] > 1 else ""
    loss = "the loss eager (loss parallelism)" if how["loss_parallel"] else "the loss's cross-entropy"
    return f"{blocks}{experts}{ring}; {loss}"


def apply_compile(model: nn.Module, tensor_parallel: bool = False, loss_parallel: bool = False,
                  forward_only: bool = False, split_backward: bool = False) -> None:
    """Compile each block of `model` in place, and its loss's scoring function unless the
    logits are vocab-sharded (`loss_parallel`). `tensor_parallel`: the embedding's output
    is an AsyncCollectiveTensor, resolved before the compiled blocks take it.
    `forward_only`: compile each block's forward, for activation checkpointing to wrap
    afterwards (tp; see the module doc), instead of the whole module call. `split_backward`:
    a zero-bubble pipeline schedule runs each backward in two passes over one graph, so the
    Linear layers stay out of the compiled regions."""
    for block in model.layers.values():
        if split_backward:
            _linears_eager(block)
        if forward_only:
            block.forward = torch.compile(block.forward)
        else:
            block.compile()
    if split_backward:
        torch._functorch.config.donated_buffer = False  # the input pass retains the graph (module doc)
        _tag_cache(_NO_DONATION_TAG)  # and a donating kernel must not come back from the cache (module doc)
    if tensor_parallel:
        torch._functorch.config.enable_autograd_cache = False  # another rank's graph otherwise (module doc)
        if getattr(model, "tok_embeddings", None) is not None:  # absent on later pipeline stages
            model.tok_embeddings.register_forward_hook(_resolve_async)
    if not loss_parallel:
        model.loss = dataclasses.replace(model.loss, score=torch.compile(cross_entropy_sum))


def _linears_eager(block: nn.Module) -> None:
    """Run every Linear layer of `block` eagerly inside its compiled call (a graph break
    each), so a split backward's weight pass computes their weight gradients alone (module
    doc). Dynamo breaks at the calling frame, so the module call around them, with its hooks
    (tensor parallelism's redistributions), runs eagerly too; the code between is compiled."""
    for module in block.modules():
        if isinstance(module, nn.Linear):
            module.forward = torch.compiler.disable(module.forward)


def _tag_cache(tag: str) -> None:
    """Add `tag` to the compile cache's key tag (process-wide, as the setting it keys),
    keeping any tag the user set."""
    current = torch.compiler.config.cache_key_tag
    if tag not in current.split(","):
        torch.compiler.config.cache_key_tag = f"{current},{tag}" if current else tag


def _resolve_async(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor | None:
    """A plain tensor for an AsyncCollectiveTensor (a non-view op waits for the collective
    and unwraps it, inside autograd); anything else unchanged."""
    return out.clone() if isinstance(out, AsyncCollectiveTensor) else None
