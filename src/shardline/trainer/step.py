"""What one rank computes of a step: forward, loss and backward of its micro-batches.

The one place training runs a pipeline schedule or the model itself. Every loss here is
a share of the global mean over the labelled tokens of the whole step (`n_tokens`), so
neither gradient accumulation nor any parallel layout changes a number: the
data-parallel reduction sums the ranks' gradients of their shares, which is the
gradient of the global mean as one process computes it.
"""

from __future__ import annotations

import re
import warnings
from typing import Callable

import numpy as np
import torch

from shardline.config import Config
from shardline.parallel.collectives import local_value, loss_context, reduce_over
from shardline.parallel.context.sharding import shard_batch
from shardline.parallel.data_parallel import gradient_sync
from shardline.parallel.dims import ParallelDims
from shardline.parallel.float8 import precompute_scales
from shardline.parallel.parallelize import BuiltModel
from shardline.parallel.pipeline import sync_tied_gradient
from shardline.precision import LossScaler, autocast

Batch = dict[str, torch.Tensor]

# FSDP2 warns when its root returns a view: an in-place write to it would skip the gradient's hook.
# Under tp without loss parallel the logits are one (a replicated DTensor's local tensor); the loss
# reads them into new tensors and nothing writes them, so the warning (on every rank) is a false alarm.
_VIEW_OUTPUT = r"FSDP2-wrapped module \([^)]*\) returned a view tensor"
# A skipped update (an anomaly, an fp16 overflow) still advances the schedule, indexed by step:
# torch warns of that order, which is intended here.
_SCHEDULER_ORDER = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


def ignore_false_alarms() -> None:
    """Filter the two warnings above, once a process. (Not per step under catch_warnings: leaving
    it resets Python's record of warnings shown, so every once-only warning was shown each step.)"""
    for message in (_VIEW_OUTPUT, _SCHEDULER_ORDER):
        warnings.filterwarnings("ignore", message=message)  # (the same filter again replaces itself)


