"""What MetricsLogger leaves in TensorBoard when a run goes back (a resume after a crash, a rollback)."""

from __future__ import annotations

import json

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


def test_a_records_table_of_numbers_is_a_curve_each_in_tensorboard(tmp_path):
    """A mixture's tokens by source and an MoE's load by layer were left out of TensorBoard."""
    logger = MetricsLogger(tmp_path, "none", True, 10, 0)
    for step in (1, 2):
        logger.log("train", step=step, loss=1.0, expert_load_by_layer={"1": 1.5 * step, "3": 2.0},
                   tokens_by_source={"web": 100 * step, "code": 50 * step})
    logger.close()
    seen = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    seen.Reload()
    assert [(e.step, e.value) for e in seen.Scalars("train/expert_load_by_layer/1")] == [(1, 1.5), (2, 3.0)]
    assert [e.value for e in seen.Scalars("train/tokens_by_source/code")] == [50.0, 100.0]
    assert "train/loss" in seen.Tags()["scalars"]


KILLED_AFTER_LOGGING = """
import os, sys
from pathlib import Path
from shardline.metrics import MetricsLogger
logger = MetricsLogger(Path(sys.argv[1]), "none", True, 10, 0)
for step in (1, 2, 3):
    logger.log("train", step=step, loss=float(step))
os._exit(9)  # killed: nothing closes the writer
"""


def test_points_are_on_disk_as_they_are_logged_not_when_the_writer_closes(tmp_path):
    """TensorBoard's writer held up to two minutes of points in memory: a killed run lost them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", KILLED_AFTER_LOGGING, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    seen = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    seen.Reload()
    assert [(e.step, e.value) for e in seen.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_the_progress_bars_event_lines_keep_their_names(tmp_path, capsys):
    """rich read "[resume]" as a style tag and printed " step=3 ..." without it."""
    logger = MetricsLogger(tmp_path, "rich", False, 10, 0)
    logger.event("resume", step=3, checkpoint="runs/x/checkpoints/step-000003")
    long = "runs/" + "x" * 150 + "/checkpoints/step-000003"
    logger.event("resume", step=3, checkpoint=long)  # one line, as long as it is (a pipe cut it at 80 columns)
    logger.close()
    out = capsys.readouterr().out
    assert "[resume] step=3 checkpoint=runs/x/checkpoints/step-000003" in out
    assert f"\n[resume] step=3 checkpoint={long}\n" in out


def test_a_run_that_fails_closes_its_log(tiny_config):
    """An error mid-run (an OOM, a refused save) left TensorBoard's writer and the progress bar open."""
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("train.steps=4", "train.eval_interval=0")).build()

    def crash():
        raise RuntimeError("injected")

    trainer.compute_gradients = crash
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert trainer.metrics._jsonl.closed


