"""ZeRO-1: parameters and gradients replicated, optimizer states sharded (parallel.zero=1).

The pattern of the ZeRO paper's stage 1 (Rajbhandari et al. 2020): each of the
`dp_shard` ranks updates only its slice of every parameter with its slice of the
optimizer states, and the updated slices are all-gathered so every rank holds the full
parameters again. AdamW is element-wise, so updating slices gives exactly the values
one process gets.

How the gradients reach the slices depends on the layout:

- data parallel alone: DDP all-reduces them during backward, overlapped with it
  (parallel/data_parallel.py), and each rank reads its slice of the sum.
- with tp or pp (`ParallelDims.zero1_scatters`): DDP runs neither DTensor parameters
  nor pipeline stages, so no wrapper is applied. After the step's last backward,
  `reduce_gradients` reduce-scatters them over dp_shard (and all-reduces the slices
  over dp_replicate): each rank receives only the sum of its slice. A reduce-scatter
  moves half the bytes of an all-reduce, so reduce-scatter + parameter all-gather cost
  what DDP's all-reduce alone costs, where all-reduce + all-gather would cost 1.5x.
  It runs after backward, not overlapped with it.

Context-parallel ranks hold the same parameters and their gradients sum like the
dp ranks', so under cp the states are cut over dp_shard x cp (`ParallelDims.zero1_shard_dim`)
and DDP reduces over dp x cp.

Either way the rows of a rank's gradients outside its slices are then zeroed, so the
clipping norm (summed over dp_shard, parallel/collectives.py) and the fp16 scaler (which
unscales the optimizer's views) see every element exactly once.

Every collective runs on the mesh dimensions of the rank's own (tp, pp) coordinate:
the dp group of one coordinate holds replicas of the same parameter shards.

Routed experts under expert parallelism are DTensors split over ep, and the ep ranks hold
different experts whose gradients already carry the whole ep group's tokens: they must
never be summed over ep. So their states get a second `Cut`, over efsdp (the ranks of
dp_shard x cp holding the same experts, Megatron's expert data-parallel group), with its
own reduce-scatter and all-gather. Each parameter goes to the first cut whose mesh holds
every dimension the parameter is split over (the experts' "ep" is in the second only).

A slice is a block of one dimension, cut the way DTensor's Shard cuts (chunks of
ceil(size / ranks)). Plain parameters are cut by rows. A tensor-parallel DTensor
parameter is cut in its local shard along a dimension TP does not split (a
column-parallel weight by columns, a row-parallel one by rows), so the states of each
(dp, tp) coordinate form one block of the full parameter. They are saved as DTensors
with Shard placements over (dp_replicate, dp_shard, ..., tp): the checkpoint layout
FSDP2 writes (FQN keys), which lets DCP reshard between ZeRO-1 and any other layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor (and warns on the old
# names); 2.11 has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def row_range(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """This rank's rows of a dim-0 size `rows`, as DTensor's Shard(0) assigns them."""
    per = -(-rows // ranks)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def slice_dim(p: torch.Tensor) -> int:
    """The dimension ZeRO-1 cuts: the first one the parameter's own (TP) placements leave whole."""
    if not isinstance(p, DTensor):
        return 0
    taken = {pl.dim for pl in p.placements if pl.is_shard()}
    free = [d for d in range(p.ndim) if d not in taken]
    if not free:
        raise ValueError(f"a {p.ndim}-D parameter sharded on every dimension ({p.placements}) cannot be "
                         "cut further by ZeRO-1; use parallel.zero=2 or 3")
    return free[0]


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a parameter or gradient (shares its storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Cut:
    """The data-parallel ranks some parameters' states are cut over (`dim` of `mesh`), and the
    mesh their saved states are laid out on: the dp dims plus the parameters' own."""

    def __init__(self, mesh: DeviceMesh, dim: str):
        names = mesh.mesh_dim_names
        self.mesh, self.dim = mesh, dim
        self.group = mesh.get_group(dim)
        self.ranks, self.rank = mesh.size(names.index(dim)), mesh.get_local_rank(dim)
        replicas = "dp_replicate" in names and mesh.size(names.index("dp_replicate")) > 1
        self.replicate_group = mesh.get_group("dp_replicate") if replicas else None

    def holds(self, p: torch.Tensor) -> bool:
        """Whether `mesh` has every dimension `p` is itself split over (so a saved state can say where it sits)."""
        own = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        return set(own or ()) <= set(self.mesh.mesh_dim_names)


@dataclass
class Slice:
    """One parameter and the block of its local tensor this rank updates."""

    param: nn.Parameter
    cut: Cut
    dim: int  # the dimension cut
    lo: int
    hi: int
    per: int  # the block size every rank pads to (ceil(size / ranks))

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's block of `t` (the parameter's or its gradient's local tensor)."""
        return local(t).narrow(self.dim, self.lo, self.hi - self.lo)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The local tensor with the cut dimension first (a view)."""
        return local(t).movedim(self.dim, 0)


class StridedSlices(ValueError):
    """Slices that are strided views (a column-parallel weight cut by columns, several local
    experts cut by rows): the fused AdamW kernel refuses them on GPU and, on CPU, writes
    outside them; the foreach and for-loop updates handle them."""


class Zero1AdamW(torch.optim.AdamW):
    """AdamW over this rank's slices of replicated parameters.

    `groups` are the usual param groups (of full parameters); the optimizer itself
    holds views of this rank's slices, so states exist only for them. `mesh` names the
    data-parallel dimensions and, under tp, the tp one; `shard_dim` the one sharded.
    `experts`: (mesh, dim) of a second cut for the parameters `mesh` lacks a dimension of
    (routed experts split over ep; see the module doc).
    """

    def __init__(self, model: nn.Module, groups: list[dict], mesh: DeviceMesh, shard_dim: str,
                 experts: tuple[DeviceMesh, str] | None = None, **kwargs):
        self.cuts = [Cut(mesh, shard_dim)] + ([Cut(*experts)] if experts else [])
        self.names = {p: n for n, p in model.named_parameters()}
        self.slices: list[Slice] = []
        shard_groups = []
        for g in groups:
            views = []
            for p in g["params"]:
                cut = self._cut_of(p)
                dim = slice_dim(p)
                size = local(p).shape[dim]
                self.slices.append(Slice(p, cut, dim, *row_range(size, cut.rank, cut.ranks), -(-size // cut.ranks)))
                views.append(self.slices[-1].of(p.detach()))
            shard_groups.append({**g, "params": views})
        # Decided from shapes, the same on every rank (a rank's own slice may be empty, or whole).
        strided = [self.names.get(s.param, "?") for s in self.slices
                   if s.cut.ranks > 1 and s.dim > 0 and math.prod(local(s.param).shape[:s.dim]) > 1]
        if kwargs.get("fused") and strided:
            raise StridedSlices(f"ZeRO-1's slices of {strided[0]} (and {len(strided) - 1} more) are strided views, "
                                "which the fused AdamW kernel cannot update")
        super().__init__(shard_groups, **kwargs)
        self.views = [v for g in self.param_groups for v in g["params"]]

    def _cut_of(self, p: torch.Tensor) -> Cut:
        """The first cut whose mesh holds `p`'s own dims (tp, ep): the states may be cut over a
        data-parallel dim only, where every rank holds the same shard, and saving them needs
        the parameter's dims in the mesh."""
        own = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        for cut in self.cuts:
            if cut.holds(p):
                if cut.dim in own:
                    raise ValueError(f"ZeRO-1 would cut optimizer states over {cut.dim!r}, which already shards "
                                     f"parameter {self.names.get(p, '?')}; use a data-parallel mesh dimension")
                return cut
        raise ValueError(f"ZeRO-1's meshes {[c.mesh.mesh_dim_names for c in self.cuts]} lack the dims {own} of "
                         f"parameter {self.names.get(p, '?')}; build them with those (ParallelDims.zero1_mesh)")

    @torch.no_grad()
    def reduce_gradients(self, scatter: bool) -> None:
        """Leave each rank's gradients holding its slices only, and give the views them.

        `scatter`: sum them first over the data-parallel ranks, each receiving only its
        slices (see the module doc); else DDP has summed them, and the other rows are
        zeroed. Either way the clipping norm sums the ranks' squares (collectives.py) and
        the fp16 scaler, which unscales the views, leaves no scaled element behind.
        """
        if scatter:
            for cut in self.cuts:
                self._reduce_scatter(cut, [s for s in self.slices if s.cut is cut])
        for s, view in zip(self.slices, self.views):
            grad = s.param.grad
            if grad is not None and not scatter:
                rows = s.rows(grad)
                rows[: s.lo].zero_()
                rows[s.hi:].zero_()
            view.grad = s.of(grad) if grad is not None else None

    def _reduce_scatter(self, cut: Cut, slices: list[Slice]) -> None:
        """One reduce-scatter over the cut's dim (+ one all-reduce over dp_replicate) for its gradients.

        The send buffer holds every gradient once (each rank's block padded to the same
        size): the only full-size copy; each rank receives a 1/ranks part of it. The ranks
        of a cut hold the same parameters, so all of them skip a cut with none."""
        if not slices:
            return
        grads = [self._full_grad(s) for s in slices]
        widths = [s.per * s.rows(g)[0].numel() for s, g in zip(slices, grads)]
        send = local(grads[0]).new_zeros((cut.ranks, sum(widths)))
        offset = 0
        for s, g, n in zip(slices, grads, widths):
            rows = s.rows(g)
            blocks = send[:, offset: offset + n].view(cut.ranks, s.per, *rows.shape[1:])
            whole = rows.shape[0] // s.per  # ranks whose block is full; the next one's is short
            blocks[:whole].copy_(rows[: whole * s.per].reshape(whole, s.per, *rows.shape[1:]))
            if whole < cut.ranks:
                blocks[whole, : rows.shape[0] - whole * s.per].copy_(rows[whole * s.per:])
            offset += n
        mine = send.new_empty(send.shape[1])
        _reduce_scatter(mine, send.flatten(), group=cut.group)
        if cut.replicate_group is not None:
            dist.all_reduce(mine, group=cut.replicate_group)
        offset = 0
        for s, g, n in zip(slices, grads, widths):
            rows = s.rows(g)
            rows.zero_()
            rows[s.lo: s.hi] = mine[offset: offset + n].view(s.per, *rows.shape[1:])[: s.hi - s.lo]
            offset += n

    def _full_grad(self, s: Slice) -> torch.Tensor:
        """The parameter's gradient, laid out as the parameter (a zero one if backward left none:
        every rank must send the same blocks)."""
        p = s.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            # TP may leave a replicated or partial gradient of a sharded parameter: keep its shard.
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        return p.grad

    @torch.no_grad()
    def step(self, closure=None):
        for s, view in zip(self.slices, self.views):
            if s.param.grad is not None:
                view.grad = s.of(s.param.grad)
        loss = super().step(closure)
        self._gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for s in self.slices:  # the full gradients belong to the model, not to the views
            p = s.param
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def _gather_params(self) -> None:
        """All-gather the updated slices (one collective per cut for all its parameters)."""
        for cut in self.cuts:
            self._gather_cut(cut, [s for s in self.slices if s.cut is cut])

    def _gather_cut(self, cut: Cut, slices: list[Slice]) -> None:
        if cut.ranks == 1 or not slices:
            return
        pieces = []
        for s in slices:
            rows = s.rows(s.param.detach())
            piece = rows.new_zeros((s.per, *rows.shape[1:]))
            piece[: s.hi - s.lo] = rows[s.lo: s.hi]
            pieces.append(piece.flatten())
        mine = torch.cat(pieces)
        gathered = mine.new_empty(mine.numel() * cut.ranks)
        _all_gather(gathered, mine, group=cut.group)
        by_rank = gathered.view(cut.ranks, -1)
        offset = 0
        for s, piece in zip(slices, pieces):
            rows = s.rows(s.param.detach())
            block = by_rank[:, offset: offset + piece.numel()].reshape(cut.ranks * s.per, *rows.shape[1:])
            rows.copy_(block[: rows.shape[0]])
            offset += piece.numel()

    # ---- checkpoints: the FSDP2 layout (FQN keys, Shard DTensors) ------------------------

    def _placements(self, s: Slice) -> list:
        """Where this rank's block sits in the full parameter, per dimension of its cut's mesh."""
        p, out = s.param, []
        own = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        for name in s.cut.mesh.mesh_dim_names:
            if name == s.cut.dim:
                out.append(Shard(s.dim))
            elif name in own:
                out.append(p.placements[own.index(name)])
            else:
                out.append(Replicate())
        return out

    def checkpoint_state(self) -> dict:
        """Optimizer state keyed by parameter name, states as DTensors of the full shapes."""
        if not self.state:  # no update yet (only skipped ones: an fp16 overflow, an anomaly)
            self._create_state()
        state = {}
        for s, view in zip(self.slices, self.views):
            entry = {}
            for key, value in self.state.get(view, {}).items():
                if key == "step" or value.ndim == 0:
                    entry[key] = value
                else:
                    entry[key] = DTensor.from_local(value, s.cut.mesh, self._placements(s), run_check=False,
                                                    shape=s.param.shape, stride=s.param.stride())
            state[self.names[s.param]] = entry
        groups = []
        index = 0
        for g in self.param_groups:
            names = [self.names[self.slices[index + i].param] for i in range(len(g["params"]))]
            index += len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def _create_state(self) -> None:
        """Every state (step, moments) by one update of lr 0 on zero gradients, which moves no
        parameter (and then counts none: no_update_yet): a save holds them all, as torch's own
        optimizer state dict makes them, and the resume that loads them in place finds every key.
        Collective (the update's all-gather): every rank saves, with the same history of updates."""
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = 0.0
            for view in g["params"]:
                view.grad = torch.zeros_like(view)
        try:
            self.step()
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr
            self.zero_grad(set_to_none=True)
        no_update_yet(self)

    @torch.no_grad()
    def load_checkpoint_state(self, saved: dict) -> None:
        """Copy a loaded checkpoint_state() (same structure, filled by DCP) into the states."""
        for s, view in zip(self.slices, self.views):
            for key, value in saved["state"][self.names[s.param]].items():
                self.state[view][key].copy_(local(value))
        for g, s in zip(self.param_groups, saved["param_groups"]):
            g.update({k: v for k, v in s.items() if k != "params"})


def no_update_yet(optimizer: torch.optim.Optimizer) -> None:
    """Step counts back to 0 after states were made by an update of lr 0 on zero gradients (which
    left the moments 0): the first real update is then the first, as in a run that never saved
    before it (counted 1, it was taken as the second: 0.73x its size at AdamW's usual betas)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()


def reduce_gradients(optimizer: torch.optim.Optimizer, scatter: bool) -> None:
    """After the step's last backward, before clipping: a ZeRO-1 optimizer reduce-scatters the
    gradients when no wrapper reduced them (`scatter`, ParallelDims.zero1_scatters) and hands
    its views their slices, which the fp16 overflow check reads. Other optimizers: nothing."""
    if isinstance(optimizer, Zero1AdamW):
        optimizer.reduce_gradients(scatter)
