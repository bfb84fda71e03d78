"""Step-time model: hand-checked pieces, consistency, and published end-to-end figures."""

from __future__ import annotations

import dataclasses

import pytest

from shardline.errors import ConfigError
from shardline.models import PRESETS, flops_per_token
from shardline.planner import comm
from shardline.planner import compute as cmp
from shardline.planner.estimate import estimate
from shardline.planner.hardware import get_hardware
from shardline.planner.layout import Layout, Workload
from shardline.planner.memory import GiB, expert_layer_params, ranks, stage_params

H200 = get_hardware("h200")
H100 = get_hardware("h100-sxm")
W70 = Workload(PRESETS["llama3-70b"], 8192, 1024, "bf16", document_mask=False)


def test_single_device_step_is_compute_plus_optimizer():
    w = Workload(PRESETS["llama3.2-1b"], 4096, 4, "bf16", document_mask=False)
    e = estimate(w, Layout(micro_batch_size=4), H200)
    assert e.breakdown["compute"] + e.breakdown["optimizer"] == pytest.approx(e.step_time_s)
    # The matmul part alone: 6 x (matmul params) x tokens at the shape efficiencies, a
    # lower bound; attention and element-wise work come on top.
    lt = cmp.layer_times(w, Layout(micro_batch_size=4), H200)
    assert e.breakdown["compute"] > 3 * 16 * lt.matmul
    assert e.tokens_per_s == pytest.approx(4 * 4096 / e.step_time_s)
    assert e.mfu == pytest.approx(e.tokens_per_s * flops_per_token(w.model, 4096) / 989e12)


def test_reference_h200_llama_1b_shape():
    # The project's reference measurement: one H200, Llama-3.2-1B shape, seq 4096, batch 4, bf16 autocast, eager:
    # HF transformers 41.0% MFU at 71.5 GiB peak allocated; shardline's eager block is the same math.
    w = Workload(PRESETS["llama3.2-1b"], 4096, 4, "bf16", document_mask=False)
    e = estimate(w, Layout(micro_batch_size=4), H200)
    assert 0.36 <= e.mfu <= 0.50
    allocated = e.memory["total"] - e.memory["fragmentation"] - e.memory["reserved"]
    assert allocated / GiB == pytest.approx(71.5, rel=0.15)


def test_70b_on_256_h100_lands_in_the_published_mfu_range():
    # Megatron-LM reports 41-48% MFU for 2B-462B GPT models on H100 (fused kernels,
    # overlapped TP). The planner's best FSDP/HSDP layout for eager shardline should land
    # at or a little below that.
    from shardline.planner.search import search

    best = search(W70, H100, 256, {"cp": 1, "pp": 1}).candidates[0]
    assert best.fits and 0.33 <= best.mfu <= 0.50
    assert sum(best.breakdown.values()) == pytest.approx(best.step_time_s)


def test_fsdp_with_one_nic_per_rank_is_communication_bound_on_short_micro_batches():
    # tp=8 fills each node, so each FSDP group has one rank per node and one NIC: per
    # block the bf16 gather and the fp32 reduce-scatter (640 MB) outlast its backward.
    w = dataclasses.replace(W70, global_batch=32)
    e = estimate(w, Layout(tp=8, dp_shard=32, micro_batch_size=1, activation_checkpoint="op"), H100)
    assert e.breakdown["fsdp_comm"] > 0.2 * e.step_time_s
    assert e.breakdown["tp_comm"] > 0.05 * e.step_time_s
    longer = estimate(dataclasses.replace(W70, global_batch=64),
                      Layout(tp=8, dp_shard=32, micro_batch_size=2, activation_checkpoint="op"), H100)
    assert longer.breakdown["fsdp_comm"] < 0.05 * longer.step_time_s  # twice the compute hides it


