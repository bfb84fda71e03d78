"""Predicted vs measured on this machine: `shardline train` runs against the planner's estimate.

Runs benchmarks/planner_validation.py on one small single-process configuration, an
attention-heavy one (seq 512 on dim 128; one torch thread; a quick calibration first).
Peak memory is held to the issue's 15%. Step time is compared with the process' CPU time
per step, which other processes on a shared machine do not stretch (wall time they do;
see the script's docstring), within 50% here to stay robust to the cache and
memory-bandwidth contention that remains (a clean-clone suite run measured -41% once,
where others passed within 20%: the quick calibration and the six steps are each a few
seconds on 2 shared cores); a model off by 2x still fails. The full table (10
configurations) is benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.alone  # compares step time with the prediction
def test_predicted_vs_measured_on_cpu(tmp_path, small_corpus):
    out = tmp_path / "validation.json"
    env = {**os.environ, "SHARDLINE_CACHE": os.environ.get("SHARDLINE_CACHE", str(tmp_path / "cache"))}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "planner_validation.py"),
                           "--configs", "narrow-d128-L2-s512", "--layouts", "none", "--steps", "6",
                           "--data", str(small_corpus), "--vocab-size", "512", "--json", str(out)],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["configs"]
    assert set(res) == {"narrow-d128-L2-s512"}
    for name, row in res.items():
        assert abs(row["memory_error_pct"]) < 15, (name, row)
        assert row["measured"]["cpu_step_s"] > 0 and len(row["measured"]["step_times_s"]) == 4
        assert abs(row["time_error_pct"]) < 50, (name, row)
