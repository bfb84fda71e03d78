"""Parity: every layout trains exactly like one process (same seed, same global batch).

Per-step losses within 1e-5 relative and final parameters within 1e-5, on real gloo
process groups. One spawn per world size runs its layouts one after another.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline.cli import main
from shardline.config import load_config
from shardline.trainer import Trainer
from tests.distributed.harness import (
    ALL_STEPS,
    PARITY_OVERRIDES,
    assert_same_grad_norms,
    assert_same_run,
    losses,
    run_world,
)

LAYOUTS_2 = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.loss_parallel=false"],
    "tp2_sp": ["parallel.tp=2", "parallel.loss_parallel=false"],
    "tp2_sp_lossparallel": ["parallel.tp=2"],
    "zero3_ac_full_foreach": ["parallel.dp_shard=2", "memory.activation_checkpoint=full",
                              "optim.implementation=foreach"],
    "zero3_ac_op_async_ckpt": ["parallel.dp_shard=2", "memory.activation_checkpoint=op", "checkpoint.mode=async"],
    "pp2_gpipe": ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp2_interleaved_v2": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"],
    "pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"],
    "pp2_dualpipev": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2"],
}
# Against a single-process run with tied input/output embeddings: under TP one
# vocab-sharded weight; under PP a copy on the last stage whose gradient is summed with
# the first stage's (1f1b), or one weight on the rank holding both ends (zbv).
TIED_2 = {
    "tp2_tied": ["parallel.tp=2", "model.tie_embeddings=1"],
    "pp2_1f1b_tied": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "model.tie_embeddings=1"],
    "pp2_zbv_tied": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
                     "model.tie_embeddings=1"],
}
# Tied resharding resume: a pipeline checkpoint (one tied weight in it) resumed under
# FSDP, and the other way round; and by the same pipeline, whose ranks hold different
# parameters (each must load its own optimizer groups' names, not the saving rank's).
TIED_RESHARD_2 = [
    ("tied_pp_to_fsdp", ["parallel.pp=2", "train.stop_at_step=2"], ["parallel.dp_shard=2"]),
    ("tied_fsdp_to_pp", ["parallel.dp_shard=2", "train.stop_at_step=2"], ["parallel.pp=2"]),
    ("tied_pp_resumed", ["parallel.pp=2", "train.stop_at_step=2"], ["parallel.pp=2"]),
]
# Plain DDP 4, ZeRO-3 over 4, ZeRO-1 over 2 x 2 replicas and FSDP 2 x PP 2 run as halves of the
# resharding resumes below (tp_to_ddp, zero3_to_*), which compare every step's loss, the
# evaluation and the final parameters; FSDP 2 x PP 2 also runs whole with tied embeddings.
LAYOUTS_4 = {
    "ddp_grad_accum": ["parallel.dp_replicate=4", "parallel.dp_shard=1", "train.micro_batch_size=1"],
    # ZeRO-1 with the fused AdamW gated by the device-side anomaly check (no host sync)
    "zero1_fused_device_check": ["parallel.dp_shard=4", "parallel.zero=1", "optim.implementation=fused",
                                 "anomaly.check_on=device"],
    # ZeRO-1 with TP / PP: states sharded over the dp group of each (tp, pp) coordinate,
    # gradients reduce-scattered by the optimizer, no DDP wrapper (parallel/zero1.py)
    "zero1_tp2": ["parallel.dp_shard=2", "parallel.zero=1", "parallel.tp=2"],
    "zero1_pp2": ["parallel.dp_shard=2", "parallel.zero=1", "parallel.pp=2"],
    "zero2": ["parallel.dp_shard=4", "parallel.zero=2"],
    "hsdp_2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "fsdp2_tp2_async_ckpt_foreach": ["parallel.dp_shard=2", "parallel.tp=2", "checkpoint.mode=async",
                                     "optim.implementation=foreach"],
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_virtual_stages=2"],
}
# Tied embeddings under PP composed with FSDP and TP; pp 4 sums over a pair of ranks.
# ZBV x FSDP (zero=3: the split backward's input pass sees the gathered weights): the rank
# holding both ends keeps a copy in its last stage's FSDP unit, summed in place; stopped and
# resumed (the copy's optimizer state saved once).
ZBV_FSDP_TIED = ["parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
                 "model.tie_embeddings=1"]
TIED_4 = {
    "fsdp2_pp2_tied": ["parallel.dp_shard=2", "parallel.pp=2", "model.tie_embeddings=1"],
    "tp2_pp2_tied": ["parallel.tp=2", "parallel.pp=2", "model.tie_embeddings=1"],
    "pp4_tied": ["parallel.pp=4", "model.tie_embeddings=1"],
}
LAYOUTS_8 = {
    "fsdp2_tp2_pp2": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2"],
    "zero1_tp2_pp2": ["parallel.dp_shard=2", "parallel.zero=1", "parallel.tp=2", "parallel.pp=2"],
}
ZERO1_TP_PP = ["zero1_tp2", "zero1_pp2", pytest.param("zero1_tp2_pp2", marks=pytest.mark.slow)]
# Resharding resume: the first half under one layout, the second under another.
RESHARD_4 = [
    ("zero3_to_tp", ["parallel.dp_shard=4", "train.stop_at_step=2", "checkpoint.mode=async"],
     ["parallel.dp_shard=2", "parallel.tp=2"]),
    ("tp_to_ddp", ["parallel.dp_shard=2", "parallel.tp=2", "train.stop_at_step=2"],
     ["parallel.dp_replicate=4", "parallel.dp_shard=1"]),
    ("zero3_to_pp", ["parallel.dp_shard=4", "train.stop_at_step=2"], ["parallel.dp_shard=2", "parallel.pp=2"]),
    ("zero1_to_tp", ["parallel.dp_shard=4", "parallel.zero=1", "train.stop_at_step=2"],
     ["parallel.dp_shard=2", "parallel.tp=2"]),
    ("zero3_to_zero1", ["parallel.dp_shard=4", "train.stop_at_step=2"],
     ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=1"]),
]
# Resharding resume across world sizes, one half in this process: a ZeRO-1 x TP2 checkpoint
# finished by one process, and a tied one-process checkpoint finished by ZeRO-1 x TP2 x PP2
# (which saves its last stage's tied copy's state under the embedding's name).
ZERO1_TO_SINGLE = "zero1_tp2_to_single"
SINGLE_TO_ZERO1 = "single_tied_to_zero1_tp2_pp2"
HALF = "train.stop_at_step=2"


def _base(corpus):
    return [*PARITY_OVERRIDES, f"data.path={corpus}"]


def _emit_zero1_tp2_pp2(corpus, path: Path) -> None:
    """What `shardline plan` ranks best for 8 CPU ranks with zero=1, tp=2, pp=2 pinned, as a config."""
    small = [o for o in PARITY_OVERRIDES if o.split(".")[0] in ("model", "optim", "data", "metrics")]
    code = main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "8", "--seq-len", "32", "--global-batch", "16",
                 "--fix", "zero=1,tp=2,pp=2", "--emit-config", str(path), f"--data.path={corpus}",
                 "--train.steps=2", "--checkpoint.interval=2", *(f"--{o}" for o in small)])
    assert code == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_prepared):
    run = tmp_path_factory.mktemp("reference")
    Trainer(load_config(None, [*_base(small_prepared), f"run.dir={run}"])).build().train()
    return run


@pytest.fixture(scope="module")
def reference_tied(tmp_path_factory, small_prepared):
    run = tmp_path_factory.mktemp("reference_tied")
    Trainer(load_config(None, [*_base(small_prepared), "model.tie_embeddings=1", f"run.dir={run}"])).build().train()
    return run


@pytest.fixture(scope="module")
def world2(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("world2")
    layouts = {**LAYOUTS_2, **TIED_2}
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in layouts.items()]
    tied = [*_base(small_prepared), "model.tie_embeddings=1"]
    for name, first, second in TIED_RESHARD_2:
        jobs += [(root / name, [*tied, *first]), (root / name, [*tied, *second])]
    run_world(2, jobs)
    return root


@pytest.fixture(scope="module")
def world4(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("world4")
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in {**LAYOUTS_4, **TIED_4}.items()]
    for name, first, second in RESHARD_4:
        jobs += [(root / name, [*_base(small_prepared), *first]), (root / name, [*_base(small_prepared), *second])]
    jobs.append((root / ZERO1_TO_SINGLE, [*_base(small_prepared), *LAYOUTS_4["zero1_tp2"], HALF]))
    jobs += [(root / "zbv_fsdp_tied", [*_base(small_prepared), *ZBV_FSDP_TIED, HALF]),
             (root / "zbv_fsdp_tied", [*_base(small_prepared), *ZBV_FSDP_TIED])]
    run_world(4, jobs)
    Trainer(load_config(None, [*_base(small_prepared), f"run.dir={root / ZERO1_TO_SINGLE}"])).build().train()
    return root


@pytest.fixture(scope="module")
def world8(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("world8")
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in LAYOUTS_8.items()]
    tied = [*_base(small_prepared), "model.tie_embeddings=1"]
    Trainer(load_config(None, [*tied, HALF, f"run.dir={root / SINGLE_TO_ZERO1}"])).build().train()
    jobs.append((root / SINGLE_TO_ZERO1, [*tied, *LAYOUTS_8["zero1_tp2_pp2"]]))
    # The plan `shardline plan --emit-config` writes, and the same config in one process.
    _emit_zero1_tp2_pp2(small_prepared, root / "plan.toml")
    one = [f"parallel.{k}=1" for k in ("dp_shard", "tp", "pp")]
    Trainer(load_config(root / "plan.toml", [*one, f"run.dir={root / 'plan_single'}"])).build().train()
    jobs.append((root / "plan", [], root / "plan.toml"))
    run_world(8, jobs)
    return root


def test_harness_detects_a_different_run(tmp_path, small_prepared, reference):
    other = tmp_path / "other"
    Trainer(load_config(None, [*_base(small_prepared), "optim.lr=2.9e-3", f"run.dir={other}"])).build().train()
    with pytest.raises(AssertionError):
        assert_same_run(other, reference)


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_world2_layout_matches_single_process(world2, reference, layout):
    assert_same_run(world2 / layout, reference)


@pytest.mark.parametrize("layout", list(TIED_2))
def test_world2_tied_embeddings_match_single_process(world2, reference_tied, layout):
    assert_same_run(world2 / layout, reference_tied)
    # The tied weight counts once in the clipped norm (twice would still clip, differently).
    assert_same_grad_norms(world2 / layout, reference_tied)


@pytest.mark.parametrize("name", [name for name, _, _ in TIED_RESHARD_2])
def test_tied_resume_under_another_layout_continues_the_run(world2, reference_tied, name):
    assert sorted(losses(world2 / name)) == ALL_STEPS
    assert_same_run(world2 / name, reference_tied)


@pytest.mark.parametrize("layout", [*TIED_4, "zbv_fsdp_tied"])
def test_world4_tied_pipeline_compositions_match_single_process(world4, reference_tied, layout):
    assert_same_run(world4 / layout, reference_tied)
    assert_same_grad_norms(world4 / layout, reference_tied)


def test_convert_exports_a_tied_pipelined_checkpoint(world2, reference_tied, tmp_path):
    import json

    from safetensors.torch import load_file

    from shardline.interop.convert import checkpoint_to_hf
    from tests.distributed.harness import final_params

    out = checkpoint_to_hf(world2 / "pp2_1f1b_tied", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in hf
    ref = final_params(reference_tied)
    assert (hf["model.embed_tokens.weight"] - ref["tok_embeddings.weight"]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_world4_layout_matches_single_process(world4, reference, layout):
    # ddp_grad_accum runs micro-batches of 1: its evaluation takes the same sequences all the same
    assert_same_run(world4 / layout, reference)


@pytest.mark.parametrize("name", [name for name, _, _ in RESHARD_4])
def test_resume_under_another_layout_continues_the_run(world4, reference, name):
    assert sorted(losses(world4 / name)) == ALL_STEPS  # two halves, one log
    assert_same_run(world4 / name, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS_8))
def test_world8_layout_matches_single_process(world8, reference, layout):
    assert_same_run(world8 / layout, reference)


@pytest.mark.parametrize("layout", ZERO1_TP_PP)
def test_zero1_with_tp_pp_clips_by_the_single_process_norm(request, reference, layout):
    # Each dp_shard rank holds the summed gradient of its slices only: the norm adds them up.
    world = request.getfixturevalue("world8" if layout in LAYOUTS_8 else "world4")
    assert_same_grad_norms(world / layout, reference)


def test_zero1_tp2_checkpoint_resumes_in_one_process(world4, reference):
    assert sorted(losses(world4 / ZERO1_TO_SINGLE)) == ALL_STEPS  # two halves, one log
    assert_same_run(world4 / ZERO1_TO_SINGLE, reference)


@pytest.mark.slow
def test_one_process_tied_checkpoint_resumes_under_zero1_tp2_pp2(world8, reference_tied):
    assert sorted(losses(world8 / SINGLE_TO_ZERO1)) == ALL_STEPS
    assert_same_run(world8 / SINGLE_TO_ZERO1, reference_tied)
    assert_same_grad_norms(world8 / SINGLE_TO_ZERO1, reference_tied)


@pytest.mark.slow
def test_emitted_zero1_tp2_pp2_plan_trains_like_one_process(world8):
    plan = load_config(world8 / "plan.toml").parallel
    assert (plan.zero, plan.tp, plan.pp, plan.dp_shard) == (1, 2, 2, 2), plan
    assert sorted(losses(world8 / "plan")) == [1, 2]
    assert_same_run(world8 / "plan", world8 / "plan_single")


def test_convert_exports_a_pipelined_checkpoint(world4, reference, tmp_path):
    from safetensors.torch import load_file

    from shardline.interop.convert import checkpoint_to_hf
    from tests.distributed.harness import final_params

    out = checkpoint_to_hf(world4 / "zero3_to_pp", tmp_path / "hf")  # its last save: FSDP 2 x PP 2
    hf = load_file(out / "model.safetensors")
    ref = final_params(reference)
    assert hf["model.layers.3.mlp.down_proj.weight"].shape == ref["layers.3.feed_forward.w2.weight"].shape
    for ours, theirs in [("layers.3.feed_forward.w2.weight", "model.layers.3.mlp.down_proj.weight"),
                         ("tok_embeddings.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight")]:
        assert (hf[theirs] - ref[ours]).abs().max() < 1e-5
