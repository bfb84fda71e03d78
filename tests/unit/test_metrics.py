"""What MetricsLogger leaves in TensorBoard when a run goes back (a resume after a crash, a rollback)."""

from __future__ import annotations

import pytest

from shardline.metrics import MetricsLogger

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_steps_logged_again_replace_the_old_history_in_tensorboard(tmp_path):
    """A run logs steps 1-5 and dies; its resume from step 3 logs 4-6 and then rolls back to
    step 4 and logs 5-6 again. TensorBoard shows each step once, from the latest history."""
    first = MetricsLogger(tmp_path, "none", True, 10, 0)
    for step in range(1, 6):
        first.log("train", step=step, loss=float(step))
    first.close()
    resumed = MetricsLogger(tmp_path, "none", True, 10, 3)
    for step in range(4, 7):
        resumed.log("train", step=step, loss=10.0 + step)
    resumed.rewind(4)
    for step in range(5, 7):
        resumed.log("train", step=step, loss=20.0 + step)
    resumed.close()
    seen = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    seen.Reload()
    points = [(e.step, e.value) for e in seen.Scalars("train/loss")]
    assert points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 25.0), (6, 26.0)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 10  # the jsonl keeps every record
