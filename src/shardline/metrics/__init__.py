"""Metric sinks: a progress display or plain lines, metrics.jsonl, TensorBoard.

Every record is a dict with a `kind`: `train` (step, loss, lr, grad_norm,
tokens_per_s, mfu, ...), `eval` (step, eval_loss, eval_ppl) or `event` (anything
notable: resumes, skipped steps, checkpoints). The trainer builds the records; the
sinks only write them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from shardline.errors import ConfigError
from shardline.metrics.records import history, is_record, written_by_a_run  # noqa: F401 (the package's)
from shardline.metrics.tb_writer import KeptErrors, after_newest_event_file

ETA_LINES = 20  # the plain line's time left: the pace of the last this many train lines (200 steps at log_interval 10)


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak memory of this rank, by record key: on CPU the process's peak RSS; on CUDA the
    allocator's peaks since the last call (which resets them).

    On CUDA, `peak_reserved_gib` far above `peak_mem_gib` (allocated) is memory the
    caching allocator holds but cannot hand out: fragmentation.
    """
    if device.type == "cuda":
        peaks = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                 "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
        torch.cuda.reset_peak_memory_stats(device)
        return peaks
    return {"peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None, n_devices: int) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices.

    The peak is devices.peak_tflops, whose dtype is devices.mfu_peak_dtype: fp8 runs are
    measured against the bf16 dense peak. The planner's reported MFU uses the same function.
    """
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * n_devices)


def format_line(rec: dict[str, Any], total_steps: int) -> str:
    if rec["kind"] == "train":
        parts = [f"step {rec['step']}/{total_steps}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
                 f"gnorm {rec['grad_norm']:.3f}", f"{rec['tokens_per_s']:,.0f} tok/s"]
        if "tokens_by_source" in rec:  # a data mixture: training tokens seen from each source
            parts.append("tokens " + ", ".join(f"{k} {v:,}" for k, v in rec["tokens_by_source"].items()))
        if rec.get("mfu") is not None:
            parts.append(f"mfu {100 * rec['mfu']:.1f}%")
        parts += [_memory_part(rec), f"{rec['step_time_s']:.3f} s/step"]
        if "loss_scale" in rec:  # fp16
            parts.append(f"loss scale {rec['loss_scale']:g}")
        if "expert_load_max" in rec:  # a mixture-of-experts model
            parts.append(f"experts load max/mean {rec['expert_load_max']:.2f} aux {rec['aux_loss']:.4f} "
                         f"dropped {rec['dropped_tokens']:,.0f}"
                         + (f" ({100 * rec['dropped_share']:.1f}%)" if "dropped_share" in rec else ""))
        return " | ".join(parts)
    if rec["kind"] == "eval":
        by_source = " ".join(f"{name} {loss:.4f}" for name, loss in rec.get("eval_loss_by_source", {}).items())
        return f"eval step {rec['step']} | loss {rec['eval_loss']:.4f} | ppl {rec['eval_ppl']:.2f}" + (
            f" | by source: {by_source}" if by_source else "")
    fields = " ".join(f"{k}={_value(v)}" for k, v in rec.items() if k not in ("kind", "event", "time"))
    return f"[{rec['event']}] {fields}"


def _value(v: Any) -> str:
    """An event field on the console: a table as (key=value, ...), not a Python dict's repr."""
    return f"({', '.join(f'{k}={_value(x)}' for k, x in v.items())})" if isinstance(v, dict) else str(v)


def _duration(seconds: float) -> str:
    """12s, 4m05s, 3h25m, 2d04h: two units at most."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _memory_part(rec: dict[str, Any]) -> str:
    if "peak_reserved_gib" in rec:  # CUDA: allocated / reserved since the last line
        return f"mem {rec['peak_mem_gib']:.2f}/{rec['peak_reserved_gib']:.2f} GiB alloc/reserved"
    return f"mem {rec['peak_mem_gib']:.2f} GiB"


def silence(fd: int) -> None:
    """Point file descriptor `fd` (1: stdout, 2: stderr) at /dev/null: a reader gone, a closed terminal
    or a stdout closed at start; later writes, Python's own at exit too, go nowhere."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:  # (fd was closed: the lowest free one is now held as it)
            os.dup2(null, fd)
            os.close(null)


class Console:
    """Plain lines, or a rich progress bar on a terminal; silent when mode is "none"."""

    def __init__(self, mode: str, total_steps: int, first_step: int, last_step: int = 0):
        self.total = total_steps  # the run's steps, each line's "step N/total"
        self.last = last_step or total_steps  # the step this launch stops at (train.stop_at_step): the time left's
        if sys.stdout is None:  # (started with stdout closed, `>&-`: metrics.jsonl has every record)
            mode = "none"
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self._progress = self._task = None
        self._broken = False  # rich met a broken pipe (see _rich_pipe_broke)
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=ETA_LINES + 1)  # (time, step)
        if mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.description}"))
            self._task = self._progress.add_task("", total=self.last, completed=first_step)
            self._progress.console.on_broken_pipe = self._rich_pipe_broke
            self._progress.start()

    def write(self, rec: dict[str, Any]) -> None:
        if self.mode == "none":
            return
        try:
            self._write(format_line(rec, self.total), rec)
            if self._broken:
                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
        except OSError as e:  # `| tee` gone with the Ctrl-C that asks for a save, a closed ssh, a full disk
            self._lost(e)

    def _rich_pipe_broke(self) -> None:
        """rich's own handler exits the process (SystemExit 1), a stop's save with it: quiet instead,
        said at the next write (its refresh thread may meet the broken pipe first)."""
        self._progress.console.quiet, self._broken = True, True
        silence(1)  # (its last render, as it stops, may be what broke: Python's flush at exit must not fail)

    def _write(self, line: str, rec: dict[str, Any]) -> None:
        if self._progress is None:  # (plain lines: a log file's reader has no bar; the time left ends the line)
            print(line + (self._eta(rec) if rec["kind"] == "train" else ""), flush=True)
            return
        # "[resume] ..." is no style tag; a record stays one line (a pipe's 80 columns cut it into several)
        self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        if rec["kind"] == "train":
            self._progress.update(self._task, completed=rec["step"], description=f"loss {rec['loss']:.4f}")

    def _eta(self, rec: dict[str, Any]) -> str:
        """The line's end, " | eta 1h05m": the steps left at this launch's pace over its last
        ETA_LINES train lines (evaluations and saves between them included; a slowdown, or a faster
        pace after a slow start, shows within that many lines; the first line, before any pace is
        known: its own step time), to this launch's last step (named where it stops before the run's
        end: train.stop_at_step); none at that step."""
        now, step, left = time.monotonic(), rec["step"], self.last - rec["step"]
        if self._recent and step <= self._recent[-1][1]:  # a rollback: the pace starts again from here
            self._recent.clear()
        self._recent.append((now, step))
        if left <= 0:
            return ""
        since, first = self._recent[0]
        per_step = (now - since) / (step - first) if step > first else rec["step_time_s"]
        return f" | eta {_duration(per_step * left)}" + (f" to step {self.last}" if self.last < self.total else "")

    def _lost(self, error: OSError) -> None:
        """The console's output failed: training goes on without it (a stop's save too), said once."""
        self.mode = "none"
        with contextlib.suppress(Exception):
            self.close()
        silence(1)  # later writes, and Python's at exit
        try:
            print(f"shardline: the console's output failed ({error.strerror or error}); training goes on, "
                  "every record in metrics.jsonl", file=sys.stderr, flush=True)
        except (OSError, ValueError, AttributeError):  # stderr the same pipe or terminal (`2>&1 | tee`): its
            silence(2)  # lines to come (a stop's, a halt's) would raise there too, the exit code lost

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _drop_torn_line(path: Path) -> None:
    """A record cut short by a kill (no newline at the end) goes, so the resumed run's first one
    starts a line of its own: each line stays one JSON object."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            tail = b""
            while size > 0 and b"\n" not in tail:
                step = min(size, 1 << 16)
                f.seek(size - step)
                tail, size = f.read(step) + tail, size - step
            if not tail.endswith(b"\n"):
                f.truncate(size + tail.rfind(b"\n") + 1)
    except FileNotFoundError:
        return


def append_event(run_dir: Path, event: str, **fields: Any) -> None:
    """One event record appended to <run_dir>/metrics.jsonl as MetricsLogger writes it, without one:
    for a process that exits before its log opens (a hang while it restores). A write that fails
    is let go: the exit it precedes is the news."""
    try:
        _drop_torn_line(Path(run_dir) / "metrics.jsonl")  # (a killed launch's last line: not one to append to)
        with open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(_line(_record("event", event=event, **fields)))
    except OSError:
        pass


def trained_in(run_dir: Path | str) -> bool:
    """Whether run_dir's metrics.jsonl holds a training step's record (read up to the first)."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8", errors="replace") as f:
            return any(line.startswith('{"kind": "train"') for line in f)
    except OSError:
        return False