def test_a_record_cut_short_by_a_kill_goes_before_the_resumed_run_appends(tmp_path):
    import json

    whole = json.dumps({"kind": "train", "step": 1}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(whole + '{"kind": "train", "st')  # killed mid-write
    logger = MetricsLogger(tmp_path, "none", False, 10, 1)
    logger.event("resume", step=1)
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == whole.strip() and [json.loads(line)["kind"] for line in lines] == ["train", "event"]
    (tmp_path / "torn.jsonl").write_text('{"no newline at all"')
    from shardline.metrics import _drop_torn_line

    _drop_torn_line(tmp_path / "torn.jsonl")
    assert (tmp_path / "torn.jsonl").read_text() == ""


def test_the_history_that_stands_in_metrics_jsonl_is_tensorboards(tiny_config, tmp_path):
    """Read by "the last record of a step stands", the file kept steps of histories a resume from
    an older checkpoint had left (and a new run in a dir whose checkpoints were gone kept the old
    run's later steps), where TensorBoard showed the right ones."""
    import shutil

    from shardline.metrics import history
    from shardline.trainer import Trainer

    common = ["train.eval_interval=0", "checkpoint.interval=2", "checkpoint.keep=5", "metrics.tensorboard=true"]
    Trainer(tiny_config(*common, "train.steps=6", "metrics.log_interval=3")).build().train()  # logs 3, 6
    Trainer(tiny_config(*common, "train.steps=10", "metrics.log_interval=3")).build().train()  # 9, 10 (from 6)
    older = f"run.resume={tmp_path / 'run' / 'checkpoints' / 'step-000004'}"
    Trainer(tiny_config(*common, "train.steps=10", "metrics.log_interval=4", older)).build().train()  # 8, 10

    def tensorboard() -> list[tuple[int, float]]:
        seen = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
        seen.Reload()
        return [(e.step, round(e.value, 5)) for e in seen.Scalars("train/loss")]

    stands = [(r["step"], round(r["loss"], 5)) for r in history(tmp_path / "run" / "metrics.jsonl")
              if r["kind"] == "train"]
    assert [s for s, _ in stands] == [3, 8, 10] and stands == tensorboard()  # not 6 and 9 of the histories left
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # a new run in that dir: step 0 again
    Trainer(tiny_config(*common, "train.steps=4", "metrics.log_interval=3")).build().train()  # 3, 4
    stands = [(r["step"], round(r["loss"], 5)) for r in history(tmp_path / "run" / "metrics.jsonl")
              if r["kind"] == "train"]
    assert [s for s, _ in stands] == [3, 4] and stands == tensorboard()
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # a record cut short by a kill
        f.write('{"kind": "train", "step": 5, "lo')
    assert [r["step"] for r in history(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"] == [3, 4]


def test_tensorboard_missing_is_one_line_naming_the_switch(tmp_path, monkeypatch):
    """Without the tensorboard package (a --no-deps install) a run died in a traceback."""
    import sys

    from shardline.errors import ConfigError
    from shardline.metrics import MetricsLogger

    from shardline.config import load_config
    from shardline.preflight import check_config

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # (an import of it raises ImportError)
    for check in (lambda: check_config(load_config(None, [f"run.dir={tmp_path / 'run'}"])),  # every rank, at start
                  lambda: MetricsLogger(tmp_path, "none", True, 10, 0)):
        with pytest.raises(ConfigError, match=r"^metrics.tensorboard=true needs the tensorboard package .*: pip "
                                              r"install tensorboard, or --metrics.tensorboard=false$"):
            check()
    check_config(load_config(None, [f"run.dir={tmp_path / 'run'}", "metrics.tensorboard=false"]))  # not needed
    MetricsLogger(tmp_path, "none", False, 10, 0).close()


def test_a_launch_s_event_file_sorts_after_the_last_launch_s(tmp_path):
    """TensorBoard reads event files in name order, <second>.<host>.<pid>.<n>: a writer opened in
    the second of the last one could sort before it ("...pid.10" before "...pid.9", as two quick
    launches in one process made it in a suite) and its purge be read first. The next writer waits
    past that second, for at most a bound (another host's clock may be ahead)."""
    import time

    from shardline.metrics.tb_writer import after_newest_event_file

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now}.host.12.9").write_bytes(b"")
    after_newest_event_file(tmp_path)
    assert time.time() >= now + 1
    (tmp_path / f"events.out.tfevents.{now + 3600}.host.12.10").write_bytes(b"")  # a clock an hour ahead
    began = time.monotonic()
    after_newest_event_file(tmp_path, most_s=0.3)
    assert time.monotonic() - began < 1.0
    after_newest_event_file(tmp_path / "none")  # (no folder yet: nothing to wait for)


def test_an_event_holding_a_table_reads_as_keys_and_values_on_the_console():
    """The end event's goodput `seconds` printed as a Python dict's repr ({'useful': 128.6, ...})."""
    from shardline.metrics import format_line

    line = format_line({"kind": "event", "event": "end", "time": 0.0, "step": 3,
                        "seconds": {"useful": 1.5, "eval": 0.0}, "sources": {"a": {"loss": 0.5}}, "ids": [1, 2]}, 5)
    assert line == "[end] step=3 seconds=(useful=1.5, eval=0.0) sources=(a=(loss=0.5)) ids=[1, 2]"


def test_history_leaves_out_lines_that_are_no_record(tmp_path):
    """A line damaged by hand or by the storage (a launch appends after it all the same) raised a
    JSONDecodeError, a KeyError or an AttributeError from history() for the whole run."""
    from shardline.metrics import history

    good = [{"kind": "event", "event": "start", "step": 0, "time": 0.0},
            {"kind": "train", "step": 1, "loss": 5.0, "time": 1.0}, {"kind": "eval", "step": 1, "eval_loss": 5.5}]
    damage = ["garbage", "[1, 2]", '{"step": 3}', '{"kind": "train", "step": "x"}', "", '{"kind": "event", '
              '"event": "start", "step": "0"}']
    lines = [json.dumps(good[0]), *damage[:3], json.dumps(good[1]), *damage[3:], json.dumps(good[2])]
    (tmp_path / "metrics.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe\n")
    assert history(tmp_path) == good
