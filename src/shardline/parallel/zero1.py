"""ZeRO-1: parameters and gradients replicated, optimizer states sharded (parallel.zero=1).

The pattern of the ZeRO paper's stage 1: gradients are all-reduced as in DDP; each of
the `dp_shard` ranks then updates only its slice of every parameter with its slice of
the optimizer states, and the updated slices are all-gathered so every rank holds the
full parameters again. AdamW is element-wise, so updating slices gives exactly the
values one process gets.

A slice is a block of rows (dim 0), cut the way DTensor's Shard(0) cuts (chunks of
ceil(rows / ranks)), so the optimizer states are saved as Shard(0) DTensors: the same
checkpoint layout FSDP2 writes, which lets DCP reshard between ZeRO-1 and any other
layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def row_range(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """This rank's rows of a dim-0 size `rows`, as DTensor's Shard(0) assigns them."""
    per = -(-rows // ranks)
    return min(rank * per, rows), min((rank + 1) * per, rows)


class Zero1AdamW(torch.optim.AdamW):
    """AdamW over this rank's row slices of replicated parameters.

    `groups` are the usual param groups (of full parameters); the optimizer itself
    holds views of this rank's rows, so states exist only for them.
    """

    def __init__(self, model: nn.Module, groups: list[dict], mesh: DeviceMesh, shard_dim: str, **kwargs):
        self.mesh, self.shard_dim = mesh, shard_dim
        self.group = mesh.get_group(shard_dim)
        self.ranks, self.rank = mesh.size(mesh.mesh_dim_names.index(shard_dim)), mesh.get_local_rank(shard_dim)
        self.full: list[nn.Parameter] = []
        self.slices: list[tuple[int, int]] = []
        self.names = {p: n for n, p in model.named_parameters()}
        shard_groups = []
        for g in groups:
            views = []
            for p in g["params"]:
                lo, hi = row_range(p.shape[0], self.rank, self.ranks)
                self.full.append(p)
                self.slices.append((lo, hi))
                views.append(p.detach()[lo:hi])
            shard_groups.append({**g, "params": views})
        super().__init__(shard_groups, **kwargs)
        self.views = [v for g in self.param_groups for v in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for p, view, (lo, hi) in zip(self.full, self.views, self.slices):
            if p.grad is not None:
                view.grad = p.grad[lo:hi]
        loss = super().step(closure)
        self._gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.full:  # the full gradients belong to the model, not to the views
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def _gather_params(self) -> None:
        """All-gather the updated row slices (one collective for all parameters)."""
        if self.ranks == 1:
            return
        per_rank = [-(-p.shape[0] // self.ranks) for p in self.full]  # rows, the last rank's padded
        pieces = []
        for p, per, (lo, hi) in zip(self.full, per_rank, self.slices):
            piece = p.new_zeros((per, *p.shape[1:]))
            piece[: hi - lo] = p[lo:hi]
            pieces.append(piece.flatten())
        local = torch.cat(pieces)
        gathered = local.new_empty(local.numel() * self.ranks)
        dist.all_gather_into_tensor(gathered, local, group=self.group)
        by_rank = gathered.view(self.ranks, -1)
        offset = 0
        for p, per, piece in zip(self.full, per_rank, pieces):
            rows = by_rank[:, offset: offset + piece.numel()].reshape(self.ranks * per, *p.shape[1:])
            p.copy_(rows[: p.shape[0]])
            offset += piece.numel()

    # ---- checkpoints: the FSDP2 layout (FQN keys, Shard(0) DTensors) ---------------------

    def _placements(self):
        return [Shard(0) if name == self.shard_dim else Replicate() for name in self.mesh.mesh_dim_names]

    def checkpoint_state(self) -> dict:
        """Optimizer state keyed by parameter name, states as DTensors of the full shapes."""
        state = {}
        for p, view in zip(self.full, self.views):
            entry = {}
            for key, value in self.state.get(view, {}).items():
                if key == "step" or value.ndim == 0:
                    entry[key] = value
                else:
                    entry[key] = DTensor.from_local(value, self.mesh, self._placements(), run_check=False,
                                                    shape=p.shape, stride=p.stride())
            state[self.names[p]] = entry
        groups = []
        index = 0
        for g in self.param_groups:
            names = [self.names[self.full[index + i]] for i in range(len(g["params"]))]
            index += len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_checkpoint_state(self, saved: dict) -> None:
        """Copy a loaded checkpoint_state() (same structure, filled by DCP) into the states."""
        for p, view in zip(self.full, self.views):
            for key, value in saved["state"][self.names[p]].items():
                local = value.to_local() if isinstance(value, DTensor) else value
                self.state[view][key].copy_(local)
        for g, s in zip(self.param_groups, saved["param_groups"]):
            g.update({k: v for k, v in s.items() if k != "params"})
