"""A rank is killed mid-run under torchrun --max-restarts: the job recovers by itself
from the newest checkpoint on disk and its losses equal the uninterrupted run's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_overrides
from tests.e2e.test_torchrun import torchrun

LAYOUTS = {"fsdp": (2, ["parallel.dp_shard=2"]), "fsdp_x_tp": (4, ["parallel.dp_shard=2", "parallel.tp=2"])}


def train_losses(run) -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_rank_recovers_from_disk_with_identical_losses(tmp_path, small_corpus, layout):
    nproc, extra = LAYOUTS[layout]
    common = [*extra, "checkpoint.interval=3", "train.eval_interval=0"]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    out = torchrun(nproc, *[f"--{o}" for o in tiny_overrides(clean, small_corpus, *common)])
    assert out.returncode == 0, out.stderr[-2000:]
    out = torchrun(nproc, "--max-restarts=1", *[f"--{o}" for o in tiny_overrides(
        killed, small_corpus, *common, f"faults.kill_rank={nproc - 1}", "faults.kill_step=8")])
    assert out.returncode == 0, out.stderr[-2000:]
    assert train_losses(killed) == train_losses(clean)  # bit-identical after recovery
    events = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 6
