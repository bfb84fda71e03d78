"""Calibration: the fits recover known parameters; measurements and the profile round trip work."""

from __future__ import annotations

import math
import multiprocessing
import re

import pytest
import torch

from shardline.errors import ShardlineError
from shardline.planner.calibrate import ops
from shardline.planner.calibrate import run as cal
from shardline.planner.calibrate.comm import fit_alpha_beta, measure_collectives, op_factors
from shardline.planner.hardware import get_hardware


def test_fit_curve_recovers_efficiency_and_half_dimension():
    e_max, d0 = 0.7, 128.0
    shapes = [(4096, 256, 256), (512, 128, 128), (2048, 2048, 2048), (64, 4096, 512), (1024, 64, 1024)]
    points = [(e_max * math.prod(x / (x + d0) for x in s), s) for s in shapes]
    got_e, got_d0 = cal.fit_curve(points)
    assert got_e == pytest.approx(e_max, rel=0.02)
    assert got_d0 == pytest.approx(d0, rel=0.1)


def test_rounds_are_combined_point_by_point_before_fitting():
    # One disturbed round (the third: everything 3x slower) must not move any point.
    quiet = {"linear_fp32": [0.5, 0.6], "loss_gbs": 4.0, "stream": {"2MiB": 20.0}}
    disturbed = {"linear_fp32": [0.17, 0.2], "loss_gbs": 1.3, "stream": {"2MiB": 6.7}}
    other = {"linear_fp32": [0.52, 0.58], "loss_gbs": 4.2, "stream": {"2MiB": 21.0}}
    assert cal._median_rounds([quiet, other, disturbed]) == {"linear_fp32": [0.5, 0.58], "loss_gbs": 4.0,
                                                              "stream": {"2MiB": 20.0}}


def test_op_factors_are_over_the_planners_own_price():
    """At 4 ranks the planner prices an all-reduce as the faster of ring and tree (the tree wins
    the small sizes here). Points timed at 1.5x that price give a factor of 1.5; over the ring
    alone, as the factor was measured before, the small sizes would give less, and the planner,
    multiplying it into the tree's price, would under-price them."""
    import math

    alpha, bw, n = 50e-6, 2e9, 4
    points = []
    for nbytes in (4096, 65536, 1 << 20):
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw
        tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw
        points.append({"op": "all_reduce", "world": n, "bytes": nbytes, "seconds": 1.5 * min(ring, tree)})
        points.append({"op": "all_gather", "world": n, "bytes": nbytes, "seconds": ring / 2})
    assert 2 * math.ceil(math.log2(n)) * alpha + 2 * 4096 / bw < 2 * (n - 1) * alpha  # the tree wins at 4 KiB
    factors = op_factors(points, {n: (alpha, bw)})
    assert factors == {"all_reduce": pytest.approx(1.5, rel=1e-9), "all_gather": pytest.approx(1.0, rel=1e-9)}


def test_fit_alpha_beta_recovers_latency_and_bandwidth():
    alpha, bw = 50e-6, 2e9
    points = []
    for world in (2, 4):
        for size in (4096, 65536, 1 << 20, 4 << 20):
            for op, k in (("all_reduce", 2), ("all_gather", 1)):
                t = k * (world - 1) * alpha + k * (world - 1) / world * size / bw
                points.append({"op": op, "world": world, "bytes": size, "seconds": t})
    got_alpha, got_bw = fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


def test_measurements_are_positive_and_plausible():
    cpu = torch.device("cpu")
    mm = ops.measure_linear("fp32", cpu, 1e11, [(256, 128, 64)])
    assert mm[0]["seconds"] > 0 and 0 < mm[0]["eff"] < 20
    bw = ops.measure_bandwidth(cpu, sizes_mib=(2,))
    assert 0.05 < bw["2MiB"] < 1000
    elem = ops.measure_elementwise(cpu, "fp32", sizes=((256, 64),))
    assert 0.01 < elem < 1000
    assert 0 < ops.measure_loss_eff(cpu, elem, tokens=64, vocab=256) < 10
    assert 0 < ops.measure_op_overhead(cpu, n_ops=50) < 10_000


def test_byte_counter_counts_inputs_and_outputs():
    x = torch.ones(1000)
    with ops._ByteCounter() as counter:
        torch.add(x, x).view(10, 100)
    assert counter.bytes == 3 * 4000  # two inputs and one output; the view moves nothing


def test_gloo_collectives_between_two_processes(monkeypatch):
    from shardline.planner.calibrate import comm
    from tests.ports import free_port

    monkeypatch.setattr(comm, "_free_port", free_port)  # this xdist worker's share of ports
    net, points = measure_collectives(world_sizes=(2,))
    assert net["intra_bw_gbs"] > 0.01 and 0 < net["intra_latency_us"] < 1e5
    assert set(points) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all({p[0] for p in pts} == {2} and len(pts) == 4 for pts in points.values())
    assert net["latency_by_world_us"]["2"] > 0 and net["bw_by_world_gbs"]["2"] > 0.01
    assert set(net["op_factor"]) == set(points) and all(f > 0 for f in net["op_factor"].values())


