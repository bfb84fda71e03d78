"""Config sections of the resilience features: [anomaly], [watchdog], [faults]."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.errors import require

ACTIONS = ("skip", "rollback", "halt")
HANG_PHASES = ("step", "restore", "eval", "save", "snapshot", "drain", "halt")  # where faults.hang_phase stops a rank
SLOW_IN = ("host", "compute", "data")  # where faults.slow_rank is slow


@dataclass
class AnomalyConfig:
    action: str = "skip"  # skip (drop the update) | rollback (to the newest checkpoint, skip the batch) | halt
    spike_zscore: float = 8.0  # robust z-score of the loss over the window that counts as a spike; 0 = off
    window: int = 50  # recent healthy losses the z-score is computed over
    min_history: int = 20  # no spike verdicts before this many healthy steps
    max_rollbacks: int = 3  # then halt: the same fault keeps coming back
    # Anomalous steps in a row that halt a skipping run: skipped updates keep the weights, so a
    # loss level that moved up for good is flagged at every later step; 0 = never halt.
    max_consecutive: int = 20
    check_on: str = "auto"  # host (reads loss every step) | device (no per-step sync; action=skip) | auto

    def check(self) -> None:
        require(self.action in ACTIONS, "anomaly.action", self.action, f"one of {', '.join(ACTIONS)}")
        require(self.spike_zscore >= 0, "anomaly.spike_zscore", self.spike_zscore, "must be >= 0 (0 = off)")
        require(self.window >= 3, "anomaly.window", self.window, "must be >= 3")
        require(1 <= self.min_history <= self.window, "anomaly.min_history", self.min_history,
                "must be in [1, anomaly.window]")
        require(self.max_rollbacks >= 0, "anomaly.max_rollbacks", self.max_rollbacks, "must be >= 0")
        require(self.max_consecutive >= 0, "anomaly.max_consecutive", self.max_consecutive, "must be >= 0 (0 = off)")
        require(self.check_on in ("auto", "host", "device"), "anomaly.check_on", self.check_on,
                "auto, host or device")


@dataclass
class WatchdogConfig:
    timeout_s: float = 0.0  # a step or collective longer than this on any rank is a hang; 0 = off
    # The limit of the one-off work around the steps: restoring at start-up, the first step
    # (compilation, warm-up) and the final drain of saves; 0 = 10 x timeout_s.
    long_timeout_s: float = 0.0
    straggler_factor: float = 1.5  # slower than this x the median step time ...
    straggler_steps: int = 5  # ... this many steps in a row: reported
    # Every this many steps each rank times a fixed GEMM alone (resilience/compute_probe.py), so a
    # rank whose device computes slowly, which step times cannot tell (its peers wait for it in the
    # collectives), is reported by the same factor and streak; 0 = off. With several ranks and
    # timeout_s > 0, as the rest of the watchdog.
    probe_interval: int = 50

    def check(self) -> None:
        require(self.timeout_s >= 0, "watchdog.timeout_s", self.timeout_s, "must be >= 0 (0 = off)")
        require(self.long_timeout_s >= 0, "watchdog.long_timeout_s", self.long_timeout_s,
                "must be >= 0 (0 = 10 x timeout_s)")
        require(self.straggler_factor > 1, "watchdog.straggler_factor", self.straggler_factor, "must be > 1")
        require(self.straggler_steps >= 1, "watchdog.straggler_steps", self.straggler_steps, "must be >= 1")
        require(self.probe_interval >= 0, "watchdog.probe_interval", self.probe_interval, "must be >= 0 (0 = off)")

    @property
    def long_limit_s(self) -> float:
        return self.long_timeout_s or 10 * self.timeout_s


DRILL_STEPS = ("kill_step", "nan_step", "spike_step", "overflow_step", "hang_step", "corrupt_checkpoint_step",
               "fail_save_step", "refuse_save_step")


@dataclass
class FaultsConfig:
    """Fault injection for tests and drills; off by default, fires on the first attempt only."""

    kill_rank: int = -1
    kill_step: int = 0
    kill_wipes_memory: bool = False  # the killed rank's in-memory snapshots go too (its own folder, as if lost)
    nan_step: int = 0  # the loss of this step becomes NaN
    spike_step: int = 0  # the loss of this step is multiplied by 100
    # the gradients of this step hold an inf, as an overflow leaves them: under fp16 rank 0's alone, and the
    # loss scaler skips the update on every rank; elsewhere every rank's, the anomaly check's non-finite norm
    overflow_step: int = 0
    hang_rank: int = -1
    hang_step: int = 0
    # Where hang_rank hangs: a step (hang_step), or the first phase of that name (its watchdog limit is
    # long_timeout_s): "restore", "eval", "save", "snapshot", "drain" or an anomaly "halt"
    hang_phase: str = "step"
    slow_rank: int = -1
    slow_factor: float = 1.0
    # Where slow_rank is slow: "host" sleeps after its step (outside the collectives: host work);
    # "compute" inside its step and its compute probes, as a slow GPU is (its peers wait for it);
    # "data" in its first batch read of each step, as a slow disk is (its peers wait for it too)
    slow_in: str = "host"
    corrupt_checkpoint_step: int = 0  # flip bytes in the checkpoint saved at this step
    fail_save_step: int = 0  # die in the middle of writing this step's checkpoint
    refuse_save_step: int = 0  # the storage refuses this step's checkpoint (an I/O error): checkpoint.on_error's drill

    def check(self) -> None:
        for key in DRILL_STEPS:
            require(getattr(self, key) >= 0, f"faults.{key}", getattr(self, key), "must be >= 0 (0 = off)")
        for key in ("kill_rank", "hang_rank", "slow_rank"):
            require(getattr(self, key) >= -1, f"faults.{key}", getattr(self, key), "must be a rank, or -1 (off)")
        require(self.slow_factor >= 1, "faults.slow_factor", self.slow_factor, "must be >= 1")
        require(self.slow_in in SLOW_IN, "faults.slow_in", self.slow_in, f"one of {', '.join(SLOW_IN)}")
        require(self.hang_phase in HANG_PHASES, "faults.hang_phase", self.hang_phase,
                f"one of {', '.join(HANG_PHASES)}")
        # A drill given half (a step without its rank, or the reverse) never fires: a drill that passed
        # without anything happening.
        for step, rank in (("kill_step", "kill_rank"), ("hang_step", "hang_rank")):
            if getattr(self, step) and getattr(self, rank) < 0:
                require(False, f"faults.{step}", getattr(self, step), f"needs faults.{rank}, the rank it fires on")
        if self.kill_rank >= 0:
            require(self.kill_step > 0, "faults.kill_rank", self.kill_rank,
                    "needs faults.kill_step, the step it dies at")
        if self.hang_rank >= 0 and self.hang_phase == "step":
            require(self.hang_step > 0, "faults.hang_rank", self.hang_rank,
                    "needs faults.hang_step, the step it hangs at (or faults.hang_phase)")
        if self.slow_rank >= 0:
            require(self.slow_factor > 1, "faults.slow_rank", self.slow_rank, "needs faults.slow_factor > 1")

    def rank_problem(self, world: int) -> str | None:
        """A drill's rank outside this job's ranks (it would never fire), or None."""
        for key in ("kill_rank", "hang_rank", "slow_rank"):
            if getattr(self, key) >= world:
                return f"faults.{key}={getattr(self, key)} is not a rank of this {world}-rank job (0-{world - 1})"
