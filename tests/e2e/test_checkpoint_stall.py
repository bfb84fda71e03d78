"""benchmarks/checkpoint_stall.py runs end to end (tiny shape) and reports every column."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_stall_benchmark_runs(tmp_path):
    cmd = [sys.executable, "benchmarks/checkpoint_stall.py", "--sizes", "tiny", "--rounds", "1", "--world", "2",
           "--redundancy", "xor", "--dir", str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| tiny"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10 and all(float(c.split()[0]) > 0 for c in cells[3:]), row
    assert not any((tmp_path / "ckpt").rglob("*.bin"))  # the memory tier cleaned up after itself
