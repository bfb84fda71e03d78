"""shardline.layout: every impossible layout is one ConfigError before any collective runs,
and the trainer, `train --dry-run` and the planner give the same verdict on every layout."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
import torch

from shardline import layout as layouts
from shardline.cli import main
from shardline.config import PP_SCHEDULES, Config, load_config
from shardline.errors import ConfigError
from shardline.layout import Layout
from shardline.models.llama import ModelArgs
from shardline.models.presets import PRESETS
from shardline.parallel import float8
from shardline.planner.layout import Workload, layout_problem
from shardline.planner.search import runnable_problem
from shardline.preflight import check_config, check_layout, preflight

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128)


REPO = Path(__file__).parents[2]


def layout_for(world: int, *overrides: str, args: ModelArgs = ARGS) -> Layout:
    cfg = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=2", "train.seq_len=32",
                             *overrides])
    cfg.check()
    check_config(cfg)  # what a launch checks first (the trainer, and --dry-run)
    return check_layout(cfg, world, args)


def test_dp_shard_fills_the_rest():
    lay = layout_for(8, "parallel.tp=2", "parallel.pp=2")
    assert (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.dp, lay.world) == (1, 2, 2, 2, 2, 8)
    assert lay.pp_microbatches == 4  # 0 in the config: global / (dp x micro-batch)


@pytest.mark.parametrize("world, overrides, message", [
    (4, ["parallel.dp_shard=3"], "does not match the world size 4; their product must equal the number of "
                                 "processes .or set parallel.dp_shard=-1 to take what the others leave"),
    # DDP 2 relaunched on one process: dp_shard=-1 alone would not do, and the line says so
    (1, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], "dp_shard=-1 takes what the others leave, but their "
                                                            "product 2 does not divide 1 either: lower them too"),
    (6, ["parallel.tp=4"], "does not divide the world size 6 .*that product must be one of 1, 2, 3, 6"),
    (4, ["parallel.tp=4"], "must divide n_heads=4 and n_kv_heads=2; valid tp: 1, 2"),
    (8, ["parallel.pp=8"], "fewer than the 8 pipeline stages"),
    (4, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=4"],
     "fewer than the 8 pipeline stages"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "needs pp_virtual_stages >= 2"),
    (2, ["parallel.pp=2", "parallel.pp_virtual_stages=2"], "runs one stage per rank"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=3"], "pp_microbatches=3 but"),
    (2, ["parallel.pp=2", "train.micro_batch_size=16"], "cannot fill the pipeline: 1f1b needs at least 2 (one per "
                                                         "pipeline rank, pp=2"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "train.micro_batch_size=16"],  # 4 stages, 2 ranks: 2
     "cannot fill the pipeline: zbv needs at least 2 (one per pipeline rank"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "train.micro_batch_size=8"],
     "cannot fill the pipeline: dualpipev needs at least 4 (one per stage"),
    (8, ["train.micro_batch_size=4"], "not divisible by train.micro_batch_size=4 x 8"),
    (2, ["parallel.cp=2", "train.seq_len=30"], "train.seq_len=30 must be divisible by 4 (parallel.cp=2, 2 chunks"),
    (2, ["parallel.cp=2", "train.seq_len=30"], "use a multiple of 4 (e.g. 28 or 32)"),
    (3, ["parallel.cp=3", "parallel.cp_mode=ulysses", "train.seq_len=30"],  # (no hybrid of 3: none offered)
     "valid: [2, 4]; or keep this cp with cp_mode='ring'$"),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_balance=none", "train.seq_len=30"], "each cp rank's 15 "
     "tokens must split over parallel.tp=2 with sequence_parallel; train.seq_len=30 must be a multiple of 4 (e.g. 28 "
     "or 32; or parallel.sequence_parallel=false)"),
    (2, ["parallel.cp=2", "parallel.cp_balance=none", "train.seq_len=31"], "divisible by 2 (parallel.cp=2, one chunk"),
    (4, ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=4"], "valid: [2]"),
    (4, ["parallel.cp=4", "parallel.cp_mode=hybrid"], "needs parallel.cp_ulysses to divide parallel.cp=4"),
    (4, ["parallel.cp=4", "parallel.cp_ulysses=2"], "applies to cp_mode='hybrid' only (here cp_mode='ring'"),
    (8, ["parallel.cp=8", "parallel.cp_mode=ulysses"], "parallel.cp=8 splits the 4 attention heads per tp rank "
     "(n_heads=4 / tp=1) over 8 Ulysses ranks: they must divide evenly; valid: [2, 4]; or keep this cp with "
     "cp_mode='ring'"),
    (8, ["parallel.cp=4", "parallel.tp=2", "parallel.cp_mode=ulysses"], "parallel.cp=4 splits the 2 attention heads "
     "per tp rank (n_heads=4 / tp=2) over 4 Ulysses ranks: they must divide evenly; valid: [2]"),
    (16, ["parallel.cp=8", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=4", "parallel.tp=2"],
     "parallel.cp_ulysses=4 splits the 2 attention heads per tp rank (n_heads=4 / tp=2) over 4 Ulysses ranks: they "
     "must divide evenly; valid: [2]"),
    (2, ["parallel.ep=2"], "parallel.ep=2 needs a mixture-of-experts model; this model is dense"),
    (2, ["parallel.tp=2", "train.seq_len=33"], "must be divisible by parallel.tp=2"),
    (2, ["memory.cpu_offload=true", "parallel.zero=1"], "zero=1 keeps parameters replicated"),
    (1, ["memory.cpu_offload=true", "parallel.zero=1"], "zero=1 keeps parameters replicated"),
    (4, ["parallel.dp_shard=2"], "or set parallel.dp_shard=-1"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "memory.activation_checkpoint=op"],
     "memory.activation_checkpoint='op' with parallel.pp_schedule='zbv': its split backward"),
    (4, ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "memory.activation_checkpoint=full",
         "train.micro_batch_size=2"], "recomputed in every weight-gradient group"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=4"],
     "lower parallel.pp or parallel.pp_virtual_stages"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "memory.activation_checkpoint=selective"],
     "use activation_checkpoint=none, or pp_schedule interleaved_1f1b"),
    # Each way out is one that can work (4 layers here; pp=2, the least pipeline: the test below)
    (4, ["parallel.pp=4", "parallel.pp_schedule=dualpipev", "train.micro_batch_size=1"],
     "(pp=4 x 2 per rank); lower parallel.pp, or use a schedule of one stage per rank"),
    (8, ["train.micro_batch_size=4", "train.global_batch_size=16"], "use a multiple of 32, lower "
                                                                    "train.micro_batch_size (one dividing 2), or"),
    (8, ["train.micro_batch_size=4", "train.global_batch_size=8"], "use a multiple of 32, lower "
                                                                   "train.micro_batch_size to 1, or"),
    (2, ["parallel.cp=2", "train.seq_len=30"], "or set parallel.cp_balance='none' (one chunk per rank"),
])
def test_invalid_layouts(world, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        layout_for(world, *overrides)


@pytest.mark.parametrize("world, overrides, message", [
    (4, ["model.preset=tiny-moe", "parallel.ep=3", "parallel.dp_shard=3", "parallel.dp_replicate=1"],
     "does not match the world size 4"),
    (6, ["model.preset=tiny-moe", "parallel.ep=3", "parallel.dp_shard=6"], "x tp=1 must divide the 8 experts"),
    # the valid values name only those the world's dp_shard x cp ranks can lend (ep 4 and 8 cannot, of 6)
    (6, ["model.preset=tiny-moe", "parallel.ep=3", "parallel.dp_shard=6"], "dp_shard x cp = 6: 1, 2"),
    # ep 2 would take half of the 4 cp ranks: ep borrows none or all of them
    (4, ["model.preset=tiny-moe", "parallel.ep=2", "parallel.cp=4", "parallel.dp_shard=1"],
     "would borrow part of the cp ranks, which is not built: ep must divide dp_shard or be a multiple of cp; "
     "valid ep: 4"),
    # ... holding whole experts: of 6, ep 4 (which cp=4 would take whole) is not offered
    (4, ["model.preset=tiny-moe", "moe.num_experts=6", "parallel.ep=2", "parallel.cp=4", "parallel.dp_shard=1"],
     "which is not built: ep must divide dp_shard or be a multiple of cp; valid ep: none"),
    (4, ["model.preset=tiny-moe", "parallel.ep=4", "parallel.cp=2", "parallel.dp_shard=1", "parallel.tp=2"],
     "parallel.ep=4 must divide dp_shard x cp = 2 (expert parallelism borrows those ranks); valid: 1, 2"),
    # the valid ones hold whole experts too: of 6 experts at tp 2, ep 2 (6 % 4) is not offered
    (4, ["model.preset=tiny-moe", "moe.num_experts=6", "parallel.tp=2", "parallel.ep=4", "parallel.dp_shard=2"],
     "parallel.ep=4 must divide dp_shard x cp = 2 (expert parallelism borrows those ranks); valid: 1"),
    (4, ["model.preset=tiny-moe", "moe.num_experts=6", "parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=2"],
     "parallel.ep=2 x tp=2 must divide the 6 experts"),
    # capacity counted on a cp rank's slice would drop other tokens than one process drops
    (2, ["model.preset=tiny-moe", "moe.capacity_factor=1.25", "parallel.cp=2", "parallel.dp_shard=1"],
     "moe.capacity_factor=1.25 with parallel.cp=2 is not built: each cp rank would drop tokens by its own slice"),
    (2, ["model.preset=tiny-moe", "moe.top_k=9"], "moe top_k=9 must be in 1..n_experts=8"),
    (1, ["moe.top_k=2"], "missing moe.num_experts, moe.expert_ffn_dim"),
    # not MoE, but read from the shape as these are: a tp-cut bias leaves ZeRO-1 nothing to cut
    (4, ["model.qkv_bias=1", "parallel.zero=1", "parallel.tp=2"],
     "parallel.zero=1 with parallel.tp=2 and q/k/v biases"),
])
def test_invalid_moe_layouts(world, overrides, message):
    """Mixture-of-experts shapes and layouts, checked as a launch checks them (preset + [moe])."""
    cfg = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=2", "train.seq_len=32",
                             *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        preflight(cfg, world, 512)


@pytest.mark.parametrize("world, overrides", [
    (4, ["parallel.zero=1", "parallel.tp=2"]),
    (4, ["parallel.zero=1", "parallel.pp=2"]),
    (8, ["parallel.zero=1", "parallel.tp=2", "parallel.pp=2"]),
    (8, ["parallel.zero=1", "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"]),
    (2, ["parallel.zero=1", "parallel.cp=2"]),
    (8, ["parallel.zero=1", "parallel.cp=2", "parallel.dp_shard=2", "parallel.tp=2"]),
])
def test_zero1_composes_with_tp_and_pp(world, overrides):
    lay = layout_for(world, *overrides)
    assert lay.dp_mode == "zero1" and lay.world == world
    assert layouts.first_problem(lay, layouts.Job(ARGS, 32, 16), runnable=True) is None


@pytest.mark.parametrize("world, overrides", [
    (2, ["parallel.cp=2", "parallel.ep=2", "parallel.dp_shard=1"]),  # ep borrows every cp rank
    (4, ["parallel.cp=2", "parallel.ep=4", "parallel.dp_shard=2", "parallel.zero=2"]),  # ep: 2 of dp_shard x cp
    (8, ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2", "parallel.ep=4",
         "parallel.dp_shard=2"]),
])
def test_ep_borrowing_cp_ranks_is_built(world, overrides):
    cfg = load_config(None, ["model.preset=tiny-moe", "train.global_batch_size=16", "train.micro_batch_size=2",
                             "train.seq_len=32", *overrides])
    lay = preflight(cfg, world, 512).layout
    assert lay.ep > 1 and lay.ep_borrows_cp  # ep does not divide dp_shard: it takes cp ranks


@pytest.mark.parametrize("world, overrides", [
    (2, ["parallel.ep=2"]),
    (4, ["parallel.tp=2"]),
    (8, ["parallel.ep=2", "parallel.tp=2"]),
    (8, ["parallel.ep=2", "parallel.pp=2", "parallel.dp_replicate=2"]),
])
def test_zero1_composes_with_ep_and_tp_for_moe(world, overrides):
    cfg = load_config(None, ["model.preset=tiny-moe", "parallel.zero=1", "train.global_batch_size=16",
                             "train.micro_batch_size=2", "train.seq_len=32", *overrides])
    assert preflight(cfg, world, 512).layout.dp_mode == "zero1"


@pytest.mark.parametrize("world, overrides, mode, described, without", [
    (1, [], "fsdp", "fsdp:1+offload", "single"),  # one GPU: FSDP2 over a one-rank shard dimension
    (1, ["parallel.zero=2"], "zero2", "zero2:1+offload", "single"),
    (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], "hsdp", "hsdp2x1+offload", "ddp"),  # shard 1
    (2, ["parallel.tp=2", "run.device=cpu"], "fsdp", "fsdp:1+offload", "single"),  # CPU: checks the path only
    (2, ["parallel.cp=2"], "fsdp", "fsdp:cp2+offload", "fsdp"),
    (2, [], "fsdp", "fsdp:2+offload", "fsdp"),
])
def test_cpu_offload_is_fsdp_at_any_shard_degree(world, overrides, mode, described, without):
    lay = layout_for(world, "memory.cpu_offload=true", *overrides)
    assert lay.offload_fsdp and lay.dp_mode == mode and described in lay.describe()
    assert layouts.first_problem(lay, layouts.Job(ARGS, 32, 16), runnable=True) is None
    assert layout_for(world, *overrides).dp_mode == without


def test_too_few_layers_for_a_v_shaped_pp_2_is_not_told_to_lower_pp():
    """pp=2 is the least pipeline: "lower parallel.pp" could not help 3 layers, 1f1b can."""
    with pytest.raises(ConfigError, match=r"\(pp=2 x 2 per rank\); use a schedule of one stage per rank "
                                          r"\(parallel.pp_schedule=1f1b or gpipe, pp_virtual_stages=1\)$"):
        layout_for(2, "parallel.pp=2", "parallel.pp_schedule=zbv", args=dataclasses.replace(ARGS, n_layers=3))


def test_tp_must_divide_the_mlp():
    with pytest.raises(ConfigError, match=r"must divide ffn_dim=130 \(the MLP is split by columns\); valid tp: 1, 2$"):
        layout_for(4, "parallel.tp=4", args=dataclasses.replace(ARGS, n_kv_heads=4, ffn_dim=130))


def test_a_sequence_tp_cannot_split_names_the_lengths_near_it_and_the_way_out():
    lay = Layout(tp=2)
    assert layouts.first_problem(lay, layouts.Job(ARGS, 255, 16))[1] == (
        "train.seq_len=255 must be divisible by parallel.tp=2 with sequence_parallel (e.g. 254 or 256; or "
        "parallel.sequence_parallel=false)")
    assert layouts.first_problem(dataclasses.replace(lay, sequence_parallel=False), layouts.Job(ARGS, 255, 16)) is None


def test_the_length_cp_and_tp_both_cut_is_their_common_multiple():
    """cp 2 (zigzag: 4 chunks) x tp 4 was told "a multiple of 16 (e.g. 16 or 32)", where 24 runs."""
    job = layouts.Job(dataclasses.replace(ARGS, n_kv_heads=4), 20, 16)
    said = layouts.first_problem(Layout(cp=2, tp=4), job)[1]
    assert "train.seq_len=20 must be a multiple of 8 (e.g. 16 or 24;" in said, said
    assert layouts.first_problem(Layout(cp=2, tp=4), dataclasses.replace(job, seq_len=24)) is None


def test_tps_sequence_and_loss_parallelism_show_in_the_layout_where_off():
    """Both off priced 66 GiB where both on priced 39 (llama3-8b, tp 8), and the log read "tp8" for both."""
    assert Layout(tp=2).describe().startswith("tp2 ")
    assert Layout(tp=2, sequence_parallel=False).describe().startswith("tp2(no-sp) ")
    assert Layout(tp=2, sequence_parallel=False, loss_parallel=False).describe().startswith("tp2(no-sp,no-lp) ")
    assert Layout(tp=1, sequence_parallel=False).describe().startswith("tp1 ")  # (nothing to split at tp 1)


def test_interleaved_rounds_follow_torchs_rule():
    # torch runs n micro-batches in max(1, n // pp) rounds and needs n to be a multiple of them.
    def problem(pp, m):
        lay = Layout(pp=pp, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=m)
        return layouts.first_problem(lay, layouts.Job(PRESETS["llama3-8b"], 4096, m))

    assert problem(4, 8) is None and problem(4, 6) is None and problem(4, 10) is None
    assert "multiple of the 2 rounds" in problem(4, 9)[1]
    # The way out names the key's values, not micro-batch counts (2 dp ranks x 2 sequences a micro-batch).
    lay = Layout(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=9, dp_shard=2,
                 micro_batch_size=2)
    assert "set train.global_batch_size=32 or 48 (8 or 12 micro-batches)" in layouts.first_problem(
        lay, layouts.Job(PRESETS["llama3-8b"], 4096, 36))[1]


def test_tied_embeddings_run_with_every_pipeline_layout():
    tied = dataclasses.replace(ARGS, tie_embeddings=True)
    assert layout_for(2, "parallel.tp=2", args=tied).tp == 2  # one vocab-sharded weight for both ends
    ends = layouts.pipeline_ranks(tied, 2, 1, "1f1b")
    assert layout_for(2, "parallel.pp=2", args=tied).pp == 2 and ends[0].first and ends[-1].last
    assert not ends[0].last  # the ends on two ranks: the last holds a copy
    assert layout_for(8, "parallel.pp=2", "parallel.tp=2", args=tied).dp_shard == 2  # x FSDP 2
    zbv = layout_for(4, "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=zbv", args=tied)
    first = layouts.pipeline_ranks(tied, 2, zbv.pp_virtual_stages, "zbv")[0]
    assert first.first and first.last  # one rank holds both ends
    for dp in ("parallel.dp_shard=2", "parallel.dp_replicate=2"):  # both, as two FSDP units' parameters
        layout_for(4, "parallel.pp=2", "parallel.pp_schedule=dualpipev", dp, args=tied)


def test_layer_split_balances_the_output_head():
    assert layouts.split_layers(8, 4, 0.0) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # a heavy head (big vocabulary) leaves the last stage fewer blocks
    assert layouts.split_layers(8, 2, 2.0) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert all(layouts.split_layers(16, 5, 1.5))  # every stage keeps a block


def test_stage_placement():
    assert layouts.stages_of_rank(1, pp=4, virtual=2, schedule="interleaved_1f1b") == [1, 5]
    assert layouts.stages_of_rank(1, pp=4, virtual=2, schedule="zbv") == [1, 6]
    assert layouts.stages_of_rank(0, pp=2, virtual=1, schedule="1f1b") == [0]
    ranks = layouts.pipeline_ranks(PRESETS["llama3-8b"], 2, 2, "zbv")
    assert ranks[0].stages == (0, 3) and ranks[0].first and ranks[0].last
    assert sorted(i for r in ranks for i in r.layer_ids) == list(range(32))


# ---- the trainer, --dry-run and the planner agree -------------------------------------

SHAPES = [PRESETS["llama3-8b"], PRESETS["llama3.2-1b"], ARGS, dataclasses.replace(ARGS, n_layers=6, ffn_dim=96),
          dataclasses.replace(ARGS, tie_embeddings=True, n_heads=8, n_kv_heads=8, ffn_dim=120)]


def random_case(rng: random.Random):
    """A layout of up to 4096 ranks with every degree and schedule, valid or not."""
    pick = rng.choice
    schedule = pick(PP_SCHEDULES)
    pp = pick([1, 1, 2, 4, 8, 16])
    virtual = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}.get(schedule, pick([2, 3, 4]))
    if rng.random() < 0.1:
        virtual = pick([1, 2, 3])  # sometimes wrong for the schedule
    if pp > 1 and schedule in ("zbv", "dualpipev") and virtual == 1:
        virtual = 2  # what a config's pp_virtual_stages=1 resolves to for a V shape: keep the round trip
    lay = Layout(dp_replicate=pick([1, 1, 2, 4]), dp_shard=pick([1, 2, 4, 8, 16, 32]), zero=pick([1, 2, 3]),
                 tp=pick([1, 2, 3, 4, 8]), pp=pp, cp=pick([1, 1, 1, 2]), ep=pick([1, 1, 1, 2]),
                 sequence_parallel=pick([True, False]), loss_parallel=pick([True, False]), pp_schedule=schedule,
                 pp_virtual_stages=virtual, activation_checkpoint=pick(["none", "full", "selective", "op"]),
                 cpu_offload=rng.random() < 0.1, micro_batch_size=pick([1, 2, 4]))
    shape = pick(SHAPES)
    seq_len = pick([32, 96, 128, 4096, 30])  # 30: not divisible into 2 cp x 2 zigzag chunks
    global_batch = lay.dp * lay.micro_batch_size * pick([1, 2, 3, 4, 8, 16]) + pick([0, 0, 0, 0, 1])
    n_mb = max(lay.micro_batches(global_batch), 1)
    if pp > 1:  # without pp the layout holds 1, as resolve() gives
        lay = dataclasses.replace(lay, pp_microbatches=n_mb if rng.random() < 0.9 else pick([1, 3, 5]))
    return lay, shape, seq_len, global_batch


def as_config(lay: Layout, shape: ModelArgs, seq_len: int, global_batch: int) -> Config:
    """The config file a user would write for this layout (pp_microbatches=0 where it is derived)."""
    cfg = Config()
    derived = lay.pp > 1 and lay.pp_microbatches == lay.micro_batches(global_batch)
    for key in ("dp_replicate", "dp_shard", "zero", "tp", "pp", "cp", "ep", "sequence_parallel",
                "loss_parallel", "pp_schedule", "pp_virtual_stages"):
        setattr(cfg.parallel, key, getattr(lay, key))
    cfg.parallel.pp_microbatches = 0 if derived or lay.pp == 1 else lay.pp_microbatches
    cfg.memory.activation_checkpoint, cfg.memory.cpu_offload = lay.activation_checkpoint, lay.cpu_offload
    cfg.train.seq_len, cfg.train.global_batch_size = seq_len, global_batch
    cfg.train.micro_batch_size = lay.micro_batch_size
    m = cfg.model
    m.preset, m.dim, m.n_layers, m.n_heads, m.n_kv_heads = "tiny", shape.dim, shape.n_layers, shape.n_heads, \
        shape.kv_heads
    m.ffn_dim, m.vocab_size, m.tie_embeddings = shape.ffn_dim, shape.vocab_size, int(shape.tie_embeddings)
    m.head_dim = shape.head_size
    cfg.run.device = "cuda"  # the layout is for GPUs; the machine check is the launch's, not the layout's
    return cfg


def test_dry_run_and_planner_give_the_same_verdict_on_random_layouts():
    rng = random.Random(0)
    seen = {"valid": 0, "invalid": 0}
    keys = set()
    for _ in range(400):
        lay, shape, seq_len, global_batch = random_case(rng)
        precision = rng.choice(["bf16", "bf16", "fp8"])
        if float8.config_problem(precision, lay.pp, lay.pp_schedule):  # fp8 x zbv on torch < 2.13: not a layout's
            precision = "bf16"
        cfg = as_config(lay, shape, seq_len, global_batch)
        cfg.train.precision = precision
        try:
            launch = preflight(cfg, lay.world, tokenizer_vocab=256)  # what the trainer and --dry-run call
            launch_verdict = None
        except ConfigError as e:
            launch, launch_verdict = None, str(e)
        work = Workload(dataclasses.replace(PRESETS["tiny"], **_shape_fields(shape)), seq_len, global_batch, precision)
        planner = layout_problem(work, lay, runnable=True)
        assert (planner[1] if planner else None) == launch_verdict == runnable_problem(work, lay), lay
        if launch is not None:
            assert launch.layout == lay  # the config round-trips to the same resolved layout
        seen["valid" if planner is None else "invalid"] += 1
        keys.add(planner[0] if planner else "ok")
    assert seen["valid"] >= 20 and seen["invalid"] >= 100, seen
    assert {"tp", "pp", "batch", "cp", "ep", "offload", "ok"} <= keys, keys


def _shape_fields(shape: ModelArgs) -> dict:
    return {"dim": shape.dim, "n_layers": shape.n_layers, "n_heads": shape.n_heads, "n_kv_heads": shape.kv_heads,
            "ffn_dim": shape.ffn_dim, "vocab_size": shape.vocab_size, "tie_embeddings": shape.tie_embeddings,
            "head_dim": shape.head_size}


# ---- train --dry-run ----------------------------------------------------------------


@pytest.mark.parametrize("extra, says", [
    (["--parallel.ep=2"], "8 routed, top-2, dropless, 1 shared; 4 a rank over ep=2 (tokens reach them by all-to-all); "
                          "their weights cut over efsdp=2 rank(s)"),
    (["--parallel.ep=2", "--parallel.zero=1", "--moe.capacity_factor=1.25"],
     "capacity x1.25, 1 shared; 4 a rank over ep=2 (tokens reach them by all-to-all); their optimizer states cut over "
     "efsdp=2 rank(s)"),
    (["--parallel.ep=4"], "2 a rank over ep=4 (tokens reach them by all-to-all)\n"),
    ([], "not split by expert (parallel.ep=1): laid out as the other weights\n"),
])
def test_dry_run_says_where_the_experts_live(capsys, tmp_path, extra, says):
    """The layout line said "ep8" alone: not how many experts a rank holds, nor what their weights are cut over."""
    assert main(["train", "--dry-run", "--world-size", "4", f"--run.dir={tmp_path / 'run'}", "--model.preset=tiny-moe",
                 "--train.micro_batch_size=2", *extra]) == 0
    out = capsys.readouterr().out
    assert "experts   8 routed, top-2, " in out and says in out, out


def test_a_misfit_the_dense_document_mask_makes_names_what_shrinks_it(capsys, tmp_path):
    """Under Ulysses the s x s mask is whole on every rank: the misfit line's ways (checkpointing, a chunked
    loss, more cp) left it at 16 GiB; a ring, or no document mask, is what fits."""
    common = ["train", "--dry-run", "--world-size", "2", f"--run.dir={tmp_path / 'run'}", "--run.device=cpu",
              "--parallel.cp=2", "--train.seq_len=65536", "--train.global_batch_size=2", "--train.micro_batch_size=1"]
    assert main([*common, "--parallel.cp_mode=ulysses"]) == 1
    assert ("the dense s x s document mask takes 16.00 GiB of it, whole on each rank but under a ring: "
            "parallel.cp_mode=ring builds it") in capsys.readouterr().out
    assert main([*common, "--parallel.cp_mode=ring"]) == 0
    assert "document mask takes" not in capsys.readouterr().out
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'gpu'}", "--gpu", "h100-sxm", "--train.attention=sdpa",
                 "--train.seq_len=65536", "--train.global_batch_size=16", "--train.micro_batch_size=16"]) == 1
    said = capsys.readouterr().out  # (one rank: no ring to switch to; on a GPU flex or varlen needs no mask)
    assert "parallel.cp=N with parallel.cp_mode=ring builds it" in said and "train.attention=flex or varlen" in said
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'big'}", "--run.device=cpu", "--model.preset=llama3-70b",
                 "--train.seq_len=256"]) == 1  # (a misfit of the weights: no word of the mask)
    assert "document mask takes" not in capsys.readouterr().out


def test_dry_run_prints_the_layout_placement_and_memory_and_touches_nothing(capsys, tmp_path):
    run = tmp_path / "run"
    code = main(["train", "--dry-run", "--world-size", "512", f"--run.dir={run}", "--model.preset=llama3-8b",
                 "--parallel.tp=8", "--parallel.pp=4", "--parallel.pp_schedule=interleaved_1f1b",
                 "--parallel.pp_virtual_stages=2", "--train.seq_len=8192", "--train.global_batch_size=512",
                 "--train.micro_batch_size=1", "--train.precision=bf16", "--train.compile=true", "--gpu", "h100-sxm"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tp8 pp4(interleaved_1f1b v2 m32) fsdp:16" in out
    assert "a tp group is 8 consecutive ranks (one node's, where tp divides a node's GPUs)" in out  # (NVLink's)
    assert "compile   each transformer block whole; the loss eager (loss parallelism)" in out
    assert "pp rank 0: stages [0, 4]" in out and "+ embedding" in out and "+ output" in out
    assert "on the busiest rank on h100-sxm" in out and "fits" in out
    assert "the model's vocabulary of 128,256 rows is far past the tokenizer's 4,096 tokens" in out  # (a preset's)
    assert "or data.vocab_size=128256 for a BPE trained up to that size" in out
    assert re.search(r"MFU \d+\.\d%, pipeline bubble \d+\.\d% of the step", out), out  # (which schedule: its cost)
    assert "(train.compile priced: blocks as compiled (fused element-wise work, the compiler's saved set), the " \
           "loss eager (loss parallelism)" in out
    assert not run.exists()


def test_a_dry_run_without_a_world_size_says_how_to_give_one(capsys, tmp_path, monkeypatch):
    """"with 1 processes it must be one of 1": the dry run checked one process, and did not say that
    --world-size gives the launch's; with it given (or $WORLD_SIZE) the message is the launch's own."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--parallel.tp=2", "--parallel.dp_shard=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not match the world size 1" in err and "give --world-size N for the launch's" in err, err
    assert main([*argv, "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "does not match the world size 4" in err and "--world-size" not in err, err


def test_a_dry_run_whose_memory_estimate_does_not_fit_exits_1(capsys, tmp_path):
    """`shardline train --dry-run && torchrun ...` must not go on to a launch the planner sees
    running out of memory; the report is printed all the same."""
    argv = ["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--config", "configs/llama3.2-1b-gpu.toml"]
    assert main(argv) == 0
    assert main([*argv, "--train.micro_batch_size=8"]) == 1
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "memory estimate does not fit the device (exit 1)" in err
    assert "lower train.micro_batch_size" in err and "parallel.tp or parallel.cp" in err
    assert "DOES NOT FIT; were it to fit, " in out and "DOES NOT FIT; predicted" not in out  # (no speed it runs at)
    assert "or offload (memory.cpu_offload)" in err
    # ... not where it is on already, nor on a CPU, where the host's memory is the device's
    outs = []
    for more in (["--memory.cpu_offload=true", "--parallel.dp_shard=1"], ["--run.device=cpu"], ["--gpu", "cpu"]):
        assert main([*argv, "--train.micro_batch_size=8", "--train.seq_len=65536", *more]) == 1
        out, err = capsys.readouterr()
        assert "does not fit" in err and "offload" not in err.split("(exit 1)")[1], err
        outs.append(out)
    # the offloaded states are on the memory line too: the verdict on the host's memory counts them
    assert "; offloaded to the host " in outs[0] and "optimizer 0.00" in outs[0] and "offloaded" not in outs[1]
    # at one sequence a micro-batch, lowering it is no advice
    assert main([*argv, "--train.micro_batch_size=1", "--train.seq_len=65536", "--train.global_batch_size=64"]) == 1
    assert "lower train.micro_batch_size" not in capsys.readouterr().err
    assert main([*argv, "--train.micro_batch_size=8", "--gpu", "h200", "--train.loss_chunk_tokens=4096",
                 "--memory.activation_checkpoint=full"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="says what a machine without a GPU checks")
def test_a_dry_run_on_a_machine_without_a_gpu_says_it_checked_a_cuda_launch(capsys, tmp_path):
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}"]) == 0
    cuda = capsys.readouterr().out
    assert "(as a CUDA launch: run.device=auto, and this machine has no GPU" in cuda.splitlines()[0]
    assert "predicted" in cuda and "uncalibrated guess" not in cuda  # (an assumed H100: its datasheet's speeds)
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--run.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "as a CUDA launch" not in out
    # A CPU's predicted speed is a guess, often a few times off this host's: said beside it.
    (line,) = [x for x in out.splitlines() if "predicted" in x]
    assert "this CPU's speed is an uncalibrated guess" in line and "shardline calibrate" in line


def test_an_fp8_dry_run_on_a_cpu_prices_its_gemms_at_bf16(capsys, tmp_path):
    """The trainer runs fp8 on a CPU (torchao's emulation); the dry run's estimate has no fp8 peak
    there and refused the launch with an error naming no config key."""
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--train.precision=fp8",
                 "--run.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "on the busiest rank on cpu" in out
    assert "params: autocast's 16-bit weight copies alive at the peak (none in fp32;" in out


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "6", "--parallel.tp=4"], "does not divide the world size 6"),
    (["--world-size", "3", "--parallel.tp=3"], "must divide n_heads=8"),
    (["--model.preset=gpt5"], "model.preset='gpt5' is invalid: one of tiny, llama3.2-1b"),
    (["--data.path=/no/such/corpus"], "data.path='/no/such/corpus' does not exist"),
    (["--resume"], "holds no valid checkpoint"),
    (["--model.init_from=/no/such/ck"], "model.init_from='/no/such/ck' does not exist or is not a folder"),
    (["--world-size", "2", "--anomaly.check_on=device", "--anomaly.action=rollback"],
     "anomaly.check_on='device' is not possible here: anomaly.action is not skip"),
    (["--memory.cpu_offload=true", "--parallel.zero=1", "--world-size", "2"], "zero=1 keeps parameters replicated"),
    (["--world-size", "2", "--parallel.cp=2", "--train.seq_len=250"], "train.seq_len=250 must be divisible by 4"),
    (["--world-size", "2", "--parallel.cp=2", "--parallel.cp_mode=spiral"], "parallel.cp_mode='spiral' is invalid"),
    (["--world-size", "64", "--train.global_batch_size=8"],  # (a long-context run: cp takes the ranks batch cannot)
     "use a multiple of 512, or give ranks to parallel.tp, cp or pp, which leaves fewer to data parallelism"),
])
def test_dry_run_fails_as_a_launch_would(capsys, tmp_path, argv, message):
    code = main(["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_dry_run_checks_a_mixture_and_a_resume_as_the_launch_does(capsys, tmp_path, tiny_config):
    """Raw sources mixed without one tokenizer; a resume whose batch size, seq_len (which the launch
    finds in the count of sequences) or skipped batches the config contradicts; a vocabulary with
    gaps sized as the launch sizes it (one past its largest id)."""
    from tokenizers import Tokenizer, models

    from shardline.trainer import Trainer

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("some words of text\n" * 50)
    mix = f'--data.mix=[{{path="{tmp_path / "a.txt"}"}}, {{path="{tmp_path / "b.txt"}"}}]'
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'new'}", mix]) == 2
    assert "data.mix of raw files needs one tokenizer for all" in capsys.readouterr().err
    gone = f'--data.mix=[{{path="{tmp_path / "a.txt"}"}}, {{path="{tmp_path / "gone.txt"}"}}]'  # said first
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'new'}", gone]) == 2
    assert f"data.mix[1].path='{tmp_path / 'gone.txt'}' does not exist" in capsys.readouterr().err

    cfg = tiny_config("train.steps=2", "checkpoint.interval=2", "train.eval_interval=0")
    Trainer(cfg).build().train()
    base = ["train", "--dry-run", f"--run.dir={cfg.run.dir}", *(f"--{o}" for o in _tiny_args(cfg))]
    assert main(base) == 0 and "resumes from" in capsys.readouterr().out
    for extra, message in (("--train.global_batch_size=16", "was saved with train.global_batch_size=8"),
                           (f"--train.seq_len={cfg.train.seq_len // 2}", f"saved at train.seq_len={cfg.train.seq_len}; "
                                                                         f"this run has {cfg.train.seq_len // 2}"),
                           ("--train.skip_batches=[1]", "train.skip_batches=[1] names batches already trained on")):
        assert main([*base, extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    # A named checkpoint is checked as the load checks it: a folder without a manifest, and a
    # damaged trainer file (an UnpicklingError traceback before), are one line.
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk" / "trainer").mkdir(parents=True)
    (tmp_path / "junk" / "trainer" / "rank0.pt").write_bytes(b"not a pickle")
    for named, message in ((tmp_path / "empty", "holds no checkpoint (no manifest.json)"),
                           (tmp_path / "junk", "holds no checkpoint (no manifest.json)")):
        assert main([*base, "--resume", str(named)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err

    gapped = tmp_path / "gapped.json"
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 7_000}, unk_token="[UNK]")).save(str(gapped))
    assert main(["train", "--dry-run", f"--run.dir={tmp_path / 'new'}", f"--data.tokenizer={gapped}",
                 "--model.vocab_size=5000"]) == 2
    assert "smaller than the tokenizer's 7001 tokens" in capsys.readouterr().err


def _tiny_args(cfg: Config) -> list[str]:
    """The overrides that give `cfg`'s model, batch and data."""
    return [f"model.{k}={getattr(cfg.model, k)}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")] + [
        f"train.{k}={getattr(cfg.train, k)}" for k in ("seq_len", "global_batch_size", "micro_batch_size", "steps")] + [
        f"data.path={cfg.data.path}", "train.eval_interval=0", "checkpoint.interval=2"]