def test_calibrate_writes_a_profile_the_planner_reads(tmp_path, monkeypatch, capsys):
    fields = {"base": "cpu", "matmul_eff_max": {"fp32": 0.41}, "attn_eff": {"fp32": 0.2}, "matmul_half_dim": 90.0,
              "mem_bw_gbs": 12.5, "op_overhead_us": 7.0, "cpu": {"process_baseline_gib": 0.5},
              "network": {"intra_bw_gbs": 1.5, "intra_latency_us": 80.0}}
    monkeypatch.setattr(cal, "measure", lambda **kw: (fields, {"matmul_fp32_tflops": [0.1, 0.2]}))
    out = tmp_path / "cpu.toml"
    cal.calibrate(out)
    hw = get_hardware("cpu", out)
    assert hw.matmul_eff_max["fp32"] == 0.41 and hw.mem_bw_gbs == 12.5 and hw.network.intra_bw_gbs == 1.5
    assert hw.cpu.process_baseline_gib == 0.5 and hw.cpu.cores == cal.cpu_hardware().cpu.cores  # the [cpu] table
    assert "shardline hardware profile" in capsys.readouterr().out
    with pytest.raises(Exception, match="describes 'cpu'"):
        get_hardware("h100-sxm", out)


def test_a_profile_the_planner_would_refuse_is_refused_by_calibrate_and_kept(tmp_path, monkeypatch, capsys):
    """A measured figure out of the planner's range (a link measured above its bandwidth on a noisy
    machine) is said by calibrate itself, not first by `plan --profile`; the file keeps the points."""
    fields = {"base": "cpu", "mem_bw_gbs": 12.5, "network": {"bw_efficiency": 1.3}}
    monkeypatch.setattr(cal, "measure", lambda **kw: (fields, {"allreduce_gbs": [1.0, 2.0]}))
    out = tmp_path / "cpu.toml"
    with pytest.raises(ShardlineError, match=re.escape("the profile it wrote is not usable (") + ".*bw_efficiency=1.3 "
                       "must be at most 1.*keeps the measurements"):
        cal.calibrate(out)
    assert "allreduce_gbs" in out.read_text()


@pytest.mark.alone  # times the wrappers against the plain block
def test_tp_and_fsdp_wrapper_overheads_between_two_processes():
    from shardline.planner.calibrate.dist import measure_wrappers

    fields, raw = measure_wrappers(world=2, rounds=3)
    assert set(raw) == {"plain", "tp", "fsdp", "sizes_mb"} and raw["plain"]["per_layer_s"] > 0
    # DTensor dispatch of a TP block costs host time beyond the plain block's; so do FSDP2's hooks.
    # (FSDP's held at the small block itself: its fitted intercept may be clipped to 0 by a noisy slope.)
    assert fields["tp_layer_overhead_us"] > 0 and raw["fsdp"]["per_layer_s"] > raw["plain"]["per_layer_s"]
    # The optimizer over DTensors: both timed; their difference is near 0 since the host's windowed AdamW
    # reads a DTensor's local tensor directly, so its sign is noise (it failed two runs of three here).
    assert raw["fsdp"]["per_param_s"] > 0 and raw["plain"]["per_param_s"] > 0
    assert math.isfinite(fields["dtensor_param_overhead_us"]) and fields["dtensor_param_overhead_us"] >= 0
    # The ends (embedding, output, loss) run once a step: their time is the intercept of the
    # slope over 1 and 3 blocks, within the noise of two processes on 2 shared cores for the
    # plain model (it measured -0.1 ms once), so only that they were timed is held.
    assert math.isfinite(raw["tp"]["ends_s"]) and math.isfinite(raw["plain"]["ends_s"])
    assert raw["fsdp"]["per_layer_large_s"] > raw["fsdp"]["per_layer_s"]  # a wider block with more tokens costs more
    # In wall time a TP step also waits on its collectives: more than its CPU time alone. Held on
    # the whole 3-block step (ends + 3 blocks), not on the fitted per-block figures: those are
    # differences of noisy timings (the block's wall intercept once fell below its CPU overhead
    # on a loaded machine), while thread CPU time can never exceed wall time call by call.
    tp = raw["tp"]
    assert tp["ends_wall_s"] + 3 * tp["per_layer_wall_s"] > tp["ends_s"] + 3 * tp["per_layer_s"]
    assert raw["tp"]["ends_vocab_wall_s"] > raw["tp"]["ends_wide_wall_s"]  # a 32x vocabulary costs the ends more
    # Every field the profile takes is there, finite and non-negative (the lines' fits are clipped
    # at 0: test_line_through_two_sizes holds that arithmetic on exact points).
    assert set(fields) == {"tp_layer_overhead_us", "tp_head_overhead_us", "fsdp_root_overhead_us",
                           "dtensor_param_overhead_us", "fsdp_layer_overhead_us", "fsdp_layer_overhead_us_per_mb",
                           "tp_layer_wall_us", "tp_layer_wall_us_per_mb", "tp_head_wall_us", "tp_head_wall_us_per_mb"}
    assert all(math.isfinite(v) and v >= 0 for v in fields.values()), fields


@pytest.mark.parametrize("small, large, expected", [
    ((1.0, 10.0), (3.0, 16.0), (7.0, 3.0)),  # a fixed part and a part per MB
    ((1.0, 10.0), (3.0, 4.0), (10.0, 0.0)),  # the larger size measured cheaper (noise): no slope
    ((1.0, 1.0), (3.0, 11.0), (0.0, 5.0)),  # the line would cross 0 before size 0: no negative fixed part
])
def test_line_through_two_sizes(small, large, expected):
    from shardline.planner.calibrate.dist import _line

    assert _line(small, large) == pytest.approx(expected)


def test_co_run_efficiency_with_a_busy_neighbour():
    from shardline.planner.calibrate.corun import KINDS, measure_corun

    assert measure_corun(1) == dict.fromkeys(KINDS, 1.0)  # one core: nothing shared
    ratios = measure_corun(2, rounds=1)
    assert set(ratios) == set(KINDS) and all(0 < r <= 1 for r in ratios.values())
    assert not multiprocessing.active_children()  # the neighbour processes are gone again
