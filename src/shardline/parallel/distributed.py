"""Process-group set-up for torchrun launches (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline import errors
from shardline.errors import ConfigError
from shardline.parallel.rendezvous import meet
from shardline.version import version


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
    # with several ranks each takes its LOCAL_RANK's GPU instead; one process (torchrun's too) takes cuda:N
    lone = not launched_by_torchrun() or os.environ.get("WORLD_SIZE") == "1"
    if lone and device.type == "cuda" and device.index is not None:
        check_card(name, device.index)
    return device


def check_card(name: str, index: int) -> None:
    """ConfigError when run.device `name` asks for card `index` past the ones this machine shows."""
    if index >= torch.cuda.device_count():
        raise ConfigError(f"run.device={name!r} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                          f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def say_for_node(proc: ProcessInfo, text: str) -> None:
    """One line on the console of a node other than rank 0's, which logs the run: an operator tailing
    that node's log (a Slurm task's output) saw nothing on a healthy run, and could not tell it
    joined, nor how it ended. Said by the node's first local rank; one node's job has no other."""
    if proc.local_rank == 0 and proc.rank != 0 and proc.world_size > proc.local_world_size:
        print(f"shardline: {socket.gethostname()} (ranks {proc.rank}-{proc.rank + proc.local_world_size - 1}) "
              f"{text}", flush=True)


def speaks_for_the_job() -> bool:
    """This process prints a command's report: a lone process (a RANK left in the shell without a
    WORLD_SIZE above 1 is no rank: it printed nothing), or rank 0 of a launched job."""
    return _world_size() <= 1 or os.environ.get("RANK", "0") == "0"


def init_distributed(device: torch.device) -> ProcessInfo:
    """Join the job's process group if torchrun started us (idempotent); else one process."""
    if dist.is_initialized():  # someone (a test harness) set the group up already
        world = dist.get_world_size()
        return ProcessInfo(dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)),
                           dist.distributed_c10d._get_default_store(), _local_world_size(world))
    check_launch_env(os.environ, torch.cuda.device_count() if device.type == "cuda" else 0)
    if not launched_by_torchrun():
        return ProcessInfo(0, 1, 0)
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world == 1:
        return ProcessInfo(0, 1, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    store, rank, world = meet(local_rank)  # (torch's env:// rendezvous, said where it waits long)
    # This set of processes' keys under a prefix of its own: a restarted job may otherwise read the
    # addresses its dead predecessors published and fail to connect (agents' restart counts are no
    # such prefix: a node's agent relaunched beside living ones starts at 0, and the ranks never met).
    store = dist.PrefixStore(f"shardline/attempt-{_fresh_prefix(store, rank, world)}/", store)
    same_code(store, rank, world, f"shardline {version()} with torch {torch.__version__.split('+')[0]}")
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            device_id=torch.device("cuda", local_rank) if device.type == "cuda" else None)
    return ProcessInfo(rank, world, local_rank, store, _local_world_size(world))


