"""TensorBoard's writer as the run's log needs it: each launch's event file read after the last
launch's (its purge of the steps trained again read in order), and its writer thread's storage
errors said by the log in one line rather than printed as that thread's traceback."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def after_newest_event_file(folder: Path, most_s: float = 2.0) -> None:
    """Wait (at most `most_s`) until this second is past the newest event file's in `folder`.
    TensorBoard reads a folder's files in name order, events.out.tfevents.<second>.<host>.<pid>.<n>:
    a writer opened within the second of the last one could sort before it ("...pid.10" before
    "...pid.9"), and the purge of the steps its launch trains again would be read first."""
    seconds = []
    for file in folder.glob("events.out.tfevents.*") if folder.is_dir() else ():
        with contextlib.suppress(IndexError, ValueError):
            seconds.append(int(file.name.split(".")[3]))
    deadline = time.monotonic() + most_s
    while seconds and time.time() < max(seconds) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)


class KeptErrors:
    """TensorBoard writes its events on a thread of its own, whose storage error (a full disk, the
    run dir moved) Python printed as a thread's traceback before the next flush raised it again: the
    record writer that thread calls keeps the error instead, for the flush to say in one line."""

    def __init__(self, inner):
        self.inner, self.error = inner, None

    @classmethod
    def around(cls, tb) -> KeptErrors | None:
        """Wrap `tb`'s record writer (torch's SummaryWriter over tensorboard's async writer); None where
        another version lays it out otherwise (its thread then prints as before)."""
        worker = getattr(getattr(getattr(getattr(tb, "file_writer", None), "event_writer", None), "_async_writer",
                                 None), "_worker", None)
        if worker is None or not hasattr(worker, "_record_writer"):
            return None
        worker._record_writer = kept = cls(worker._record_writer)
        return kept

    def _kept(self, call, *args) -> None:
        if self.error is None:  # (after an error: nothing more, the run's log goes on without its curves)
            try:
                call(*args)
            except OSError as e:
                self.error = e

    def write(self, data) -> None:
        self._kept(self.inner.write, data)

    def flush(self) -> None:
        self._kept(self.inner.flush)

    def close(self) -> None:
        self._kept(self.inner.close)

    @property
    def closed(self) -> bool:
        return self.inner.closed
