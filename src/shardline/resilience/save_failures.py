"""A save's failures: which are the storage's (disk full, read-only, quota), and how the
ranks of one save agree on them, so that all take the same checkpoint.on_error path."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardline.errors import CheckpointError, nearly_full


def agree_on_failure(failure: BaseException | None, group: dist.ProcessGroup | None = None,
                     where: Path | None = None) -> None:
    """A barrier at which every rank learns whether any rank's part of the save failed, and then
    all raise: a rank that went on (checkpoint.on_error=continue) while the others waited in
    the save's next collective would hang the job, or pair its barriers with the next save's.
    A peer's storage error is raised as an OSError of the same errno, so every rank takes the
    same on_error path. `where`: the save's folder (storage_error's)."""
    if not dist.is_initialized():
        if failure is not None:
            raise failure
        return
    cause = storage_error(failure, where) if failure is not None else None
    mine = [(cause.errno or 1) if cause is not None else 0, int(failure is not None and cause is None)]
    on_gpu = dist.get_backend(group) == "nccl"
    flags = torch.tensor(mine, device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    storage, other = (int(x) for x in flags.tolist())
    if other:  # an error that is not the storage's somewhere: it stops every rank, storage errors too
        if failure is not None and cause is None:
            raise failure
        raise CheckpointError("the checkpoint's save failed on another rank with an error that is not the "
                              "storage's (see that rank's error)") from failure
    if failure is not None:
        raise failure
    if storage:
        raise OSError(storage, f"{os.strerror(storage)} (on another rank)")


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `flag` holds on any rank of `group` (a host-side all-reduce: a gloo group)."""
    box = torch.tensor([int(flag)])
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return bool(box.item())


def storage_error(e: BaseException, where: Path | None = None) -> OSError | None:
    """The OSError (disk full, read-only, quota, I/O) behind a failed save, else None.

    DCP wraps each rank's error in a CheckpointException; plain writes raise it directly. torch's
    file writer (torch.save, which DCP writes its tensors with) reports a write the storage cut
    short as a RuntimeError ("unexpected pos", an iostream error): that is the storage's too, a full disk where the
    file system of `where` (the save's folder) is nearly full, else an I/O error.
    """
    seen, chain = [e], []
    while seen:  # (every error behind it: an OSError among them names the cause itself)
        err = seen.pop()
        if isinstance(err, OSError):
            return err
        chain.append(err)
        if isinstance(err, CheckpointException):
            seen += [pair[0] for pair in err.failures.values()]
        seen += [x for x in (err.__cause__, err.__context__) if x is not None]
    for err in chain:
        if isinstance(err, RuntimeError) and any(mark in str(err) for mark in WRITER_FAILURES):
            code = errno.ENOSPC if where is not None and nearly_full(where) else errno.EIO
            return WriteCutShort(code, f"{os.strerror(code)} (torch's file writer: {str(err).strip()[:200]})")
    return None


class WriteCutShort(OSError):
    """The storage error behind torch's writer's RuntimeError (storage_error): raised in its place
    where the save fails, while the folder's free space still tells a full disk."""


# torch's zip writer, a write cut short: its position check, its own error, or the C++ stream's
WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter", "basic_ios::clear")