def same_code(store, rank: int, world: int, code: str) -> None:
    """One line where a rank's code is not rank 0's (a node updated, another not): their first
    collectives differed and the job hung in silence, for the process group's 30-minute timeout.
    Rank 0 publishes its code; every other rank compares, counts itself in (naming a mismatch) and
    waits for rank 0's verdict, which rank 0 gives once all are in: every rank goes on, or every
    rank stops with the same line. A version without a commit (a wheel built without .git) is
    compared by its number alone."""
    limit = getattr(store, "timeout", None)
    if rank:
        try:
            theirs = store.get("shardline/code").decode()
            if _comparable(theirs, code) != _comparable(code, theirs):
                store.set("shardline/code_refused", f"rank {rank} runs {code}, rank 0 {theirs}")
            store.add("shardline/code_checked", 1)
            verdict = store.get("shardline/code_verdict").decode()
        except dist.DistStoreError:
            raise errors.ShardlineError(f"rank {rank}: rank 0 gave no word on the ranks' code in {limit}: did it "
                                        "fail (its log says why), or run a shardline from before this check?") from None
    else:
        store.set("shardline/code", code)
        # (answered before the others' own timeout on the verdict runs out: they stop with this line too)
        deadline = time.monotonic() + 0.8 * (limit.total_seconds() if limit else 1800.0)
        while (checked := store.add("shardline/code_checked", 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = store.check(["shardline/code_refused"])
        verdict = ("ok" if checked >= world - 1 and not refused else
                   store.get("shardline/code_refused").decode() + ": every node of a job must run the same shardline "
                   "and torch (install the same commit on each, or share one checkout)" if refused else
                   f"{world - 1 - checked} rank(s) did not compare their code with rank 0's in time (a node running a "
                   "shardline from before this check, or a rank that failed: its log says why)")
        store.set("shardline/code_verdict", verdict)
    if verdict != "ok":
        error = errors.ShardlineError(verdict)
        error.node_alike = True  # (a node's ranks all see it: said once there)
        raise error


def _comparable(code: str, other: str) -> str:
    """`code` as compared with `other`: without its commit where `other` names none."""
    return code if "+git." in other else re.sub(r"\+git\.[0-9a-f]+", "", code)


def _fresh_prefix(store, rank: int, world: int) -> str:
    """A name rank 0 makes up for this set of processes, which every rank learns through the job's
    store though keys a dead predecessor left are still there: each rank asks under a name of its
    own making (never stale), rank 0 answers the asks it sees until a count under the answer (never
    stale either) says every rank heard it. A rank that never comes is one line after the store's
    timeout, on either side, not a wait without end."""
    limit = getattr(store, "timeout", None)
    deadline = time.monotonic() + (limit.total_seconds() if limit else 1800.0)
    if rank:
        token = f"{os.getpid()}-{os.urandom(8).hex()}"
        store.set(f"shardline/asks/{rank}", token)
        try:
            prefix = store.get(f"shardline/answer/{token}").decode()  # (blocks until rank 0 answers it)
        except dist.DistStoreError:
            raise errors.ShardlineError(f"rank {rank}: rank 0 did not name this job's set-up keys in "
                                        f"{limit}; is it running (its log names why not)?") from None
        store.add(f"shardline/heard/{prefix}", 1)
        return prefix
    prefix, answered, swept = f"{os.getpid()}-{os.urandom(8).hex()}", {}, 0.0
    while store.add(f"shardline/heard/{prefix}", 0) < world - 1:
        again = time.monotonic() - swept > 2.0  # (now and then every rank: one may have restarted since)
        for r in range(1, world):
            if (again or r not in answered) and store.check([f"shardline/asks/{r}"]):
                token = store.get(f"shardline/asks/{r}").decode()  # (maybe a dead predecessor's: answered too)
                if answered.get(r) != token:
                    store.set(f"shardline/answer/{token}", prefix)
                    answered[r] = token
        swept = time.monotonic() if again else swept
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, world)) - set(answered))
            raise errors.ShardlineError(f"rank 0: {world - 1 - store.add(f'shardline/heard/{prefix}', 0)} rank(s) "
                                        f"did not take part in this job's set-up in {limit}" + (
                                            f" (never asked: ranks {missing[:8]})" if missing else ""))
        time.sleep(0.01)
    return prefix


def check_launch_env(env, gpus: int) -> None:
    """One line for a launch environment that cannot work, before anything waits on it: a
    WORLD_SIZE above 1 without RANK (an sbatch script's export, not torchrun: each process would
    train alone), a rank without MASTER_ADDR/MASTER_PORT (the rendezvous raised a traceback), or
    more ranks on a node than it shows GPUs (`gpus`; 0: not on CUDA), which failed in CUDA."""
    world = env.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and "RANK" not in env:
        raise ConfigError(f"WORLD_SIZE={world} is set but RANK is not: start the ranks with torchrun (it sets both), "
                          "or unset WORLD_SIZE for one process")
    if "RANK" not in env or world == "1":
        return
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in env]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: start the ranks with "
                          "torchrun, or set both to rank 0's host and a free port")
    local = env.get("LOCAL_RANK", "0")
    if gpus and local.isdigit() and int(local) >= gpus:
        shown = env.get("CUDA_VISIBLE_DEVICES")
        srun = "SLURM_STEP_NUM_TASKS" in env and "TORCHELASTIC_RUN_ID" not in env  # (parallel/slurm.py's ranks)
        fix = ("let every srun task see the node's GPUs (no --gpus-per-task or --gpu-bind: a task takes its local "
               "rank's)" if srun else f"start at most {gpus} ranks a node (torchrun --nproc_per_node={gpus})")
        raise ConfigError(f"LOCAL_RANK={local} but this node shows {gpus} GPU(s)"
                          + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "") + f": {fix}")