def _record(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "time": round(time.time(), 3), **fields}


def _line(rec: dict[str, Any]) -> str:
    """A record as metrics.jsonl holds it: one line of strict JSON (non-finite numbers as strings)."""
    return json.dumps(_strict(rec), allow_nan=False, default=_jsonable) + "\n"


def require_tensorboard() -> None:
    """One line, on every rank before the run starts (preflight), where the tensorboard package is
    missing (a --no-deps or broken environment): rank 0 alone died in a traceback at its writer."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"metrics.tensorboard=true needs the tensorboard package ({e}): pip install "
                          "tensorboard, or --metrics.tensorboard=false") from None


class MetricsLogger:
    """Fans records out to the console, <run_dir>/metrics.jsonl and TensorBoard."""

    def __init__(self, run_dir: Path, mode: str, tensorboard: bool, total_steps: int, first_step: int,
                 enabled: bool = True, last_step: int = 0):
        self.enabled = enabled  # only one rank writes; the others keep the same code path
        self.console = Console(mode if enabled else "none", total_steps, first_step, last_step)
        if enabled:
            _drop_torn_line(run_dir / "metrics.jsonl")
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None
        self._tb, self._said_unwritten = None, set()
        self.unowned: Callable[[], bool] = lambda: False  # the run dir is another launch's now: the console alone
        self._tb_dir = run_dir / "tensorboard"
        if enabled and tensorboard:
            self._open_tensorboard(first_step)

    def _open_tensorboard(self, step: int) -> None:
        """A writer whose points from step + 1 on replace those an earlier writer of the run dir
        logged there (a resume after a crash, a rollback): TensorBoard drops them on reading,
        where the curves would otherwise zigzag between the two histories."""
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        after_newest_event_file(self._tb_dir)
        self._tb = SummaryWriter(log_dir=str(self._tb_dir), purge_step=step + 1)
        self._tb_writes = KeptErrors.around(self._tb)

    def rewind(self, step: int) -> None:
        """The run went back to `step` (a rollback): the steps it logs again replace the old ones."""
        if self._tb is not None and not self.unowned():  # (a new writer would purge the taker's points)
            try:
                self._tb.close()
                self._open_tensorboard(step)
            except OSError as e:
                self._tb = None  # no curves from here on: the run is worth more
                self._unwritten(e, "TensorBoard")

    def log(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = _record(kind, **fields)
        if not self.enabled or self._jsonl.closed:  # closed: a watchdog report racing a failed run's end
            return rec
        if self.unowned():  # (its lock taken over: metrics.jsonl and the curves are the taker's)
            self.console.write(rec)
            return rec
        try:
            self._jsonl.write(_line(rec))
            self._jsonl.flush()
        except OSError as e:  # a full disk: the log is not worth the run (the next flush retries what is held)
            self._unwritten(e, self._jsonl.name)
        self.console.write(rec)
        if self._tb is not None and kind in ("train", "eval"):
            try:  # (its writer thread keeps a write error and raises it at the next add_scalar)
                for key, value in fields.items():  # (a table's numbers each a curve: a layer's, a source's)
                    for tag, x in (value.items() if isinstance(value, dict) else [("", value)]):
                        if key != "step" and isinstance(x, (int, float)) and math.isfinite(x):
                            self._tb.add_scalar(f"{kind}/{key}" + f"/{tag}" * bool(tag), x, fields["step"])
                self._tb.flush()  # on disk a line at a time, as metrics.jsonl: a killed run loses none of its curves
                if self._tb_writes is not None and self._tb_writes.error is not None:
                    raise self._tb_writes.error
            except OSError as e:
                self._unwritten(e, "TensorBoard")
        return rec

    def _unwritten(self, error: OSError, what: str) -> None:
        if what not in self._said_unwritten:  # once each, on stderr: the console may be a progress bar
            self._said_unwritten.add(what)
            print(f"shardline: warning: {what} cannot be written ({type(error).__name__}: {error}); "
                  "training goes on, the console keeps the log", file=sys.stderr)

    def event(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.log("event", event=event, **fields)

    def close(self) -> None:
        self.console.close()
        for log, what in ((self._jsonl, getattr(self._jsonl, "name", "")), (self._tb, "TensorBoard")):
            if log is not None:
                try:
                    log.close()
                except OSError as e:  # what a full disk still held back
                    self._unwritten(e, what)


def _strict(obj: Any) -> Any:
    """A record as strict JSON holds it: a non-finite number (a NaN loss) as the string "NaN",
    "Infinity" or "-Infinity", which float() reads back; Python's bare NaN token is not JSON,
    and strict readers (jq, most languages) refuse the whole line."""
    if isinstance(obj, torch.Tensor):
        obj = obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {key: _strict(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(value) for value in obj]
    return obj


def _jsonable(obj: Any) -> Any:
    """What json cannot write by itself, after _strict turned tensors into numbers."""
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to metrics.jsonl")
