"""Errors that speak to users.

Each is raised for a mistake the user can fix (a config key, a data file, a
checkpoint); the CLI prints the message on one line and exits with code 2. A TryLater is
no mistake of the input: the storage failed, or the same job's last launch still holds the
run dir. It exits with 75 (sysexits' EX_TEMPFAIL), so a requeue script can retry it and
stop on 2, which the same command meets again.
"""

import difflib
import errno

TRY_LATER = 75  # sysexits' EX_TEMPFAIL: the same command may pass when run again later
# The storage's failures that say nothing about the input (an I/O error, a stale NFS handle, a timeout, a
# busy or locked file): a permission refused, a full disk or a missing file is the same when run again.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EBUSY, errno.EINTR,
                              errno.ENOLCK, errno.EREMOTEIO, errno.ECONNRESET, errno.ECONNABORTED})


class ShardlineError(Exception):
    """Base class: a user-facing error with a one-line message."""

    exit_code = 2

    # Raised on every rank alike (a decision they share, or parallel.distributed.agreed's
    # verdict), so the ranks may leave the process group together before they exit.
    every_rank = False


class ConfigError(ShardlineError):
    """A config key, value or combination of values that cannot work."""


class DataError(ShardlineError):
    """A data path, data file or tokenizer that cannot be read or used."""


class ModelError(ShardlineError, ValueError):
    """A model changed in the code but not where the system reads it: a module added to the model
    and not to its parameter count, or to its tensor-parallel plan. Said in one line naming the
    file to change, not a traceback per rank inside the launcher's report."""


class CheckpointError(ShardlineError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class TryLater(ShardlineError):
    """Not the input's fault, and not known to last: the storage failed (transient), or the same
    job's last launch still holds the run dir. Exit code 75, where a refused input's is 2."""

    exit_code = TRY_LATER


def transient(error: BaseException) -> bool:
    """Whether an OSError is a failure of the storage that a later try may not meet (TRANSIENT_ERRNOS)."""
    return isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS


def exit_code(error: BaseException) -> int:
    """The error's exit code; TRY_LATER also for one raised while handling a transient OSError (a
    read that failed with EIO, said as the file it could not read: `raise ... from None` keeps it as
    the context). Not shardline's: 130 for an interrupt that saved nothing, else 1 (a crash)."""
    if not isinstance(error, ShardlineError):
        return 130 if interrupted(error) else 1
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen and error.exit_code == 2:
        if transient(cause):
            return TRY_LATER
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return error.exit_code


class CheckpointUnreadable(CheckpointError, TryLater):
    """A checkpoint the storage failed to read (EIO, a stale NFS handle): not known to be bad,
    so a resume stops instead of passing over it (a retry may read it)."""


class RunDirInUse(ConfigError, TryLater):
    """The same job's last launch still holds the run dir's lock (a requeue or restart whose
    previous launch is still leaving): free when it ends. Another job's lock is a ConfigError (2):
    two jobs given one run.dir, which a retry would only race."""


class AnomalyHalt(ShardlineError):
    """Training stopped on an anomaly with anomaly.action = halt (exit code 3): decided on the
    global loss, by every rank."""

    exit_code = 3
    every_rank = True


class Preempted(ShardlineError):
    """Training stopped on SIGTERM, SIGUSR1 or Ctrl-C after saving its state (exit code 5);
    every rank after the same step."""

    exit_code = 5
    every_rank = True


class Interrupted(Preempted, KeyboardInterrupt):
    """A Preempted on Ctrl-C (SIGINT): in a notebook or script, `except KeyboardInterrupt` catches it
    as it would catch an interrupt that saved nothing."""


def on_every_rank(error: ShardlineError, alike: bool = True) -> ShardlineError:
    """`error`, marked (when `alike`) as raised alike on every rank: see ShardlineError.every_rank."""
    error.every_rank = alike
    return error


def did_you_mean(name: str, options, prefix: str = "") -> str:
    """" (did you mean PREFIX+option?)" for the option closest to a mistyped `name` (two, where they are
    about as close: batch_size is micro_batch_size or global_batch_size), else "": a typo is found in
    the line, not by reading the list of every valid name."""
    scored = sorted(((difflib.SequenceMatcher(None, name, o).ratio(), o) for o in options), reverse=True)
    best = scored[0][0] if scored else 0.0
    close = [o for score, o in scored[:2] if best >= 0.75 and score >= best - 0.05]
    return f" (did you mean {' or '.join(prefix + o for o in close)}?)" if close else ""


def require(ok: bool, key: str, value, valid: str) -> None:
    """Raise ConfigError `key=value is invalid: valid` unless ok."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {valid}")


def outside_folder(name: object) -> bool:
    """Whether a file name a manifest gives (a prepared folder's shard, a checkpoint's file) would
    reach outside its folder: absolute, or climbing with '..'. A folder someone else gave names
    its own files only: a crafted one mapped /etc files as training tokens, or stat'ed and hashed
    them."""
    from pathlib import PurePath

    return not isinstance(name, str) or PurePath(name).is_absolute() or ".." in PurePath(name).parts


def links_outside(root, path) -> bool:
    """Whether `path`, a file of folder `root`, resolves (through links) to a file outside it, other
    than into a content-addressed store (an HF cache's models--*/blobs, DVC's .dvc/cache, git-annex's
    objects: a download's links; a name there is its content's hash, which a folder's maker cannot
    aim at a file of yours): a folder someone gave, holding `shard.bin -> /home/you/secret`, read
    that file. A link loop counts as outside."""
    from pathlib import Path

    try:
        target, home = Path(path).resolve(), Path(root).resolve()
    except (RuntimeError, OSError):  # (a loop: RuntimeError before Python 3.13)
        return True
    stored = (target.parent.name == "blobs" and target.parent.parent.name.startswith(("models--", "datasets--"))
              or any(store in target.as_posix() for store in ("/.dvc/cache/", "/.git/annex/objects/")))
    return not (target.is_relative_to(home) or stored)


NEARLY_FULL_BYTES = 64 << 20  # free space below which (or below 5% of the disk) a refused write means a full disk


def nearly_full(folder) -> bool:
    """Whether the file system holding `folder` (or its nearest existing parent) has almost no space
    left: what a write refused without an errno (numpy's "N requested and M written", torch's
    writer's RuntimeError) is taken for. False where no parent can be asked."""
    import shutil
    from pathlib import Path

    for where in (Path(folder), *Path(folder).parents):
        try:
            usage = shutil.disk_usage(where)
        except OSError:
            continue
        return usage.free < min(NEARLY_FULL_BYTES, usage.total // 20)
    return False


def causes(error: BaseException) -> list[BaseException]:
    """The error, what it was raised from (not what it was raised while handling: an error in a
    cleanup after a Ctrl-C is that error), and the failures a distributed checkpoint error carries
    (torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback)})."""
    found, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found.append(error)
        for failure in (getattr(error, "failures", None) or {}).values():
            found.append(failure[0] if isinstance(failure, tuple) else failure)
        error = error.__cause__
    return found


def interrupted(error: BaseException) -> bool:
    """A Ctrl-C, maybe inside torch's checkpoint writer, which comes back wrapped in its error."""
    return any(isinstance(cause, KeyboardInterrupt) for cause in causes(error))
