"""A layout's degrees and what follows from them (`Layout`), and the layout a config describes (`resolve`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from shardline.config import Config
from shardline.errors import ConfigError

V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2 pp - 1 - r
SPLIT_BACKWARD = V_SHAPED  # torch's zero-bubble schedules: each backward in an input and a weight pass
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
# The [parallel] keys nothing reads where their degree is 1 (a plan leaves them at their defaults there,
# and a launch names any set: launch_notes.unused_settings).
IDLE_AT_DEGREE_ONE = {"pp": ("pp_schedule", "pp_virtual_stages", "pp_microbatches"),
                      "cp": ("cp_mode", "cp_balance", "cp_ulysses"), "tp": ("sequence_parallel", "loss_parallel")}

Problem = tuple[str, str]  # (rule key, one-line message naming the keys and what would be valid)


class ModelShape(Protocol):
    """What the rules read of a model (ModelArgs has it)."""

    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_dim: int
    dim: int
    head_size: int
    vocab_size: int
    tie_embeddings: bool


@dataclass(frozen=True)
class Layout:
    """A resolved layout: every degree known (no -1), micro-batches counted."""

    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 3  # what dp_shard shards: 1 optimizer states, 2 + gradients, 3 + parameters
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 0  # hybrid: the all-to-all part of cp (see cp_degrees)
    cp_balance: str = "zigzag"
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1  # micro-batches of one pipeline round (= per rank and step)
    pp_virtual_stages: int = 1  # stages per rank (V-shaped schedules: 2)
    activation_checkpoint: str = "none"
    ac_every: int = 2
    cpu_offload: bool = False
    micro_batch_size: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the sharded model states: dp_shard x cp, both for FSDP
        and for ZeRO-1's optimizer states (replicas, dp_replicate, hold a copy each)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same routed experts but see other tokens (1 without expert parallelism):
        the experts' weights, or ZeRO-1's states of them, are cut over these (parallel/dims.py)."""
        return self.shard_degree // self.ep if self.ep > 1 else 1

    @property
    def offload_fsdp(self) -> bool:
        """CPU offload is FSDP2's (zero 2 or 3), so it wraps the model in FSDP2 even where no
        rank shares its states: at shard degree 1 over a size-1 shard dimension (one rank, or
        HSDP with shard 1 under dp_replicate), keeping parameters, gradients and optimizer
        states on the host all the same."""
        return self.cpu_offload and self.zero != 1

    @property
    def cp_degrees(self) -> tuple[int, int]:
        """(ring, ulysses): the ranks that pass K/V around x the ranks that exchange heads."""
        if self.cp == 1:
            return 1, 1
        u = {"ring": 1, "ulysses": self.cp}.get(self.cp_mode, self.cp_ulysses)
        return self.cp // max(u, 1), u

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule in V_SHAPED else self.pp_virtual_stages

    @property
    def split_backward(self) -> bool:
        """Whether the pipeline runs each micro-batch's backward in two passes over one graph
        (inputs, then weights): what checkpointing and compiled blocks must survive."""
        return self.pp > 1 and self.pp_schedule in SPLIT_BACKWARD

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def dp_mode(self) -> str:
        if self.dp_shard * self.cp == 1 and not self.offload_fsdp:
            return "ddp" if self.dp_replicate > 1 else "single"
        if self.zero == 1:
            return "zero1"  # DDP, optimizer states sharded over dp_shard x cp (each replica holds a copy)
        if self.dp_replicate > 1:
            return "hsdp"  # zero=2 too: FSDP2 keeps the parameters sharded at rest either way
        return {2: "zero2", 3: "fsdp"}[self.zero]

    @property
    def zero1_scatters(self) -> bool:
        """ZeRO-1 under tp, pp or ep: no DDP wrapper (it runs neither DTensor parameters, TP's or
        the experts split over ep, nor pipeline stages, and it would sum expert gradients over
        ep); the optimizer reduce-scatters the gradients itself (parallel/zero1.py)."""
        return self.dp_mode == "zero1" and (self.tp > 1 or self.pp > 1 or self.ep > 1)

    @property
    def ep_borrows_cp(self) -> bool:
        """Whether ep borrows cp ranks (ep does not divide dp_shard). What is built then is ep
        taking every cp rank and ep / cp of the dp_shard ranks (rules: `_not_built_moe`)."""
        return self.ep > 1 and self.dp_shard % self.ep != 0

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each rank runs per optimizer step."""
        return global_batch // (self.dp * self.micro_batch_size)

    def describe(self) -> str:
        # (TP's sequence and loss parallelism are on by default, and unnamed then: only their absence is)
        off = [name for name, on in (("no-sp", self.sequence_parallel), ("no-lp", self.loss_parallel)) if not on]
        parts = [f"tp{self.tp}" + (f"({','.join(off)})" if off and self.tp > 1 else "")]
        if self.pp > 1:
            sched = self.pp_schedule + (f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else "")
            parts.append(f"pp{self.pp}({sched} m{self.pp_microbatches})")
        if self.cp > 1:
            ring, u = self.cp_degrees
            mode = {"ring": f"ring {self.cp_balance}", "ulysses": "ulysses"}.get(self.cp_mode, f"ring{ring}xu{u}")
            parts.append(f"cp{self.cp}({mode})")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        # FSDP shards over dp_shard x cp (the cp ranks hold the same parameters): "fsdp:4xcp2" is 8 ranks.
        shard = "x".join([str(self.dp_shard)] * (self.dp_shard > 1 or self.cp == 1) + [f"cp{self.cp}"] * (self.cp > 1))
        # Every degree is named: ZeRO-1's replicas (each holds a copy of the shards) and HSDP's ZeRO-2.
        dp = {"hsdp": f"hsdp{self.dp_replicate}x{shard}" + ("(zero2)" if self.zero == 2 else ""),
              "ddp": f"ddp{self.dp_replicate}", "single": "dp1",
              "zero1": f"ddp{self.dp_replicate}+" * (self.dp_replicate > 1) + f"zero1:{shard}"
              }.get(self.dp_mode, f"{self.dp_mode}:{shard}")
        parts.append(dp + ("+offload" if self.cpu_offload else ""))
        ac = self.activation_checkpoint
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append("ac=" + (f"sel/{self.ac_every}" if ac == "selective" else ac))
        return " ".join(parts)

    def to_json(self) -> dict:
        """The fields; ac_every null where no selective checkpointing reads it (as an emitted config
        leaves it at its default)."""
        fields = dataclasses.asdict(self)
        if self.activation_checkpoint != "selective":
            fields["ac_every"] = None
        return fields


# ---- from a config ------------------------------------------------------------------


def resolve(cfg: Config, world: int | None) -> Layout:
    """The Layout a config describes on `world` processes.

    dp_shard = -1 takes what the other degrees leave of `world` (1 when world is None,
    as `shardline estimate` without --gpus does). A product that is not the world size
    is a ConfigError naming the degrees.
    """
    p, m = cfg.parallel, cfg.memory
    dp_shard = shard_degree(cfg, world)
    lay = Layout(dp_replicate=p.dp_replicate, dp_shard=dp_shard, zero=p.zero, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                 cp_mode=p.cp_mode, cp_ulysses=p.cp_ulysses, cp_balance=p.cp_balance,
                 sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel, pp_schedule=p.pp_schedule,
                 pp_virtual_stages=_stages_per_rank(p.pp, p.pp_schedule, p.pp_virtual_stages),
                 activation_checkpoint=m.activation_checkpoint, ac_every=m.ac_every, cpu_offload=m.cpu_offload,
                 micro_batch_size=cfg.train.micro_batch_size)
    n_mb = lay.micro_batches(cfg.train.global_batch_size) if p.pp > 1 else 1
    return dataclasses.replace(lay, pp_microbatches=p.pp_microbatches or max(n_mb, 1))


# The degrees whose product is the world size.
WORLD_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


def shard_degree(cfg: Config, world: int | None) -> int:
    """dp_shard on `world` processes (-1: what the other degrees leave; 1 when world is None); a
    product of the degrees that is not the world size is a ConfigError naming them."""
    p = cfg.parallel
    fixed = p.dp_replicate * p.cp * p.tp * p.pp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        dp_shard = 1 if world is None else max(world // fixed, 1)
    if world is not None and fixed * dp_shard != world:
        raise ConfigError(_product_message(cfg, world, fixed if p.dp_shard == -1 else fixed * dp_shard))
    return dp_shard


def _stages_per_rank(pp: int, schedule: str, virtual: int) -> int:
    """A V-shaped schedule always places 2 stages per rank; the config may leave it at 1."""
    return 2 if pp > 1 and schedule in V_SHAPED and virtual == 1 else virtual


def _product_message(cfg: Config, world: int, product: int) -> str:
    p = cfg.parallel
    degrees = f"parallel degrees dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} pp={p.pp}"
    if p.dp_shard == -1:  # dp_shard takes what the others leave: their product must divide the world
        fits = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        return (f"{degrees} give dp_replicate x cp x tp x pp = {product}, which does not divide the world size "
                f"{world} (dp_shard=-1 takes what they leave); with {world} process{'es' * (world > 1)} that "
                f"product must be one of {fits}")
    others = p.dp_replicate * p.cp * p.tp * p.pp
    way_out = "set parallel.dp_shard=-1 to take what the others leave" if world % others == 0 else (
        f"parallel.dp_shard=-1 takes what the others leave, but their product {others} does not divide {world} "
        "either: lower them too")
    return (f"{degrees} give dp_replicate x dp_shard x cp x tp x pp = {product}, which does not match the world "
            f"size {world}; their product must equal the number of processes (or {way_out})")