# A key of the one-process group's own store: how many of this process's runs use it (a later
# Trainer may take over a run dir while an earlier one still holds the group).
ONE_PROCESS_HOLDERS = "shardline/one_process_holders"


def init_one_process_group(device: torch.device) -> None:
    """A process group of this process alone, for a one-process run that still needs a mesh
    (FSDP2's CPU offload on one GPU: layout.Layout.offload_fsdp). An in-memory store: no
    rendezvous, no port; shutdown_distributed() leaves it as it leaves any group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    dist.distributed_c10d._get_default_store().add(ONE_PROCESS_HOLDERS, 0)  # (marks it as made here)


def hold_one_process_group(device: torch.device) -> bool:
    """The one-process group a one-process mesh needs, made where there is none. True where it is
    one made here: the caller is counted among its holders, and release_one_process_group ends it
    with the last (a caller's own init_process_group after the run would find it). A group the
    caller or a launcher made is theirs to end."""
    if not dist.is_initialized():
        init_one_process_group(device)
    store = dist.distributed_c10d._get_default_store()
    if not store.check([ONE_PROCESS_HOLDERS]):
        return False
    store.add(ONE_PROCESS_HOLDERS, 1)
    return True


def release_one_process_group() -> None:
    """One holder of the group hold_one_process_group made lets go; the last ends it."""
    if dist.is_initialized() and dist.distributed_c10d._get_default_store().add(ONE_PROCESS_HOLDERS, -1) <= 0:
        dist.destroy_process_group()


def shutdown_distributed() -> None:
    """Leave the process group together once the work is done.

    Without it a rank that exits first can close its connections while a peer's gloo
    teardown still reads them, and the peer aborts (SIGABRT): a finished job then looks
    failed to torchrun.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_together(line: str, exit_code: int, timeout_s: float = 60.0) -> None:
    """For ranks that stopped alike on an error (ShardlineError.every_rank): its one `line`
    printed once, by rank 0, then the process group left together (shutdown_distributed). A rank
    exiting first could make a peer's gloo teardown abort (SIGABRT). Bounded: a peer that never
    comes (it failed in another way) must not hold this rank in the barrier (on NCCL, unwatched,
    for the group's timeout); after `timeout_s` the process exits with `exit_code`, as it would
    have. Where leaving fails or times out (rank 0 may be gone before it spoke), this rank prints
    the line too; a failure to leave is not the error to report."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    if not dist.is_initialized():
        return

    def alone(exit_now: bool = False) -> None:
        if rank != 0:
            print(line, file=sys.stderr, flush=True)
        if exit_now:
            sys.stdout.flush()  # (os._exit leaves buffers: the log's last lines on a pipe)
            os._exit(exit_code)

    timer = threading.Timer(timeout_s, alone, args=(True,))
    timer.daemon = True
    timer.start()
    try:
        shutdown_distributed()
    except Exception:  # noqa: BLE001 (a peer gone meanwhile: the error stands)
        alone()
    finally:
        timer.cancel()


def agreed(check, world_size: int):
    """check()'s result, where it succeeded on every rank; else an error raised on every rank
    (collective when world_size > 1): a rank's own, or the lowest failing rank's, named. A rank's
    own storage error (OSError) is the same one line its peers raise; another exception (a bug)
    keeps its traceback there.

    For a check each rank makes from shared storage, where a lagging name cache can fail it on
    one rank alone: that rank exiting while its peers go on to the next collective left them
    waiting for the process group's timeout (or the launcher's teardown) with no message."""
    try:
        result, failure = check(), None
    except Exception as e:  # any: a storage OSError raised on one rank left the others in the gather
        result, failure = None, e
    one_line = isinstance(failure, (errors.ShardlineError, OSError))  # (else a bug: its traceback, at once)
    outcomes: list = [None] * world_size
    if world_size > 1:
        later = errors.transient(failure) or (isinstance(failure, errors.ShardlineError)
                                              and errors.exit_code(failure) == errors.TRY_LATER)
        dist.all_gather_object(outcomes, None if failure is None else (type(failure).__name__, str(failure), one_line,
                                                                       later))
    # Every rank raises a one-line error here: they may leave the process group together (ShardlineError.every_rank).
    together = all(outcome is None or outcome[2] for outcome in outcomes) and (failure is None or one_line)
    if failure is not None:
        if isinstance(failure, OSError):  # storage, not a bug: the one line its peers print, not a traceback
            where = f"on rank {dist.get_rank()}: " if world_size > 1 else ""
            kind = errors.TryLater if errors.transient(failure) else errors.ShardlineError  # (its exit code)
            error = kind(f"{where}{type(failure).__name__}: {failure}{_also(outcomes, failure)}")
            raise errors.on_every_rank(error, together) from failure
        if not one_line:
            raise failure
        also = _also(outcomes, failure)  # (the line is printed once, by rank 0: other ranks' causes in it too)
        if also:
            raise errors.on_every_rank(type(failure)(f"{failure}{also}"), together) from failure
        raise errors.on_every_rank(failure, together)
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            kind = getattr(errors, outcome[0], None)
            text = f"on rank {rank}: {outcome[1]}{_also(outcomes, outcome[1])}"
            if isinstance(kind, type) and issubclass(kind, errors.ShardlineError):
                later = outcome[3] and not issubclass(kind, errors.TryLater)  # (its code, as on its own rank)
                raise errors.on_every_rank((errors.TryLater if later else kind)(text), together)
            text = f"on rank {rank}: {outcome[0]}: {outcome[1]}{_also(outcomes, outcome[1])}"
            raise errors.on_every_rank((errors.TryLater if outcome[3] else errors.ShardlineError)(text), together)
    return result


def _also(outcomes: list, shown) -> str:
    """The other causes the ranks failed with (up to two), besides the one `shown` (a type named
    where it is not one of shardline's errors)."""
    def cause(o) -> str:
        kind = getattr(errors, o[0], None)
        return o[1] if isinstance(kind, type) and issubclass(kind, errors.ShardlineError) else f"{o[0]}: {o[1]}"

    others = {cause(o): r for r, o in reversed(list(enumerate(outcomes))) if o is not None and o[1] != str(shown)}
    return "".join(f"; also on rank {r}: {text}" for text, r in sorted(others.items(), key=lambda kv: kv[1])[:2])


def ranks_differing(value, world_size: int) -> list[tuple[int, object, object]]:
    """(rank, its value, rank 0's) for each rank whose `value` differs from rank 0's
    (collective when world_size > 1; every rank gets the same list)."""
    if world_size == 1:
        return []
    values: list = [None] * world_size
    dist.all_gather_object(values, value)
    return [(rank, v, values[0]) for rank, v in enumerate(values) if v != values[0]]


def _local_world_size(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


# What a collective's error says when the other end went away (gloo, NCCL): a peer killed or
# crashed. Not a timeout (every waiting rank gets one at once, and a hang's traceback is where it
# stopped), nor a refused connection (setting up, on every rank: this node's network).
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited",
             "ncclRemoteError")
NOT_A_PEER = ("init_process_group", "new_group", "new_subgroups")  # setting up: every rank alike


def lost_peer(error: BaseException) -> str | None:
    """'<the collective>: <what failed>' when `error` is a collective failing because another
    rank went away (in a world of several), else None. One rank's death then leaves every other
    rank with the same long traceback of its collective; each says this in one line instead
    (cli.main), and torchrun's summary names the rank that failed first."""
    if _world_size() < 2 or not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    text = str(error).strip()
    codes = [tb.tb_frame.f_code for tb in _frames(error.__traceback__)]
    ops = [c.co_name for c in codes if c.co_filename.endswith("distributed_c10d.py") and not c.co_name.startswith("_")]
    if not ops or ops[-1] in NOT_A_PEER or not any(mark in text for mark in PEER_GONE):
        return None
    what = text.split("\n")[0]
    what = what.split("] ", 1)[1] if what.startswith("[") and "] " in what else what  # gloo's source location
    return f"{ops[-1]}: {what.split('. ', 1)[0][:200]}"


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
