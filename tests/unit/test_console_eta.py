"""The plain log line's time left: a log file under nohup, torchrun or Slurm has no progress bar."""

from __future__ import annotations

import itertools

from shardline import metrics
from shardline.metrics import Console


def _train(step: int) -> dict:
    return {"kind": "train", "step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
            "mfu": None, "peak_mem_gib": 1.0, "step_time_s": 0.5}


def test_a_plain_train_line_ends_with_the_time_left_at_the_launch_s_pace(monkeypatch, capsys):
    clock = itertools.chain([100.0, 160.0, 400.0], itertools.repeat(401.0))  # (any other reader: a late time)
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    console = Console("plain", total_steps=1000, first_step=200)  # a resumed launch: its own pace
    for step in (210, 220, 260):
        console.write(_train(step))
    console.write({"kind": "eval", "step": 260, "eval_loss": 2.0, "eval_ppl": 7.39})
    console.write(_train(1000))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| 0.500 s/step | eta 6m35s")  # first line: its step time, 790 steps left
    assert lines[1].endswith("| eta 1h18m")  # 60 s for 10 steps: 780 left at 6 s
    assert lines[2].endswith("| eta 1h14m")  # 300 s for 50 steps: 740 left at 6 s
    assert lines[3].startswith("eval step 260") and "eta" not in lines[3]
    assert lines[4].endswith("s/step")  # the last step: nothing left


def test_the_pace_is_the_last_lines_so_a_slowdown_shows(monkeypatch, capsys):
    """A run that slows (a straggling node, a throttled disk) or speeds up after a slow start shows
    it within ETA_LINES lines, not diluted by the whole launch's history."""
    times = iter([10.0 * k for k in range(40)] + [400.0 + 100.0 * k for k in range(1, 41)])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(times))
    console = Console("plain", total_steps=100_000, first_step=0)
    for line in range(80):
        console.write(_train(10 * (line + 1)))  # 1 s a step for 40 lines, then 10 s a step
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f"| eta {metrics._duration(10.0 * (100_000 - 800))}"), last


def test_a_rollback_starts_the_pace_again(monkeypatch, capsys):
    """An anomaly's rollback logs lower steps again: lines of steps ahead of the one logged made
    the pace 4x too slow for 20 lines."""
    times = iter([float(10 * k) for k in range(60)])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(times))
    console = Console("plain", total_steps=10_000, first_step=0)
    for step in [*range(10, 310, 10), *range(160, 460, 10)]:  # 1 s a step; back from 300 to 150
        console.write(_train(step))
    lines = capsys.readouterr().out.splitlines()
    assert all(line.endswith(f"| eta {metrics._duration(10_000 - step)}")
               for line, step in zip(lines[31:], range(170, 460, 10))), lines[31:34]


def test_durations_read_in_two_units():
    assert [metrics._duration(s) for s in (0, 59.4, 61, 3599, 3600, 86399, 90061)] == [
        "0s", "59s", "1m01s", "59m59s", "1h00m", "23h59m", "1d01h"]


def test_a_launch_stopping_early_counts_the_time_left_to_its_stop(monkeypatch, capsys):
    """train.stop_at_step=120 of 400: the time left counted the 280 steps after the launch's end, and its
    last line still had one."""
    times = iter([float(k) for k in range(20)])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(times))
    console = Console("plain", total_steps=400, first_step=0, last_step=120)
    for step in (10, 20, 120):
        console.write(_train(step))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 10/400") and lines[0].endswith("| eta 55s to step 120")  # 110 x 0.5 s
    assert lines[1].endswith("| eta 10s to step 120")  # (1 s for 10 steps: 100 left)
    assert lines[2].endswith("s/step")
