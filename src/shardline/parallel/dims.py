"""ParallelDims: the one place where meshes and process groups are built.

What a layout is and which layouts are valid is `shardline.layout`'s business; this
object takes a resolved, checked Layout and builds its meshes. Mesh dimensions,
outermost first: pp, dp_replicate, dp_shard, cp_ring, cp_ulysses, tp. Data-parallel
ranks (dp_replicate x dp_shard) each see a different slice of the global batch;
context-parallel ranks (cp = cp_ring x cp_ulysses) split each of its sequences, and
tensor-parallel ranks in one group see the same tokens. FSDP shards over
dp_shard x cp ("dp_shard_cp"): cp ranks hold the same parameters, so they share
them as data-parallel ranks would, and their gradients are summed the same way.

Expert parallelism borrows ep of the dp_shard x cp ranks. When ep divides dp_shard,
dp_shard is built as dp_shard_mod_ep x ep (and kept as a flattened dimension of that
name); routed experts are split over "ep" and sharded by FSDP over what is left of
dp_shard x cp ("efsdp": dp_shard_mod_ep x cp). Otherwise ep is a multiple of cp
(layout rule `_not_built_moe`) and borrows every cp rank (`ep_borrows_cp`, as torchtitan
does): dp_shard is built as dp_shard_mod_ep x dp_shard_in_ep, "ep" is the flattened
dp_shard_in_ep x cp_ring x cp_ulysses, and efsdp is dp_shard_mod_ep alone: the cp ranks
hold different experts then, so the experts' gradients are not summed over cp (the
tokens of every cp rank reach them through the all-to-all). Under ZeRO-1 the experts'
optimizer states are cut over efsdp instead of FSDP sharding them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardline.layout import Layout
from shardline.parallel.distributed import hold_one_process_group, release_one_process_group


@dataclass
class ParallelDims:
    layout: Layout
    mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)  # dp_replicate x dp_shard, flattened
    # A gloo group of all ranks for asynchronous checkpoint writes, apart from training's.
    checkpoint_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Another gloo group of all ranks, for host-side agreements (e.g. on a stop request).
    control_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Tied embeddings under pp: the first and the last pp rank of this rank's pipeline
    # (Megatron's "embedding group"), which sum the tied weight's gradient. None elsewhere.
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)
    flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)  # flattened dimensions by name
    made_group: bool = field(default=False, repr=False)  # build_mesh holds a one-process group: release()

    # ---- degrees (the layout's) ---------------------------------------------------------

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.layout.dp_shard

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def zero(self) -> int:
        return self.layout.zero

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def needs_mesh(self) -> bool:
        """Several ranks, or one under FSDP2's CPU offload (a one-rank mesh; Layout.offload_fsdp)."""
        return self.world_size > 1 or self.layout.offload_fsdp

    @property
    def data_parallel_wrap(self) -> bool:
        """Whether data parallelism wraps the parameters at all: several dp x cp ranks, or one
        under FSDP2's CPU offload (Layout.offload_fsdp)."""
        return self.dp * self.cp > 1 or self.layout.offload_fsdp

    @property
    def ddp(self) -> bool:
        return self.layout.dp_mode == "ddp"

    @property
    def zero1(self) -> bool:
        """Replicated parameters (DDP over all dp and cp ranks), optimizer states sharded over
        dp_shard x cp (`zero1_shard_dim`)."""
        return self.zero == 1 and self.dp_shard * self.cp > 1

    @property
    def zero1_shard_dim(self) -> str:
        """The mesh dimension ZeRO-1 cuts optimizer states over: the ranks FSDP would shard over
        (cp ranks hold the same parameters as dp_shard ranks, and their gradients sum alike)."""
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    @property
    def zero1_scatters(self) -> bool:
        return self.layout.zero1_scatters

    def zero1_cut_dim(self, param_dims: tuple[str, ...]) -> str:
        """The dimension ZeRO-1 cuts a parameter's states over, given the mesh dims the parameter
        is itself split over: routed experts split over ep go over efsdp, the ranks that hold the
        same experts (Megatron's expert data-parallel group; their ep-mates hold other experts),
        everything else over `zero1_shard_dim`. Under tp alone the experts are whole on a tp rank
        and cut like any TP shard."""
        return "efsdp" if self.ep > 1 and {"ep", "ep_tp"} & set(param_dims) else self.zero1_shard_dim

    def zero1_expert_cut(self) -> tuple[DeviceMesh, str] | None:
        """Under ep: the mesh the routed experts' states live on (dp_replicate, efsdp and the dim
        the experts are split over, so a saved state knows its experts) and its dim they are cut over."""
        if not self.zero1 or self.ep == 1:
            return None
        return self.submesh("dp_replicate", "efsdp", "ep_tp" if self.tp > 1 else "ep"), "efsdp"

    def zero1_mesh(self) -> DeviceMesh | None:
        """The dims ZeRO-1's states live on: dp_replicate, the shard dim and, under tp, tp, so a
        saved state knows its TP shard."""
        if not self.zero1:
            return None
        shard = self.zero1_shard_dim
        if self.tp > 1:
            return self.submesh("dp_replicate", shard, "tp")
        return self.submesh("dp_replicate", shard) if self.dp_replicate > 1 else self.submesh(shard)

    # ---- meshes -----------------------------------------------------------------------

    def release(self) -> None:
        """Let go of the one-process group build_mesh holds (ended with its last holder: a caller's
        own init_process_group after the run would find it). A group torchrun's launch or the
        caller made is theirs to end (shutdown_distributed)."""
        if self.made_group:
            release_one_process_group()
        self.made_group = False

    def build_mesh(self, device: torch.device, embedding_group: bool = False) -> DeviceMesh:
        """The mesh and the groups beside it; `embedding_group`: tied embeddings whose two ends
        sit on the first and the last pp rank. One process without a group (torchrun's world
        1, or no torchrun) gets a one-rank group first."""
        if self.world_size == 1:
            self.made_group = hold_one_process_group(device)
        ring, ulysses = self.layout.cp_degrees
        shard, shard_sizes = self._dp_shard_dims()
        names = ("pp", "dp_replicate", *shard, "cp_ring", "cp_ulysses", "tp")
        shape = (self.pp, self.dp_replicate, *shard_sizes, ring, ulysses, self.tp)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        self.dp_mesh = self.mesh[("dp_replicate", *shard)]._flatten("dp")
        cp = ("cp_ring", "cp_ulysses")
        self.flat = {"dp": self.dp_mesh, "cp": self.mesh[cp]._flatten("cp"),
                     "dp_shard_cp": self.mesh[(*shard, *cp)]._flatten("dp_shard_cp"),
                     "dp_cp": self.mesh[("dp_replicate", *shard, *cp)]._flatten("dp_cp")}
        if self.ep > 1:
            self._build_expert_dims(shard)
        self.checkpoint_group = dist.new_group(backend="gloo")
        self.control_group = dist.new_group(backend="gloo")
        if embedding_group and self.pp > 1:
            self.embedding_group = self._build_embedding_group()
        return self.mesh

    @property
    def ep_borrows_cp(self) -> bool:
        return self.layout.ep_borrows_cp

    def _dp_shard_dims(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The mesh dims dp_shard is built from and their sizes: itself, or split so that its
        inner part (all of ep, or ep / cp of it when ep borrows the cp ranks) is a dim of its own."""
        if self.ep == 1:
            return ("dp_shard",), (self.dp_shard,)
        inner = self.ep // self.cp if self.ep_borrows_cp else self.ep
        return ("dp_shard_mod_ep", "dp_shard_in_ep" if self.ep_borrows_cp else "ep"), (self.dp_shard // inner, inner)

    def _build_expert_dims(self, shard: tuple[str, ...]) -> None:
        """dp_shard flattened back, ep (flattened when it borrows cp), efsdp and ep_tp."""
        cp = ("cp_ring", "cp_ulysses")
        self.flat["dp_shard"] = self.mesh[shard]._flatten("dp_shard")
        if self.ep_borrows_cp:
            ep_dims, efsdp_dims = ("dp_shard_in_ep", *cp), ("dp_shard_mod_ep",)
            self.flat["ep"] = self.mesh[ep_dims]._flatten("ep")
        else:
            ep_dims, efsdp_dims = ("ep",), ("dp_shard_mod_ep", *cp)
        # Ranks holding the same experts and different tokens: their expert gradients sum.
        self.flat["efsdp"] = self.mesh[efsdp_dims]._flatten("efsdp")
        if self.tp > 1:  # experts split over ep x tp, ep-major
            self.flat["ep_tp"] = self.mesh[(*ep_dims, "tp")]._flatten("ep_tp")

    def _build_embedding_group(self) -> dist.ProcessGroup | None:
        """The group of the first and the last pp rank that share this rank's other coordinates."""
        if self.pp == 2:
            return self.submesh("pp").get_group()
        ranks = self.mesh.mesh.reshape(self.pp, -1)  # pp x (every other coordinate)
        pairs = [[int(ranks[0, i]), int(ranks[-1, i])] for i in range(ranks.shape[1])]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)  # every rank creates every group; None if in none
        return mine

    def submesh(self, *names: str) -> DeviceMesh:
        """The mesh of these dimensions, flattened ones (`flat`) included, in the order given.

        A flattened dimension is the mesh kept when it was built: torch is deprecating
        slicing one from the root mesh, so several dimensions that include one are joined
        from their own 1-D meshes (the same layout and process groups a slice would give)."""
        if len(names) == 1:
            return self.flat[names[0]] if names[0] in self.flat else self.mesh[names[0]]
        if not set(names) & self.flat.keys():
            return self.mesh[names]
        return DeviceMesh._concatenate([self.submesh(name) for name in names])

    @property
    def batch_dim(self) -> str:
        """The mesh dimension over which the ranks hold disjoint tokens of a step's batch (their
        loss shares and gradients are summed over it): dp, and cp beside it."""
        return "dp_cp" if self.cp > 1 else "dp"

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (0 in one process)."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0
