"""`shardline comm-bench` as a user runs it: two torchrun agents on this host act as two nodes of
two gloo ranks each; the table, the profile it writes and the planner reading that profile."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.planner.calibrate.cluster import OPS
from shardline.planner.calibrate.cluster_fit import bus_factor
from shardline.planner.hardware import get_hardware
from tests.e2e.test_torchrun import REPO
from tests.ports import free_port

SIZES = (65536, 262144, 1048576)  # (smaller ones' times, under load, may not grow with the size: no fit)


def launch(tmp_path: Path, nnodes: int, *args: str, launcher: tuple[str, ...] = (),
           nproc: int = 2) -> list[subprocess.CompletedProcess]:
    """`nnodes` torchrun agents of `nproc` ranks each meeting at one c10d rendezvous on this host (each
    agent a node); their output in files, every agent killed if they outlive the timeout."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=comm-bench", *launcher,
           "-m", "shardline", "comm-bench", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    logs = [(tmp_path / f"agent{i}.out", tmp_path / f"agent{i}.err") for i in range(nnodes)]
    agents = []
    try:
        for out, err in logs:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                agents.append(subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=stderr, env=env,
                                               start_new_session=True))
        for agent in agents:
            agent.wait(timeout=240)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return [subprocess.CompletedProcess(cmd, a.returncode, out.read_text(), err.read_text())
            for a, (out, err) in zip(agents, logs)]


def fitted_launch(tmp_path: Path, nnodes: int, *args: str, nproc: int = 2) -> list[subprocess.CompletedProcess]:
    """launch(), again (up to 5 tries) where noise left a tier's times not growing with the size, which
    fits no link (said in a `fit` line): a machine running other tests beside these ranks, or 4 ranks on
    2 cores alone; skipped where every try was noisy."""
    for _ in range(5):
        runs = launch(tmp_path, nnodes, *args, nproc=nproc)
        if not any("times do not grow with the message size" in r.stdout for r in runs):
            return runs
    # (every try noisy: the fit is untestable on this machine now, not wrong; two clean CI-like runs of
    # 2026-12-08 each had one of these tests fail so, in the alone phase, on 2 cores)
    pytest.skip("comm-bench: scheduling noise left a tier's times not growing with the size in 5 tries")


