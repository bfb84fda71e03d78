"""One job per run dir: a lock file that a second run meets with a one-line error.

Two runs on one run dir overwrite each other's checkpoints and interleave their
metrics. Rank 0 creates `<run_dir>/.lock` atomically (O_EXCL) after every input
check has passed and before anything in the run dir is written or restored (the
checkpoint to resume is chosen before, and chosen again if the checkpoints changed);
it holds the job's host, pid, process start time and job id, and is removed when the
run ends, halts or fails.

A lock left by a dead run is taken over: same host, and its pid is gone or now
belongs to a process started at another time. A lock of the same job is taken over
too (Slurm requeues keep SLURM_JOB_ID and step, torchrun restarts TORCHELASTIC_RUN_ID, when not
under Slurm), unless its holder still runs: on this host its pid says so; on another, the holder
touches its lock every BEAT_S seconds, and a lock untouched while QUIET_BEATS beats pass is a dead
holder's (two first launches given one --rdzv_id are two live runs). Another job's lock from another
host (the job before, in a chain of jobs, SIGKILLed by its scheduler) is a dead holder's once it stays
untouched for OTHER_JOB_QUIET_BEATS beats: no clock is compared, only whether the file changes.
A takeover renames the lock aside before removing it, so two runs racing for one stale lock never both
hold it.

Within one process (a notebook building Trainers) the pid says nothing, and a Trainer built and
dropped unclosed cannot free its lock: a later Trainer of the process takes it over, and the
earlier one, should it be asked to train, finds the lock no longer its own (`still_held`) and
refuses instead of training over the later one's checkpoints.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from shardline import errors
from shardline.errors import ConfigError, RunDirInUse, TryLater, on_every_rank, transient

LOCK = ".lock"
EMPTY_LOCK_S = 60.0  # an empty lock older than this was left by a start that died while taking it
BEAT_S = 5.0  # the holder touches its lock this often
QUIET_BEATS = 3  # a same-job lock of another host untouched this many beats is a dead holder's
OTHER_JOB_QUIET_BEATS = 6  # and another job's, untouched this many (a live run's own beat goes on through them)


def launcher_ids() -> dict[str, str]:
    """This job's ids by launcher, each kept across that launcher's restarts: Slurm's (job and
    step: two srun steps of one job are two runs) and torchrun's run id."""
    ids = {}
    slurm = os.environ.get("SLURM_JOB_ID", "")
    if slurm and slurm != "none":
        step = os.environ.get("SLURM_STEP_ID", "")
        ids["SLURM_JOB_ID"] = slurm + (f".{step}" if step else "")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        ids["TORCHELASTIC_RUN_ID"] = run
    return ids


