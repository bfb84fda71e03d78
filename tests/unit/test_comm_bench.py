"""`shardline comm-bench`'s parts: tiers from node keys, the values each collective must leave,
the fit of the planner's link figures, sizes; and the wrong-result verdict on 2 gloo ranks.
(The command itself, two torchrun agents as two nodes: tests/e2e/test_comm_bench.py.)"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from shardline.errors import ConfigError
from shardline.planner.calibrate import cluster, cluster_fit
from shardline.planner.calibrate.cluster_fit import Point
from shardline.planner.hardware import Network
from tests.distributed.harness import gloo_rank, start_ranks
from tests.ports import free_port


def test_tiers_follow_the_nodes():
    assert cluster.tiers(["a", "a", "b", "b"]) == {"node": [[0, 1], [2, 3]], "rail": [[0, 2], [1, 3]],
                                                   "world": [[0, 1, 2, 3]]}
    # Ranks of a node need not be consecutive: the groups follow the keys.
    assert cluster.tiers(["a", "b", "a", "b"])["rail"] == [[0, 1], [2, 3]]
    assert cluster.tiers(["a", "a"]) == {"world": [[0, 1]]}  # one node: the world is the node tier
    assert cluster.tiers(["a", "b"]) == {"world": [[0, 1]]}  # one rank a node: the world is the rail
    with pytest.raises(ConfigError, match=r"different numbers of ranks \(1, 2\).*same --nproc_per_node"):
        cluster.tiers(["a", "a", "b"])
    # Groups smaller than a node: neighbouring ranks, every power of two below the node's count.
    eight = cluster.tiers(["a"] * 8)
    assert list(eight) == ["node2", "node4", "world"]
    assert eight["node2"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and eight["node4"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    two_by_four = cluster.tiers(["a", "a", "a", "a", "b", "b", "b", "b"])
    assert list(two_by_four) == ["node2", "node", "rail", "world"]
    assert two_by_four["node2"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    six = cluster.tiers(["a"] * 6 + ["b"] * 6)
    assert list(six) == ["node2", "node", "rail", "world"]  # 4 does not divide 6


def _reference(op: str, parts: list[torch.Tensor], me: int) -> torch.Tensor:
    """What `op` computes for group rank `me`, written plainly from every rank's input."""
    n = len(parts)
    if op == "all_reduce":
        return sum(parts)
    if op == "all_gather":
        return torch.cat(parts)
    if op == "reduce_scatter":
        return sum(parts).chunk(n)[me]
    return torch.cat([p.chunk(n)[me] for p in parts])  # all_to_all: my chunk of every rank's input


@pytest.mark.parametrize("op", cluster.OPS)
@pytest.mark.parametrize("n", [2, 3, 8, 40])
def test_the_checked_values_are_what_each_collective_computes(op, n):
    numel = 4 * n
    parts = [cluster.inputs(op, numel, n, r) for r in range(n)]
    for me in range(n):
        assert torch.equal(cluster.expected(op, numel, n, me), _reference(op, parts, me))
    # The inputs tell the ranks and chunks apart: a rank's data lost (another's in its place), or
    # another rank's share handed out, fails the check.
    lost = [parts[1], *parts[1:]]
    for me in range(n):
        assert not torch.equal(cluster.expected(op, numel, n, me), _reference(op, lost, me))
    if op in ("reduce_scatter", "all_to_all"):
        assert not torch.equal(cluster.expected(op, numel, n, 0), cluster.expected(op, numel, n, 1))


def _ring_seconds(op: str, n: int, nbytes: int, alpha: float, bw: float) -> float:
    k = 2 if op == "all_reduce" else 1
    return k * (n - 1) * alpha + k * (n - 1) / n * nbytes / bw


def _tree_seconds(n: int, nbytes: int, alpha: float, bw: float) -> float:
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bw


