"""metrics.profile_steps (a Chrome trace of chosen steps) and memory.expandable_segments."""

from __future__ import annotations

import json
import time
import re

import pytest
import torch

from shardline.profiling import (StepProfiler, allocator_conf, configure_allocator, forget_allocator_env,
                                 profile_window)
from shardline.trainer import Trainer

FAST = ("train.steps=4", "train.eval_interval=0", "checkpoint.interval=0")


def events(run_dir, name):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "event" and r["event"] == name]


def step_labels(trace_path) -> set[int]:
    trace = json.loads(trace_path.read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    return {int(m.group(1)) for n in names if (m := re.fullmatch(r"shardline\.step\.(\d+)", n))}


def test_profile_steps_write_a_trace_of_exactly_those_steps(tiny_config, tmp_path):
    Trainer(tiny_config(*FAST, "metrics.profile_steps=[2, 3]")).build().train()
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0_steps2-3.json"]
    trace_path = run / "profile" / "rank0_steps2-3.json"
    assert step_labels(trace_path) == {2, 3}
    names = {e.get("name", "") for e in json.loads(trace_path.read_text())["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)  # the ops themselves, not only the labels
    (event,) = events(run, "profile")
    assert event["step"] == 3 and event["first_step"] == 2 and event["trace"] == str(trace_path)


def test_writing_the_trace_is_on_no_steps_clock(tiny_config, tmp_path, monkeypatch):
    """The export ran inside the last profiled step: its time counted as that step's (goodput's,
    the straggler check's) and lowered the tokens/s of the window it fell in."""
    trainer = Trainer(tiny_config(*FAST, "metrics.profile_steps=[2, 2]", "metrics.log_interval=3",
                                  "train.steps=3")).build()
    close = trainer.profiler.close

    def slow_close(step):
        time.sleep(2.0)
        close(step)

    monkeypatch.setattr(trainer.profiler, "close", slow_close)
    trainer.train()
    (record,) = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
                 if r["kind"] == "train"]
    assert record["step"] == 3 and record["step_time_s"] < 1.0, record  # steps 2 and 3, without the export
    assert (tmp_path / "run" / "profile" / "rank0_steps2-2.json").is_file()


def test_no_profile_when_unset(tiny_config, tmp_path):
    Trainer(tiny_config(*FAST)).build().train()
    run = tmp_path / "run"
    assert not (run / "profile").exists()
    assert not events(run, "profile") and not events(run, "profile_skipped")


def test_steps_beyond_the_run_warn_and_train_on(tiny_config, tmp_path):
    last = Trainer(tiny_config(*FAST, "metrics.profile_steps=[3, 9]")).build().train()
    run = tmp_path / "run"
    assert last["step"] == 4 and not (run / "profile").exists()
    (skipped,) = events(run, "profile_skipped")
    assert "train.steps=4" in skipped["reason"]


def test_a_run_stopped_inside_the_window_writes_the_steps_it_ran(tiny_config, tmp_path):
    Trainer(tiny_config(*FAST, "train.stop_at_step=2", "metrics.profile_steps=[2, 3]")).build().train()
    trace_path = tmp_path / "run" / "profile" / "rank0_steps2-2.json"
    assert step_labels(trace_path) == {2}


@pytest.mark.parametrize(("steps", "done", "total", "window"), [
    ([], 0, 10, None),
    ([2, 3], 0, 10, (2, 3)),
    ([5, 10], 4, 10, (5, 10)),  # resumed after step 4: step 5 is still ahead
    ([4, 6], 4, 10, None),  # step 4 was computed before the resume
    ([8, 11], 0, 10, None),
])
def test_profile_window_counts_global_steps(steps, done, total, window):
    got, reason = profile_window(steps, done, total)
    assert got == window
    assert (reason is not None) == (bool(steps) and window is None)  # a skip says why


def test_a_resumed_run_profiles_later_steps_by_their_global_number(tmp_path):
    seen = []
    prof = StepProfiler([6, 6], tmp_path, 3, torch.device("cpu"), 5, 10, lambda *a, **k: seen.append((a, k)))
    for step in (6, 7):
        with prof.step(step):
            torch.ones(4) @ torch.ones(4)
        prof.after_step(step)
    assert step_labels(tmp_path / "profile" / "rank3_steps6-6.json") == {6}
    assert [a for a, _ in seen] == [("profile",)]


def test_allocator_conf_sets_expandable_segments_only_when_nobody_else_did():
    assert allocator_conf({}, True)[0] == "expandable_segments:True"
    assert allocator_conf({"PATH": "/bin"}, False)[0] is None
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        setting, note = allocator_conf({name: "max_split_size_mb:128"}, True)
        assert setting is None and name in note and "max_split_size_mb:128" in note


def test_configure_allocator_writes_the_env_on_cuda_only_and_the_run_takes_it_out_again():
    env = {}
    assert configure_allocator(torch.device("cpu"), True, env) == (None, None) and env == {}
    if not torch.cuda.is_initialized():  # else the allocator API would change this process's allocator
        note, written = configure_allocator(torch.device("cuda"), True, env)
        assert "expandable_segments:True" in note and env == {"PYTORCH_ALLOC_CONF": written}
        forget_allocator_env(written, env)  # (a run's close(): a later run here would take it for the user's)
        assert env == {}
        assert "keeps torch's defaults" in configure_allocator(torch.device("cuda"), False, env)[0]
    user = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert configure_allocator(torch.device("cuda"), True, user)[1] is None
    forget_allocator_env("expandable_segments:False", user)  # (another variable: the user's, left)
    assert user == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


def test_a_step_failing_inside_the_window_writes_the_trace_and_raises_its_own_error(tmp_path):
    def closed_log(*args, **kwargs):  # as after an anomaly halt, which closes the metrics first
        raise ValueError("I/O operation on closed file")

    prof = StepProfiler([1, 3], tmp_path, 0, torch.device("cpu"), 0, 10, closed_log)
    with pytest.raises(RuntimeError, match="out of memory"), prof.step(1):
        torch.ones(4) @ torch.ones(4)
        raise RuntimeError("out of memory")
    assert step_labels(tmp_path / "profile" / "rank0_steps1-1.json") == {1}


def test_a_run_failing_between_profiled_steps_writes_the_steps_it_ran(tiny_config, tmp_path, monkeypatch):
    """An evaluation (or a save) that fails inside the window ends the run outside any step:
    the trace of the steps before it is still written."""
    trainer = Trainer(tiny_config(*FAST, "train.eval_interval=1", "metrics.profile_steps=[1, 3]")).build()

    def broken_eval(*args):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(trainer, "evaluate", broken_eval)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        trainer.train()
    assert step_labels(tmp_path / "run" / "profile" / "rank0_steps1-1.json") == {1}


def test_a_window_run_again_after_a_rollback_keeps_its_first_trace(tmp_path):
    """A rollback to before the window runs its steps again: the trace written stays (the steps
    as first run, with what led to the anomaly), not overwritten by a second profile."""
    prof = StepProfiler([2, 2], tmp_path, 0, torch.device("cpu"), 0, 10, lambda *a, **k: None)
    for step in (1, 2, 1, 2):  # rolled back to step 0 after step 2
        with prof.step(step):
            torch.ones(4) @ torch.ones(4)
        prof.after_step(step)
        if step == 2 and not (tmp_path / "profile" / "kept").exists():
            (tmp_path / "profile" / "rank0_steps2-2.json").rename(tmp_path / "profile" / "kept")
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["kept"]


def test_a_rollback_at_the_windows_last_step_writes_the_trace_then(tiny_config, tmp_path):
    """The trace was written inside the last profiled step; once moved after the step's clock, a
    rollback there skipped it, and the profiler recorded on through the restore and the steps after."""
    Trainer(tiny_config(*FAST, "metrics.profile_steps=[2, 3]", "faults.nan_step=3", "anomaly.action=rollback",
                        "anomaly.min_history=1", "checkpoint.interval=2", "train.steps=4")).build().train()
    run = tmp_path / "run"
    (event,) = events(run, "profile")
    assert event["step"] == 3 and step_labels(run / "profile" / "rank0_steps2-3.json") == {2, 3}
    (rollback,) = events(run, "anomaly")
    assert rollback["to_step"] == 2
    trace = json.loads((run / "profile" / "rank0_steps2-3.json").read_text())["traceEvents"]
    assert sum(e.get("name") == "shardline.step.3" for e in trace) == 1  # not the step run again as well
