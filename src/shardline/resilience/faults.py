"""Fault injection ([faults]): the faults a large run meets, on demand, for tests and drills.

Every fault fires on the first attempt of a job only (neither torchrun nor a Slurm
requeue restarted it) and at most once per process, so a restarted or rolled-back run gets past it. Steps are
the 1-based step numbers of the log.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from shardline.config.resilience import FaultsConfig
from shardline.resilience.recovery import restarted


class FaultInjector:
    def __init__(self, cfg: FaultsConfig, rank: int, memory_dir: Path | None = None):
        self.cfg, self.rank, self.memory_dir = cfg, rank, memory_dir
        self.first_attempt = not restarted()  # a requeued job resuming before kill_step must get past it
        self.fired: set[str] = set()
        self._last_step_s = self._slept_s = 0.0  # the slow-rank drill inside a step: its scale, its sleep
        self._steps_seen = 0
        self._read_due = False  # the data drill has yet to sleep in this step

    def _fire(self, name: str, step: int, at: int, rank: int | None = None) -> bool:
        if not (self.first_attempt and at and step == at and name not in self.fired):
            return False
        if rank is not None and rank != self.rank:
            return False
        self.fired.add(name)
        return True

    def before_step(self, step: int) -> None:
        c = self.cfg
        if self._fire("kill", step, c.kill_step, c.kill_rank):
            if c.kill_wipes_memory and self.memory_dir is not None:
                shutil.rmtree(self.memory_dir, ignore_errors=True)
            # One line in the job's log: the peers' errors that follow are the drill's, not a fault's.
            print(f"shardline: drill: faults.kill_step={step} kills rank {self.rank} (SIGKILL)", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if c.hang_phase == "step" and self._fire("hang", step, c.hang_step, c.hang_rank):
            _hang()

    def in_phase(self, phase: str, step: int) -> None:
        """Called as a phase outside steps begins (restore, eval, save, snapshot, drain, halt) after `step`:
        the hang drill there, at the first such phase from faults.hang_step on (0: the first)."""
        if self.cfg.hang_phase == phase and step >= self.cfg.hang_step and self._fire("hang", 1, 1, self.cfg.hang_rank):
            _hang()

    def _slow(self, where: str) -> bool:
        c = self.cfg
        return self.first_attempt and self.rank == c.slow_rank and c.slow_factor > 1 and c.slow_in == where

    def after_step(self, step_time_s: float) -> None:
        """The slow-rank drill, slow_in="host": a sleep once the step's update is settled, before the
        collectives that follow it (host work, as an optimizer step on the host is)."""
        if self._slow("host"):
            time.sleep(step_time_s * (self.cfg.slow_factor - 1))

    def step_computed(self, seconds: float) -> None:
        """A step's own time (its update settled; no evaluation or save): the scale of the
        compute and data drills' sleep in the next step, without that sleep. This process's first step
        (compilation, warm-up; a resumed run's too), which the watchdog gives its long limit,
        sets none."""
        if self._steps_seen:
            self._last_step_s = max(0.0, seconds - self._slept_s)
        self._steps_seen += 1

    def inside_step(self) -> None:
        """A step's clock starts (a retried step's too: a rolled-back one never settled). The
        slow-rank drill, slow_in="compute": a sleep now, as a slow device's extra compute time
        (the peers wait for it in the step's collectives)."""
        self._slept_s, self._read_due = 0.0, True
        if self._slow("compute"):
            self._drill_sleep()

    def _drill_sleep(self) -> None:
        """The in-step drills' sleep: (slow_factor - 1) x the previous step's own time."""
        self._slept_s = self._last_step_s * (self.cfg.slow_factor - 1)
        if self._slept_s > 0:
            time.sleep(self._slept_s)

    def in_read(self) -> None:
        """The slow-rank drill, slow_in="data": the step's first batch read sleeps, on the step's
        clock, as a read from a slow disk or file system (the peers wait for it in the step's
        first collective)."""
        if self._slow("data") and self._read_due:
            self._read_due = False
            self._drill_sleep()

    def slow_compute_probe(self, seconds: float) -> None:
        """Inside a compute probe's timed round of `seconds`: the slow rank of slow_in="compute"
        takes slow_factor x as long."""
        if self._slow("compute"):
            time.sleep(seconds * (self.cfg.slow_factor - 1))

    def corrupt_loss(self, step: int, loss):
        """The loss as the anomaly check sees it (a float, or a device tensor)."""
        if self._fire("nan", step, self.cfg.nan_step):
            return loss * float("nan")
        if self._fire("spike", step, self.cfg.spike_step):
            return loss * 100.0
        return loss

    def corrupt_gradients(self, step: int, model, every_rank: bool) -> None:
        """faults.overflow_step: one of this rank's gradients (its local shard) holds an inf after the
        backward, as an overflow leaves them. Rank 0's alone under fp16, whose loss scaler must agree
        the skip; `every_rank` elsewhere, as a data-parallel all-reduce spreads one to every replica,
        whose anomaly checks each see it (a norm reduced over the shards only would see it on one)."""
        if not self._fire("overflow", step, self.cfg.overflow_step, rank=None if every_rank else 0):
            return
        for param in model.parameters():
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            if grad is not None and grad.numel():
                grad.view(-1)[0] = float("inf")
                return

    def during_save(self, step: int) -> None:
        """Called after the state is written and before the manifest: die half-saved, or have the
        storage refuse the save (the path checkpoint.on_error takes, short of filling a disk)."""
        if self._fire("refuse_save", step, self.cfg.refuse_save_step):
            raise OSError(errno.EIO, "the storage refused the write (drill: faults.refuse_save_step)")
        if self._fire("fail_save", step, self.cfg.fail_save_step):
            print(f"shardline: drill: faults.fail_save_step={step} ends rank {self.rank} midway through the save "
                  "(exit 1, a half-written checkpoint left)", file=sys.stderr, flush=True)
            os._exit(1)

    def after_save(self, step: int, path: Path) -> None:
        if self._fire("corrupt", step, self.cfg.corrupt_checkpoint_step) and self.rank == 0:
            shard = sorted((path / "state").glob("*.distcp"))[0]
            data = bytearray(shard.read_bytes())
            for i in range(0, len(data), max(1, len(data) // 64)):
                data[i] ^= 0xFF
            shard.write_bytes(bytes(data))
            print(f"shardline: drill: faults.corrupt_checkpoint_step={step} damaged {shard} (a resume finds it "
                  "invalid and falls back)", file=sys.stderr, flush=True)  # (as the kill and save drills say)


def _hang() -> None:
    while True:  # a rank stuck outside any collective; the watchdog must notice
        time.sleep(3600)