def test_the_fit_recovers_the_links_it_was_made_from():
    # Points timed as exact collectives over known links, 2 nodes x 4 ranks: rings, and all-reduce
    # the faster of ring and tree (as a library picks, and the planner prices), 1.3x slower inside
    # a node than that (what op_factor is for).
    intra, inter = (20e-6, 200e9), (40e-6, 30e9)
    points = []
    for tier, n, on_node, (alpha, bw) in (("node", 4, 4, intra), ("rail", 2, 1, inter)):
        for op in cluster_fit.FACTORED:
            for nbytes in (1 << 10, 1 << 16, 1 << 22, 1 << 26):
                t = _ring_seconds(op, n, nbytes, alpha, bw)
                if op == "all_reduce":
                    t = min(t, _tree_seconds(n, nbytes, alpha, bw)) * (1.3 if tier == "node" else 1.0)
                points.append(Point(tier, op, n, on_node, nbytes, t))
    points.append(Point("world", "all_reduce", 8, 4, 1 << 20, 1e-3))  # not fitted
    base = Network(inter_bw_gbs=50.0, bw_efficiency=0.8, oversubscription=2.0)
    fields, notes = cluster_fit.fit_links(points, base, nodes=2, per_node=4)
    assert fields["gpus_per_node"] == 4 and fields["bw_efficiency"] == 1.0
    assert fields["intra_latency_us"] == pytest.approx(20.0, rel=1e-6)
    assert fields["intra_bw_gbs"] == pytest.approx(200.0, rel=1e-6)
    assert fields["latency_by_world_us"] == {"4": pytest.approx(20.0, rel=1e-6)}
    assert fields["op_factor"] == {"all_reduce": pytest.approx(1.3, rel=1e-6), "all_gather": pytest.approx(1.0),
                                   "reduce_scatter": pytest.approx(1.0)}
    assert fields["inter_latency_us"] == pytest.approx(40.0, rel=1e-6)
    # The planner divides by the oversubscription again: the profile predicts what was measured.
    assert fields["inter_bw_gbs"] == pytest.approx(30.0 * 2.0, rel=1e-6)
    assert [n.split(":")[0] for n in notes] == ["intra", "inter"] and "rail tier" in notes[1]
    # Nodes run in part would tell the planner smaller nodes: no gpus_per_node then.
    fields, notes = cluster_fit.fit_links(points, base, nodes=2, per_node=4, whole_nodes=False)
    assert "gpus_per_node" not in fields and notes[0].startswith("gpus_per_node: not written")


def test_groups_smaller_than_a_node_get_fits_of_their_own():
    # One node of 4: pairs over (30 us, 300 GB/s), the whole node over (20 us, 200 GB/s).
    points = [Point(tier, op, n, n, nbytes, _ring_seconds(op, n, nbytes, alpha, bw))
              for tier, n, (alpha, bw) in (("node2", 2, (30e-6, 300e9)), ("world", 4, (20e-6, 200e9)))
              for op in cluster_fit.LINK_OPS for nbytes in (1 << 16, 1 << 24)]
    fields, notes = cluster_fit.fit_links(points, Network(), nodes=1, per_node=4)
    assert fields["latency_by_world_us"] == {"2": pytest.approx(30.0, rel=1e-6), "4": pytest.approx(20.0, rel=1e-6)}
    assert fields["bw_by_world_gbs"] == {"2": pytest.approx(300.0, rel=1e-6), "4": pytest.approx(200.0, rel=1e-6)}
    assert fields["intra_latency_us"] == pytest.approx(20.0, rel=1e-6)  # the scalar: the whole node's
    assert [n.split(" from ")[-1].split(" (")[0] for n in notes if "from" in n] == ["the node2 tier", "the world tier"]
    # The planner prices a pair by the pair's fit and the node by its own.
    net = dataclasses.replace(Network(), **fields)
    pair = Point("node2", "all_gather", 2, 2, 1 << 20, 0.0)
    want = _ring_seconds("all_gather", 2, 1 << 20, 30e-6, 300e9)
    assert cluster_fit.predict(pair, net) == pytest.approx(want, rel=1e-6)


def test_one_node_keeps_the_bases_network_rate():
    points = [Point("world", op, 4, 4, nbytes, _ring_seconds(op, 4, nbytes, 10e-6, 100e9))
              for op in cluster_fit.LINK_OPS for nbytes in (1 << 16, 1 << 24)]
    base = Network(inter_bw_gbs=50.0, bw_efficiency=0.8)
    fields, notes = cluster_fit.fit_links(points, base, nodes=1, per_node=4)
    assert fields["intra_bw_gbs"] == pytest.approx(100.0, rel=1e-6)
    assert fields["inter_bw_gbs"] == pytest.approx(40.0)  # 50 x 0.8: the same effective rate at efficiency 1
    assert "inter_latency_us" not in fields and "gpus_per_node" not in fields
    assert notes[2].startswith("inter: not measured")


