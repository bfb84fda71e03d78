"""One piece of work at a time on a background thread, for saves that must not stall training.

The next start() waits for the work in flight, so at most one runs; its result (with
the seconds it took as `background_s`) or its exception comes back to the training
thread from wait().
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from typing import Callable


# Every BackgroundWork thread's name starts so (busy() finds those still running).
THREAD_PREFIX = "shardline-background-"


def busy() -> list[str]:
    """The names of this process's background saves still running (their threads are daemons: the
    interpreter's exit does not wait for them)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def leave_if_busy(code: int) -> None:
    """Exit with `code` now where a background save or snapshot still runs: after a peer was lost it
    waits in a collective with that peer, which never returns, and Python's own exit would tear its
    process group down under it, which aborts the process (SIGABRT in torchrun's summary, not the
    exit code). The atexit handlers run first (the run dir's lock, a hang report's hold, which exits
    with its own code). The CLI's, for a rank whose job is over: a Python caller ends with it."""
    if busy():
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class BackgroundWork:
    def __init__(self, name: str):
        self.name = THREAD_PREFIX + name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished: list[dict] = []

    def start(self, work: Callable[[], dict]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(work,), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], dict]) -> None:
        begin = time.perf_counter()
        try:
            self._finished.append({**work(), "background_s": time.perf_counter() - begin})
        except BaseException as e:  # re-raised in the training thread by wait()
            self._error = e

    def peek(self) -> list[dict]:
        """The results finished since last peeked at, without waiting; wait() still returns them
        (marked "peeked")."""
        fresh = [r for r in list(self._finished) if not r.get("peeked")]  # (appended by the thread: a copy)
        for r in fresh:
            r["peeked"] = True
        return fresh

    def wait(self) -> list[dict]:
        """Block until the work in flight is done; returns the results finished since last asked."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        done, self._finished = self._finished, []
        return done
