"""The in-memory checkpoint tier (checkpoint.memory_interval): snapshots in host RAM.

Every k steps each rank serialises its own shard of the state (model, optimizer,
trainer state) into the node's shared memory (`/dev/shm`, i.e. RAM), so it outlives
the worker process and a torchrun restart, but not the node. To survive losing the
node's memory too, a peer keeps a replica, or the ranks keep XOR parity
(`checkpoint.memory_redundancy`, see redundancy.py). A restarted job asks every rank
what it still holds and rebuilds the missing snapshots from the survivors, without
touching disk; persistent checkpoints stay the last line of defence.

Layout, one folder per rank: `<root>/rank<r>/{own,replica,parity}-<step>.bin`, each
with a `.json` sidecar (size, CRC-32, layout fingerprint) written after it. A
generation is pruned only after every rank has finished the next one, so a crash
mid-snapshot leaves the previous complete one. Snapshots hold local shards, so they
are only used by a job with the same layout (the fingerprint); otherwise disk.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardline.parallel.distributed import agreed
from shardline.resilience import redundancy, snapshot_format
from shardline.resilience.background import BackgroundWork
from shardline.resilience.model_state import capture_state, restore_state
from shardline.resilience.own_folder import make_own
from shardline.resilience.save_failures import any_rank

KINDS = ("own", "replica", "parity")


def run_root(run_dir: Path, base: str = "") -> Path:
    """The run's own folder under `base` (default_base()), keyed by the run dir: two runs sharing a
    base never read each other's snapshots."""
    return Path(base or default_base()) / hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def default_base() -> Path:
    """This user's folder in the node's shared memory (else the temp dir): private (own_folder.py)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return shm / f"shardline-{getpass.getuser()}"


def to_local(obj: Any, copy: bool = False) -> Any:
    """The state tree on the host with every DTensor replaced by this rank's shard.

    Host tensors are copied only with `copy`: a synchronous snapshot is serialised
    before training moves on, a background one needs a private copy.
    """
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: to_local(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local(v, copy) for v in obj)
    return obj


def from_local(template: Any, saved: Any) -> Any:
    """The saved local shards put back into the template's layout (devices, DTensor meshes)."""
    if isinstance(template, DTensor):
        return DTensor.from_local(saved.to(template.device), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(template, torch.Tensor):
        return saved.to(template.device)
    if isinstance(saved, dict) and isinstance(template, dict):
        return {k: from_local(template.get(k), v) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(template, (list, tuple)) and len(saved) == len(template):
        return type(saved)(from_local(t, s) for t, s in zip(template, saved))
    return saved


def deserialize(data: torch.Tensor) -> Any:
    return snapshot_format.read(data)


def choose_step(reports: list[dict], world: int, ranks_per_node: int, mode: str) -> tuple[int | None, dict]:
    """The newest step whose every rank's snapshot exists or can be rebuilt, and how.

    `reports[r]` maps each kind to the steps rank r holds. Returns (step, {rank:
    "own" | "replica" | "parity"}) or (None, {}).
    """
    steps = sorted({s for rep in reports for s in rep["own"]}, reverse=True)
    groups = {r: g for g in redundancy.parity_groups(world, ranks_per_node) for r in g}
    for step in steps:
        sources = {}
        for r in range(world):
            if step in reports[r]["own"]:
                sources[r] = "own"
            elif mode == "replica" and world > 1 and \
                    step in reports[redundancy.replica_holder(r, world, ranks_per_node)]["replica"]:
                sources[r] = "replica"
            elif mode == "xor" and world > 1 and all(
                    step in reports[m]["own"] and step in reports[m]["parity"] for m in groups[r] if m != r):
                sources[r] = "parity"
            else:
                break
        else:
            return step, sources
    return None, {}


def _unusable(side: dict, data: np.ndarray, fingerprint: str) -> str | None:
    """Why a snapshot cannot be used (None: it can; "": it is another run's). The fingerprint is
    the layout's, then a line naming the run (tiers.py)."""
    if side["fingerprint"] != fingerprint:
        same_run = str(side["fingerprint"]).rsplit("\n", 1)[-1] == fingerprint.rsplit("\n", 1)[-1]
        return ("written under another layout (ranks or parallel degrees), which alone can read it back"
                if same_run else "")
    if len(data) != side["size"] or zlib.crc32(data.data) != side["crc"]:
        return "damaged: its size or CRC-32 is not the one recorded"
    return None


class MemoryTier:
    def __init__(self, root: Path, rank: int, world: int, ranks_per_node: int, mode: str, fingerprint: str):
        self.dir = self.rank_dir(root, rank)
        self.root, self.rank, self.world, self.mode = Path(root), rank, world, mode
        self.ranks_per_node, self.fingerprint = ranks_per_node, fingerprint
        self.unusable: dict[int, str] = {}  # step -> why: this run's own snapshots the last inventory passed over
        self.group = self.parity_members = self.parity_group = None
        self._work = BackgroundWork("memory-snapshot")
        if world > 1:
            # Host-memory collectives on groups of their own: never interleaved with
            # training's (NCCL on GPU) or an asynchronous disk save's.
            self.group = dist.new_group(backend="gloo")
            groups = redundancy.parity_groups(world, ranks_per_node)
            self.parity_group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
            self.parity_members = next(g for g in groups if rank in g)
        agreed(self._make_dir, world)  # a node-local folder: one node's refusal is every rank's

    def _make_dir(self) -> None:  # (from the shared place down: the default base included, a given one not)
        base = self.root.parent
        make_own(self.dir, base.parent if base == default_base() else base, "checkpoint.memory_dir",
                 "name a folder of your own (on a tmpfs such as /dev/shm) or set checkpoint.memory_interval=0")

    @staticmethod
    def rank_dir(root: Path, rank: int) -> Path:
        return Path(root) / f"rank{rank}"

    # ---- files ----------------------------------------------------------------------

    def _path(self, kind: str, step: int, suffix: str) -> Path:
        return self.dir / f"{kind}-{step:06d}{suffix}"

    def _write(self, kind: str, step: int, data: torch.Tensor | Any, **extra: Any) -> torch.Tensor:
        """Write bytes (a uint8 tensor) or, for `own`, serialise an object; returns the bytes.

        Serialising straight into shared memory and mapping the file back avoids a
        second in-RAM copy of the snapshot; the sidecar is written last, so a torn
        write is never listed.
        """
        tmp = self._path(kind, step, ".bin.tmp")
        self._make_dir()  # clear() may have removed it: made again as this user's own, checked
        if isinstance(data, torch.Tensor):
            with open(tmp, "wb") as f:
                f.write(data.numpy().data)
        else:
            snapshot_format.write(tmp, data)
        os.replace(tmp, self._path(kind, step, ".bin"))
        written = self._read(kind, step)
        view = written.numpy().data
        side = {"step": step, "size": len(view), "crc": zlib.crc32(view), "fingerprint": self.fingerprint, **extra}
        self._path(kind, step, ".json.tmp").write_text(json.dumps(side), encoding="utf-8")
        os.replace(self._path(kind, step, ".json.tmp"), self._path(kind, step, ".json"))
        return written

    def _read(self, kind: str, step: int) -> torch.Tensor:
        """The file's bytes, mapped (not copied) from shared memory."""
        path = self._path(kind, step, ".bin")
        if path.stat().st_size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r+"))

    def inventory(self) -> dict[str, dict[int, dict]]:
        """What this rank holds intact for this layout: {kind: {step: sidecar}}. Its own snapshots of
        this run that cannot be used (damaged, or of another layout) go to `unusable`, to be said."""
        held: dict[str, dict[int, dict]] = {k: {} for k in KINDS}
        self.unusable = {}
        if not self.dir.is_dir():
            return held
        for side_path in self.dir.glob("*-*.json"):
            try:
                side = json.loads(side_path.read_text(encoding="utf-8"))
                kind, step = side_path.stem.rsplit("-", 1)[0], side["step"]
                data = self._read(kind, step).numpy()
            except (OSError, ValueError, KeyError):
                continue  # half-written or removed: not a usable snapshot
            if kind not in held:
                continue
            why = _unusable(side, data, self.fingerprint)
            if why is None:
                held[kind][step] = side
            elif kind == "own" and why:  # ("": another run's, cleared when this one started)
                self.unusable[step] = why
        return held

    def _prune(self, keep_step: int) -> None:
        self._drop(lambda step: step < keep_step)

    def discard_after(self, step: int) -> None:
        """Drop every snapshot file of a step after `step`, of any layout: the run goes on from
        `step`, and they belong to a history it left. Kept, a later snapshot of the same step
        would replace them file by file, and a crash midway could mix the two histories."""
        self.wait()
        self._drop(lambda held: held > step)
        self._drop_departed()

    def discard_through(self, step: int) -> None:
        """Drop every snapshot file of `step` and before: a state saved to disk since supersedes them
        (a rollback's, with the batch it skipped), and a restart would prefer them on a tie."""
        self.wait()
        self._drop(lambda held: held <= step)

    def _drop(self, which: Callable[[int], bool]) -> None:
        """Remove this rank's files (<kind>-<step>.*) of the steps `which` picks."""
        for f in self.dir.glob("*-*"):
            try:
                if which(int(f.name.split("-")[1].split(".")[0])):
                    f.unlink(missing_ok=True)
            except (ValueError, OSError):  # not a snapshot's name, or not removable: no sidecar lists it
                continue

    def _drop_departed(self, everyone: bool = False) -> None:
        """Remove the folders of ranks past this job's world here (a job that shrank), or every one."""
        try:  # (another rank's clear() may remove the run's folder meanwhile)
            folders = list(self.root.glob("rank*"))
        except FileNotFoundError:
            return
        for folder in folders:
            index = folder.name.removeprefix("rank")
            if index.isdigit() and (everyone or int(index) >= self.world):
                shutil.rmtree(folder, ignore_errors=True)

    def newest_held(self) -> int | None:
        """The newest step this rank holds its own intact snapshot of, if any."""
        own = self.inventory()["own"]
        return max(own) if own else None

    def others_bytes(self) -> int:
        """Bytes held in RAM by other runs' snapshots under the same base (e.g. crashed runs)."""
        total = 0
        with contextlib.suppress(FileNotFoundError):  # (a folder another run removes while it is listed)
            for f in self.root.parent.glob("*/rank*/*"):
                with contextlib.suppress(OSError):
                    total += f.stat().st_size if not f.is_relative_to(self.root) else 0
        return total

    def clear(self) -> None:
        """Remove the run's snapshots on this node (the run ended, or a fresh run reuses the run dir: every
        rank clears alike), those of ranks it no longer has here included (a rank reads its own alone)."""
        self.wait()
        self._drop_departed(everyone=True)
        for empty in (self.root, self.root.parent)[:2 if self.root.parent == default_base() else 1]:
            try:  # (a checkpoint.memory_dir the user named stays)
                empty.rmdir()  # the last rank out removes the run's folder
            except OSError:
                break

    # ---- save -----------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict, background: bool = False) -> dict:
        """Snapshot this step into memory with its redundancy; returns what training waited for.

        In the background (checkpoint.memory_mode = async) training waits only for a host copy
        of the state; a thread writes it and exchanges the replica or parity, and its
        figures come back from wait(). At most one snapshot is in flight.
        """
        self.wait()
        begin = time.perf_counter()
        tree = {"step": step, "state": to_local(capture_state(model, optimizer), copy=background),
                "trainer": trainer_state}
        if not background:
            return {**self._persist(step, tree), "stall_s": time.perf_counter() - begin}
        self._work.start(lambda: self._persist(step, tree))
        return {"stall_s": time.perf_counter() - begin}

    def wait(self) -> list[dict]:
        """Block until the background snapshot (if any) is held; returns the ones finished since."""
        return self._work.wait()

    def _persist(self, step: int, tree: dict) -> dict:
        """Write this step's snapshot and its redundancy. A write the shared memory refuses (a
        full /dev/shm) on any rank is that step's failure on every rank, agreed through the
        collectives the snapshot makes anyway: each drops the step's files and training goes on
        ({"step", "error"}); an optional tier does not end the job, nor leave its RAM full."""
        own, error = self._attempt("own", step, tree)
        extra = 0
        if self.world > 1:
            sizes = self._all_sizes(-1 if error else own.numel())  # -1: this rank's failed
            error = error or (f"rank {sizes.index(-1)}'s failed" if -1 in sizes else "")
            if not error and self.mode == "replica":
                held = redundancy.exchange_replicas(own, sizes, self.rank, self.world, self.ranks_per_node,
                                                    self.group)
                _, error = self._attempt("replica", step, held)
                extra = held.numel()
            elif not error:
                parity = redundancy.encode_parity(own, sizes, self.parity_members, self.rank, self.parity_group)
                _, error = self._attempt("parity", step, parity.view(torch.uint8), sizes=sizes)
                extra = parity.numel() * parity.element_size()
            # Every rank holds this generation (or none keeps it) before any drops the last.
            if any_rank(bool(error), self.group) and not error:  # (called by every rank, failed or not)
                error = "another rank's redundancy write failed"
        if error:
            self._drop(lambda held: held == step)
            return {"step": step, "error": error}
        self._prune(step)
        return {"step": step, "own_bytes": own.numel(), "redundancy_bytes": extra}

    def _attempt(self, kind: str, step: int, data: Any, **extra: Any) -> tuple[torch.Tensor | None, str]:
        """_write, or the reason it failed (a refusal of the storage is the step's, not the job's)."""
        try:
            return self._write(kind, step, data, **extra), ""
        except OSError as e:  # (a full disk's names no file: the one being written)
            return None, f"cannot write {e.filename or self._path(kind, step, '.bin.tmp')}: {e.strerror or e}"

    def _all_sizes(self, size: int) -> list[int]:
        sizes = torch.zeros(self.world, dtype=torch.int64)
        sizes[self.rank] = size
        dist.all_reduce(sizes, group=self.group)
        return sizes.tolist()

    # ---- recovery -------------------------------------------------------------------

    def recover(self) -> tuple[int, dict, dict] | None:
        """(step, payload, sources) of the newest snapshot every rank can get back, else None.

        Collective over all ranks. Lost snapshots are rebuilt from the survivors'
        replicas or parity.
        """
        self.wait()
        held = self.inventory()
        if self.world == 1:
            if not held["own"]:
                return None
            step = max(held["own"])
            return step, deserialize(self._read("own", step)), {0: "own"}
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, {k: sorted(v) for k, v in held.items()}, group=self.group)
        step, sources = choose_step(reports, self.world, self.ranks_per_node, self.mode)
        if step is None:
            return None
        own = self._read("own", step) if sources[self.rank] == "own" else None
        if self.mode == "replica":
            rebuilt = self._recover_replicas(step, sources)
        else:
            rebuilt = self._recover_parity(step, sources, own, held)
        payload = deserialize(own if own is not None else rebuilt)
        if rebuilt is not None:
            # Held again; the peers' replica / parity of it come back with the next snapshot.
            self._write("own", step, rebuilt)
        return step, payload, sources

    def _recover_replicas(self, step: int, sources: dict) -> torch.Tensor | None:
        w, n = self.world, self.ranks_per_node
        transfers = [(redundancy.replica_holder(r, w, n), r) for r, src in sorted(sources.items()) if src == "replica"]
        mine = [lost for holder, lost in transfers if holder == self.rank]
        held = self._read("replica", step) if mine else None
        sizes = [0] * w
        dist.all_gather_object(sizes, held.numel() if held is not None else 0, group=self.group)
        size = next((sizes[h] for h, lost in transfers if lost == self.rank), 0)
        return redundancy.send_replicas(transfers, self.rank, held, size, self.group)

    def _recover_parity(self, step: int, sources: dict, own: torch.Tensor | None, held: dict) -> torch.Tensor | None:
        members = self.parity_members
        lost = [r for r in members if sources[r] == "parity"]
        if not lost:
            return None
        # The survivors' sidecars carry every rank's snapshot size; share one with the lost member.
        mine = held["parity"][step]["sizes"] if step in held["parity"] else None
        group_sizes: list[Any] = [None] * len(members)
        dist.all_gather_object(group_sizes, mine, group=self.parity_group)
        sizes = next(s for s in group_sizes if s is not None)
        parity = self._read("parity", step).view(torch.int64) if self.rank != lost[0] else None
        return redundancy.decode_lost(own, parity, sizes, members, lost[0], self.rank, self.parity_group)

    @staticmethod
    def load_into(payload: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Put a recovered snapshot into the model and optimizer; returns its trainer state."""
        restore_state(model, optimizer, from_local(capture_state(model, optimizer), payload["state"]))
        return payload["trainer"]
