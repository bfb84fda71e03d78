"""Looking inside a run: the CUDA allocator's settings and a profile of chosen steps.

`configure_allocator` turns on expandable segments (memory.expandable_segments)
before CUDA starts: the caching allocator then grows a segment in place instead of
adding new fixed-size ones, so blocks freed at changing sizes (activations of
varying length, MoE routing) are reused rather than left as reserved-but-unusable
memory. `StepProfiler` profiles optimizer steps [first, last] of
metrics.profile_steps into a Chrome trace per rank and, on CUDA, a memory snapshot.
See docs/profiling.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# The name torch >= 2.9 reads (and warns about the other one before 2.12), then the
# older CUDA-only alias, which every torch still reads. A value in either is the user's.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"
# Allocation events the CUDA memory history keeps (the oldest are dropped past it): a
# few KB each, so the snapshot stays in the hundreds of MB at most.
MEMORY_HISTORY_ENTRIES = 100_000


def allocator_conf(env: Mapping[str, str], expandable: bool) -> tuple[str | None, str]:
    """The allocator setting shardline would add to `env` (None: leave it), and a line saying why.

    A user who set either variable knows their allocator: theirs is used untouched,
    even when it says nothing about expandable segments.
    """
    for name in ALLOC_CONF_VARS:
        if name in env:
            return None, f"{name}={env[name]!r} was set by the user; memory.expandable_segments is not applied"
    if not expandable:
        return None, "memory.expandable_segments=false: the allocator keeps torch's defaults"
    return EXPANDABLE, f"{EXPANDABLE} (memory.expandable_segments=true)"


def configure_allocator(device: torch.device, expandable: bool,
                        env: MutableMapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """Apply memory.expandable_segments on CUDA; returns the line to log (None off CUDA) and the
    value written into `env` (None: nothing written), for forget_allocator_env at the run's end.

    torch reads the variable once, when CUDA first allocates, so this must run before
    that. Where CUDA has already started (a caller that used it first, or an earlier run in
    this process), torch's allocator-settings call still changes segments created from then on.
    """
    if device.type != "cuda":
        return None, None
    setting, note = allocator_conf(env, expandable)
    if setting is None:
        if not expandable and torch.cuda.is_initialized() and not any(name in env for name in ALLOC_CONF_VARS):
            _set_allocator_settings("expandable_segments:False")  # (an earlier run here may have turned them on)
        return note, None
    if not torch.cuda.is_initialized():
        env[ALLOC_CONF_VARS[0]] = setting
        return f"{ALLOC_CONF_VARS[0]}={note}", setting
    _set_allocator_settings(setting)
    return f"{note}; CUDA had already started, so set through torch's allocator API", None


def forget_allocator_env(written: str | None, env: MutableMapping[str, str] = os.environ) -> None:
    """Take out the variable configure_allocator wrote, where it still holds that value: a later
    run in this process would take it for the user's (and not apply its own setting), and the
    processes started after the run would inherit it. This process's allocator keeps it."""
    if written is not None and env.get(ALLOC_CONF_VARS[0]) == written:
        del env[ALLOC_CONF_VARS[0]]


def _set_allocator_settings(setting: str) -> None:
    """torch >= 2.9 has the accelerator-wide call; torch.cuda's older one warns it is deprecated."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def profile_window(steps: list[int], done: int, total: int) -> tuple[tuple[int, int] | None, str | None]:
    """The steps [first, last] to profile, or None and the reason it is skipped.

    Steps are global 1-based optimizer steps: a resumed run that has completed
    `done` steps can only profile later ones, and none past train.steps (`total`).
    """
    if not steps:
        return None, None
    first, last = steps
    if first <= done:
        return None, f"metrics.profile_steps={steps} starts at or before step {done}, where this run resumes"
    if last > total:
        return None, f"metrics.profile_steps={steps} ends past train.steps={total}"
    return (first, last), None


class StepProfiler:
    """Profiles optimizer steps [first, last] of metrics.profile_steps; the trainer wraps
    each step in `step()` and calls `close()` when the loop ends.

    Writes <run_dir>/profile/rank{r}_steps{first}-{last}.json (Chrome trace: CPU ops,
    and CUDA kernels on a GPU) and, on CUDA, rank{r}_steps{first}-{last}_memory.pickle
    (the allocator's history, for pytorch.org/memory_viz). Every step of a profiled run
    carries a `shardline.step.N` label, so a trace shows exactly which steps it holds.
    """

    def __init__(self, steps: list[int], run_dir: Path, rank: int, device: torch.device, done: int,
                 total: int, event: Callable[..., object]):
        self.window, skipped = profile_window(steps, done, total)
        if skipped:
            event("profile_skipped", step=done, reason=skipped)
        self.dir, self.rank, self.cuda = Path(run_dir) / "profile", rank, device.type == "cuda"
        self.event = event
        self._prof: profile | None = None
        self._first = 0
        self._written = False  # once: a rollback to before the window would run it again over the files

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step number `step` (1-based) inside the profile when it falls in the window."""
        if self.window is None:
            yield
            return
        first, last = self.window
        if step == first and self._prof is None and not self._written:
            self._start(step)
        try:
            with record_function(f"shardline.step.{step}"):
                yield
        except BaseException:
            # A step that fails (an OOM) inside the window: the files show what led to it. The
            # step's own error is the one to raise (an anomaly halt has closed the metrics already).
            with suppress(Exception):
                self.close(step)
            raise

    def after_step(self, step: int) -> float:
        """Write the profile when `step` ends its window: after the step's clock stopped (its time,
        the straggler check's and goodput's, is the step's own). Returns the seconds the writing
        took, which the throughput window leaves out as it does an evaluation."""
        if self._prof is None or step < self.window[1]:
            return 0.0
        begin = time.perf_counter()
        self.close(step)
        return time.perf_counter() - begin

    def close(self, step: int) -> None:
        """Stop and write the profile if one is running (a run that stopped inside the window
        writes the steps it ran: the file names the last one)."""
        if self._prof is None:
            return
        prof, self._prof, self._written = self._prof, None, True
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"rank{self.rank}_steps{self._first}-{step}"
        trace = stem.with_suffix(".json")
        prof.export_chrome_trace(str(trace))
        files = {"trace": str(trace)}
        if self.cuda:
            files["memory_snapshot"] = str(stem) + "_memory.pickle"
            torch.cuda.memory._dump_snapshot(files["memory_snapshot"])
            torch.cuda.memory._record_memory_history(enabled=None)
        self.event("profile", step=step, first_step=self._first, **files)

    def _start(self, step: int) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            # Python stacks only: C++ frames take seconds to minutes to symbolize at the dump.
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES, stacks="python")
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self._prof.start()
        self._first = step