def test_times_that_do_not_grow_with_size_fit_no_link_and_small_messages_are_said():
    """A noisy pair of points (the larger message faster) wrote a profile at the fit's 1000 GB/s
    ceiling in silence; a fit of messages far below a MiB is latency's, said beside the fit."""
    noisy = [Point("world", "all_gather", 2, 2, 4096, 2395e-6), Point("world", "all_gather", 2, 2, 16384, 370e-6)]
    fields, notes = cluster_fit.fit_links(noisy, Network(), nodes=1, per_node=2)
    assert "intra_latency_us" not in fields and "bw_by_world_gbs" not in fields  # (the base's rate kept)
    assert notes[1] == ("intra: not fitted: the world tier's times do not grow with the message size (noise: more "
                        "--rounds, or a larger --max-size); the base's figures kept")
    small = [Point("world", "all_gather", 2, 2, nbytes, _ring_seconds("all_gather", 2, nbytes, 10e-6, 1e9))
             for nbytes in (8, 96)]
    fields, notes = cluster_fit.fit_links(small, Network(), nodes=1, per_node=2)
    assert fields["intra_bw_gbs"] == pytest.approx(1.0, rel=1e-6)
    assert notes[1].endswith("; its largest message, 96 B, is mostly latency: give --max-size 1 MiB or more for a "
                             "bandwidth to plan with")
    # Pairs inside a node of 4 that noise leaves unfitted: the node's fit and op factors still come
    pairs = [Point("node2", "all_gather", 2, 2, 4096, 2e-3), Point("node2", "all_gather", 2, 2, 1 << 20, 1e-3)]
    node = [Point("world", op, 4, 4, nbytes, _ring_seconds(op, 4, nbytes, 10e-6, 1e9))
            for op in cluster_fit.LINK_OPS for nbytes in (4096, 1 << 20)]
    fields, notes = cluster_fit.fit_links(pairs + node, Network(), nodes=1, per_node=4)  # (a KeyError before)
    assert set(fields["bw_by_world_gbs"]) == {"4"} and "not fitted" in notes[1] and "op_factor" in fields
    big = [Point("world", "all_gather", 2, 2, nbytes, _ring_seconds("all_gather", 2, nbytes, 10e-6, 1e9))
           for nbytes in (4096, 1 << 20)]
    assert "mostly latency" not in cluster_fit.fit_links(big, Network(), nodes=1, per_node=2)[1][1]


def test_sizes():
    assert cluster.parse_size("4096", "--min-size") == 4096
    assert cluster.parse_size("64K", "--min-size") == 64 << 10 and cluster.parse_size("2g", "x") == 2 << 30
    for bad in ("", "K", "1.5M", "-4", "2"):
        with pytest.raises(ConfigError, match="--max-size .* is not a size in bytes"):
            cluster.parse_size(bad, "--max-size")
    assert cluster.sizes_between(4096, 1 << 20, 4) == [4096, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert cluster.sizes_between(4096, 10000, 2) == [4096, 8192, 10000]
    with pytest.raises(ConfigError, match="--min-size 8192 is above --max-size 4096"):
        cluster.sizes_between(8192, 4096, 4)
    with pytest.raises(ConfigError, match="--factor 1 must be >= 2"):
        cluster.sizes_between(4096, 8192, 1)


def _bench_rank(rank: int, world: int, port: int, out: str) -> None:
    """bench() on real collectives, with rank 1's idea of one result wrong (as a faulty link
    would make it): every rank must get the same verdict naming rank 1."""
    import json

    if rank == 1:
        right = cluster.expected
        cluster.expected = lambda op, numel, n, me, device: right(op, numel, n, me, device) + (op == "all_gather")
    with gloo_rank(rank, world, port):
        m = cluster.bench(torch.device("cpu"), [4096, 16384], ["all_reduce", "all_gather"], rounds=1, iters=1)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"points": [(p.tier, p.op, p.ranks, p.nbytes, p.seconds > 0) for p in m.points], "wrong": m.wrong,
                   "nodes": m.nodes, "per_node": m.per_node}, f)


def test_a_wrong_result_names_the_tier_op_size_and_rank(tmp_path):
    import json

    out = str(tmp_path / "bench")
    start_ranks(_bench_rank, args=(2, free_port(), out), nprocs=2)
    results = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    assert results[0] == results[1]
    got = results[0]
    assert got["nodes"] == 1 and got["per_node"] == 2
    ops, sizes = ("all_reduce", "all_gather"), (4096, 16384)
    assert got["points"] == [["world", op, 2, size, True] for op in ops for size in sizes]
    assert got["wrong"] == [f"world all_gather at {size} bytes: wrong result on rank(s) 1" for size in (4096, 16384)]


