"""examples/slurm/train.sbatch's requeue rule, run by bash with stand-ins for Slurm's `srun` and
`scontrol` (no Slurm here): the script under test is ours, what it calls is not."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"


def run_script(tmp_path: Path, codes: list[int], restarts: int = 0, *args: str) -> tuple[int, list[str], list[str]]:
    """The script's exit code, the commands its sruns ran, and scontrol's calls: each srun exits
    with the next of `codes`. Its output is `tmp_path / "out"`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "codes").write_text("\n".join(map(str, codes)) + "\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\necho \"$*\" >> \"$LOG_DIR/srun\"\n"
        "code=$(head -n 1 \"$LOG_DIR/codes\"); sed -i 1d \"$LOG_DIR/codes\"; exit \"$code\"\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho \"$*\" >> \"$LOG_DIR/scontrol\"\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG_DIR": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restarts), "SLURM_CPUS_PER_TASK": "8",
           "SLURM_JOB_NODELIST": "node[01-04]", "TRY_LATER_PAUSE_S": "0"}
    done = subprocess.run(["bash", str(SCRIPT), "my.toml", *args], env=env, capture_output=True, text=True,
                          timeout=60)
    (tmp_path / "out").write_text(done.stdout)
    read = lambda name: (tmp_path / name).read_text().splitlines() if (tmp_path / name).exists() else []  # noqa: E731
    return done.returncode, read("srun"), read("scontrol")


@pytest.mark.parametrize("code", [5, 4, 1, 143])
def test_a_stop_a_hang_or_a_crash_is_requeued(tmp_path, code):
    rc, sruns, requeues = run_script(tmp_path, [code], 0, "--parallel.tp=8")
    assert rc == 0 and requeues == ["requeue 4242"]
    assert len(sruns) == 1 and "-m shardline train --config my.toml" in sruns[0] and "--kill-on-bad-exit=0" in sruns[0]
    assert sruns[0].endswith("--parallel.tp=8")


@pytest.mark.parametrize("code", [0, 2, 3, 6])
def test_an_end_or_what_a_rerun_meets_again_is_not_requeued(tmp_path, code):
    rc, sruns, requeues = run_script(tmp_path, [code])
    assert (rc, len(sruns), requeues) == (code, 1, [])


def test_try_later_is_retried_in_the_job_then_given_up(tmp_path):
    (tmp_path / "a").mkdir()
    rc, sruns, requeues = run_script(tmp_path / "a", [75, 75, 0])
    assert (rc, len(sruns), requeues) == (0, 3, [])
    (tmp_path / "b").mkdir()
    rc, sruns, requeues = run_script(tmp_path / "b", [75] * 4)
    assert (rc, len(sruns), requeues) == (75, 4, [])  # the first try and TRY_LATER=3 retries
    said = (tmp_path / "b" / "out").read_text()
    assert said.count("retrying in 0 s") == 3 and "retry 3 of 3" in said  # (no pause after the last)


def test_requeues_stop_at_their_cap(tmp_path):
    rc, _, requeues = run_script(tmp_path, [5], restarts=20)
    assert (rc, requeues) == (5, [])
