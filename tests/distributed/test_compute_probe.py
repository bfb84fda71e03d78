"""The compute probe ([watchdog] probe_interval) names a rank whose device is slow, which step
times cannot: its peers wait for it inside the step's collectives."""

from __future__ import annotations

import json

import pytest
import torch

from shardline.resilience.compute_probe import REPEATS, probe_seconds
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
        "faults.slow_rank=1", "faults.slow_factor=4", "faults.slow_in=compute"))])
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    found = [e for e in events if e.get("event") == "straggler"]
    # (once per streak of slow probes: noise that breaks one starts another report)
    assert found and {(e["measure"], e["rank"]) for e in found} == {("compute", 1)}, found
    # 4x by the drill; rank 0's own probe shares 2 cores with rank 1's, so the factor moves
    assert found[0]["factor"] > 1.5 and found[0]["compute_time_s"] > 0, found


def test_the_probe_times_its_gemms_and_the_drill_slows_them():
    plain = probe_seconds(torch.device("cpu"))
    assert plain > 0
    seen = []
    slowed = probe_seconds(torch.device("cpu"), lambda s: seen.append(s) or 3 * s)
    assert len(seen) == 1 and slowed == pytest.approx(3 * seen[0]) and REPEATS >= 1
