"""The planner's model of CPU ranks and pipelines as the trainer runs them.

Pipeline stages are split by the trainer's rule (the head counts as blocks on the last
stage); CPU ranks share the node's cores; gloo collectives use the alpha/B calibrated
for their group size; saturated CPU ranks overlap no communication.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardline import layout as layouts
from shardline.models.presets import PRESETS
from shardline.planner import comm
from shardline.planner import compute as cmp
from shardline.planner.estimate import estimate
from shardline.planner.hardware import cpu_hardware
from shardline.planner.layout import Layout, Workload
from shardline.planner.memory import activation_bytes, memory_breakdown, ranks

TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=4096)
WORK = Workload(TINY, 128, 8, "fp32")


def cpu(cores=2, threads=1):
    return cpu_hardware().with_cpu(cores=cores, threads=threads)


@pytest.mark.parametrize("n_layers, stages, head, counts", [
    (4, 2, 1.33, (3, 1)),  # the output weighs 1.33 blocks: 3 | 1 + 1.33 beats 2 | 2 + 1.33
    (16, 4, 0.0, (4, 4, 4, 4)),
    (7, 3, 2.5, (3, 3, 1)),  # the slowest stage: 1 + 2.5 = 3.5 (3, 2, 2 would give 4.5)
    (80, 4, 0.9, (20, 20, 20, 20)),  # 20.9 on the last; 21 blocks anywhere would be worse
])
def test_stage_split_worked_out(n_layers, stages, head, counts):
    assert layouts.stage_layer_counts(n_layers, stages, head) == counts


@pytest.mark.parametrize("n_layers, stages, head", [(4, 2, 1.33), (16, 4, 0.0), (32, 8, 5.0), (80, 4, 0.9),
                                                    (7, 3, 2.5), (126, 16, 1.2)])
def test_stage_split_is_the_one_the_trainer_cuts(n_layers, stages, head):
    from shardline.parallel.pipeline import Pipeline  # noqa: F401  the trainer's pipeline uses layout's split

    split = layouts.split_layers(n_layers, stages, head)
    assert [len(s) for s in split] == list(layouts.stage_layer_counts(n_layers, stages, head))
    assert [i for s in split for i in s] == list(range(n_layers)) and all(split)


def test_pipeline_ranks_follow_the_split_and_the_schedule():
    ranks = layouts.pipeline_ranks(TINY, 2, 1, "1f1b")
    assert [(r.layers, r.label) for r in ranks] == [(3, "first"), (1, "last")]  # tiny's head is 1.33 blocks
    v = layouts.pipeline_ranks(PRESETS["llama3-8b"], 2, 2, "zbv")
    assert v[0].first and v[0].last and v[0].label == "both" and v[1].label == "middle"
    assert sum(r.layers for r in v) == 32


def test_the_fuller_first_stage_sets_the_pace_and_the_bubble_is_the_other_stage():
    lay = Layout(pp=2, pp_microbatches=4, micro_batch_size=2)
    e = estimate(WORK, lay, cpu())
    assert e.info["layers_per_stage"] == [3, 1]
    even = dataclasses.replace(TINY, vocab_size=8)  # a negligible head: 2 + 2 layers
    e_even = estimate(dataclasses.replace(WORK, model=even), lay, cpu())
    assert e_even.info["layers_per_stage"] == [2, 2]
    # 1F1B with stage times t0 > t1: m·t0 + t1, so the bubble is one micro-batch of the last stage.
    assert e.breakdown["pp_bubble"] < e.breakdown["compute"] / 4
    # Even blocks: the bubble is one micro-batch of the other stage, nearly the slow one's.
    assert e_even.breakdown["pp_bubble"] == pytest.approx(
        (e_even.step_time_s - e_even.breakdown["pp_bubble"] - e_even.breakdown["optimizer"]
         - e_even.breakdown["dp_comm"]) / 4, rel=0.02)
    # Memory: 1F1B's first rank keeps 2 micro-batches of 3 blocks in flight, more than the last's
    # one block and its logits, so it holds the peak. One block's bytes and the mask's come from
    # the last rank (1 block + mask, one in flight) and one rank of all 4 blocks (4 blocks + mask).
    first, last = ranks(WORK, lay)
    single = Layout(micro_batch_size=2)
    whole = activation_bytes(WORK, single, ranks(WORK, single)[0], on_cuda=False)["activations"]
    tail = activation_bytes(WORK, lay, last, on_cuda=False)
    block = (whole - tail["activations"]) / 3
    mask = tail["activations"] - block
    peak = memory_breakdown(WORK, lay, cpu())
    assert block > 0 and mask > 0 and peak["logits"] == 0.0  # the peak is on the first rank, no logits
    assert peak["activations"] == pytest.approx(2 * (3 * block + mask), rel=1e-9)
    assert peak["activations"] > tail["activations"] + tail["logits"]


@pytest.mark.parametrize("world, cores, threads, expected", [(1, 2, 1, 1.0), (2, 2, 1, 1.0), (4, 2, 1, 0.5),
                                                             (8, 2, 1, 0.25), (2, 2, 2, 0.5), (4, 16, 2, 1.0)])
def test_cpu_ranks_share_the_cores(world, cores, threads, expected):
    assert cmp.share(cpu(cores, threads), Layout(dp_shard=world)) == pytest.approx(expected)
    assert cmp.saturated(cpu(cores, threads), Layout(dp_shard=world)) == (world * threads >= cores)


def test_oversubscribed_ranks_stretch_compute_including_op_overhead():
    one = cmp.layer_times(WORK, Layout(dp_shard=2), cpu())
    four = cmp.layer_times(WORK, Layout(dp_shard=4), cpu())
    assert four.matmul == pytest.approx(2 * one.matmul) and four.overhead == pytest.approx(2 * one.overhead)


@pytest.mark.parametrize("world, cores, expected", [(1, 2, 1.0), (2, 2, 0.8), (4, 2, 0.4), (2, 4, 1 - 0.2 / 3),
                                                   (4, 4, 0.8), (8, 4, 0.4)])
def test_busy_cores_slow_each_other_as_calibrated(world, cores, expected):
    hw = cpu(cores).with_cpu(corun_matmul_eff=0.8, corun_memory_eff=0.9, corun_dispatch_eff=0.95)
    lay = Layout(dp_shard=world)
    assert cmp.share(hw, lay, "matmul") == pytest.approx(expected)
    assert cmp.share(hw, lay) == pytest.approx(min(1.0, cores / world))  # wrappers: calibrated co-running
    one, slowed = cmp.layer_times(WORK, lay, cpu(cores)), cmp.layer_times(WORK, lay, hw)
    assert slowed.matmul == pytest.approx(one.matmul * cmp.share(cpu(cores), lay) / expected)
    assert slowed.elementwise >= one.elementwise and slowed.overhead >= one.overhead
    assert (slowed.elementwise > one.elementwise) == (world > 1)


def test_collectives_use_the_fit_of_their_group_size():
    net = dataclasses.replace(cpu().network, latency_by_world_us={"2": 100.0, "4": 300.0, "8": 2000.0},
                              bw_by_world_gbs={"2": 2.0, "4": 1.0, "8": 0.5}, op_factor={})
    for size, (alpha_us, bw) in {2: (100, 2.0), 3: (100, 2.0), 4: (300, 1.0), 6: (300, 1.0), 16: (2000, 0.5)}.items():
        t = comm.all_gather(1e6, comm.group(size, 1, net.gpus_per_node), net)[0]
        assert t == pytest.approx((size - 1) * alpha_us * 1e-6 + (size - 1) / size * 1e6 / (bw * 1e9))


def test_each_collective_takes_its_calibrated_factor_inside_a_node():
    plain = dataclasses.replace(cpu().network, op_factor={})
    slow_rs = dataclasses.replace(plain, op_factor={"reduce_scatter": 3.0, "all_gather": 0.5})
    g = comm.group(2, 1, plain.gpus_per_node)
    assert comm.reduce_scatter(1e6, g, slow_rs)[0] == pytest.approx(3 * comm.reduce_scatter(1e6, g, plain)[0])
    assert comm.all_gather(1e6, g, slow_rs)[0] == pytest.approx(0.5 * comm.all_gather(1e6, g, plain)[0])
    assert comm.all_reduce(1e6, g, slow_rs)[0] == comm.all_reduce(1e6, g, plain)[0]  # no entry: 1
    across = comm.Group(4, 2)  # two nodes: the network's figures, not the node's calibration
    assert comm.reduce_scatter(1e6, across, slow_rs)[0] == comm.reduce_scatter(1e6, across, plain)[0]


def test_saturated_cpu_ranks_expose_all_data_parallel_communication():
    wide = dataclasses.replace(WORK, model=dataclasses.replace(TINY, dim=1024, ffn_dim=4096))  # 200 MB of grads
    lay = Layout(dp_replicate=2, micro_batch_size=4)
    ddp = estimate(wide, lay, cpu(cores=2))
    assert ddp.breakdown["dp_comm"] == pytest.approx(ddp.info["dp_comm_total_s"], rel=1e-4)  # info is rounded
    idle = estimate(wide, lay, cpu(cores=16))  # spare cores: the buckets overlap the backward
    assert idle.breakdown["dp_comm"] < 0.9 * ddp.breakdown["dp_comm"]


def test_parameter_tensors_per_rank_match_the_model():
    import torch

    from shardline.models.llama import Llama
    from shardline.planner.memory import stage_tensors

    for args in (TINY, PRESETS["llama3-8b"]):
        with torch.device("meta"):
            n = len(list(Llama(args).parameters()))
        (whole,) = layouts.pipeline_ranks(args, 1, 1, "1f1b")
        assert stage_tensors(Workload(args, 128, 8), whole) == n


def test_wrapper_overheads_and_gradient_norm_reductions_are_charged_where_they_run():
    hw = cpu().with_cpu(tp_layer_overhead_us=1000.0, fsdp_layer_overhead_us=400.0, dtensor_param_overhead_us=50.0,
                        tp_head_overhead_us=300.0, fsdp_root_overhead_us=70.0, tp_layer_wall_us=0.0,
                        tp_layer_wall_us_per_mb=0.0, fsdp_layer_overhead_us_per_mb=0.0)
    ddp = estimate(WORK, Layout(dp_replicate=2, micro_batch_size=4), hw)
    fsdp = estimate(WORK, Layout(dp_shard=2, micro_batch_size=4), hw)
    tp = estimate(WORK, Layout(tp=2, micro_batch_size=8), hw)
    plain = hw.with_cpu(tp_layer_overhead_us=0.0, fsdp_layer_overhead_us=0.0, dtensor_param_overhead_us=0.0,
                        tp_head_overhead_us=0.0, fsdp_root_overhead_us=0.0)
    # Per block per micro-batch, on a full core (2 ranks, 2 cores): 4 blocks and the model's ends.
    assert fsdp.breakdown["compute"] - estimate(WORK, Layout(dp_shard=2, micro_batch_size=4), plain).breakdown[
        "compute"] == pytest.approx(4 * 400e-6 + 70e-6)
    assert tp.breakdown["compute"] - estimate(WORK, Layout(tp=2, micro_batch_size=8), plain).breakdown[
        "compute"] == pytest.approx(4 * 1000e-6 + 300e-6)
    # DDP's parameters are plain tensors: no per-tensor optimizer overhead, one loss all-reduce.
    assert ddp.breakdown["optimizer"] == pytest.approx(
        estimate(WORK, Layout(dp_replicate=2, micro_batch_size=4), plain).breakdown["optimizer"])
    one = comm.all_reduce(4, comm.group(2, 1, 1024), hw.network)[0]
    assert ddp.breakdown["sync_comm"] == pytest.approx(one)
    # The gradient norm reduces once per group of gradients with one mesh and placements:
    # FSDP alone has one group; TP two sharded ones (column, row) and replicated norms.
    assert fsdp.breakdown["sync_comm"] == pytest.approx(one + one)  # the loss + the norm group
    assert tp.breakdown["sync_comm"] == pytest.approx(2 * one)  # dp = 1: no loss reduction


def test_fsdp_wrapper_overhead_grows_with_the_parameter_bytes_it_copies():
    hw, base = (cpu().with_cpu(fsdp_layer_overhead_us_per_mb=x) for x in (10.0, 0.0))
    block_mb = 4e-6 * (256 * (2 * 256 + 2 * 128) + 3 * 256 * 768 + 2 * 256)  # tiny: dim 256, ffn 768, 8 / 4 heads
    embed_mb = 4e-6 * 4096 * 256
    fsdp = Layout(dp_shard=2, micro_batch_size=4)
    extra = estimate(WORK, fsdp, hw).breakdown["compute"] - estimate(WORK, fsdp, base).breakdown["compute"]
    # 4 blocks, embedding and output; the root gathers and reduce-scatters once a micro-batch: 2 of 3 passes
    assert extra == pytest.approx(10e-6 * (4 * block_mb + 2 * embed_mb * 2 / 3))
    ddp = Layout(dp_replicate=2, micro_batch_size=4)  # no FSDP: nothing charged
    assert estimate(WORK, ddp, hw).breakdown["compute"] == estimate(WORK, ddp, base).breakdown["compute"]


@pytest.mark.parametrize("zero, pp, expected", [
    (3, 1, 1.0),  # as calibrated: each micro-batch gathers twice and reduce-scatters once
    (2, 1, 2 / 3),  # gathered once per micro-batch, kept for the backward
    (3, 2, (4 + 1 + 1) / (3 * 4)),  # a stage gathers per micro-batch (+ pp - 1) and reduce-scatters once per step
    (2, 2, 2 / (3 * 4)),  # a stage gathers and reduce-scatters once per step
])
def test_fsdp_copies_are_charged_by_the_passes_that_copy(zero, pp, expected):
    """FSDP's hooks run every micro-batch, but its copies into and out of the buffers only on a
    gather or reduce-scatter: under pp most micro-batches do neither."""
    hw, base = (cpu(cores=8).with_cpu(fsdp_layer_overhead_us_per_mb=x) for x in (10.0, 0.0))
    lay = Layout(dp_shard=2, zero=zero, pp=pp, pp_microbatches=4 if pp > 1 else 1, micro_batch_size=1)
    work = dataclasses.replace(WORK, global_batch=8)
    n_micro = lay.micro_batches(work.global_batch)
    assert n_micro == 4
    block_mb = 4e-6 * (256 * (2 * 256 + 2 * 128) + 3 * 256 * 768 + 2 * 256)
    embed_mb = 4e-6 * 4096 * 256
    first = ranks(work, lay)[0]  # all 4 blocks and both ends, or under pp the first stage: 3 blocks, the embedding
    ends = 2 * embed_mb if pp == 1 else embed_mb
    root = 2 / 3 if pp == 1 else 2 / (3 * n_micro)  # 1 gather + 1 reduce-scatter a micro-batch, or a step
    extra = estimate(work, lay, hw).breakdown["compute"] - estimate(work, lay, base).breakdown["compute"]
    assert extra == pytest.approx(n_micro * 10e-6 * (first.layers * block_mb * expected + ends * root), rel=1e-6)


def test_idle_pipeline_stages_lend_their_cores_on_a_shared_cpu(monkeypatch):
    """Four CPU ranks on two cores (a half each), pp 2 with unequal stages (3 blocks | 1 + head):
    the lighter stage and the bubble wait in receives, which frees their cores, so the step is
    shorter than the slow stage's micro-batches at a half plus the bubble, but no shorter than
    at a whole core. Where every rank has its core, or the stages are on two nodes (one core
    each for two ranks: no core to lend across), nothing changes."""
    lay = Layout(dp_shard=2, pp=2, pp_microbatches=4, micro_batch_size=1)
    work = dataclasses.replace(WORK, global_batch=8)
    shared, roomy = cpu(cores=2), cpu(cores=4)
    two_nodes = dataclasses.replace(cpu(cores=1), network=dataclasses.replace(shared.network, gpus_per_node=2))
    with_rule = [estimate(work, lay, hw) for hw in (shared, roomy, two_nodes)]
    monkeypatch.setattr("shardline.planner.estimate._idle_stages_lend_cores", lambda *a: None)
    without = [estimate(work, lay, hw) for hw in (shared, roomy, two_nodes)]
    terms = ("compute", "recompute", "fsdp_comm", "pp_comm", "pp_bubble")

    def pace(e):
        return sum(e.breakdown.get(k, 0.0) for k in terms)

    assert cmp.share(shared, lay) == 0.5
    assert cmp.share(shared, lay) * pace(without[0]) < pace(with_rule[0]) < pace(without[0])
    assert other_terms(with_rule[0], terms) == pytest.approx(other_terms(without[0], terms))
    assert with_rule[1].breakdown == without[1].breakdown  # 4 ranks on 4 cores
    assert cmp.share(two_nodes, lay) == 0.5 and with_rule[2].breakdown == without[2].breakdown


def other_terms(e, terms) -> dict:
    return {k: v for k, v in e.breakdown.items() if k not in terms}


def test_a_wall_time_tp_calibration_replaces_the_tp_wrapper_and_collective_costs_on_cpu():
    tp = Layout(tp=2, micro_batch_size=8)
    act_mb = 4e-6 * 8 * 128 * TINY.dim  # a micro-batch's activations
    none = cpu().with_cpu(tp_layer_wall_us=0.0, tp_layer_wall_us_per_mb=0.0)
    wall = none.with_cpu(tp_layer_wall_us=30000.0, tp_layer_wall_us_per_mb=10000.0, tp_head_wall_us=5000.0,
                         tp_head_wall_us_per_mb=2000.0)
    before, after = estimate(WORK, tp, none).breakdown, estimate(WORK, tp, wall).breakdown
    logits_mb = 4e-6 * 8 * 128 * TINY.vocab_size / 2  # one rank's share of a micro-batch's logits
    assert after["tp_comm"] == pytest.approx(4 * (30000 + 10000 * act_mb) * 1e-6 + (5000 + 2000 * logits_mb) * 1e-6)
    # The wall times hold the wrappers' host time: the blocks' and the ends' thread-time costs go.
    assert before["compute"] - after["compute"] == pytest.approx(
        (4 * none.cpu.tp_layer_overhead_us + none.cpu.tp_head_overhead_us) * 1e-6)
    four = estimate(WORK, Layout(tp=2, dp_shard=2, micro_batch_size=4), wall).breakdown  # 4 ranks, 2 cores
    assert four["tp_comm"] > 4 * 2 * (30000 + 10000 * act_mb / 2) * 1e-6  # a half share of the cores
    gpu = estimate(WORK, tp, wall.with_cpu(shared_compute=False)).breakdown
    assert gpu["tp_comm"] == pytest.approx(estimate(WORK, tp, none.with_cpu(shared_compute=False))
                                           .breakdown["tp_comm"])  # accelerators: the alpha-beta model


def test_ddp_buckets_are_the_gradients_unless_the_runtime_copies_them():
    """The trainer's DDP keeps its gradients as views of the reducer's buckets
    (gradient_as_bucket_view): no second copy; a DDP that copies them into its buckets has one."""
    wide = dataclasses.replace(WORK, model=dataclasses.replace(TINY, dim=1024, ffn_dim=4096))
    ddp = memory_breakdown(wide, Layout(dp_replicate=2, micro_batch_size=4), cpu())
    one = memory_breakdown(wide, Layout(micro_batch_size=4), cpu())
    assert ddp["buffers"] == pytest.approx(one["buffers"]) and ddp["grads"] == pytest.approx(one["grads"])
    copying = dataclasses.replace(wide, runtime=dataclasses.replace(wide.runtime, ddp_grad_copy=True))
    copied = memory_breakdown(copying, Layout(dp_replicate=2, micro_batch_size=4), cpu())
    assert copied["buffers"] - ddp["buffers"] == pytest.approx(ddp["grads"])  # fp32 gradients, bucketed once more


def test_ranks_sharing_the_cores_report_mfu_against_their_share_as_the_trainer_logs_it():
    """8 one-thread ranks on 2 cores: the trainer's log counts each rank's peak as a quarter core
    (devices.cpu_peak_tflops), so the estimate's MFU must too, or the two read 4x apart."""
    from shardline.models.flops import flops_per_token

    hw = cpu(cores=2, threads=1)
    for world in (1, 2, 8):
        e = estimate(WORK, Layout(dp_shard=world, micro_batch_size=1), hw)
        host = hw.peak("fp32") * min(world, 2)  # the cores the ranks use between them
        assert e.mfu == pytest.approx(e.tokens_per_s * flops_per_token(TINY, 128) / host, rel=1e-9)
    # More threads than cores: a process's peak is the cores' already (as the trainer's), not cut again.
    wide = cpu(cores=2, threads=8)
    e = estimate(WORK, Layout(micro_batch_size=1), wide)
    assert e.mfu == pytest.approx(e.tokens_per_s * flops_per_token(TINY, 128) / wide.peak("fp32"), rel=1e-9)