def test_thin_shards_run_slower_per_flop():
    small = cmp.matmul_efficiency(H100, "bf16", 8192, 8192, 8192 // 16)
    assert small < cmp.matmul_efficiency(H100, "bf16", 8192, 8192, 8192)
    e1 = estimate(W70, Layout(tp=1, dp_shard=256, micro_batch_size=1, activation_checkpoint="full"), H100)
    e8 = estimate(W70, Layout(tp=8, dp_shard=32, micro_batch_size=1, activation_checkpoint="full"), H100)
    assert e8.breakdown["compute"] > e1.breakdown["compute"]  # same FLOPs per device, thinner GEMMs


def test_recompute_costs_a_forward():
    base = Layout(tp=8, dp_shard=32, micro_batch_size=1)
    none = estimate(W70, base, H100)
    full = estimate(W70, dataclasses.replace(base, activation_checkpoint="full"), H100)
    op = estimate(W70, dataclasses.replace(base, activation_checkpoint="op"), H100)
    assert "recompute" not in none.breakdown
    assert full.breakdown["recompute"] == pytest.approx(none.breakdown["compute"] / 3, rel=0.1)
    assert 0 < op.breakdown["recompute"] < full.breakdown["recompute"] / 2  # element-wise ops only
    assert full.memory["activations"] < op.memory["activations"] < none.memory["activations"]


@pytest.mark.parametrize("sp", [True, False])
def test_a_rerun_forward_replays_the_tensor_parallel_collectives_its_backward_needs(sp):
    """Op-level AC reruns every block's forward, and with it two gathers and a reduce-scatter
    (SP) or one all-reduce per block (tests/distributed/test_recompute_collectives.py counts
    them); full AC the same, not every forward collective."""
    base = Layout(tp=8, dp_shard=32, micro_batch_size=1, sequence_parallel=sp)
    work = dataclasses.replace(W70, global_batch=32)
    tp = {ac: estimate(work, dataclasses.replace(base, activation_checkpoint=ac), H100).breakdown["tp_comm"]
          for ac in ("none", "op", "full")}
    g, elems, layers = comm.group(8, 1, 8), 8192 * W70.model.dim, W70.model.n_layers
    if sp:
        replay = 2 * comm.all_gather(4 * elems, g, H100.network)[0] + comm.reduce_scatter(2 * elems, g, H100.network)[0]
    else:
        replay = comm.all_reduce(2 * elems, g, H100.network)[0]
    microbatches = work.global_batch // base.dp_shard  # of one sequence, per rank
    assert tp["op"] - tp["none"] == pytest.approx(microbatches * layers * replay, rel=1e-6)
    assert tp["full"] == pytest.approx(tp["op"], rel=1e-9)


def test_pipeline_bubble_and_p2p_appear():
    lay = Layout(tp=8, pp=4, dp_shard=8, micro_batch_size=1, pp_microbatches=128, activation_checkpoint="full")
    e = estimate(W70, lay, H100)
    per_mb = (e.step_time_s - e.breakdown["pp_bubble"] - e.breakdown["optimizer"] - e.breakdown["dp_comm"]) / 128
    # (p-1)/m x m x the other stages' mean micro-batch time: at most the slowest stage's, and
    # close to it (the trainer's split of 80 layers on 4 stages differs by the head's share).
    assert e.breakdown["pp_bubble"] <= 3 / 128 * per_mb * 128 * (1 + 1e-9)
    assert e.breakdown["pp_bubble"] == pytest.approx(3 / 128 * per_mb * 128, rel=0.1)
    assert e.breakdown["pp_comm"] > 0
    inter = estimate(W70, dataclasses.replace(lay, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), H100)
    assert inter.breakdown["pp_bubble"] == pytest.approx(e.breakdown["pp_bubble"] / 2, rel=0.05)


def test_fsdp_gathers_hide_under_compute_until_they_do_not():
    big = estimate(W70, Layout(dp_shard=256, micro_batch_size=1, activation_checkpoint="full"), H100)
    assert big.breakdown["fsdp_comm"] < 0.02 * big.step_time_s  # 1 node: NVLink; 32 nodes: 8 NICs pooled
    slow_net = dataclasses.replace(H100, network=dataclasses.replace(H100.network, inter_bw_gbs=2.0))
    starved = estimate(W70, Layout(dp_shard=256, micro_batch_size=1, activation_checkpoint="full"), slow_net)
    assert starved.breakdown["fsdp_comm"] > 5 * big.breakdown["fsdp_comm"]


def test_ddp_all_reduce_overlaps_the_last_backward():
    w = Workload(PRESETS["llama3.2-1b"], 2048, 64, "bf16", document_mask=False)
    e = estimate(w, Layout(dp_replicate=8, micro_batch_size=2), H100)
    assert e.info["dp_comm_total_s"] > e.breakdown["dp_comm"] > 0
    assert e.info["algorithms"]["dp"] in ("ring", "tree")


def test_context_and_expert_parallel_rules():
    lay = Layout(cp=2, dp_shard=128, micro_batch_size=1, activation_checkpoint="full")
    e = estimate(W70, lay, H100)
    assert e.breakdown["compute"] > 0 and e.layout.shard_degree == 256
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        estimate(W70, Layout(ep=2, dp_shard=256), H100)
    with pytest.raises(ConfigError, match="not divisible"):
        estimate(W70, Layout(dp_shard=256, micro_batch_size=3), H100)
    with pytest.raises(ConfigError, match="tp=3 must divide"):
        estimate(W70, Layout(tp=3, dp_shard=1), H100)


def test_context_parallel_costs_follow_the_mode_and_the_balance():
    from shardline.planner.microbatch_comm import cp_layer

    w = Workload(PRESETS["llama3-8b"], 131072, 8, "bf16", document_mask=False)
    lays = {name: Layout(cp=8, dp_shard=1, micro_batch_size=1, activation_checkpoint="full", **kw)
            for name, kw in {"ring": {}, "none": {"cp_balance": "none"}, "ulysses": {"cp_mode": "ulysses"},
                             "hybrid": {"cp_mode": "hybrid", "cp_ulysses": 4}}.items()}
    costs = {n: cp_layer(w, lay, H100, cmp.layer_times(w, lay, H100)) for n, lay in lays.items()}
    assert all(c > 0 for c in costs.values())  # the ring's gradient hops and the all-to-alls are exposed
    # Without zigzag the slowest rank's attention kernels take 4R / (2R + 1) times as long (the
    # merge of partial results, the same in both, dilutes the ratio a little).
    ring, none = (cmp.layer_times(w, lays[n], H100).attention for n in ("ring", "none"))
    assert 1.7 < none / ring <= 32 / 17
    assert estimate(w, lays["none"], H100).step_time_s > estimate(w, lays["ring"], H100).step_time_s


def test_expert_parallel_all_to_all_for_moe_shapes():
    # Any shape with n_experts / moe_top_k gets the EP term (here a 70B shape made MoE).
    from shardline.models.llama import ModelArgs
    from shardline.planner.microbatch_comm import ep_layer

    @dataclasses.dataclass(frozen=True)
    class MoeArgs(ModelArgs):
        n_experts: int = 8
        moe_top_k: int = 2

    moe = dataclasses.replace(W70, model=MoeArgs(**dataclasses.asdict(W70.model)))
    lay = Layout(ep=8, dp_shard=256, micro_batch_size=1, activation_checkpoint="full")
    lt = cmp.layer_times(moe, lay, H100)
    one = ep_layer(moe, lay, H100, lt)
    # 8 ranks inside a node: (n-1) alpha + (n-1)/n x tokens x top_k x dim x 2 bytes over NVLink, 4 times.
    size = 8192 * 2 * 8192 * 2
    net = H100.network
    expected = 4 * (7 * net.intra_latency_us * 1e-6 + 7 / 8 * size / (net.intra_bw_gbs * 1e9 * net.bw_efficiency))
    assert one == pytest.approx(expected)
    assert ep_layer(W70, lay, H100, lt) == 0.0  # dense: no experts, no all-to-all
    # Full activation checkpointing recomputes each forward, its dispatch and combine too: 6 of them.
    assert ep_layer(moe, lay, H100, lt, rec=1.0) == pytest.approx(one * 6 / 4)
    per_step = estimate(moe, lay, H100).breakdown["ep_comm"]
    assert per_step == pytest.approx(80 * one * 6 / 4 * 4)  # 80 blocks, 1024 / 256 = 4 micro-batches per rank
    # Without borrowing cp ranks (ep divides dp_shard), the ep ranks sit cp x tp apart: 8 of them
    # 2 x 1 apart span two 8-GPU nodes, their all-to-all crosses the network, slower than NVLink.
    apart = Layout(ep=8, dp_shard=128, cp=2, micro_batch_size=1)
    assert not apart.ep_borrows_cp
    assert ep_layer(moe, apart, H100, cmp.layer_times(moe, apart, H100)) > \
        ep_layer(moe, Layout(ep=8, dp_shard=256, micro_batch_size=1), H100, lt) * 2  # half the tokens, cp 2
    # ... which estimate and the dry run say (their ep_comm was 43% of a step, unexplained)
    from shardline.planner.microbatch_comm import ep_placement
    from shardline.planner.report import estimate_text

    said = ("the 8 expert-parallel ranks sit 2 ranks apart, 4 on a node of 8: each all-to-all crosses 2 nodes over "
            "the links between them (ep_comm); ep=2 or 4 keeps it inside a node")
    assert ep_placement(apart, H100, 8) == said
    assert said in estimate_text(moe, H100, estimate(moe, apart, H100))
    assert ep_placement(Layout(ep=8, dp_shard=256, micro_batch_size=1), H100, 8) == ""  # side by side: one node
    assert ep_placement(Layout(ep=4, dp_shard=128, cp=2, micro_batch_size=1), H100, 8) == ""  # 4 x 2 apart: one node
    # 12 side by side span two nodes (not "1"); an ep that borrows the cp ranks sits tp apart, named where it fits
    assert "crosses 2 nodes" in ep_placement(Layout(ep=12, dp_shard=24, micro_batch_size=1), H100, 24)
    assert ep_placement(Layout(ep=4, dp_shard=3, cp=4, tp=4, micro_batch_size=1), H100, 8).endswith(
        "no ep the layout allows keeps it inside a node")
    assert ep_placement(Layout(ep=4, dp_shard=4, cp=4, micro_batch_size=1), H100, 8).endswith(
        "ep=2 or 8 keeps it inside a node")  # (8 = 2 dp_shard ranks x the 4 cp ranks, side by side)


def test_moe_blocks_are_priced_by_active_experts_and_held_in_full():
    """Mixtral: a block's GEMMs compute top_k of 8 experts; its parameters count all 8."""
    from shardline.models.flops import matmul_params, num_params
    from shardline.planner.memory import layer_params

    mixtral = Workload(PRESETS["mixtral-8x7b"], 4096, 1024, "bf16", document_mask=False)
    m = mixtral.model
    gemm_params = sum(n * k for _, n, k in cmp.layer_gemms(mixtral, 1, 1))
    router = m.dim * m.moe.n_experts  # not in the block's GEMM list: 0.01 % of it
    embed_out = m.vocab_size * m.dim
    assert gemm_params * m.n_layers + router * m.n_layers + embed_out == pytest.approx(matmul_params(m), rel=1e-12)
    # Under ep the busiest rank's load is priced over the mean; without it no rank waits on another's
    # routing (the allowance was charged at ep 1 too, pricing plain FSDP 15% slow in the experts)
    allowance = (cmp.EXPERT_LOAD_ALLOWANCE - 1) * 3 * m.dim * m.moe.top_k * m.moe.expert_ffn_dim
    assert sum(n * k for _, n, k in cmp.layer_gemms(mixtral, 1, 1, ep=2)) == pytest.approx(gemm_params + allowance)
    held = layer_params(mixtral, 1) * m.n_layers + 2 * embed_out + m.dim
    assert held == pytest.approx(num_params(m) - router * m.n_layers, rel=1e-12)


def test_search_ranks_expert_parallel_layouts_that_the_trainer_runs():
    from shardline.planner.search import search

    mixtral = Workload(PRESETS["mixtral-8x7b"], 4096, 256, "bf16", document_mask=False)
    result = search(mixtral, H100, 64, {"tp": 1, "pp": 1, "cp": 1}, runnable_only=True)
    eps = {e.layout.ep for e in result.candidates}
    assert eps >= {1, 2, 4, 8}, eps  # 8 experts, 8 GPUs per node
    best_ep = max((e for e in result.candidates if e.layout.ep == 8), key=lambda e: e.tokens_per_s)
    assert best_ep.breakdown["ep_comm"] > 0


def test_zero1_under_tp_or_pp_reduces_after_backward_and_chunked_loss_holds_less():
    w8 = Workload(PRESETS["llama3-8b"], 4096, 256, "bf16", document_mask=False)
    plain = estimate(w8, Layout(dp_shard=32, zero=1, micro_batch_size=1, activation_checkpoint="full"), H100)
    tp = estimate(w8, Layout(dp_shard=16, tp=2, zero=1, micro_batch_size=1, activation_checkpoint="full"), H100)
    assert plain.breakdown["dp_comm"] < plain.info["dp_comm_total_s"]  # DDP's buckets overlap backward
    assert tp.breakdown["dp_comm"] == pytest.approx(tp.info["dp_comm_total_s"], abs=1e-6)  # after backward
    lay = Layout(dp_shard=32, micro_batch_size=2, activation_checkpoint="full")
    whole = estimate(w8, lay, H100).memory["logits"]
    chunked = estimate(dataclasses.replace(w8, loss_chunk_tokens=1024), lay, H100).memory["logits"]
    assert chunked < whole / 4  # 1024 of 8192 tokens' logits at a time; the hidden states stay


def test_zero1_prices_each_cut_over_its_own_ranks():
    """As parallel/zero1.py runs it: the dense gradients reduce-scattered over dp_shard, the rank's
    ep-th of the routed experts over efsdp (dp_shard / ep ranks holding the same experts), each
    received slice all-reduced over dp_replicate, and the updated slices all-gathered over the
    same cuts; not one collective over all dp ranks."""
    w = Workload(PRESETS["mixtral-8x7b"], 4096, 64, "bf16")
    net, gpn = H100.network, H100.network.gpus_per_node
    replicas = comm.group(2, 8, gpn)  # across the two nodes
    for ep in (2, 4, 8):
        lay = Layout(dp_replicate=2, dp_shard=8, zero=1, ep=ep, micro_batch_size=1, activation_checkpoint="full")
        stage = ranks(w, lay)[0]
        experts = stage.layers * expert_layer_params(w, 1)
        cuts = ((stage_params(w, lay, stage) - experts, comm.group(8, 1, gpn)),
                (experts / ep, comm.group(8 // ep, ep, gpn)))  # ep 8: one rank per cut, nothing moves
        expected = sum(comm.reduce_scatter(4 * n, g, net)[0] + comm.all_reduce(4 * n / g.size, replicas, net)[0]
                       + comm.all_gather(4 * n, g, net)[0] for n, g in cuts)
        assert estimate(w, lay, H100).breakdown["dp_comm"] == pytest.approx(expected)


def test_fsdp_under_pp_reduce_scatters_once_per_step():
    # torch's pipeline stages keep gradients unsharded until the last micro-batch: ZeRO-2 gathers
    # and reduce-scatters once per step, whatever the micro-batch count; ZeRO-3 gathers again
    # each micro-batch, but still reduce-scatters once (a model that paid both per micro-batch
    # would double with the micro-batches).
    def fsdp_comm(zero: int, m: int) -> float:
        lay = Layout(dp_shard=16, pp=4, zero=zero, pp_microbatches=m, micro_batch_size=1, activation_checkpoint="full")
        return estimate(dataclasses.replace(W70, global_batch=16 * m), lay, H100).breakdown["fsdp_comm"]

    assert fsdp_comm(2, 8) > 0
    assert fsdp_comm(2, 16) == pytest.approx(fsdp_comm(2, 8))
    assert fsdp_comm(3, 8) < fsdp_comm(3, 16) < 1.9 * fsdp_comm(3, 8)


def test_the_chunked_loss_recompute_is_priced_on_the_last_stage_twice_under_a_split_backward():
    """Once per micro-batch on the stage holding the loss (the last; under zbv rank 0, which
    holds both ends), twice under the split backward; nothing without chunks."""
    w8 = Workload(PRESETS["llama3-8b"], 4096, 256, "bf16", document_mask=False)
    chunked = dataclasses.replace(w8, loss_chunk_tokens=1024)
    lay = {s: Layout(dp_shard=16, pp=2, pp_schedule=s, pp_virtual_stages=2 if s == "zbv" else 1,
                     micro_batch_size=1, pp_microbatches=16) for s in ("1f1b", "zbv")}
    once = cmp.loss_recompute_time(chunked, lay["1f1b"], H100, "last")
    assert once > 0 and cmp.loss_recompute_time(chunked, lay["zbv"], H100, "both") == pytest.approx(2 * once)
    for stage in ("first", "middle"):
        assert cmp.loss_recompute_time(chunked, lay["zbv"], H100, stage) == 0
    assert cmp.loss_recompute_time(w8, lay["zbv"], H100, "both") == 0  # no chunks, nothing recomputed
    for layout, label in ((lay["zbv"], "both"), (Layout(dp_shard=16, micro_batch_size=1), "both")):
        est = estimate(chunked, layout, H100)  # no checkpointing: the loss is the only recompute
        assert est.breakdown["recompute"] == pytest.approx(16 * cmp.loss_recompute_time(chunked, layout, H100, label))
        assert "recompute" not in estimate(w8, layout, H100).breakdown


def test_tied_embedding_gradient_sum_crosses_nodes_by_the_first_and_last_stage():
    """The tied weight's two copies sit on the first and last pipeline stage: (pp - 1) x world / pp
    ranks apart. Under a V-shaped schedule both ends are on pp rank 0: one weight, nothing sent."""
    from shardline.planner.step_comm import tied_grads

    tied = dataclasses.replace(W70, model=dataclasses.replace(W70.model, tie_embeddings=True))
    net = H100.network
    # world 16, pp 4, tp 4: neighbouring stages are 4 ranks apart (one node), the ends 12 (two)
    lay = Layout(tp=4, pp=4, dp_shard=1)
    size = 4 * tied.model.vocab_size * tied.model.dim / 4
    assert tied_grads(tied, lay, H100) == pytest.approx(comm.p2p(size, True, net))
    assert comm.p2p(size, True, net) > comm.p2p(size, False, net)
    assert tied_grads(tied, Layout(tp=4, pp=4, dp_shard=1, pp_schedule="zbv", pp_virtual_stages=2), H100) == 0.0
    assert tied_grads(W70, lay, H100) == 0.0  # untied: no sum


def test_the_request_line_names_the_overrides_of_the_presets_shape(capsys):
    """A config's [moe] table over another preset priced another model under the preset's name alone:
    "mixtral-8x7b (2.66 B params)" was tiny-moe's experts in Mixtral's attention."""
    from pathlib import Path

    from shardline.cli import main

    moe = str(Path(__file__).parents[2] / "configs" / "tiny-moe.toml")
    assert main(["estimate", "--config", moe, "--model.preset=mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "8",
                 "--parallel.ep=8", "--train.micro_batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("estimate: mixtral-8x7b with moe.expert_ffn_dim=256 moe.shared_experts=1 "
                          "moe.first_dense_layers=1 "), out
    assert main(["estimate", "--config", moe, "--moe.bias_update_rate=0", "--model.n_layers=6"]) == 0
    assert capsys.readouterr().out.startswith("estimate: tiny-moe with model.n_layers=6 (")  # (the preset's own: none)


def test_the_request_line_gives_a_small_model_in_millions(capsys):
    """The tiny preset read "tiny (0.01 B params) ... (0.00 M tokens)"."""
    from shardline.cli import main

    from pathlib import Path

    assert main(["estimate", "--config", str(Path(__file__).parents[2] / "configs" / "tiny.toml")]) == 0
    out = capsys.readouterr().out
    assert "tiny (5.2 M params) on 1 x cpu, seq 256, global batch 16 seqs (4,096 tokens)" in out, out
    # and what priced it (a profile, a datasheet, or this CPU's uncalibrated guesses: it was never said)
    assert out.splitlines()[1].startswith("priced by uncalibrated guesses for this CPU (`shardline calibrate`")


def test_the_smollm_preset_is_counted_alike_by_the_plan_and_the_dry_run(capsys, tiny_config):
    """smollm-135m's 134,515,008 parameters (HF's count of that shape: test_hf_interop) as both say them."""
    from shardline import dry_run
    from shardline.cli import main

    assert main(["plan", "--model", "smollm-135m", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "2048",
                 "--global-batch", "256", "--top", "1"]) == 0
    assert "plan: smollm-135m (134.5 M params) on 8 x h100-sxm" in capsys.readouterr().out
    # (the tiny test config's shape overrides given back as 0: the preset's own)
    cfg = tiny_config("run.device=cpu", "model.preset=smollm-135m", *(f"model.{key}=0" for key in
                      ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")))
    report, _ = dry_run.dry_run(cfg, 1)
    assert "model     smollm-135m: 134.5 M parameters, 30 layers, dim 576, 9 heads (3 kv), vocab 49,152" in report


def test_a_calibrated_cpu_profile_says_how_far_it_was_found_off(capsys, tmp_path):
    """A user read a calibrated estimate as exact; it was 20-37% under two ranks' steps."""
    from pathlib import Path

    from shardline.cli import main

    profile = tmp_path / "cpu.toml"
    profile.write_text('base = "cpu"\nmatmul_half_dim = 16.0\n[matmul_eff_max]\nfp32 = 0.9\n'
                       '[measured]\nworld_all_gather = [[2, 4096, 100.0]]\n')  # (comm-bench's record: not a figure)
    config = str(Path(__file__).parents[2] / "configs" / "tiny.toml")
    assert main(["estimate", "--config", config, "--profile", str(profile)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "with matmul_eff_max, matmul_half_dim from the profile" in line
    assert "within ~10% of the measured ones and several ranks' 15-40% under" in line
    assert main(["estimate", "--config", config, "--gpu", "h100-sxm", "--profile", str(profile)]) in (0, 2)
    assert "15-40% under" not in capsys.readouterr().out  # (a GPU profile's: not measured here)


def test_a_report_piped_into_head_ends_quietly(tmp_path):
    """`plan ... | head` printed a BrokenPipeError traceback (and "Exception ignored" at exit)."""
    import subprocess
    import sys
    from pathlib import Path

    err = tmp_path / "err"
    cmd = (f"{sys.executable} -m shardline plan --model llama3-8b --gpu h100-sxm --gpus 64 --seq-len 4096 "
           f"--global-batch 64 --top 300 --json 2>{err} | head -c1 >/dev/null; echo ${{PIPESTATUS[0]}}")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.stdout.strip() == "0" and err.read_text() == "", (done.stdout, err.read_text())


def test_estimate_says_what_it_assumed_and_exits_1_where_it_does_not_fit(capsys):
    """On a machine without a GPU it priced the CPU for a config a dry run prices as an H100, exited 0
    on DOES NOT FIT (a script's `estimate && torchrun` went on), and priced a dp_shard=-1 config left
    without --gpus on the other degrees' ranks alone, in silence."""
    from pathlib import Path

    from shardline.cli import main

    configs = Path(__file__).parents[2] / "configs"
    assert main(["estimate", "--config", str(configs / "tiny.toml")]) == 0
    assert "priced on this machine's CPU (no GPU here, run.device=auto): --gpu TYPE" in capsys.readouterr().err
    gpu = ["estimate", "--config", str(configs / "llama3.2-1b-gpu.toml"), "--gpu", "h100-sxm"]
    assert main([*gpu, "--gpus", "1"]) == 0 and capsys.readouterr().err == ""
    assert main([*gpu, "--gpus", "1", "--train.micro_batch_size=8"]) == 1
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "the memory estimate does not fit h100-sxm or its host (exit 1)" in err
    assert main([*gpu, "--parallel.tp=2"]) == 0
    assert "--gpus not given: parallel.dp_shard=-1 taken as 1, the job priced on 2 device(s)" in capsys.readouterr().err


def test_estimate_refuses_devices_that_are_no_whole_number_of_nodes_as_plan_does(capsys):
    """8 GPUs at 3 a node: plan and simulate refused it, estimate priced it."""
    from pathlib import Path

    from shardline.cli import main

    config = str(Path(__file__).parents[2] / "configs" / "tiny.toml")
    base = ["estimate", "--config", config, "--gpu", "h100-sxm", "--train.global_batch_size=96"]
    assert main([*base, "--gpus", "8", "--gpus-per-node", "3"]) == 2
    assert "--gpus 8 is not a whole number of 3-device nodes" in capsys.readouterr().err
    assert main([*base, "--gpus", "6", "--gpus-per-node", "3", "--train.micro_batch_size=4"]) in (0, 1)
