"""Parity: every layout trains exactly like one process (same seed, same global batch).

Per-step losses within 1e-5 relative and final parameters within 1e-5, on real gloo
process groups. One spawn per world size runs its layouts one after another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardline.cli import main
from shardline.config import load_config
from shardline.data import build_data
from shardline.interop.convert import checkpoint_to_hf
from shardline.trainer import Trainer
from tests.distributed.harness import (
    ALL_STEPS,
    PARITY_OVERRIDES,
    PARITY_STEPS,
    assert_same_run,
    losses,
    run_world,
)

# Two blocks where the layout needs no more (one a stage at pp 2): a run's cost grows with its
# blocks (a 3-step FSDP 2 x TP 2 run took 5.3 s with four, 2.6 s with two, on 2 cores). Four
# where it does: pp 4, and two stages a rank (interleaved, zbv, dualpipev). Each run is compared
# with one process of its own model (`single`).
SHALLOW = "model.n_layers=2"
TIE = "model.tie_embeddings=1"
# The chunked loss (train.loss_chunk_tokens; 24 does not divide a micro-batch's 64 tokens, so
# the last chunk is short) on vocab-sharded logits, on a pipeline's last stage and under FSDP
# with full AC. Those paths' unchunked losses run in TIED_2, test_cpu_offload and test_fp16;
# one process's chunked loss against the plain one in tests/unit/test_loss.py.
CHUNK = "train.loss_chunk_tokens=24"
LAYOUTS_2 = {
    "tp2": [SHALLOW, "parallel.tp=2", "parallel.sequence_parallel=false", "parallel.loss_parallel=false"],
    "tp2_sp": [SHALLOW, "parallel.tp=2", "parallel.loss_parallel=false"],
    "tp2_sp_lossparallel_chunked": [SHALLOW, "parallel.tp=2", CHUNK],
    # Qwen3's q/k norms see a tp rank's heads only: their gradients must be summed over tp;
    # Qwen2's q/k/v biases are cut with their heads; and loss parallelism without sequence parallelism
    "tp2_lossparallel_qk_norm_qkv_bias": [SHALLOW, "model.qk_norm=1", "model.qkv_bias=1", "parallel.tp=2",
                                          "parallel.sequence_parallel=false"],
    "zero3_ac_full_foreach_chunked": [SHALLOW, "parallel.dp_shard=2", "memory.activation_checkpoint=full",
                                      "optim.implementation=foreach", CHUNK],
    # FSDP shards Qwen2's 1-D q/k/v biases (and saves them asynchronously)
    "zero3_ac_op_async_ckpt_qkv_bias": [SHALLOW, "parallel.dp_shard=2", "memory.activation_checkpoint=op",
                                        "checkpoint.mode=async", "model.qkv_bias=1"],
    "pp2_gpipe": [SHALLOW, "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp2_1f1b_chunked": [SHALLOW, "parallel.pp=2", "parallel.pp_schedule=1f1b", CHUNK],
    "pp2_interleaved_v2": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"],
    "pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"],
    "pp2_dualpipev": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2"],
}
# Against a single-process run with tied input/output embeddings: under TP one
# vocab-sharded weight; under PP a copy on the last stage whose gradient is summed with
# the first stage's (1f1b), or one weight on the rank holding both ends (zbv).
TIED_2 = {
    "tp2_tied": [SHALLOW, "parallel.tp=2", TIE],
    "pp2_1f1b_tied": [SHALLOW, "parallel.pp=2", "parallel.pp_schedule=1f1b", TIE],
    "pp2_zbv_tied": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2", TIE],
}
# Tied resharding resume: a pipeline checkpoint (one tied weight in it) resumed under
# FSDP, and the other way round; and by the same pipeline, whose ranks hold different
# parameters (each must load its own optimizer groups' names, not the saving rank's).
# Two blocks (SHALLOW), as every resharding resume below.
TIED_RESHARD_2 = [
    ("tied_pp_to_fsdp", ["parallel.pp=2", "train.stop_at_step=2"], ["parallel.dp_shard=2"]),
    ("tied_fsdp_to_pp", ["parallel.dp_shard=2", "train.stop_at_step=2"], ["parallel.pp=2"]),
    ("tied_pp_resumed", ["parallel.pp=2", "train.stop_at_step=2"], ["parallel.pp=2"]),
]
# Plain DDP 4, ZeRO-3 over 4, ZeRO-1 over 2 x 2 replicas and FSDP 2 x PP 2 run as halves of the
# resharding resumes below (tp_to_ddp, zero3_to_*), which compare every step's loss, the
# evaluation and the final parameters; FSDP 2 x PP 2 also runs whole with tied embeddings.
LAYOUTS_4 = {
    "ddp_grad_accum": [SHALLOW, "parallel.dp_replicate=4", "parallel.dp_shard=1", "train.micro_batch_size=1"],
    # ZeRO-1 with the fused AdamW gated by the device-side anomaly check (no host sync)
    "zero1_fused_device_check": [SHALLOW, "parallel.dp_shard=4", "parallel.zero=1", "optim.implementation=fused",
                                 "anomaly.check_on=device"],
    # ZeRO-1 with TP / PP: states sharded over the dp group of each (tp, pp) coordinate,
    # gradients reduce-scattered by the optimizer, no DDP wrapper (parallel/zero1.py)
    "zero1_tp2": [SHALLOW, "parallel.dp_shard=2", "parallel.zero=1", "parallel.tp=2"],
    "zero1_pp2": [SHALLOW, "parallel.dp_shard=2", "parallel.zero=1", "parallel.pp=2"],
    "zero2": [SHALLOW, "parallel.dp_shard=4", "parallel.zero=2"],
    "hsdp_2x2": [SHALLOW, "parallel.dp_replicate=2", "parallel.dp_shard=2"],
    # selective AC (every ac_every-th block checkpointed) inside FSDP units around TP blocks
    # (and FSDP shards the q/k/v biases tp has cut with their heads)
    "fsdp2_tp2_selective_async_ckpt_foreach_qkv_bias": [SHALLOW, "parallel.dp_shard=2", "parallel.tp=2",
                                                        "memory.activation_checkpoint=selective",
                                                        "checkpoint.mode=async", "optim.implementation=foreach",
                                                        "model.qkv_bias=1"],
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_virtual_stages=2"],
    # data-parallel replicas of a pipeline (run as HSDP: each stage an FSDP unit of shard 1, 2 replicas)
    "ddp2_pp2": [SHALLOW, "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.pp=2"],
    # DualPipeV's split backward under zero=3 (the weights gathered before each input pass)
    "fsdp2_pp2_dualpipev": ["parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=dualpipev",
                            "parallel.pp_virtual_stages=2", "train.micro_batch_size=1"],
}
# Tied embeddings under PP composed with FSDP and TP; pp 4 sums over a pair of ranks.
# ZBV x FSDP (zero=3: the split backward's input pass sees the gathered weights): the rank
# holding both ends keeps a copy in its last stage's FSDP unit, summed in place; stopped and
# resumed (the copy's optimizer state saved once).
ZBV_FSDP_TIED = ["parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
                 TIE]
TIED_4 = {
    "fsdp2_pp2_tied": [SHALLOW, "parallel.dp_shard=2", "parallel.pp=2", TIE],
    "tp2_pp2_tied": [SHALLOW, "parallel.tp=2", "parallel.pp=2", TIE],
    "pp4_tied": ["parallel.pp=4", TIE],
    # tp lays out the two ends apart, so the tie is made again right after the TP plan (apply_tp)
    "fsdp2_tp2_tied": [SHALLOW, "parallel.dp_shard=2", "parallel.tp=2", TIE],
}
LAYOUTS_8 = {
    "fsdp2_tp2_pp2": [SHALLOW, "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2"],
    "zero1_tp2_pp2": [SHALLOW, "parallel.dp_shard=2", "parallel.zero=1", "parallel.tp=2", "parallel.pp=2"],
}
# Resharding resume (two blocks): the first half under one layout, the second under another.
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
    """What `shardline plan` ranks best for 8 CPU ranks with zero=1, tp=2, pp=2 and dp_shard=2 pinned, as a
    config (at this shape, which the search prices, ZeRO-1 over 2 and DDP 2 tie: dp_shard keeps it ZeRO-1)."""
    small = [o for o in PARITY_OVERRIDES if o.split(".")[0] in ("model", "optim", "data", "metrics")]
    code = main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "8", "--seq-len", "32", "--global-batch", "16",
                 "--fix", "zero=1,tp=2,pp=2,dp_shard=2", "--emit-config", str(path), f"--data.path={corpus}",
                 "--train.steps=2", "--checkpoint.interval=2", *(f"--{o}" for o in small)])
    assert code == 0


def _from_hf(root: Path) -> list[str]:
    return [SHALLOW, f"model.hf_path={root / 'hf'}"]


def _grown(root: Path, single) -> dict[str, list[str]]:
    """Starts with 6 vocabulary rows added (at the mean of the others; a tp rank holds some of both):
    from the HF folder, and from the checkpoints of one-process runs (untied; tied, whose pipeline's
    last stage holds a copy named output.weight)."""
    rows = f"model.vocab_size={json.loads((root / 'hf' / 'config.json').read_text())['vocab_size'] + 6}"
    step = f"step-{PARITY_STEPS:06d}"
    return {"tp2_from_hf_grown": [*_from_hf(root), rows],
            "zero3_from_checkpoint_grown": [SHALLOW, f"model.init_from={single(SHALLOW) / 'checkpoints' / step}", rows],
            "pp2_tied_from_checkpoint_grown": [SHALLOW, TIE, rows,
                                               f"model.init_from={single(SHALLOW, TIE) / 'checkpoints' / step}"]}


GROWN_LAYOUTS = {"tp2_from_hf_grown": "parallel.tp=2", "zero3_from_checkpoint_grown": "parallel.dp_shard=2",
                 "pp2_tied_from_checkpoint_grown": "parallel.pp=2"}


def _as_phi3(llama: Path, out: Path) -> None:
    """A Llama HF folder rewritten as Phi-3 stores it: per layer one q/k/v tensor (rows q, k, v)
    and one gate/up tensor (rows gate, up), model_type phi3; its tokenizer files copied."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(llama, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "config.json"))
    tensors = {}
    for file in sorted(llama.glob("*.safetensors")):
        tensors.update(load_file(file))
    fused = {}
    for name, tensor in tensors.items():
        prefix = name.rsplit(".", 2)[0]  # model.layers.i.self_attn / .mlp
        if name.endswith("self_attn.q_proj.weight"):
            fused[f"{prefix}.qkv_proj.weight"] = torch.cat([tensors[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
        elif name.endswith("mlp.gate_proj.weight"):
            fused[f"{prefix}.gate_up_proj.weight"] = torch.cat([tensor, tensors[f"{prefix}.up_proj.weight"]])
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")) or "gate_up" in name:
            fused[name] = tensor
    save_file({k: v.contiguous() for k, v in fused.items()}, out / "model.safetensors")
    config = json.loads((llama / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "phi3",
                                                 "architectures": ["Phi3ForCausalLM"]}))


def _model(overrides: list[str]) -> tuple[str, ...]:
    """The model overrides of a layout's run: what its one-process reference must share."""
    return tuple(o for o in overrides if o.startswith("model."))


@pytest.fixture(scope="module")
def single(tmp_path_factory, small_prepared):
    """single(*model_overrides): the one-process run of the parity setting with that model,
    trained on first use (each distinct model once)."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*model: str) -> Path:
        key = tuple(sorted(model))
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("single")
            Trainer(load_config(None, [*_base(small_prepared), *key, f"run.dir={runs[key]}"])).build().train()
        return runs[key]

    return run


@pytest.fixture(scope="module")
def reference(single):
    return single()


@pytest.fixture(scope="module")
def world2(tmp_path_factory, small_prepared, single):
    root = tmp_path_factory.mktemp("world2")
    layouts = {**LAYOUTS_2, **TIED_2}
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in layouts.items()]
    # An HF folder (a one-process run's weights) loaded into FSDP-sharded parameters, each rank
    # keeping its shard: the path a one-process run does not take (it loads strictly, in place).
    checkpoint_to_hf(single(SHALLOW), root / "hf")
    jobs.append((root / "zero3_from_hf", [*_base(small_prepared), *_from_hf(root), "parallel.dp_shard=2"]))
    # ... and into tensor-parallel shards (vocab-parallel embedding, column and row-parallel projections)
    jobs.append((root / "tp2_from_hf", [*_base(small_prepared), *_from_hf(root), "parallel.tp=2"]))
    jobs += [(root / name, [*_base(small_prepared), *model, GROWN_LAYOUTS[name]])
             for name, model in _grown(root, single).items()]
    # The same weights as a Phi-3 folder (q/k/v and gate/up fused): each tp rank reads its rows of the parts
    _as_phi3(root / "hf", root / "phi3")
    jobs.append((root / "tp2_from_phi3", [*_base(small_prepared), SHALLOW, f"model.hf_path={root / 'phi3'}",
                                          "parallel.tp=2"]))
    # train.epochs derives the steps from the data each rank read: PARITY_STEPS' worth, as one process trains them
    sequences = len(build_data(load_config(None, _base(small_prepared))).train)
    epochs = f"train.epochs={(PARITY_STEPS - 0.5) * 8 / sequences:.9f}"  # (ceil: PARITY_STEPS steps of 8 sequences)
    jobs.append((root / "zero3_epochs", [*_base(small_prepared), SHALLOW, "parallel.dp_shard=2", epochs]))
    tied = [*_base(small_prepared), SHALLOW, TIE]
    for name, first, second in TIED_RESHARD_2:
        jobs += [(root / name, [*tied, *first]), (root / name, [*tied, *second])]
    run_world(2, jobs)
    return root


@pytest.mark.parametrize("layout", ["pp2_gpipe", "pp2_1f1b_chunked", "pp2_interleaved_v2", "pp2_zbv"])
def test_the_last_stage_keeps_no_micro_batch_outputs_after_a_step(world2, layout):
    """A schedule's step returns the last stage's outputs unless told not to, keeping every
    micro-batch's logits (unchunked loss) until the next step; the trainer never reads them."""
    held = [json.loads((world2 / layout / f"held_outputs.{rank}.json").read_text()) for rank in range(2)]
    assert held == [0, 0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("world4")
    base = _base(small_prepared)
    jobs = [(root / name, [*base, *extra]) for name, extra in {**LAYOUTS_4, **TIED_4}.items()]
    for name, first, second in RESHARD_4:
        jobs += [(root / name, [*base, SHALLOW, *first]), (root / name, [*base, SHALLOW, *second])]
    jobs.append((root / ZERO1_TO_SINGLE, [*base, *LAYOUTS_4["zero1_tp2"], HALF]))
    jobs += [(root / "zbv_fsdp_tied", [*base, *ZBV_FSDP_TIED, HALF]), (root / "zbv_fsdp_tied", [*base, *ZBV_FSDP_TIED])]
    run_world(4, jobs)
    Trainer(load_config(None, [*base, SHALLOW, f"run.dir={root / ZERO1_TO_SINGLE}"])).build().train()
    return root


@pytest.fixture(scope="module")
def world8(tmp_path_factory, small_prepared):
    root = tmp_path_factory.mktemp("world8")
    jobs = [(root / name, [*_base(small_prepared), *extra]) for name, extra in LAYOUTS_8.items()]
    tied = [*_base(small_prepared), SHALLOW, TIE]
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


@pytest.mark.parametrize("kind, key", [("train", "grad_norm"), ("eval", "eval_loss")])
def test_harness_compares_gradient_norms_and_evaluations_on_their_own(tmp_path, reference, kind, key):
    """A run whose losses match but whose logged gradient norm or evaluation is off by 1e-4."""
    other = tmp_path / "other"
    shutil.copytree(reference, other)
    records = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if r["kind"] == kind and r["step"] == PARITY_STEPS:
            r[key] *= 1 + 1e-4
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert losses(other) == losses(reference)
    with pytest.raises(AssertionError, match=str(PARITY_STEPS)):
        assert_same_run(other, reference)


def test_harness_compares_parameters_on_their_own(tmp_path, small_prepared, single):
    """A run that logs the reference's losses and gradient norms but takes its last update
    at another lr (resumed for it): only its parameters differ."""
    reference = single("train.eval_interval=0")
    other = tmp_path / "other"
    base = [*_base(small_prepared), "train.eval_interval=0", f"run.dir={other}"]
    Trainer(load_config(None, [*base, HALF])).build().train()
    Trainer(load_config(None, [*base, "optim.lr=1.5e-3"])).build().train()  # step 3: 1.5e-4 for 3e-4
    assert losses(other) == losses(reference)
    assert losses(other, key="grad_norm") == losses(reference, key="grad_norm")
    with pytest.raises(AssertionError, match="weight"):
        assert_same_run(other, reference, evaluated=False)


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_world2_layout_matches_single_process(world2, single, layout):
    assert_same_run(world2 / layout, single(*_model(LAYOUTS_2[layout])))


@pytest.mark.parametrize("layout", ["zero3_from_hf", "tp2_from_hf", "tp2_from_phi3"])
def test_hf_weights_load_into_fsdp_and_tp_shards_as_into_one_process(world2, single, layout):
    reference = single(*_from_hf(world2))
    assert_same_run(world2 / layout, reference)
    assert losses(reference)[1] < losses(single(SHALLOW))[1]  # it starts from the trained weights


@pytest.mark.parametrize("layout", list(GROWN_LAYOUTS))
def test_vocabulary_rows_added_to_starting_weights_are_the_same_in_shards(world2, single, layout):
    assert_same_run(world2 / layout, single(*_grown(world2, single)[layout]))


def test_a_length_in_epochs_gives_sharded_ranks_the_steps_of_one_process(world2, single):
    events = [json.loads(line) for line in (world2 / "zero3_epochs" / "metrics.jsonl").read_text().splitlines()]
    assert next(e for e in events if e.get("event") == "steps_from_epochs")["steps"] == PARITY_STEPS
    assert_same_run(world2 / "zero3_epochs", single(SHALLOW))


def test_a_pipelined_run_logs_which_layers_each_pp_rank_holds(world2):
    """The start event places the layers (the dry run's list): a run's own log showed pp2(1f1b m4) alone."""
    events = [json.loads(line) for line in (world2 / "pp2_gpipe" / "metrics.jsonl").read_text().splitlines()]
    placed = next(e for e in events if e.get("event") == "start")["pipeline"]
    assert [(p["rank"], p["embedding"], p["output"]) for p in placed] == [(0, True, False), (1, False, True)]
    layers = [i for p in placed for i in p["layers"]]
    assert layers == sorted(layers) and len(layers) >= 2 and all(p["layers"] for p in placed)


@pytest.mark.parametrize("layout", list(TIED_2))
def test_world2_tied_embeddings_match_single_process(world2, single, layout):
    reference = single(*_model(TIED_2[layout]))
    assert_same_run(world2 / layout, reference)  # its gradient norms too: the tied weight counts once


@pytest.mark.parametrize("name", [name for name, _, _ in TIED_RESHARD_2])
def test_tied_resume_under_another_layout_continues_the_run(world2, single, name):
    assert sorted(losses(world2 / name)) == ALL_STEPS
    assert_same_run(world2 / name, single(SHALLOW, TIE))


@pytest.mark.parametrize("layout", [*TIED_4, "zbv_fsdp_tied"])
def test_world4_tied_compositions_match_single_process(world4, single, layout):
    reference = single(*_model({**TIED_4, "zbv_fsdp_tied": ZBV_FSDP_TIED}[layout]))
    assert_same_run(world4 / layout, reference)


def test_convert_exports_a_tied_pipelined_checkpoint(world2, single, tmp_path):
    import json

    from safetensors.torch import load_file

    from tests.distributed.harness import final_params

    out = checkpoint_to_hf(world2 / "pp2_1f1b_tied", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    hf = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in hf
    ref = final_params(single(*_model(TIED_2["pp2_1f1b_tied"])))
    assert (hf["model.embed_tokens.weight"] - ref["tok_embeddings.weight"]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_world4_layout_matches_single_process(world4, single, layout):
    # ddp_grad_accum runs micro-batches of 1: its evaluation takes the same sequences all the same
    assert_same_run(world4 / layout, single(*_model(LAYOUTS_4[layout])))


@pytest.mark.parametrize("name", [name for name, _, _ in RESHARD_4])
def test_resume_under_another_layout_continues_the_run(world4, single, name):
    assert sorted(losses(world4 / name)) == ALL_STEPS  # two halves, one log
    assert_same_run(world4 / name, single(SHALLOW))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS_8))
def test_world8_layout_matches_single_process(world8, single, layout):
    assert_same_run(world8 / layout, single(*_model(LAYOUTS_8[layout])))


def test_zero1_tp2_checkpoint_resumes_in_one_process(world4, single):
    assert sorted(losses(world4 / ZERO1_TO_SINGLE)) == ALL_STEPS  # two halves, one log
    assert_same_run(world4 / ZERO1_TO_SINGLE, single(SHALLOW))
    records = map(json.loads, (world4 / ZERO1_TO_SINGLE / "metrics.jsonl").read_text().splitlines())
    (changed,) = [r for r in records if r.get("event") == "config_changed"]
    assert changed["world_size"] == [4, 1], changed  # (with dp_shard=-1 no degree key says it)


@pytest.mark.slow
def test_one_process_tied_checkpoint_resumes_under_zero1_tp2_pp2(world8, single):
    assert sorted(losses(world8 / SINGLE_TO_ZERO1)) == ALL_STEPS
    assert_same_run(world8 / SINGLE_TO_ZERO1, single(SHALLOW, TIE))


@pytest.mark.slow
def test_emitted_zero1_tp2_pp2_plan_trains_like_one_process(world8):
    plan = load_config(world8 / "plan.toml").parallel
    assert (plan.zero, plan.tp, plan.pp, plan.dp_shard) == (1, 2, 2, 2), plan
    assert sorted(losses(world8 / "plan")) == [1, 2]
    assert_same_run(world8 / "plan", world8 / "plan_single")


def test_convert_exports_a_pipelined_checkpoint(world4, single, tmp_path):
    from safetensors.torch import load_file

    from tests.distributed.harness import final_params

    out = checkpoint_to_hf(world4 / "zero3_to_pp", tmp_path / "hf")  # its last save: FSDP 2 x PP 2
    hf = load_file(out / "model.safetensors")
    ref = final_params(single(SHALLOW))  # block 1 lives on the second stage
    assert hf["model.layers.1.mlp.down_proj.weight"].shape == ref["layers.1.feed_forward.w2.weight"].shape
    for ours, theirs in [("layers.1.feed_forward.w2.weight", "model.layers.1.mlp.down_proj.weight"),
                         ("tok_embeddings.weight", "model.embed_tokens.weight"), ("output.weight", "lm_head.weight")]:
        assert (hf[theirs] - ref[ours]).abs().max() < 1e-5
