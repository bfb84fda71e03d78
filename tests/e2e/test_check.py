"""`shardline check` under torchrun: healthy ranks pass; a slow rank (the [faults] drill) is named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_torchrun import REPO
from tests.ports import free_port


def check(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "-m", "shardline", "check", "--run.device=cpu", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.alone  # a healthy rank must not look slow
def test_healthy_ranks_pass_and_a_slow_one_is_named(tmp_path):
    ok = check(2, "--slow-factor", "3")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "shardline check: 2 rank(s), all ranks ok" in ok.stdout and ok.stdout.count(" ok\n") >= 2
    slow = check(2, "--faults.slow_rank=1", "--faults.slow_factor=8", "--slow-factor", "3")
    assert slow.returncode != 0  # torchrun passes on the ranks' exit code 6 as a failure
    assert "FAILED: rank 1" in slow.stdout
    (line,) = [x for x in slow.stdout.splitlines() if x.strip().startswith("1 ")]
    assert "slow:" in line and "x the median GEMM throughput" in line


def test_a_wrong_product_or_sum_names_the_rank():
    from shardline.resilience.health import RankResult, _verdict

    good = [RankResult(r, "h", 1.0, 42.0, True, 1.0) for r in range(3)]
    report, healthy = _verdict([*good, RankResult(3, "h", 1.0, 41.5, True, 1.0)], slow_factor=1.5)
    assert not healthy and "FAILED: rank 3" in report and "wrong GEMM result" in report
    report, healthy = _verdict([*good[:2], RankResult(2, "h", 1.0, 42.0, False, 1.0)], slow_factor=1.5)
    assert not healthy and "wrong all-reduce sum" in report
    assert _verdict(good, slow_factor=1.5)[1]
    # Two ranks that disagree: no majority to blame one of them.
    report, healthy = _verdict([good[0], RankResult(1, "h", 1.0, 41.5, True, 1.0)], slow_factor=1.5)
    assert not healthy and "FAILED: rank 0, rank 1" in report and report.count("no majority") == 2


def test_a_slow_rank_is_measured_against_the_others_not_a_median_that_holds_it():
    from shardline.resilience.health import RankResult, _verdict

    # Of two ranks, one 1.6x slower at slow_factor 1.5: against a median holding itself it read 0.77x.
    report, healthy = _verdict([RankResult(0, "h", 1.6, 42.0, True, 1.0), RankResult(1, "h", 1.0, 42.0, True, 1.0)],
                               slow_factor=1.5)
    assert not healthy and "FAILED: rank 1\n" in report and "0.62x the median" in report


def test_a_drill_rank_past_the_job_is_refused_not_passed_in_silence():
    """One process with a slow-rank drill on rank 1: the drill could never fire, so "all ranks ok"
    would claim a check it did not make; refused in one line, as training refuses it."""
    cmd = [sys.executable, "-m", "shardline", "check", "--run.device=cpu", "--size", "64",
           "--faults.slow_rank=1", "--faults.slow_factor=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "faults.slow_rank=1 is not a rank of this 1-rank job (0-0)" in done.stderr
    assert "all ranks ok" not in done.stdout and "Traceback" not in done.stderr
    two = check(2, "--faults.slow_rank=2", "--faults.slow_factor=4", "--size", "64")  # said once, before any group
    assert two.returncode != 0 and two.stderr.count("faults.slow_rank=2 is not a rank of this 2-rank job (0-1)") == 1
    assert "all ranks ok" not in two.stdout


def test_a_slow_rank_drill_on_one_process_is_refused_and_the_version_is_said(capsys):
    """One process has no peer to be slower than: the drill passed as "all ranks ok"."""
    from shardline.cli import main

    assert main(["check", "--faults.slow_rank=0", "--faults.slow_factor=4"]) == 2
    assert "faults.slow_rank=0 on one process" in capsys.readouterr().err
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("shardline ")
    import subprocess
    import sys

    said = subprocess.run([sys.executable, "-c", "import sys; from shardline.cli import main; main(['--version']); "
                           "print('torch' in sys.modules)"], capture_output=True, text=True, check=True).stdout
    assert said.split() == ["shardline", said.split()[1], "False"]  # answered before torch's import (seconds)