def _slow(layout: dict, sizes: dict[str, int], bad: dict[int, float], **only) -> list[str]:
    """slow_groups over one all-gather point per tier at its own size (a rail of 3 ranks rounds
    the size down), every rank's calls 1 ms but `bad` ranks' (rank -> seconds) in the tiers `only`
    names (all when empty)."""
    points = [Point(t, "all_gather", len(g[0]), 1, sizes.get(t, 1 << 20), 1.0) for t, g in layout.items()]
    points.append(Point("node", "all_gather", 8, 8, 1 << 10, 1.0))  # a smaller size: not judged
    every = torch.full((24, len(points), 2), 1e-3, dtype=torch.float64)  # [rank, point, round]
    for i, p in enumerate(points):
        for rank, seconds in bad.items():
            if not only or p.tier in only.get("tiers", ()):
                every[rank, i, :] = seconds
    return cluster.slow_groups(points, every, layout, factor=1.5)


def test_a_slow_gpu_is_named_through_its_smallest_group_and_its_rail():
    """3 nodes x 8: a slow device (rank 3) slows every group it is in: its pair, its four, its node
    and its rail are named, and rank 3 alone as the one in the smallest slow group inside a node
    and in a slow rail."""
    layout = cluster.tiers(["a"] * 8 + ["b"] * 8 + ["c"] * 8)
    assert list(layout) == ["node2", "node4", "node", "rail", "world"]
    sizes = {"rail": 4 * ((1 << 20) // 4 // 3 * 3)}  # 3 does not divide 1 MiB: the rail's largest is less
    lines = _slow(layout, sizes, {3: 1e-2})
    behind = "took 10.0x the median of the tier's groups"
    assert lines[:4] == [f"slow: node2 group of ranks 2,3: all_gather at 1 MiB {behind}",
                         f"slow: node4 group of ranks 0-3: all_gather at 1 MiB {behind}",
                         f"slow: node group of ranks 0-7: all_gather at 1 MiB {behind}",
                         f"slow: rail group of ranks 3,11,19: all_gather at 1024 KiB {behind}"]
    assert lines[4:] == ["slow: rank(s) 3 in a slow group inside its node and in a slow rail: the rank itself "
                         "(its GPU or host) more likely than one link"]
    # A slow network port shows in its rail alone; a slow link inside a node in the node tiers alone.
    port = _slow(layout, sizes, {3: 1e-2}, tiers=("rail",))
    assert port == [f"slow: rail group of ranks 3,11,19: all_gather at 1024 KiB {behind}"]
    link = _slow(layout, sizes, {3: 1e-2}, tiers=("node2", "node4", "node"))
    assert len(link) == 3 and not any("rail" in x for x in link)
    assert _slow(layout, sizes, {3: 1.4e-3}) == []  # under the factor
    assert cluster.slow_groups([], torch.empty(0), layout, factor=0) == []  # off


def test_of_two_groups_each_is_judged_against_the_other():
    layout = cluster.tiers(["a", "a", "b", "b"])
    points = [Point(t, "all_reduce", 2, 1, 4096, 1.0) for t in ("node", "rail")]
    every = torch.full((4, 2, 1), 1e-3, dtype=torch.float64)
    every[0, :, :] = 3e-3
    named = [x.split(":")[1] for x in cluster.slow_groups(points, every, layout, factor=1.5)]
    assert named == [" node group of ranks 0,1", " rail group of ranks 0,2",
                     " rank(s) 0 in a slow group inside its node and in a slow rail"]


def test_an_out_the_file_system_refuses_is_found_by_trying_it(tmp_path):
    """Permission bits said yes to root on /proc: the profile failed only after the whole benchmark."""
    from shardline.planner.calibrate.cluster_cli import out_problem

    assert out_problem(Path("/proc/shardline-profile.toml")) is not None
    assert out_problem(tmp_path / "p.toml") is None and not (tmp_path / "p.toml").exists()  # (the try removed)
    # A file there is replaced only where the same command wrote it: a config given by mistake, or a
    # calibrate profile (minutes of measuring) named as comm-bench's --out, was overwritten
    (tmp_path / "old.toml").write_text("# shardline network profile, written by `shardline comm-bench`\n")
    assert out_problem(tmp_path / "old.toml") is None and (tmp_path / "old.toml").read_text().startswith("# shardline")
    (tmp_path / "my.toml").write_text("[train]\nsteps = 5\n", encoding="utf-8")
    assert out_problem(tmp_path / "my.toml") == (f"--out {tmp_path / 'my.toml'} exists and was not written by "
                                                 "shardline comm-bench: it is not replaced; give another file (or "
                                                 "remove it)")
    assert "not written by shardline calibrate" in out_problem(tmp_path / "old.toml", "calibrate")
    assert (tmp_path / "my.toml").read_text() == "[train]\nsteps = 5\n"
    (tmp_path / "empty.toml").touch()  # (a placeholder: nothing to lose)
    assert out_problem(tmp_path / "empty.toml") is None
