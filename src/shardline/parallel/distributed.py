"""Process-group set-up for torchrun launches (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline import errors
from shardline.errors import ConfigError


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    store: dist.Store | None = None  # the job's c10d store (a side channel for the watchdog)
    local_world_size: int = 1  # ranks on this node


    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(name: str) -> torch.device:
    """run.device as a torch device; "auto" takes a GPU when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"run.device={name!r} but no CUDA device is available; use cpu or auto")
    device = torch.device(name)
    lone = not launched_by_torchrun()  # under torchrun each rank takes its LOCAL_RANK's GPU instead
    if lone and device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"run.device={name!r} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(device: torch.device) -> ProcessInfo:
    """Join the job's process group if torchrun started us (idempotent); else one process."""
    if dist.is_initialized():  # someone (a test harness) set the group up already
        world = dist.get_world_size()
        return ProcessInfo(dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)),
                           dist.distributed_c10d._get_default_store(), _local_world_size(world))
    if not launched_by_torchrun():
        return ProcessInfo(0, 1, 0)
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world == 1:
        return ProcessInfo(0, 1, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    store, rank, world = next(dist.rendezvous("env://"))
    # Keys of each restart under their own prefix: a restarted job may otherwise read the
    # addresses its dead predecessors published and fail to connect.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"shardline/attempt{attempt}/", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            device_id=torch.device("cuda", local_rank) if device.type == "cuda" else None)
    return ProcessInfo(rank, world, local_rank, store, _local_world_size(world))


def init_one_process_group(device: torch.device) -> None:
    """A process group of this process alone, for a one-process run that still needs a mesh
    (FSDP2's CPU offload on one GPU: layout.Layout.offload_fsdp). An in-memory store: no
    rendezvous, no port; shutdown_distributed() leaves it as it leaves any group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def shutdown_distributed() -> None:
    """Leave the process group together once the work is done.

    Without it a rank that exits first can close its connections while a peer's gloo
    teardown still reads them, and the peer aborts (SIGABRT): a finished job then looks
    failed to torchrun.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def agreed(check, world_size: int):
    """check()'s result, where it succeeded on every rank; else an error raised on every rank
    (collective when world_size > 1): a rank's own, or the lowest failing rank's, named.

    For a check each rank makes from shared storage, where a lagging name cache can fail it on
    one rank alone: that rank exiting while its peers go on to the next collective left them
    waiting for the process group's timeout (or the launcher's teardown) with no message."""
    if world_size == 1:
        return check()
    try:
        result, failure = check(), None
    except errors.ShardlineError as e:
        result, failure = None, e
    outcomes: list = [None] * world_size
    dist.all_gather_object(outcomes, None if failure is None else (type(failure).__name__, str(failure)))
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            kind = getattr(errors, outcome[0], None)
            kind = kind if isinstance(kind, type) and issubclass(kind, errors.ShardlineError) else errors.ShardlineError
            raise kind(f"on rank {rank}: {outcome[1]}")
    return result


def _local_world_size(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))
