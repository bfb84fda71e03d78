"""The compute probe ([watchdog] probe_interval) names a rank whose device is slow, which step
times cannot: its peers wait for it inside the step's collectives."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shardline.resilience.compute_probe import ROUNDS, probe_due, probe_seconds
from tests.conftest import tiny_overrides
from tests.distributed.harness import run_world


def test_a_slow_device_hidden_from_step_times_is_named_by_the_compute_probe(tmp_path, small_prepared):
    """Rank 1 computes 4x slower inside its steps (the drill's slow_in="compute"), so rank 0 waits
    for it in the FSDP collectives and their step times agree: only the probe names it."""
    run = tmp_path / "run"
    # 40 steps (~4 s): rank 0's watchdog judges the published records once a second, and stops
    # judging a rank whose record is closed
    run_world(2, [(run, tiny_overrides(
        run, small_prepared, "parallel.dp_shard=2", "train.steps=40", "train.eval_interval=0", "checkpoint.interval=0",
        "watchdog.timeout_s=60", "watchdog.probe_interval=1", "watchdog.straggler_steps=3",
        "watchdog.straggler_factor=2.5",  # the drill's 4x is measured inside the rounds: 2.5x and up
        "faults.slow_rank=1", "faults.slow_factor=4", "faults.slow_in=compute"))])
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    found = [e for e in events if e.get("event") == "straggler"]
    # (once per streak of slow probes: noise that breaks one starts another report)
    seen = [(e["measure"], e["rank"], e["factor"]) for e in found]
    assert found and {(e["measure"], e["rank"]) for e in found} == {("compute", 1)}, seen
    assert all(e["factor"] >= 2.5 and e["compute_time_s"] > 0 for e in found), seen  # (logged to 2 decimals)


def test_the_probe_times_the_drills_delay_inside_each_round():
    seen = []
    slowed = probe_seconds(torch.device("cpu"), lambda s: seen.append(s) or time.sleep(0.05))
    assert len(seen) == ROUNDS and all(s > 0 for s in seen)
    assert slowed >= 0.05  # the fastest round still holds the delay: it is measured, not added


def test_the_drill_scales_by_the_steps_own_time_from_the_second_step_of_the_process(monkeypatch):
    """The first step of a process (compilation, warm-up; a resumed run's first too) sets no
    scale, and the drill's own sleep is taken out of the step it slowed."""
    from shardline.config.resilience import FaultsConfig
    from shardline.resilience.faults import FaultInjector

    slept = []
    monkeypatch.setattr("shardline.resilience.faults.time.sleep", slept.append)
    drill = FaultInjector(FaultsConfig(slow_rank=0, slow_factor=4, slow_in="compute"), rank=0)
    drill.inside_step(), drill.step_computed(30.0)  # the first step: 30 s of compiling
    drill.inside_step(), drill.step_computed(1.0)
    drill.inside_step(), drill.step_computed(1.0 + 3.0)  # its time holds the 3 s slept
    drill.inside_step()
    assert slept == [0.0, 0.0, 3.0, 3.0]


@pytest.mark.parametrize(("interval", "steps"), [(50, [25, 75, 125]), (1, list(range(1, 7))), (4, [2, 6]), (0, [])])
def test_probes_fall_between_the_default_save_and_evaluation_steps(interval, steps):
    assert [s for s in range(1, 130 if interval == 50 else 7) if probe_due(s, interval)] == steps