def test_cli_mistakes_found_before_any_work_are_one_line(capsys, tmp_path, small_prepared):
    """A run dir that is a file, a prepared folder too small for one sequence, a --gpus below 1,
    a calibration profile that could not be written after minutes of measuring, a slow factor
    that would disable or break the check: each one line, exit 2, before anything runs."""
    (tmp_path / "a-file").write_text("x")
    cases = [
        (["train", "--dry-run", f"--run.dir={tmp_path / 'a-file'}"], "run.dir="),
        (["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={small_prepared}",
          "--train.seq_len=1000000", "--model.preset=tiny"], "too few for one sequence of train.seq_len=1000000"),
        (["estimate", "--config", str(REPO / "configs" / "tiny.toml"), "--gpu", "h100-sxm", "--gpus", "0"],
         "--gpus 0 must be >= 1"),
        (["calibrate", "--out", str(tmp_path / "no" / "such" / "x.toml")], "cannot be written"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("shardline: error:") and message in err, (argv, err)
    for factor in ("0", "-1", "nan", "1"):
        with pytest.raises(SystemExit) as stop:
            main(["check", "--slow-factor", factor])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"{factor!r} is not a number > 1" in err and err.startswith("shardline check: error:")
        assert len(err.strip().splitlines()) == 1  # no usage block above the message
    for argv in (["trian"], ["simulate", "--gpus", "x"], ["train", "--foo"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, argv


def test_a_launch_checks_its_layout_before_it_reads_the_data(tiny_config, tmp_path):
    """Reading and tokenizing raw data takes minutes on every rank: a batch the ranks cannot
    split (or a tp that does not divide the heads) is refused before, here with data.path
    pointing nowhere, so the layout's error is the one raised."""
    from shardline.trainer import Trainer

    cfg = tiny_config("train.global_batch_size=7", "train.micro_batch_size=2", f"data.path={tmp_path / 'none'}")
    with pytest.raises(ConfigError, match="train.global_batch_size=7 is not divisible"):
        Trainer(cfg).build()
    assert not (tmp_path / "run").exists()


def test_the_schedule_and_checkpointing_names_agree_everywhere_they_are_listed():
    """The config's names, the trainer's schedules, the planner's search and the stage placement:
    a schedule or AC mode added to one list and not the others would fail only at run time."""
    from shardline.config.sections import AC_MODES
    from shardline.layout.degrees import V_SHAPED
    from shardline.parallel.pipeline import SCHEDULES
    from shardline.planner.pipeline import VIRTUAL_STAGES
    from shardline.planner.search import AC_OPTIONS

    assert set(PP_SCHEDULES) == set(SCHEDULES) == set(VIRTUAL_STAGES)
    assert set(V_SHAPED) <= set(PP_SCHEDULES)
    assert {mode for mode, _ in AC_OPTIONS} == set(AC_MODES)


def test_dry_run_tokenizes_a_resume_whose_data_settings_changed_and_names_them(capsys, tmp_path, tiny_config,
                                                                               small_corpus, monkeypatch):
    """A dry run passed data changes (data.vocab_size, data.val_fraction) that the launch refused after
    tokenizing, and the refusals blamed [model] changes or data.tokenizer, which the user had not set.
    It also says what else the resume changes, and when nothing is left to train."""
    from shardline.errors import CheckpointError
    from shardline.trainer import Trainer

    raw = ["data.path=" + str(small_corpus), "data.vocab_size=512"]
    cfg = tiny_config("train.steps=4", "train.stop_at_step=2", "checkpoint.interval=2", "train.eval_interval=0", *raw)
    Trainer(cfg).build().train()
    base = ["train", "--dry-run", f"--run.dir={cfg.run.dir}", *(f"--{o}" for o in _tiny_args(cfg)),
            "--train.steps=4", *(f"--{o}" for o in raw)]
    for extra, message in (("data.vocab_size=300", "another shape (vocab_size=512 -> 300); a vocabulary follows the "
                                                   "tokenizer, and the data settings changed since it "
                                                   "(data.vocab_size=512 -> 300); set them back to resume it"),
                           ("data.val_fraction=0.2", "the data settings changed since it (data.val_fraction=0.01 -> "
                                                     "0.2): set them back")):
        assert main([*base, f"--{extra}"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        with pytest.raises(CheckpointError, match=re.escape(message)):  # the launch says the same
            Trainer(tiny_config("train.steps=4", "train.eval_interval=0", *raw, extra)).build()
    assert main([*base, "--train.precision=bf16", "--train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert "changed since it: train.steps 4 -> 2, train.precision 'fp32' -> 'bf16'" in out, out
    assert "lr of the next update" not in out  # (nothing left to train)
    assert "nothing to train: it is at step 2, the run ends at 2 (train.steps)" in out
    assert main([*base, "--world-size", "2"]) == 0  # (dp_shard=-1 hides a world's change in the config)
    assert "changed since it: world_size 1 -> 2" in capsys.readouterr().out
    import shardline.dry_run

    monkeypatch.setattr(shardline.dry_run, "saved_world_size", lambda path: 4)  # (saved on 4 ranks)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(base) == 0  # no world size given: no change claimed, the saved one said
    out = capsys.readouterr().out
    assert "world_size" not in out and "saved on 4 ranks (give --world-size N to check the launch's)" in out, out


@pytest.mark.parametrize(("world", "overrides", "label"), [
    (8, ["parallel.cp=2"], "cp2(ring zigzag) fsdp:4xcp2 "),  # FSDP shards over dp_shard x cp: 8 ranks
    (2, ["parallel.cp=2"], "cp2(ring zigzag) fsdp:cp2 "),
    (8, ["parallel.cp=2", "parallel.dp_replicate=2"], "hsdp2x2xcp2 "),
    (4, ["parallel.cp=2", "parallel.zero=1"], "zero1:2xcp2 "),
    (4, [], "tp1 fsdp:4 "),  # without cp, as before
    (8, ["parallel.cp=2", "parallel.zero=1", "parallel.dp_replicate=2"], "ddp2+zero1:2xcp2 "),  # (was zero1:2xcp2)
    (4, ["parallel.zero=1", "parallel.dp_replicate=4", "parallel.dp_shard=1"], "ddp4 "),  # nothing sharded: DDP
    (4, ["parallel.zero=2", "parallel.dp_replicate=2"], "hsdp2x2(zero2) "),  # (was hsdp2x2, as zero=3's)
    (4, ["parallel.zero=3", "parallel.dp_replicate=2"], "hsdp2x2 "),
])
def test_the_layout_label_counts_the_cp_ranks_fsdp_shards_over(world, overrides, label):
    """`fsdp:16` under cp 8 read as 16 shards where there were 128; `zero1:4xcp2` on 16 ranks hid
    ZeRO-1's 2 replicas, and HSDP's label was the same under zero=2 and zero=3."""
    assert label in layouts.resolve(load_config(None, overrides), world).describe()


def test_dry_run_compares_a_prepared_folders_tokens_with_the_resumed_checkpoint(capsys, tmp_path, tiny_config,
                                                                               small_corpus, small_prepared):
    """A folder prepared again from edited text, at the same settings: the launch refused it, the dry
    run passed it (a prepared folder's fingerprint is in its manifest: no tokenizing needed)."""
    from shardline.data.validation import digest, held_out
    from shardline.data.prepare import PrepareOptions, prepare
    from shardline.data.sources import read_documents
    from shardline.trainer import Trainer

    docs = read_documents(str(small_corpus))
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    options = dict(tokenizer=str(small_prepared / "tokenizer.json"), progress=False)
    prepare(PrepareOptions([str(text)], str(tmp_path / "prep"), **options))
    cfg = tiny_config(f"data.path={tmp_path / 'prep'}", "train.steps=2", "checkpoint.interval=2",
                      "train.eval_interval=0")
    Trainer(cfg).build().train()
    base = ["train", "--dry-run", f"--run.dir={cfg.run.dir}", *(f"--{o}" for o in _tiny_args(cfg)),
            "--train.steps=4", f"--data.path={tmp_path / 'prep'}"]
    assert main(base) == 0
    capsys.readouterr()
    held = set(held_out(map(digest, docs), 0.01).tolist())
    first, second = [i for i in range(len(docs)) if i not in held][:2]
    docs[first], docs[second] = docs[second], docs[first]
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(PrepareOptions([str(text)], str(tmp_path / "prep"), overwrite=True, **options))  # the same folder, edited
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "was trained on other data (tokens " in err and err.count("\n") == 1, err
    assert f"(files changed since: {tmp_path / 'prep'} (prepared again " in err, err  # (the folder, not its manifest)


def test_a_cpu_dry_run_whose_ranks_fit_alone_but_not_together_says_the_host(capsys, tmp_path, monkeypatch):
    """Its line read "total 0.6 of 23.5: DOES NOT FIT", a figure that fits: the ranks share the host."""
    from shardline.planner import hardware

    monkeypatch.setattr(hardware, "_host_memory_gib", lambda: 1.0)
    argv = ["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", "--run.device=cpu", "--world-size", "4",
            "--parallel.dp_shard=1", "--parallel.dp_replicate=4", "--train.micro_batch_size=2"]
    assert main(argv) == 1
    assert "DOES NOT FIT the host: 4 ranks share its 1.0 GiB (90% usable)" in capsys.readouterr().out


def test_a_dry_run_refuses_text_too_short_for_one_sequence(capsys, tmp_path):
    """The dry run, which does not tokenize raw text, said the launch checks passed for a file the
    launch refuses as too short: text shorter than a sequence even at a token a byte is refused."""
    (tmp_path / "tiny.jsonl").write_text('{"text": "hi there"}\n{"text": "bye"}\n', encoding="utf-8")
    argv = ["train", "--dry-run", f"--run.dir={tmp_path / 'run'}", f"--data.path={tmp_path / 'tiny.jsonl'}",
            "--train.eval_interval=0", "--data.val_fraction=0"]
    assert main([*argv, "--train.seq_len=64"]) == 2
    assert "has at most 19 training tokens (a token a byte, and its document markers): too few for one sequence " \
           "of train.seq_len=64" in capsys.readouterr().err
    assert main([*argv, "--train.seq_len=16"]) == 0  # (19 bytes may hold a sequence of 16: the launch judges)
