"""Stragglers that step times cannot name, since their peers wait for them inside the step's
collectives: a slow device, named by the compute probe ([watchdog] probe_interval), and a slow
reader of the step's batch, named by its reads' time."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shardline.resilience.compute_probe import ROUNDS, probe_due, probe_seconds
from tests.conftest import tiny_overrides
from tests.distributed.harness import run_world


@pytest.mark.parametrize("slow_in", ["compute", "data"])
def test_a_rank_slow_inside_its_steps_is_named_by_its_own_measure(tmp_path, small_prepared, slow_in):
    """Rank 1 is slow inside its steps: computing 4x slower (the drill's slow_in="compute"), or
    reading its batch for 3 of its step times (slow_in="data": a step 4x as long). Rank 0 waits
    for it in the FSDP collectives and their step times agree: only the probe, or only the
    reads' time, names it; every measure is on."""
    run = tmp_path / "run"
    # 40 steps (~4 s): rank 0's watchdog judges the published records once a second, and stops
    # judging a rank whose record is closed
    run_world(2, [(run, tiny_overrides(
        run, small_prepared, "parallel.dp_shard=2", "train.steps=40", "train.eval_interval=0", "checkpoint.interval=0",
        "watchdog.timeout_s=60", "watchdog.probe_interval=1", "watchdog.straggler_steps=3",
        "watchdog.straggler_factor=2.5",  # the drill's 4x is measured inside the rounds: 2.5x and up
        "faults.slow_rank=1", "faults.slow_factor=4", f"faults.slow_in={slow_in}"))])
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    found = [e for e in events if e.get("event") == "straggler"]
    # (once per streak of slow measurements: noise that breaks one starts another report)
    seen = [(e["measure"], e["rank"], e["factor"]) for e in found]
    assert found and {(e["measure"], e["rank"]) for e in found} == {(slow_in, 1)}, seen  # named by one measure
    assert all(e["factor"] >= 2.5 and e[f"{slow_in}_time_s"] > 0 for e in found), seen  # (logged to 2 decimals)


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
    assert slept == [3.0, 3.0]


def test_the_slow_reader_drill_sleeps_in_the_first_read_of_a_step_only(monkeypatch):
    from shardline.config.resilience import FaultsConfig
    from shardline.resilience.faults import FaultInjector

    slept = []
    monkeypatch.setattr("shardline.resilience.faults.time.sleep", slept.append)
    drill = FaultInjector(FaultsConfig(slow_rank=0, slow_factor=3, slow_in="data"), rank=0)
    drill.inside_step(), drill.in_read(), drill.step_computed(30.0)  # the first step: no scale
    drill.inside_step(), drill.in_read(), drill.in_read(), drill.step_computed(1.0)
    drill.inside_step(), drill.in_read(), drill.in_read(), drill.in_read(), drill.step_computed(1.0 + 2.0)
    assert slept == [2.0]  # once in the step, scaled by the step before without its sleep
    drill.inside_step(), drill.in_read()  # a step rolled back: it never settles ...
    drill.inside_step(), drill.in_read(), drill.in_read(), drill.step_computed(1.0 + 2.0)  # ... and is retried
    drill.inside_step(), drill.in_read()
    assert slept == [2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize(("interval", "steps"), [(50, [25, 75, 125]), (1, list(range(1, 7))), (4, [2, 6]), (0, [])])
def test_probes_fall_between_the_default_save_and_evaluation_steps(interval, steps):
    assert [s for s in range(1, 130 if interval == 50 else 7) if probe_due(s, interval)] == steps


def test_the_guard_adds_up_a_steps_reads_failed_ones_too():
    """RunGuard.reads times every read of the step into one figure, the step's reading time."""
    from types import SimpleNamespace

    from shardline.config.resilience import FaultsConfig
    from shardline.resilience.faults import FaultInjector
    from shardline.resilience.guard import RunGuard

    guard = SimpleNamespace(faults=FaultInjector(FaultsConfig(), rank=0), _read_s=0.0)  # what reads() uses

    def read(seconds):
        time.sleep(seconds)
        if seconds > 0.02:
            raise OSError("a read that fails")
        return seconds

    timed = RunGuard.reads(guard, read)
    assert timed(0.01) == 0.01 and timed(0.01) == 0.01
    with pytest.raises(OSError):
        timed(0.03)
    assert 0.05 <= guard._read_s < 0.5
