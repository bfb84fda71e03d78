"""A rank is killed mid-run under torchrun --max-restarts: the job recovers by itself and
its losses equal the uninterrupted run's, whether it resumes from the newest checkpoint
on disk or from the in-memory tier (the killed rank's memory wiped as if its node were
lost, so its snapshot is rebuilt from a peer's replica or from XOR parity)."""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.harness import run_world
from tests.e2e.test_torchrun import torchrun

LAYOUTS = {"fsdp": (2, ["parallel.dp_shard=2"]), "fsdp_x_tp": (4, ["parallel.dp_shard=2", "parallel.tp=2"])}
# The memory tier is the only one on (no disk checkpoints), with each redundancy scheme,
# its snapshots taken synchronously under FSDP and in the background under FSDP x TP.
MEMORY = {"fsdp": ("replica", "sync"), "fsdp_x_tp": ("xor", "async")}
# Recovery from disk under FSDP only: the restart path does not depend on the layout, and
# FSDP x TP checkpoints resume exactly in the parity suite's resharding tests.
FROM_DISK = {"fsdp"}


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def train_losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run) if r["kind"] == "train"}


KILL_STEP = 8
# Each rank's last exception (torch prefixes a rank's traceback with [rankN]:), or shardline's one line.
RANK_ERROR = re.compile(r"\[(rank\d+)\]:\s*([\w.]+(?:Error|Exception|Interrupt|Exit)\b.*|shardline: \w+: .*)"
                        r"|shardline: (rank \d+) (lost a peer: .*)")  # (the one line of a rank whose peer died)
LAUNCHER = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+|Worker group FAILED.*|[Ss]ignal \d+.*")


def ranks_errors(stderr: str) -> list[str]:
    """Each failed rank's last exception line, and what the launcher said of the failures."""
    last: dict[str, str] = {}
    for line in stderr.splitlines():
        m = RANK_ERROR.search(line)
        if m:
            last[m.group(1) or m.group(3)] = (m.group(2) or m.group(4))[:300]
    return [f"{rank}: {text}" for rank, text in sorted(last.items())] + LAUNCHER.findall(stderr)[:4]


def killed_run(run, corpus, nproc, *extra, tries: int = 2):
    """Launch with rank nproc-1 killed at KILL_STEP; returns the restart's resume event.

    A first attempt that died before the drill fired (its one stderr line never came; seen in
    loaded CI runs, the cause not yet known) tests nothing about recovery: it is launched once
    more, in a fresh run dir, and the warning carries each rank's last error and the
    launcher's account of the failure for the log."""
    kill = [f"faults.kill_rank={nproc - 1}", f"faults.kill_step={KILL_STEP}"]
    out = torchrun(nproc, "--max-restarts=1", *[f"--{o}" for o in tiny_overrides(run, corpus, *extra, *kill)])
    assert out.returncode == 0, out.stderr[-2000:]
    resumes = [e for e in records(run) if e.get("event") == "resume"]
    fired = f"shardline: drill: faults.kill_step={KILL_STEP} kills rank {nproc - 1}" in out.stderr
    starts = sum(e.get("event") == "start" for e in records(run))
    diagnosis = (f"drill fired: {fired}; {starts} start events; resumes {resumes}; "
                 f"errors: {ranks_errors(out.stderr)}")
    if not fired and tries > 1:
        warnings.warn(f"the first attempt died before the kill drill; launched again. {diagnosis}", stacklevel=1)
        shutil.rmtree(run)
        return killed_run(run, corpus, nproc, *extra, tries=tries - 1)
    assert fired and len(resumes) == 1, diagnosis
    return resumes[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_rank_recovers_with_identical_losses(tmp_path, small_prepared, layout):
    nproc, extra = LAYOUTS[layout]
    common = [*extra, "train.eval_interval=0"]
    clean = tmp_path / "clean"
    # The uninterrupted reference on ranks forked from the harness's preloaded server: the
    # same trainer and gloo ranks as torchrun's, without a launcher and fresh imports.
    run_world(nproc, [(clean, tiny_overrides(clean, small_prepared, *common))])
    # The clean run as a user sees it: rank 0 alone logs, each step once, in order, and every
    # rank's trainer state is in the last checkpoint.
    assert [r["step"] for r in records(clean) if r["kind"] == "train"] == list(range(1, 13))
    trainer_files = {p.name for p in (clean / "checkpoints" / "step-000012" / "trainer").iterdir()}
    assert {f"rank{r}.pt" for r in range(nproc)} <= trainer_files, trainer_files
    expected = train_losses(clean)

    if layout in FROM_DISK:
        disk = killed_run(tmp_path / "disk", small_prepared, nproc, *common, "checkpoint.interval=3")
        assert disk["step"] == 6 and disk["checkpoint"].endswith("step-000006") and disk["recomputed_steps"] == 1
        assert train_losses(tmp_path / "disk") == expected  # bit-identical after recovery

    memory = tmp_path / "memory"
    shm = tmp_path / "shm"
    redundancy, mode = MEMORY[layout]
    resumed = killed_run(memory, small_prepared, nproc, *common, "checkpoint.interval=0",
                         f"checkpoint.memory_mode={mode}",
                         "checkpoint.memory_interval=3", f"checkpoint.memory_redundancy={redundancy}",
                         f"checkpoint.memory_dir={shm}", "faults.kill_wipes_memory=true")
    assert resumed["step"] == 6 and resumed["checkpoint"].startswith("memory tier step 6")
    rebuilt = "replica" if redundancy == "replica" else "parity"
    assert f"{{{nproc - 1}: '{rebuilt}'}}" in resumed["checkpoint"]  # only the killed rank was rebuilt
    assert not (memory / "checkpoints").exists()  # nothing came from disk
    assert train_losses(memory) == expected
    assert shm.is_dir() and not any(shm.iterdir())  # a finished run gives the memory back (the folder named stays)
    end = [e for e in records(memory) if e.get("event") == "end"][-1]
    assert end["seconds"]["recomputed"] > 0 and end["seconds"]["restart_gap"] > 0 and 0 < end["goodput"] < 1
