"""Pipeline schedules and the alpha-beta collective model against their closed forms."""

from __future__ import annotations

import pytest

from shardline.planner import comm
from shardline.planner.hardware import Network
from shardline.planner.pipeline import bubble_fraction, inflight_microbatches

NET = Network(gpus_per_node=8, intra_bw_gbs=400.0, intra_latency_us=2.0, inter_bw_gbs=50.0,
              inter_latency_us=10.0, bw_efficiency=1.0)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (16, 64)])
def test_bubble_fractions_match_the_papers(p, m):
    assert bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / m)
    assert bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / m)
    for v in (2, 4):
        assert bubble_fraction("interleaved_1f1b", p, m, v) == pytest.approx((p - 1) / (v * m))
    # Zero-bubble schedules sit below 1F1B's bubble.
    assert bubble_fraction("zbv", p, m, 2) < bubble_fraction("dualpipev", p, m, 2) < bubble_fraction("1f1b", p, m)
    assert bubble_fraction("1f1b", 1, m) == 0.0


def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches("gpipe", 4, 16) == 16
    assert inflight_microbatches("1f1b", 4, 16) == 4
    assert inflight_microbatches("1f1b", 4, 2) == 2
    # Megatron's interleaved warm-up: 2(p-1) + (v-1)p + 1 chunks of 1/v stage each.
    assert inflight_microbatches("interleaved_1f1b", 4, 16, 2) == pytest.approx((6 + 4 + 1) / 2)
    # torch's rounds when p does not divide m: 7 // (7 // 4) = 7 micro-batches a round, so
    # 2·3 + 3·7 + 1 = 28 chunks (all of them: m·v) at v 4, not 2·3 + 3·4 + 1 = 19; and m 6, v 2:
    # 6 a round, min(12, 6 + 6 + 1) = 12 chunks, not 11.
    assert inflight_microbatches("interleaved_1f1b", 4, 7, 4) == pytest.approx(28 / 4)
    assert inflight_microbatches("interleaved_1f1b", 4, 6, 2) == pytest.approx(12 / 2)
    assert inflight_microbatches("zbv", 4, 16, 2) == 4


def test_placement_follows_the_mesh_order():
    assert comm.group(8, 1, 8) == comm.Group(8, 8)  # tp inside a node
    assert comm.group(16, 8, 8).per_node == 1  # dp over tp=8: one member per node
    assert comm.group(32, 2, 8).per_node == 4 and comm.group(32, 2, 8).nodes == 8


def test_ring_all_reduce_inside_a_node_is_the_textbook_formula():
    n, size = 8, 256e6
    t, algo = comm.all_reduce(size, comm.group(n, 1, 8), NET)
    assert algo == "ring"
    assert t == pytest.approx(2 * (n - 1) * 2e-6 + 2 * (n - 1) / n * size / 400e9)


def test_tree_wins_on_latency_ring_on_bandwidth():
    many_nodes = comm.group(512, 8, 8)  # one member per node, 512 nodes
    t_tree, algo = comm.all_reduce(1e3, many_nodes, NET)
    assert algo == "tree" and t_tree == pytest.approx(2 * 9 * 10e-6 + 2 * 1e3 / 50e9)
    assert comm.all_reduce(1e9, comm.group(8, 1, 8), NET)[1] == "ring"  # (n-1)/n < 1 wins at size


def test_hierarchical_all_reduce_across_nodes():
    g = comm.group(64, 1, 8)  # 8 nodes x 8
    t, _ = comm.all_reduce(1e9, g, NET)
    k, nodes, size = 8, 8, 1e9
    hier = (2 * ((k - 1) * 2e-6 + (k - 1) / k * size / 400e9)
            + 2 * (nodes - 1) * 10e-6 + 2 * (nodes - 1) / nodes * (size / k) / 50e9)
    assert t <= hier + 1e-12
    # Across nodes, 8 members per node pool 8 NICs: far faster than one NIC's ring.
    one_nic = comm.all_reduce(1e9, comm.group(64, 8, 8), NET)[0]
    assert t < one_nic / 4


def test_gather_scatter_all_to_all_and_p2p():
    g = comm.group(4, 1, 8)
    assert comm.all_gather(4e8, g, NET)[0] == pytest.approx(3 * 2e-6 + 0.75 * 4e8 / 400e9)
    assert comm.reduce_scatter(4e8, g, NET) == comm.all_gather(4e8, g, NET)
    assert comm.all_to_all(4e8, g, NET)[0] == pytest.approx(3 * 2e-6 + 0.75 * 4e8 / 400e9)
    assert comm.p2p(1e8, True, NET) == pytest.approx(10e-6 + 1e8 / 50e9)
    assert comm.all_reduce(1e9, comm.group(1, 1, 8), NET) == (0.0, "none")
    oversub = Network(**{**NET.__dict__, "oversubscription": 2.0})
    far = comm.group(16, 8, 8)
    assert comm.all_gather(1e9, far, oversub)[0] > 1.9 * comm.all_gather(1e9, far, NET)[0]


def test_gradient_reductions_move_the_programs_gradient_bytes():
    """DDP's all-reduce, ZeRO-1's reduce-scatter, FSDP's and HSDP's reductions and offload's copies
    out move Runtime.grad_bytes a parameter (Megatron's fp16 gradients: 2), not a fixed 4; what
    ZeRO-1 gathers after its step is the fp32 parameters, and stays."""
    import dataclasses

    from shardline.layout import Layout
    from shardline.models import PRESETS
    from shardline.planner import microbatch_comm as mbc
    from shardline.planner.hardware import get_hardware
    from shardline.planner.layout import Runtime, Workload
    from shardline.planner.memory import layer_params
    from shardline.planner.step_comm import dp_tail

    hw, slow = get_hardware("h100-sxm"), {"compute": 0.0}
    fp32 = Workload(PRESETS["llama3-8b"], 4096, 64, "bf16")
    fp16 = dataclasses.replace(fp32, runtime=Runtime(grad_bytes=2))
    ddp, zero1 = Layout(dp_replicate=16), Layout(dp_shard=8, zero=1, tp=2)
    for lay in (ddp, zero1):
        assert dp_tail(fp16, lay, hw, slow)[1] < dp_tail(fp32, lay, hw, slow)[1], lay.describe()
    psi = layer_params(fp32, 2) * fp32.model.n_layers  # ZeRO-1: the drop is the reduction's alone
    cut = comm.group(8, 2, 8)
    drop = comm.reduce_scatter(4 * psi, cut, hw.network)[0] - comm.reduce_scatter(2 * psi, cut, hw.network)[0]
    assert dp_tail(fp32, zero1, hw, slow)[1] - dp_tail(fp16, zero1, hw, slow)[1] >= 0.9 * drop
    hsdp = Layout(dp_replicate=2, dp_shard=8, zero=3, cpu_offload=True)
    per_layer = layer_params(fp32, 1)
    scatter = comm.reduce_scatter(2 * per_layer, comm.group(8, 1, 8), hw.network)[0] + comm.all_reduce(
        2 * per_layer / 8, comm.group(2, 8, 8), hw.network)[0]
    assert mbc.fsdp_block(fp16, hsdp, hw)[3] == pytest.approx(scatter)
    assert dp_tail(fp16, Layout(dp_shard=16), hw, slow)[1] < dp_tail(fp32, Layout(dp_shard=16), hw, slow)[1]
    assert mbc.offload_copies(fp16, hsdp, hw) < mbc.offload_copies(fp32, hsdp, hw)
