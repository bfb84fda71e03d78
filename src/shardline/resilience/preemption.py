"""Stopping on request: SIGTERM, SIGUSR1, SIGHUP (the terminal closed) or a first Ctrl-C finish
the step, save, and exit. A SIGHUP the process was started ignoring (nohup's) stays ignored; the
others are taken even so (a shell ignores SIGINT for its background jobs, and a `kill -INT` sent
to one on purpose is a stop request).

Slurm and Kubernetes send SIGTERM (or a chosen signal, ahead of time) before they kill
a job. A handler here only records the request; the trainer asks `agreed()` at the end
of every step, which every rank answers together (a small MAX all-reduce on a gloo
group of its own, on the host: no device sync), so all ranks stop after the same step,
save the same checkpoint and exit with Preempted.exit_code (5). A second Ctrl-C stops at once,
except in a save: that finishes first, unless a third Ctrl-C comes.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable

import torch
import torch.distributed as dist

SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")
LOCK_LOST = 255  # agreed()'s flag where rank 0's run-dir lock was taken over: above every signal, so MAX keeps it


class StopRequests:
    def __init__(self, group: dist.ProcessGroup | None):
        """group: a gloo group of every rank used for nothing else (None in one process)."""
        self.group = group
        self.requested = 0  # the signal number asked for, 0 = none
        self.fastest_s: float | None = None  # the least step time over the ranks, as the last agreed() heard
        self.writing = False  # a checkpoint (or its drain) is being written: set by the guard's phases
        self._held_once = False
        self._previous: dict[int, object] = {}
        self.lock_lost: Callable[[], bool] = lambda: False  # (set by the guard once the run dir is locked)

    def install(self) -> None:
        """Handle the stop signals (main thread only: Python delivers signals there; a Trainer run on
        another thread, a notebook's background one, takes none: a Ctrl-C reaches the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None and not (name == "SIGHUP" and signal.getsignal(sig) is signal.SIG_IGN):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            if self.writing and not self._held_once:  # a second Ctrl-C (often a quick double press) in a save
                self._held_once = True  # would leave no checkpoint and a traceback: the save first, once
                with contextlib.suppress(OSError):  # (a terminal gone: the save still comes first)
                    print("shardline: a checkpoint is being written; it finishes first (Ctrl-C again abandons it)",
                          file=sys.stderr)
                return
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if signum == signal.SIGINT and not self.requested and (self.group is None or dist.get_rank() == 0):
            with contextlib.suppress(OSError):  # (said at once: a long step kept it silent, and a second press came)
                print("shardline: Ctrl-C: stopping after this step, with a checkpoint of it (Ctrl-C again: at once, "
                      "without one)", file=sys.stderr, flush=True)
        self.requested = self.requested or signum

    def agreed(self, step_s: float | None = None) -> str | None:
        """The name of a stop signal any rank received, the same answer on every rank ("LOCK_LOST" where
        another launch took rank 0's run-dir lock: before any signal). `step_s` (every rank gives one, or
        none does): this rank's step time, whose least over the ranks the same all-reduce carries, as
        `fastest_s` after it."""
        flag, self.fastest_s = LOCK_LOST if self.lock_lost() else self.requested, step_s
        if self.group is not None:
            t = torch.tensor([flag] + ([] if step_s is None else [-round(step_s * 1e6)]), dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = int(t[0])
            self.fastest_s = None if step_s is None else -int(t[1]) / 1e6
        return "LOCK_LOST" if flag == LOCK_LOST else signal.Signals(flag).name if flag else None