def _rows(table: str) -> dict[tuple, list[float]]:
    """(tier, ranks, op, size in bytes) -> [time us, algbw, busbw, model us] of each table row."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
    rows = {}
    for line in table.splitlines():
        f = line.split()
        if len(f) == 10 and re.fullmatch(r"node\d*|rail|world", f[0]):
            rows[(f[0], int(f[1]), f[2], round(float(f[3]) * units[f[4]]))] = [float(x) for x in f[5:9]]
    return rows


def _fit(table: str, link: str) -> tuple[float, float]:
    """(alpha us, B GB/s) of a `fit intra:` / `fit inter:` line."""
    (line,) = [x for x in table.splitlines() if x.startswith(f"fit {link}:")]
    words = line.split()
    return float(words[2]), float(words[5])


@pytest.mark.alone  # (a fit of measured times: noise from a test beside it left no link fitted)
def test_two_nodes_every_tier_measured_and_a_profile_the_planner_reads(tmp_path):
    profile = tmp_path / "comm.toml"
    runs = fitted_launch(tmp_path, 2, "--out", str(profile), "--min-size", "64K", "--max-size", "1M", "--rounds",
                         "3", "--iters", "2")
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    (table,) = [r.stdout for r in runs if "shardline comm-bench:" in r.stdout]  # rank 0's agent prints
    assert table.startswith("shardline comm-bench: 4 ranks, 2 node(s) x 2 (gloo, cpu)")
    rows = _rows(table)
    assert set(rows) == {(tier, n, op, size) for tier, n in (("node", 2), ("rail", 2), ("world", 4))
                         for op in OPS for size in SIZES}
    for (tier, n, op, size), (us, algbw, busbw, _) in rows.items():
        assert algbw == pytest.approx(size / us / 1e3, rel=0.02, abs=2e-3)
        assert busbw == pytest.approx(algbw * bus_factor(op, n), rel=0.02, abs=2e-3)

    net = get_hardware("cpu", profile).network  # the profile is one `plan --gpu cpu --profile` takes
    assert net.gpus_per_node == 2 and net.bw_efficiency == 1.0
    for link in ("intra", "inter"):  # printed to 2 decimals and 5 digits
        alpha, bw = _fit(table, link)
        assert getattr(net, f"{link}_latency_us") == pytest.approx(alpha, abs=0.006)
        assert getattr(net, f"{link}_bw_gbs") == pytest.approx(bw, rel=1e-4)
    # The model column is the planner's ring under the fitted links, worked out here from the profile:
    # inside a node at the intra fit times the op's factor; across nodes one rank a node, at the
    # slower of the node's link and its network share.
    size = SIZES[-1]
    node = (net.intra_latency_us * 1e-6 + size / 2 / (net.intra_bw_gbs * 1e9)) * net.op_factor["all_gather"]
    rail = net.inter_latency_us * 1e-6 + size / 2 / (min(net.intra_bw_gbs, net.inter_bw_gbs) * 1e9)
    # printed to 0.1 us from unrounded links; the profile's are rounded to 7 digits
    assert rows[("node", 2, "all_gather", size)][3] == pytest.approx(node * 1e6, rel=1e-5, abs=0.06)
    assert rows[("rail", 2, "all_gather", size)][3] == pytest.approx(rail * 1e6, rel=1e-5, abs=0.06)
    assert "world tier (not fitted) against the fitted model: median |error|" in table
    assert f"profile written to {profile}" in table
    measured = profile.read_text()
    assert 'base = "cpu"' in measured and "world_all_to_all = [[4, 65536," in measured


def test_bad_launches_fail_in_one_line(tmp_path, capsys):
    assert main(["comm-bench", "--device", "cpu", "--out", str(tmp_path / "p.toml")]) == 2
    assert "launch it with torchrun" in capsys.readouterr().err
    assert not (tmp_path / "p.toml").exists()
    for args, message in ((["--ops", "all_reduce,broadcast"], "--ops 'all_reduce,broadcast': give a comma"),
                          (["--min-size", "1M", "--max-size", "64K"], "--min-size 1048576 is above --max-size"),
                          (["--rounds", "0"], "--rounds 0 and --iters 5 must be >= 1"),
                          (["--iters", "0"], "--rounds 5 and --iters 0 must be >= 1"),  # (was read as the default)
                          (["--slow-factor", "0.5"], "--slow-factor 0.5 must be a number > 1"),
                          (["--drill-delay-ms", "nan", "--drill-rank", "0"], "--drill-delay-ms nan must be a number"),
                          (["--gpu", "tpu"], "unknown device type 'tpu'")):
        assert main(["comm-bench", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(message, err), err


def test_an_unwritable_out_is_refused_by_every_rank_before_measuring(tmp_path):
    logs = tmp_path / "logs"  # each rank's stderr in a file of its own (--redirects 2)
    (run,) = launch(tmp_path, 1, "--out", str(tmp_path / "no" / "p.toml"),
                    launcher=(f"--log-dir={logs}", "--redirects=2"))
    assert run.returncode != 0 and not run.stdout
    ranks = sorted(logs.rglob("stderr.log"), key=lambda log: log.parent.name)  # .../attempt_0/<rank>/stderr.log
    assert len(ranks) == 2, run.stderr[-2000:]
    said = [log.read_text() for log in ranks]
    # refused on every rank alike, said once (rank 0's), the ranks leaving together (it was said twice, interleaved)
    assert said[0].strip().startswith("shardline: error: --out "), said
    assert "cannot be written: give a file in an existing, writable folder" in said[0] and "shardline" not in said[1]


def test_what_out_accepts(tmp_path):
    from shardline.planner.calibrate.cluster_cli import out_problem

    assert out_problem(tmp_path / "p.toml") is None
    (tmp_path / "p.toml").write_text("")
    assert out_problem(tmp_path / "p.toml") is None  # an earlier profile is replaced
    for bad in (tmp_path, tmp_path / "no" / "p.toml", tmp_path / ("x" * 300) / "p.toml"):  # the last: a name
        assert out_problem(bad) == f"--out {bad} cannot be written: give a file in an existing, writable folder"


def test_without_a_ring_op_the_table_prints_and_no_profile_is_written(tmp_path):
    (run,) = launch(tmp_path, 1, "--out", str(tmp_path / "p.toml"), "--ops", "all_to_all", "--min-size", "4K",
                    "--max-size", "16K", "--rounds", "1", "--iters", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "world      2  all_to_all" in run.stdout
    assert "fit intra: not measured (needs all-gather or reduce-scatter in the world tier" in run.stdout
    assert "no profile written: no link was fitted (the `fit` lines above say why)" in run.stdout
    assert not (tmp_path / "p.toml").exists()


@pytest.mark.alone  # (a fit of measured times: noise from a test beside it left no link fitted)
def test_one_node_of_four_fits_pairs_apart_from_the_node(tmp_path):
    """Four ranks on one node: the pairs (node2) and the whole node (world) each get their own fit,
    which the planner then picks by group size."""
    profile = tmp_path / "comm.toml"
    (run,) = fitted_launch(tmp_path, 1, "--out", str(profile), "--ops", "all_gather,reduce_scatter", "--min-size",
                           "64K", "--max-size", "1M", "--rounds", "3", "--iters", "2", nproc=4)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = _rows(run.stdout)
    assert {(tier, n) for tier, n, *_ in rows} == {("node2", 2), ("world", 4)}
    net = get_hardware("cpu", profile).network
    # (gloo pairs on 2 busy cores: scheduling noise of milliseconds against a 1 MiB copy's fraction of one
    # left the pairs' times not growing at times, their fit refused and said: fitted_launch tries again)
    assert set(net.latency_by_world_us) == {"2", "4"} == set(net.bw_by_world_gbs)
    assert net.intra_latency_us == net.latency_by_world_us["4"]
    assert net.gpus_per_node == get_hardware("cpu").network.gpus_per_node  # one node: not written
    size = SIZES[-1]  # the pair's model column: the pair's own fit, times the op's factor
    alpha, bw = net.latency_by_world_us["2"] * 1e-6, net.bw_by_world_gbs["2"] * 1e9
    pair = (alpha + size / 2 / bw) * net.op_factor["all_gather"]
    assert rows[("node2", 2, "all_gather", size)][3] == pytest.approx(pair * 1e6, rel=1e-5, abs=0.06)


def test_a_rank_that_holds_its_groups_is_named(tmp_path):
    """The drill: rank 3 of 2 nodes x 2 waits 100 ms before each call (a call takes ~1-3 ms here):
    its node pair and its rail are named slow, and rank 3 as the one in both."""
    runs = launch(tmp_path, 2, "--out", str(tmp_path / "p.toml"), "--ops", "all_reduce", "--min-size", "4K",
                  "--max-size", "4K", "--rounds", "3", "--iters", "2", "--drill-rank", "3", "--drill-delay-ms", "100")
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    (table,) = [r.stdout for r in runs if "shardline comm-bench:" in r.stdout]
    slow = [x for x in table.splitlines() if x.startswith("slow:")]
    assert slow[0].startswith("slow: node group of ranks 2,3: all_reduce at 4 KiB took ")
    assert slow[1].startswith("slow: rail group of ranks 1,3: all_reduce at 4 KiB took ")
    assert slow[2:] == ["slow: rank(s) 3 in a slow group inside its node and in a slow rail: the rank itself (its "
                        "GPU or host) more likely than one link"]
    assert "no profile written: a drill (--drill-rank) slowed the timings" in table
