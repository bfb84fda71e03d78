"""Optimizer states on an SSD (`memory.ssd_offload_dir`): the third tier after the GPU and the host.

AdamW's two moments (8 bytes a parameter in fp32: with FSDP's CPU offload, the largest part of
what the host holds) live in files in that folder, mapped into the process. The optimizer reads
and writes them as ordinary host tensors; the kernel's page cache keeps what fits in RAM and
writes the rest back to the SSD, and reads it again when the next step comes to it. So the
moments stop being memory the host must have: they become cache it may evict. A run whose
states fit in RAM loses nothing but the first touch of each page; one whose states do not fit
runs at the disk's speed (each step reads and writes every moment once) instead of failing.

Why a mapping rather than DeepSpeed's explicit asynchronous reads into pinned buffers: the
optimizer, its checkpoints (DCP reads and loads the mapped tensors in place) and every layout's
state handling stay torch's own. What is scheduled is only the order: the step runs a window of
moments at a time and asks the kernel for the next window's pages (a read-ahead hint) while
this one computes (windowed.py, SSDAdamW._prefetch). Each file is unlinked as soon as it is
mapped, so its space goes back to the disk when the process ends, however it ends: a crash
leaves no stale files.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from shardline.errors import ConfigError
from shardline.optim.windowed import WindowedAdamW, local

MOMENTS = ("exp_avg", "exp_avg_sq")


def usable(zero: int, cpu_offload: bool, on_cuda: bool) -> bool:
    """Whether a layout can keep AdamW's moments in the folder: the moments are mapped into host
    memory, so AdamW must step on the host (a GPU run offloads its states there first) and be
    torch's own (ZeRO-1 keeps its own sliced states). `problem` says why not; the planner prices
    the folder only where this holds."""
    return zero != 1 and (cpu_offload or not on_cuda)


def problem(memory, zero: int, on_cuda: bool, node_paths: bool = True) -> str | None:
    """Why `memory.ssd_offload_dir` cannot run with this layout or folder, or None: the layout must
    be `usable`; the folder must exist, be writable and be on a disk (a tmpfs such as /dev/shm
    would keep the moments in RAM), looked at only where `node_paths` (not by a dry run, which may
    run where the nodes' disks are not). Its free space is reserved file by file when the
    optimizer is built (SSDAdamW)."""
    folder = memory.ssd_offload_dir
    if not folder:
        return None
    if not usable(zero, memory.cpu_offload, on_cuda):
        if on_cuda and not memory.cpu_offload:
            return ("memory.ssd_offload_dir needs memory.cpu_offload=true on a GPU: AdamW then steps on the host, "
                    "where the mapped moments are")
        return "memory.ssd_offload_dir does not work with parallel.zero=1 (its own sliced states); use zero 2 or 3"
    if not node_paths:
        return None
    path = Path(folder).expanduser()
    if not path.is_dir():
        return f"memory.ssd_offload_dir={folder!r} is not a folder; create it on a local SSD first"
    if not os.access(path, os.W_OK):
        return f"memory.ssd_offload_dir={folder!r} is not writable by this user"
    if filesystem(path) in IN_MEMORY:
        return f"memory.ssd_offload_dir={folder!r} is on {filesystem(path)}, which is RAM; pick a folder on an SSD"
    return None


IN_MEMORY = ("tmpfs", "ramfs")
PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_WILLNEED = 3  # sys/mman.h


def filesystem(path: Path) -> str:
    """The type of the file system holding `path`, or "": of its longest mount point in
    /proc/mounts (the last listed of equals: a later mount hides an earlier one), whose paths
    escape spaces, tabs, newlines and backslashes as octal."""
    try:
        lines = Path("/proc/mounts").read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError:
        return ""
    mounts = [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]), fields[2])
              for fields in (line.split() for line in lines) if len(fields) > 2]
    resolved, best = str(path.resolve()), ("", "")
    for point, kind in mounts:
        if (resolved == point or resolved.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, kind)
    return best[1]


class SSDAdamW(WindowedAdamW):
    """AdamW whose moments are memory-mapped files in `folder` (see the module docstring), stepped a
    window at a time (windowed.py), the next window's pages asked of the disk first.

    The moments are made up front (zeros, as AdamW's first step would make them), so a fresh
    run updates exactly as plain AdamW does, each file's blocks reserved on the disk then: a full
    disk fails here with one line, not with a SIGBUS at a later write into a hole (on file systems
    that write in place, ext4 and XFS; copy-on-write btrfs needs new blocks at every write, and ZFS
    reserves none). A load (a resume, a rollback, the in-memory tier) copies the loaded moments
    into the same files where they arrived as other tensors. Plain AdamW only: amsgrad,
    capturable and differentiable keep other state, and the parameters must be on the host.
    """

    PLAIN_ONLY = "memory.ssd_offload_dir maps plain AdamW's moments"
    FUSED_IN_WINDOWS = True  # each window's pages asked of the disk while the one before steps

    def __init__(self, params, folder: str, rank: int, **hyper):
        super().__init__(params, **hyper)
        params = [p for g in self.param_groups for p in g["params"]]
        if any(local(p).device.type != "cpu" for p in params):
            raise ConfigError("memory.ssd_offload_dir needs the parameters on the host (memory.cpu_offload=true "
                              "on a GPU): AdamW steps where the mapped moments are")
        self.folder = Path(folder).expanduser()
        self._prefix = f"shardline-rank{rank}-{uuid.uuid4().hex[:8]}"
        self._count = itertools.count()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.mapped: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for p in params:
            self.mapped[p] = {k: self._zeros_like(p) for k in MOMENTS}
            self.state[p] = self._fresh(p, zero=False)

    def _fresh(self, p: torch.Tensor, zero: bool = True) -> dict[str, torch.Tensor]:
        """p's state as AdamW's first step makes it: step 0, zero moments (in p's files; new files
        read as zeros already, and writing them would pull every page into RAM)."""
        for t in self.mapped[p].values() if zero else ():
            local(t).zero_()
        return {"step": torch.tensor(0.0, dtype=torch.float32), **self.mapped[p]}

    def _zeros_like(self, p: torch.Tensor) -> torch.Tensor:
        """A zero tensor of p's shape, dtype and placement held in a fresh, unlinked file, laid out as
        p is where p is dense (a transposed weight's moments transposed too, as torch's AdamW makes
        them: its fused kernel pairs the elements of parameter and moments in memory order)."""
        shard = local(p)
        path = self.folder / f"{self._prefix}-{next(self._count)}.bin"
        nbytes = max(shard.numel(), 1) * shard.element_size()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                path.unlink()  # at once: a crash from here on leaves no file (the space comes back at exit)
                os.posix_fallocate(fd, 0, nbytes)  # the blocks, now: no hole to fill at a later write
                storage = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(shard.numel(), 1),
                                          dtype=shard.dtype)  # the mapping keeps the data
            finally:
                os.close(fd)
        except (OSError, RuntimeError) as e:  # RuntimeError: the mapping refused (vm.max_map_count, memory)
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
            free = shutil.disk_usage(self.folder).free / 2**30 if self.folder.is_dir() else 0.0
            raise ConfigError(f"memory.ssd_offload_dir={str(self.folder)!r}: cannot reserve this rank's optimizer "
                              f"moments ({why}; {free:.2f} GiB free)") from None
        flat = storage[:shard.numel()]
        mapped = flat.as_strided(shard.shape, shard.stride()) if _dense(shard) else flat.view(shard.shape)
        if not isinstance(p, DTensor):
            return mapped
        return DTensor.from_local(mapped, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def _prefetch(self, window: list[tuple]) -> None:
        """Ask the kernel to read a window's moment pages now, without waiting for them: a read-ahead
        hint (an error, say madvise missing, costs only the overlap)."""
        for _, _, m, v, _, _ in window:
            for t in (local(m), local(v)):  # a window of DTensors (windowed._windows): their shards
                start = t.data_ptr() & ~(PAGE - 1)
                self._libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(t.data_ptr() + t.nbytes - start),
                                   MADV_WILLNEED)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for p, files in self.mapped.items():
            state = self.state[p]
            if not all(k in state for k in MOMENTS):  # not in the loaded state: as a fresh run's
                self.state[p] = self._fresh(p)
                continue
            for key, held in files.items():
                if local(state[key]).data_ptr() != local(held).data_ptr():
                    local(held).copy_(local(state[key]))
                    state[key] = held

    def mapped_bytes(self) -> int:
        """Bytes of moments this rank holds in the mapped files."""
        return sum(local(t).numel() * local(t).element_size() for files in self.mapped.values()
                   for t in files.values())

    def file_prefix(self) -> str:
        """The name every one of this optimizer's files starts with (they are unlinked: /proc/<pid>/maps
        shows them as `<folder>/<prefix>-<n>.bin (deleted)`)."""
        return self._prefix


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its memory without gaps or overlaps, in whatever order of dims."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True