LAUNCHERS = (("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"), ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"))


def restarted_by(counter: str) -> bool:
    count = os.environ.get(counter, "0")
    return count.isdigit() and int(count) > 0


def restarted() -> bool:
    """This process is a restart of the job (torchrun --max-restarts, a Slurm requeue), which
    runs the first attempt's command line again."""
    return any(restarted_by(counter) for _, counter in LAUNCHERS)


def job_id() -> str:
    """The job's id for its run-dir lock ("" when there is none): Slurm's first, as a requeue
    keeps it while torchrun --standalone draws a new run id at every launch."""
    ids = launcher_ids()
    key = next((k for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID") if k in ids), None)
    return f"{key}={ids[key]}" if key else ""


def start_time_of(pid: int) -> float | None:
    """When process `pid` started (clock ticks after boot), or None if there is no such process
    (a zombie, exited and not yet reaped by its launcher, counts as none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else float(fields[19])
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc: we can only tell that the pid is in use
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1.0


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.held = False
        self.created = False  # acquire() made the run dir: release() removes it where it is still empty
        self.lost: dict = {}  # the holder that took the lock over while this one held it (see _beat)

    def acquire(self) -> str | None:
        """Take the lock; returns what was taken over ("stale ..." / "same job ..."), else None.

        ConfigError (one line) when another live run holds it.
        """
        if self.held and not self.lost:  # (held already: one beat, one release)
            return None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": start_time_of(os.getpid()),
              "job": job_id(), "since": time.time()}
        try:
            self.created = not self.path.parent.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"run.dir={str(self.path.parent)!r} cannot be created: {e.strerror}") from None
        taken_over = None
        for _ in range(3):  # a racing run may take a stale lock between our read and create
            try:
                self._publish(me)
            except FileExistsError:
                holder = self._read()
                if not holder and not self.path.exists():
                    continue  # released meanwhile: take it now
                why = _why_free(holder, me) or self._left_empty()
                if why and why.startswith("same job") and holder.get("host") != me["host"]:
                    why = self._gone_quiet(why)  # (another host's holder: alive while it touches its lock)
                elif why is None and holder and holder.get("host") != me["host"]:  # (another job's: watched longer)
                    why = self._gone_quiet(f"stale: the lock of {holder.get('job') or 'a run'} on {holder['host']}",
                                           OTHER_JOB_QUIET_BEATS)
                if why is None:  # (read again: another launch may have taken it while this one watched)
                    holder = self._read() or holder
                    raise _held(holder, me)(_held_message(self.path, holder)) from None
                if self._remove_if_still(holder):
                    taken_over = why
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:  # the folder went with a refused launch's lock (release): again
                    with contextlib.suppress(OSError):
                        self.path.parent.mkdir(parents=True)
                        self.created = True
                    continue
                if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise ConfigError(f"run.dir={str(self.path.parent)!r} is not writable: {e.strerror}") from None
                failed = TryLater if transient(e) else ConfigError
                raise failed(f"run.dir={str(self.path.parent)!r}: its lock cannot be written ({e.strerror})") from None
            self.held, self.mine, self.lost = True, me, {}
            atexit.register(self.release)  # an exception that ends the process still frees it
            self._beating = threading.Event()
            threading.Thread(target=self._beat, args=(self._beating,), daemon=True, name="run-lock-beat").start()
            self._check_writable(self.path.parent / "checkpoints")
            return taken_over
        if not self.path.parent.is_dir():
            raise ConfigError(f"run.dir={str(self.path.parent)!r} cannot be created: it went each time it was made")
        raise _held(holder := self._read(), me)(_held_message(self.path, holder))

    def _publish(self, me: dict) -> None:
        """Create the lock with its content at once: a file written aside, then hard-linked to the
        lock's name (FileExistsError where a lock is there), so no run ever reads it empty and takes
        it for a dead start's (a full disk fails the write aside, leaving no lock). Where the file
        system has no hard links, an exclusive create then the write."""
        staged = self.path.with_name(f"{LOCK}.new-{uuid.uuid4().hex}")  # never another start's file
        try:
            with os.fdopen(os.open(staged, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), "w", encoding="utf-8") as f:
                json.dump(me, f)
            try:
                os.link(staged, self.path)
                return
            except FileExistsError:
                if os.stat(staged).st_nlink == 2:  # NFS: a retried link that had worked answers EEXIST
                    return
                raise
            except OSError:  # no hard links here
                pass
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(me, f)
            except OSError:  # ours, unwritten (not left empty to refuse every start)
                self.path.unlink(missing_ok=True)
                raise
        finally:
            staged.unlink(missing_ok=True)

    def _remove_if_still(self, holder: dict) -> bool:
        """Remove the lock if it is still `holder`'s: renamed aside first, so a lock a racing run
        created after our read (it took the stale one first; perhaps not yet written) is put back,
        not deleted."""
        aside = self.path.with_name(f"{LOCK}.taken-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except OSError:  # gone already (another run took it over: try again), or not ours to move
            return False
        try:
            text = aside.read_text(encoding="utf-8")
            matches = not text if not holder else json.loads(text) == holder  # ({}: an empty lock's)
        except (OSError, ValueError):
            matches = False
        if matches:
            aside.unlink(missing_ok=True)
            return True
        try:
            os.link(aside, self.path)  # a live run's lock: the same file back in place
        except OSError:
            return False  # a third run holds the name (or no hard links here): leave the file aside
        aside.unlink(missing_ok=True)
        return False

    def _beat(self, stop: threading.Event) -> None:
        """Touch the lock every BEAT_S seconds while it is ours: a same-job launch on another host tells a
        live holder from a dead one by it (see _gone_quiet). A lock that cannot be read this beat (renamed
        aside a moment by a racing launch, an NFS error) is tried again at the next; another holder's lock
        ends the beat, and says so (`lost`)."""
        while not stop.wait(BEAT_S):
            holder = self._read()
            if holder == self.mine:
                with contextlib.suppress(OSError):
                    os.utime(self.path)
            elif holder:  # (taken over: not ours to keep alive)
                self.lost = holder
                return

    def _gone_quiet(self, why: str, beats: int = QUIET_BEATS) -> str | None:
        """`why`, where the lock's holder on another host has not touched it for QUIET_BEATS beats (its
        process is gone), else None: a live run of the same job id. Its time is read on an opened file
        (NFS revalidates a file's attributes at open, where a stat may answer from its cache)."""
        first = self._touched()
        time.sleep(beats * BEAT_S)
        return f"{why}; its lock untouched for {beats * BEAT_S:g} s" if self._touched() == first else None

    def _touched(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                return os.fstat(f.fileno()).st_mtime
        except OSError:
            return None


    def _left_empty(self) -> str | None:
        """Why an empty lock is free: one a minute old was left by a start that died between creating
        and writing it (a younger one may still be being written)."""
        try:
            info = self.path.stat()
        except OSError:
            return None
        if info.st_size == 0 and time.time() - info.st_mtime > EMPTY_LOCK_S:
            return "an empty lock a minute old: a start that died while taking it"
        return None

    def _check_writable(self, folder: Path) -> None:
        """A checkpoints folder the run cannot write (read-only mount, permissions) is one line
        now, not a traceback at the first save."""
        if not folder.is_dir():
            return
        probe = folder / f".write-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self.release()
            raise ConfigError(f"{folder} is not writable ({e.strerror}); checkpoints cannot be saved there; "
                              "fix its permissions or use another run.dir") from None

    def acquire_for_job(self, is_main: bool, world_size: int) -> str | None:
        """Rank 0 acquires; every rank learns the outcome (one broadcast), so all stop with the
        same one-line error, of the same kind (its exit code). Returns what was taken over, as acquire()."""
        outcome: list = [("ok", None)]
        if is_main:
            try:
                outcome = [("ok", self.acquire())]
            except errors.ShardlineError as e:  # (one raised on a transient storage error: try later on every rank)
                outcome = [(type(e).__name__ if errors.exit_code(e) == e.exit_code else "TryLater", str(e))]
            except OSError as e:  # any storage error: every rank's one line, not rank 0's alone (the rest waited)
                failed = TryLater if transient(e) else ConfigError
                outcome = [(failed.__name__, f"run.dir={str(self.path.parent)!r}: cannot take its lock ({e})")]
        if world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        kind, text = outcome[0]
        if kind != "ok":
            raise on_every_rank(getattr(errors, kind)(text))
        return text

    def release(self) -> None:
        """Remove the lock if it is still ours: a run of the same job on another host may have
        taken it over meanwhile, and its lock is not ours to delete."""
        if self.held:
            self._beating.set()
            if not self.lost:  # (taken over: not ours to touch at all)
                self._remove_if_still(self.mine)  # renamed aside first: never another run's lock
            self.held = False
            if self.created:  # a launch refused before it wrote anything leaves no folder
                with contextlib.suppress(OSError):  # (rmdir takes an empty folder only)
                    self.path.parent.rmdir()
        atexit.unregister(self.release)  # a process that runs many trainers keeps no stale handlers

    def lost_line(self) -> str:
        """Who took this lock over while it was held, in words; "" while it is still this run's. A
        launch on another host takes a lock its holder left untouched for QUIET_BEATS beats (its own
        job's; OTHER_JOB_QUIET_BEATS another's): a holder
        paused (SIGSTOP, a swapped-out host) or stalled on its storage that long loses it."""
        if not self.lost:
            return ""
        return (f"another launch (pid {self.lost.get('pid')} on {self.lost.get('host')}) took over the lock of "
                f"run.dir={str(self.path.parent)!r} (a launch on another host takes a lock left untouched for "
                f"{QUIET_BEATS * BEAT_S:g} s, its own job's, or {OTHER_JOB_QUIET_BEATS * BEAT_S:g} s, another's: a "
                "paused process or a storage stall)")

    def still_held(self) -> bool:
        """The lock file is still the one this object wrote (nobody took it over since)."""
        return self.held and self._read() == self.mine

    def abandoned(self) -> bool:
        """The lock's holder ran on this host and is gone (or its pid is another process now): the run
        was killed before it could release it. False for no lock, or one of another host."""
        holder = self._read()
        return bool(holder) and holder.get("host") == socket.gethostname() and not _alive(holder)

    def running_here(self) -> bool:
        """The lock's holder runs on this host now: a launch on its run dir is about to be refused."""
        holder = self._read()
        return bool(holder) and holder.get("host") == socket.gethostname() and _alive(holder)

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # being written, or damaged: treated as held by an unknown run


def _why_free(holder: dict, me: dict) -> str | None:
    """Why `holder`'s lock may be taken over, or None while it may still be running."""
    if not holder:
        return None
    same_host = holder.get("host") == me["host"]
    if holder.get("job") and holder["job"] == me["job"] and not (same_host and _alive(holder)):
        return f"same job ({me['job']}): a restart"  # (another host's: only once its lock is quiet, see acquire)
    if not same_host:
        return None
    if holder.get("pid") == me["pid"] and holder.get("start") == me["start"]:
        return "this process: an earlier Trainer in it, ended or not closed, which now refuses to train"
    started = start_time_of(int(holder.get("pid", -1)))
    if started is None:
        return f"stale: pid {holder.get('pid')} on {holder['host']} is gone"
    if holder.get("start") not in (None, -1.0) and started not in (-1.0, holder["start"]):
        return f"stale: pid {holder.get('pid')} on {holder['host']} is another process now"
    return None


def _alive(holder: dict) -> bool:
    """The holder's process (on this host) still runs: its pid started when the lock says."""
    started = start_time_of(int(holder.get("pid", -1)))
    return started is not None and (started == -1.0 or holder.get("start") in (None, -1.0, started))


def _held(holder: dict, me: dict) -> type[ConfigError]:
    """The refusal's kind: this job's own lock (a requeue whose last launch is still leaving) is freed
    when that launch ends, so try later (75); another job's (two jobs given one run.dir) stays, 2."""
    return RunDirInUse if holder.get("job") and holder.get("job") == me["job"] else ConfigError


def _held_message(path: Path, holder: dict) -> str:
    if not holder:
        return (f"run dir {path.parent} is locked by another run ({path} exists, unreadable or empty); use another "
                f"run.dir, or delete {path} if no run is using the dir")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    # (its pid runs, as the lock says, or another host's holder touched it while this launch watched: a gone
    # one's is taken over)
    return (f"run dir {path.parent} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}, "
            f"since {since}); use another run.dir, or stop that run first")
