"""Goodput accounting: where a run's wall-clock time goes, across restarts.

Each attempt adds its seconds by category; rank 0 keeps the running totals and the
highest step ever completed in `<run_dir>/progress.json` (rewritten atomically every
step: a few KB, what the run trains included), so a restarted attempt knows which of its steps are
recomputed work and how long the job was down between attempts.

Categories: useful steps; recomputed steps (steps done again after a restart or a
rollback); anomaly-skipped steps; checkpoint stalls (disk saves, async snapshots,
in-memory snapshots); evaluation; startup (launch, build, loading the resumed state);
recovery (anomaly rollbacks); restart gap (from the previous attempt's last step to
this attempt's process start: detection, teardown, relaunch); peer wait (the per-step
collectives outside a step's clock, the stop-request check and the watchdog's barrier:
waiting for a slower peer, a straggler's cost); other (logging, whatever the rest do not
cover). Goodput = useful / everything.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

PROGRESS = "progress.json"
CATEGORIES = ("useful", "recomputed", "anomaly_skipped", "checkpoint", "eval", "startup", "recovery",
              "restart_gap", "peer_wait")


def process_start_time() -> float:
    """Wall-clock time this process started (imports included), from /proc where there is one."""
    try:
        # Process start in clock ticks after boot, against the uptime now (10 ms
        # resolution; /proc/stat's boot time is whole seconds, too coarse here).
        ticks = int(Path("/proc/self/stat").read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text(encoding="utf-8").split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def read_account(run_dir: Path) -> dict | None:
    """The run's progress.json (see Goodput.persist), or None where there is none to read."""
    try:
        account = json.loads((Path(run_dir) / PROGRESS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return account if isinstance(account, dict) else None


class Goodput:
    def __init__(self, run_dir: Path, enabled: bool, started: float | None = None, fresh: bool = False,
                 trains: dict | None = None):
        """`fresh`: a new run in this dir (nothing resumed, not a restart): after a run that finished,
        its account starts anew (that run's progress.json is not its history); after one that did
        not, it goes on (a relaunch by hand or by a script after a crash before any save), unless this
        launch trains another run than the account's (`trains`: what it trains, kept in the account
        as config.job.trained_settings gives it; a key the account lacks is no difference)."""
        self.path, self.enabled = Path(run_dir) / PROGRESS, enabled
        self.unowned: Callable[[], bool] = lambda: False  # the run dir is another launch's now: nothing written
        self.started = started if started is not None else process_start_time()
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.wall_before = 0.0  # wall time of earlier attempts
        self.high_water = 0
        self.last_step = 0  # the step this launch completed last (at its start: the step it resumed)
        self.phase = ""  # what this launch does (see enter), "ended" once it has
        self._begun = False  # training began: phases are said in progress.json
        self._ended = (False, False)  # end()'s (finished, run_complete): what a failure after it keeps
        self.exit_code: int | None = None  # the launch's exit code, once it ends (None while it runs)
        self._writing = threading.Lock()  # (a hang's exit writes from the watchdog's thread)
        self._recent: dict[int, tuple[str, float]] = {}  # step -> (category, seconds), for reclassify()
        self.unwritten = ""  # why progress.json could not be written, once it could not (persist)
        self.stale = ""  # why its last write failed ("" where it succeeded): the file no longer says the run
        self.counted = True  # this launch is part of the run's account (not one that found nothing to train)
        self._gap = 0.0  # the restart gap before this launch, added to the account
        previous = self._read()
        self.was_complete = bool(previous and previous.get("run_complete"))  # (a restart after it trained to its end)
        # A file there that does not read (damaged, hand-edited): the account starts over, said (progress_reset)
        self.reset = "" if previous or not self.path.exists() else f"{self.path} did not read as an account"
        self.trains = json.loads(json.dumps(trains or {}))  # (as the account reads back: lists, not tuples)
        kept = previous.get("trains") if previous and isinstance(previous.get("trains"), dict) else {}
        other = [k for k, v in self.trains.items() if k in kept and kept[k] != v]
        if previous and fresh and other and not previous.get("finished"):
            self.reset = (f"this launch resumes nothing and trains another run than the account's ({', '.join(other)} "
                          "differ)")
        if previous and fresh and (previous.get("finished") or other):
            previous = None
        if previous:
            self.high_water = previous["high_water_step"]
            self.wall_before = previous["wall_s"]
            for k, v in previous["seconds"].items():
                self.seconds[k] = self.seconds.get(k, 0.0) + v
            if not previous["finished"]:
                self._gap = max(0.0, self.started - previous["time"])
                self.seconds["restart_gap"] += self._gap

    def _read(self) -> dict | None:
        return read_account(self.path.parent)

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def accounted(self) -> float:
        """The seconds accounted so far, every category together."""
        return sum(self.seconds.values())

    def step(self, step: int, seconds: float, outcome: str) -> None:
        """Account one optimizer step (1-based) of `seconds` that ended with `outcome`."""
        if outcome in ("anomaly", "overflow"):
            category = "anomaly_skipped"
        elif step <= self.high_water:
            category = "recomputed"
        else:
            category = "useful"
        self.add(category, seconds)
        self._recent[step] = (category, seconds)
        if len(self._recent) > 1000:  # verdicts are read at every log line; older steps are settled
            self._recent.pop(next(iter(self._recent)))
        self.high_water, self.last_step = max(self.high_water, step), step
        self.persist()

    def begin(self, step: int) -> None:
        """This launch trains from `step` on: said at once (a dashboard sees it begin, no longer the
        last launch's `finished`)."""
        self.last_step, self._begun = step, True
        self.enter("train")

    def enter(self, phase: str) -> None:
        """This launch now does `phase` (train, or a guard's phase: eval, save, snapshot, drain, a
        rollback's restore, halt), said at once where training began: a dashboard reads a `time`
        grown old in a long save or evaluation as that, not as a hang."""
        self.phase = phase
        if self._begun:
            self.persist()

    def end(self, finished: bool, now: float, run_complete: bool, exit_code: int = 0) -> None:
        """The launch is over (see persist for the flags): its last word, with the exit code it ends with
        (5: a stop's; a failure after this one, a refused last save, writes its own)."""
        self.phase, self._ended, self.exit_code = "ended", (finished, run_complete), exit_code
        self.persist(finished, now, run_complete)

    def fail(self, after_end: bool = True, wait_s: float = -1, exit_code: int = 1) -> None:
        """The launch ended by an error, a halt, a hang or an interrupt: its last word is phase "failed",
        so a stale `time` reads as no hang either; also after end() (an unsaved last step's refusal, with
        end()'s flags kept: a run complete stays so) unless not `after_end` (a stop: its save and exit 5
        ended it as planned). `wait_s`: how long a writer on another thread is waited for. `exit_code`: the
        process's (a requeue script under torchrun, which exits 1 for any failure, reads it here)."""
        if self._begun and (after_end or self.phase != "ended"):  # (in start-up: the last launch's record stays)
            self.phase, self.exit_code = "failed", exit_code
            self.persist(self._ended[0], run_complete=self._ended[1], wait_s=wait_s)

    def reclassify(self, step: int, category: str) -> None:
        """Move a recent step's time to another category (an anomaly found after the fact)."""
        if step in self._recent:
            old, seconds = self._recent.pop(step)
            self.seconds[old] -= seconds
            self.seconds[category] += seconds

    def waited_within(self, step: int, seconds: float) -> None:
        """Move up to `seconds` of a recent step's time to peer_wait: the part by which this rank's step
        took longer than the fastest rank's (a useful step is the fastest rank's). A straggling rank 0,
        whose account the run dir keeps, waited for no peer: its own slowness is what its peers waited out."""
        self.move_within(step, seconds, "peer_wait")

    def move_within(self, step: int, seconds: float, to: str, keep: float | None = None) -> None:
        """Move up to `seconds` of a recent step's time to category `to` (waited_within's peer wait), or
        what it holds past `keep` seconds (a compiled launch's first step: its compilation, start-up)."""
        if step in self._recent:
            category, had = self._recent[step]
            moved = max(0.0, min(seconds, had) if keep is None else had - keep)
            self.seconds[category] -= moved
            self.seconds[to] += moved
            self._recent[step] = (category, had - moved)

    def recomputed_from(self, step: int) -> int:
        """Steps a run resuming after `step` will do again."""
        return max(0, self.high_water - step)

    def leave_out_this_launch(self) -> None:
        """A launch with nothing to train (a finished run relaunched, a requeue loop's extra start): the
        run's account is left as it was, not lowered by a start-up that trained nothing."""
        self.counted = False
        self.seconds["restart_gap"] -= self._gap

    def summary(self, now: float | None = None) -> dict:
        """The account at `now` (default: this moment; the run's end gives persist()'s, so that what
        the `end` event says is what a relaunch reads back)."""
        now = time.time() if now is None else now
        wall = self.wall_before + (now - self.started if self.counted else 0.0)
        total = wall + self.seconds["restart_gap"]
        seconds = {k: round(v, 3) for k, v in self.seconds.items()}
        seconds["other"] = round(max(0.0, total - sum(self.seconds.values())), 3)
        return {"goodput": round(self.seconds["useful"] / total, 4) if total > 0 else 0.0,
                "total_s": round(total, 3),  # every launch of the run, and the gaps between them
                "this_launch_s": round(now - self.started, 3), "seconds": seconds}

    def persist(self, finished: bool = False, now: float | None = None, run_complete: bool = False,
                wait_s: float = -1) -> None:
        """Rewrite progress.json (as of `now`, default this moment). A write the storage refuses (a disk
        a checkpoint filled) is kept in `unwritten` and training goes on: accounting must never stop a
        run; the next write retries. One writer at a time (`wait_s` for the other: -1 as long as it takes)."""
        if not self.enabled or self.unowned() or not self.counted or not self._writing.acquire(timeout=wait_s):
            return
        try:
            self._write(finished, now, run_complete)
        finally:
            self._writing.release()

    def _write(self, finished: bool, now: float | None, run_complete: bool) -> None:
        now = time.time() if now is None else now
        wall = self.wall_before + now - self.started
        total = wall + self.seconds["restart_gap"]  # (what `seconds` sum to, with what no category took)
        record = {"high_water_step": self.high_water, "step": self.last_step, "host": socket.gethostname(),
                  "pid": os.getpid(), "phase": self.phase, "time": now, "finished": finished,
                  "run_complete": run_complete, "wall_s": wall, "total_s": total,
                  "goodput": self.seconds["useful"] / total if total > 0 else 0.0, "seconds": dict(self.seconds),
                  # what no category took (a hang's wait until the watchdog ends it, ...): seconds + other_s = total_s
                  "other_s": max(0.0, total - sum(self.seconds.values())), "trains": self.trains,
                  "exit_code": self.exit_code}
        tmp = self.path.with_name(PROGRESS + ".tmp")
        try:
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, self.path)
            self.stale = ""
        except OSError as e:
            self.unwritten = self.unwritten or f"{type(e).__name__}: {e}"
            self.stale = f"{type(e).__name__}: {e}"
            with contextlib.suppress(OSError):
                tmp.unlink()