class StepRunner:
    """Forward and backward over the model as built (a module to call, DDP-wrapped or
    compiled, or under pp the pipeline schedule), with the loss scaled by `scaler`."""

    def __init__(self, cfg: Config, built: BuiltModel, dims: ParallelDims, device: torch.device, scaler: LossScaler):
        self.cfg, self.dims, self.device, self.scaler = cfg, dims, device, scaler
        self.model, self.forward = built.model, built.forward
        self.pipeline, self.context = built.pipeline, built.context
        if self.pipeline is not None:
            self.pipeline.build_schedule(device, dims.submesh("pp").get_group(), self._pipeline_loss)
        self._first_scales = cfg.train.precision == "fp8"  # due before the first pass, after every load
        ignore_false_alarms()

    def _scales_once(self) -> None:
        """fp8: the float8-gathered weights' first scales, those of the whole weights as after every
        step (left to FSDP's pre-gather hook, the amax is reduced over its shard ranks only: under tp
        each tp shard its own), at the first pass, when every weight a start or a resume loads is in
        place. FSDP's lazy init, at that pass, keeps them: float8-gathered shards are equal
        (parallel/float8.convert), so it makes no new shard tensor."""
        if self._first_scales:
            self._first_scales = False
            precompute_scales(self.model)

    @property
    def loss_in_model(self) -> bool:
        """The model scores the labels itself (chunked, never holding all logits): it is given them."""
        return self.cfg.train.loss_chunk_tokens > 0

    def forward_backward_step(self, micro: list[np.ndarray], batch_of: Callable[[np.ndarray], Batch],
                              n_tokens: int) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches (`batch_of(indices)` reads one);
        returns its share of the global mean loss."""
        self._scales_once()
        if self.pipeline is None:
            loss = torch.zeros((), device=self.device)
            for i, idx in enumerate(micro):
                with gradient_sync(self.forward, enabled=i == len(micro) - 1):
                    loss += self.forward_backward(batch_of(idx), n_tokens)
            return loss
        # The schedule splits this rank's share into the micro-batches itself; the last
        # stage's loss function (_pipeline_loss) returns each one's scaled share.
        batch = self._local(batch_of(np.concatenate(micro)))
        with loss_context(self.dims, self.cfg.parallel), autocast(self.device, self.cfg.train.precision):
            losses = self.pipeline.run(batch, self.cfg.train.document_mask, n_tokens, self.loss_in_model)
        total = sum((local_value(x.detach()) for x in losses), torch.zeros((), device=self.device))
        sync_tied_gradient(self.model, self.dims.embedding_group)
        return self.scaler.unscaled(total)

    def forward_backward(self, batch: Batch, n_tokens: int) -> torch.Tensor:
        """Backward of this micro-batch's share of the global mean loss; returns that share."""
        with loss_context(self.dims, self.cfg.parallel):  # the backward must run inside it too
            loss = self.loss_sum(batch) / n_tokens
            self.scaler.scale(loss).backward()
        return local_value(loss.detach())

    def _pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """A micro-batch's share of the global mean, scaled as forward_backward scales it
        (the last stage's output: logits, or the summed loss it computed itself)."""
        loss_sum = output.sum() if self.loss_in_model else self.model.loss.score(output, labels)
        return self.scaler.scale(loss_sum / n_tokens)

    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """Summed cross-entropy over the labelled tokens of a batch (fp32 logits); under cp,
        over this rank's tokens of it."""
        batch = self._local(batch)
        doc_ids = batch["doc_ids"] if self.cfg.train.document_mask else None
        with autocast(self.device, self.cfg.train.precision):
            if self.loss_in_model:
                return self.forward(batch["input_ids"], doc_ids, batch.get("positions"), labels=batch["labels"])
            logits = self.forward(batch["input_ids"], doc_ids, batch.get("positions"))
        return self.model.loss.score(logits, batch["labels"])

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss over the whole global batch (each rank holds shares of it)."""
        if self.dims.pp > 1:
            loss = reduce_over(self.dims, "pp", loss, "sum")  # only the last stage holds it
        return reduce_over(self.dims, self.dims.batch_dim, loss, "sum")

    def to_device(self, batch: Batch) -> Batch:
        """The batch on the device. To a GPU through pinned memory: a copy from pageable memory
        waits for the kernels queued before it, so the host could not run ahead of the GPU."""
        if self.device.type != "cuda":
            return {k: v.to(self.device) for k, v in batch.items()}
        return {k: (v.pin_memory() if v.device.type == "cpu" else v).to(self.device, non_blocking=True)
                for k, v in batch.items()}  # (an eval batch comes here twice: on the device already)

    def _local(self, batch: Batch) -> Batch:
        """The batch on this rank's device; under cp, only this rank's tokens (and their positions)."""
        batch = self.to_device(batch)
        if self.context is None:
            return batch
        return shard_batch(batch, self.context.local_positions(self.device))  # (no host copy per micro-batch)

    @torch.no_grad()
    def eval_loss_total(self, batches: list[np.ndarray], batch_of: Callable[[np.ndarray], Batch],
                        stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """Summed cross-entropy of the eval batches over every rank; None where `stop`, asked before
        each micro-batch after the first (a collective: every rank asks as often), said to stop.

        The data-parallel ranks share the batches (batch i goes to dp rank i mod dp).
        Every rank runs the same number of forward passes, since sharded parameters
        are gathered collectively: a rank short of a batch repeats one and counts it 0.
        """
        self._scales_once()
        dp, dp_rank = self.dims.dp, self.dims.dp_rank()
        total = torch.zeros((), device=self.device)
        for i in range(dp_rank, -(-len(batches) // dp) * dp, dp):
            if stop is not None and i >= dp and stop():
                return None
            batch = self.to_device(batch_of(batches[min(i, len(batches) - 1)]))
            weight = 1.0 if i < len(batches) else 0.0
            total += weight * self._eval_loss_sum(batch)
        return self.global_loss(total)

    def _eval_loss_sum(self, batch: Batch) -> torch.Tensor:
        """Summed cross-entropy of an eval batch on this rank (under pp: 0 but on the last stage)."""
        with loss_context(self.dims, self.cfg.parallel):
            if self.pipeline is None:
                return local_value(self.loss_sum(batch))
            batch = self._local(batch)
            with autocast(self.device, self.cfg.train.precision):
                out = self.pipeline.forward_only(batch, self.cfg.train.document_mask,
                                                 self.dims.submesh("pp").get_group(), self.loss_in_model)
            if out is None:
                return torch.zeros((), device=self.device)
            return local_value(out.sum() if self.loss_in_model else self.model.loss.score(out, batch["labels"]))
