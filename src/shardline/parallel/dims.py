"""ParallelDims: the one place where parallel degrees are validated and meshes built.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Data-parallel
ranks (dp_replicate x dp_shard) each see a different slice of the global batch;
tensor-parallel ranks in one group see the same slice. Every invalid combination is
a ConfigError raised before any collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardline.config import Config, ParallelConfig
from shardline.errors import ConfigError
from shardline.models.llama import ModelArgs

NOT_YET = {"cp": "context parallel", "ep": "expert parallel"}


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    zero: int = 3
    mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)  # dp_replicate x dp_shard, flattened
    # A gloo group of all ranks for asynchronous checkpoint writes, apart from training's.
    checkpoint_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Tied embeddings under pp: the first and the last pp rank of this rank's pipeline
    # (Megatron's "embedding group"), which sum the tied weight's gradient. None elsewhere.
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        for key, what in NOT_YET.items():
            if getattr(p, key) != 1:
                raise ConfigError(f"parallel.{key}={getattr(p, key)}: {what} is not implemented yet; use 1")
        fixed = p.dp_replicate * p.tp * p.pp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(_product_message(p, world_size, fixed, "dp_replicate x tp x pp"))
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ConfigError(_product_message(p, world_size, fixed * dp_shard,
                                               "dp_replicate x dp_shard x tp x pp"))
        return cls(p.dp_replicate, dp_shard, p.tp, p.pp, world_size, p.zero)

    # ---- derived degrees --------------------------------------------------------------

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def zero1(self) -> bool:
        """Replicated parameters (DDP over all dp ranks), optimizer states sharded over dp_shard."""
        return self.zero == 1 and self.dp_shard > 1

    def zero1_mesh(self) -> DeviceMesh | None:
        if not self.zero1:
            return None
        return self.submesh("dp_replicate", "dp_shard") if self.dp_replicate > 1 else self.submesh("dp_shard")

    def check_against(self, args: ModelArgs, cfg: Config) -> None:
        """Rules that involve the model shape and the batch."""
        cfg.check(dp_world=self.dp)
        t = self.tp
        if args.n_heads % t or args.kv_heads % t:
            raise ConfigError(f"parallel.tp={t} must divide n_heads={args.n_heads} and n_kv_heads={args.kv_heads}; "
                              f"valid tp: {_divisors_of_both(args.n_heads, args.kv_heads)}")
        if t > 1 and cfg.parallel.sequence_parallel and cfg.train.seq_len % t:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} must be divisible by parallel.tp={t} "
                              "with sequence_parallel")
        if self.pp > 1:
            self._check_pipeline(args, cfg)
        if self.zero1 and (self.tp > 1 or self.pp > 1):
            raise ConfigError(f"parallel.zero=1 composes with data parallelism only (got tp={self.tp}, "
                              f"pp={self.pp}); use zero=2 or zero=3 with tp/pp")
        if cfg.memory.cpu_offload and (cfg.run.device == "cpu" or not torch.cuda.is_available()):
            raise ConfigError("memory.cpu_offload=true moves sharded state from GPU to host memory: it needs a GPU")
        if cfg.memory.cpu_offload and self.dp_shard == 1:
            raise ConfigError("memory.cpu_offload=true needs FSDP: set parallel.dp_shard > 1")

    def pp_microbatches(self, cfg: Config) -> int:
        """Micro-batches per pipeline step: this rank's share of the batch / micro_batch_size."""
        return cfg.train.global_batch_size // (self.dp * cfg.train.micro_batch_size)

    def _check_pipeline(self, args: ModelArgs, cfg: Config) -> None:
        p = cfg.parallel
        v_shaped = p.pp_schedule in ("zbv", "dualpipev")
        virtual = 2 if v_shaped else p.pp_virtual_stages
        if p.pp_schedule in ("gpipe", "1f1b") and virtual != 1:
            raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} runs one stage per rank; set "
                              "pp_virtual_stages=1 or use interleaved_1f1b")
        if p.pp_schedule == "interleaved_1f1b" and virtual < 2:
            raise ConfigError("parallel.pp_schedule='interleaved_1f1b' needs pp_virtual_stages >= 2")
        if v_shaped and p.pp_virtual_stages not in (1, 2):
            raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} places exactly 2 stages per rank; "
                              "set pp_virtual_stages=2")
        if args.n_layers < self.pp * virtual:
            raise ConfigError(f"model has {args.n_layers} layers, fewer than the {self.pp * virtual} pipeline "
                              f"stages (pp={self.pp} x {virtual} per rank); lower parallel.pp")
        if args.tie_embeddings and v_shaped and self.dp > 1:
            # Each stage is its own FSDP unit, and FSDP2 cannot share a parameter between units.
            raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} with tied embeddings and data parallelism "
                              f"(dp_replicate x dp_shard = {self.dp}) is not supported: the V shape puts the first "
                              "and the last stage on one rank, where the tied weight would be one parameter in two "
                              "FSDP units; use pp_schedule=1f1b, gpipe or interleaved_1f1b, or model.tie_embeddings=0")
        n_mb = cfg.train.global_batch_size // (self.dp * cfg.train.micro_batch_size)
        if p.pp_microbatches and p.pp_microbatches != n_mb:
            raise ConfigError(f"parallel.pp_microbatches={p.pp_microbatches} but global_batch_size / (dp x "
                              f"micro_batch_size) = {n_mb}; set pp_microbatches=0 or change the batch sizes")
        if n_mb < self.pp:
            raise ConfigError(f"{n_mb} micro-batches per step cannot fill {self.pp} pipeline stages; raise "
                              f"train.global_batch_size or lower train.micro_batch_size (need >= {self.pp})")

    # ---- meshes -----------------------------------------------------------------------

    def build_mesh(self, device: torch.device, embedding_group: bool = False) -> DeviceMesh:
        """The mesh and the groups beside it; `embedding_group`: tied embeddings whose two ends
        sit on the first and the last pp rank."""
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        self.dp_mesh = self.mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        self.checkpoint_group = dist.new_group(backend="gloo")
        if embedding_group and self.pp > 1:
            self.embedding_group = self._build_embedding_group()
        return self.mesh

    def _build_embedding_group(self) -> dist.ProcessGroup | None:
        """The group of the first and the last pp rank that share this rank's other coordinates."""
        if self.pp == 2:
            return self.submesh("pp").get_group()
        ranks = self.mesh.mesh.reshape(self.pp, -1)  # pp x (every other coordinate)
        pairs = [[int(ranks[0, i]), int(ranks[-1, i])] for i in range(ranks.shape[1])]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)  # every rank creates every group; None if in none
        return mine

    def submesh(self, *names: str) -> DeviceMesh:
        if names == ("dp",):
            return self.dp_mesh
        return self.mesh[names if len(names) > 1 else names[0]]

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (0 in one process)."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0


def _product_message(p: ParallelConfig, world: int, product: int, what: str) -> str:
    return (f"parallel degrees dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} pp={p.pp} "
            f"give {what} = {product}, which does not match the world size {world}; "
            f"their product must equal the number of processes")


def _divisors_of_both(a: int, b: int) -> str:
    return ", ".join(str(d) for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0)
