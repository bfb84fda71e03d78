"""HF Mixtral / Qwen3-MoE folders <-> shardline MoE models: config, per-expert weights, logits parity.

Random transformers models of a few shapes are compared with ours in fp32, both ways.
Weights are drawn wide (0.2, norms away from one) so routing, every expert and the q/k
norms visibly move the logits: a wrong expert order or name shows far above 1e-4.
Both sides are dropless (our capacity_factor 0, the default, computes every token).
The published Mixtral-8x7B and Qwen3-30B-A3B configs give our presets, and transformers
counts the same parameters as our FLOPs model does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardline.errors import CheckpointError
from shardline.interop.hf import (
    INDEX_NAME,
    WEIGHTS_NAME,
    from_hf_pretrained,
    load_hf_weights,
    read_hf_config,
    to_hf_pretrained,
)
from shardline.models.factory import build_model_on
from shardline.models.flops import num_params
from shardline.models.llama import ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.layer import moe_layers
from shardline.models.presets import PRESETS

VOCAB = 128
SEQ = 24
ATOL = 1e-4


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@torch.no_grad()
def _spread(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(noise * 0.2 if p.ndim >= 2 else 1.0 + 0.2 * noise)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _logits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape == (2, SEQ, VOCAB)
    assert b.abs().max() > 1.0
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _hf_model(transformers, family: str, seed: int = 0, **overrides):
    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=64, num_experts_per_tok=2, attn_implementation="eager")
    kwargs.update(overrides)
    if family == "mixtral":
        config = transformers.MixtralConfig(**{"intermediate_size": 32, "num_local_experts": 4, **kwargs})
    else:
        config = transformers.Qwen3MoeConfig(**{"intermediate_size": 96, "moe_intermediate_size": 32,
                                                "num_experts": 4, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(config)
    _spread(model, seed)
    return model.eval()


def _tensor_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    return names


# ---- HF -> shardline ----------------------------------------------------------------------------

HF_CASES = {
    "mixtral-gqa": ("mixtral", dict()),
    "mixtral-8-experts-tied-sharded": ("mixtral", dict(num_hidden_layers=3, num_local_experts=8,
                                                       tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3-norm-topk-head-dim": ("qwen3_moe", dict(norm_topk_prob=True, head_dim=32)),
    "qwen3-dense-first-8-experts": ("qwen3_moe", dict(num_hidden_layers=3, num_experts=8, mlp_only_layers=[0])),
    "qwen3-sparse-step-2": ("qwen3_moe", dict(decoder_sparse_step=2, num_experts_per_tok=3)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_to_shardline_logits_match(case, tmp_path, transformers):
    family, spec = HF_CASES[case]
    hf = _hf_model(transformers, family, **spec)
    hf.save_pretrained(tmp_path, max_shard_size="30KB" if case.endswith("sharded") else "1GB")
    assert (tmp_path / INDEX_NAME).is_file() == case.endswith("sharded")

    model, args = from_hf_pretrained(tmp_path)

    moe = args.moe
    assert (moe.n_experts, moe.top_k) == (spec.get("num_local_experts", spec.get("num_experts", 4)),
                                          spec.get("num_experts_per_tok", 2))
    assert moe.expert_ffn_dim == 32 and moe.capacity_factor == 0 and moe.aux_loss_coef == 0
    assert args.qk_norm == (family == "qwen3_moe")
    assert moe.norm_topk == (family == "mixtral" or spec.get("norm_topk_prob", False))
    assert moe.first_dense_layers == (1 if "mlp_only_layers" in spec or "decoder_sparse_step" in spec else 0)
    assert args.head_size == spec.get("head_dim", 16)
    assert all(not layer.router.expert_bias.any() for layer in moe_layers(model))
    model.eval()
    with torch.no_grad():
        _logits_equal(model(_ids()), hf(_ids()).logits)

    # Written back, the folder holds the very tensor names transformers' own save wrote.
    out = to_hf_pretrained(model, tmp_path / "back")
    assert _tensor_names(out) == _tensor_names(tmp_path)


def test_experts_are_stacked_in_expert_order(tmp_path, transformers):
    hf = _hf_model(transformers, "mixtral")
    hf.save_pretrained(tmp_path)
    model, _ = from_hf_pretrained(tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    experts = model.layers["1"].feed_forward.experts
    for j in range(4):
        for ours, theirs in (("w1", "w1"), ("w3", "w3"), ("w2", "w2")):
            name = f"model.layers.1.block_sparse_moe.experts.{j}.{theirs}.weight"
            assert torch.equal(getattr(experts, ours)[j], tensors[name])


def test_load_into_a_model_built_as_the_trainer_does_resets_the_balancing_bias(tmp_path, transformers):
    hf = _hf_model(transformers, "qwen3_moe", norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    args = dataclasses.replace(read_hf_config(tmp_path), moe=dataclasses.replace(
        read_hf_config(tmp_path).moe, bias_update_rate=0.01))  # a run that balances with the bias
    model = build_model_on(args, "meta")
    model.init_weights(seed=3)
    for layer in moe_layers(model):
        layer.router.expert_bias.fill_(5.0)
    load_hf_weights(model, tmp_path)
    assert all(not layer.router.expert_bias.any() for layer in moe_layers(model))
    with torch.no_grad():
        _logits_equal(model.eval()(_ids()), hf(_ids()).logits)


def test_dropless_is_what_matches_hf(tmp_path, transformers):
    """HF computes every token; with a capacity the same weights drop some in training and the
    logits move, while evaluation stays dropless (HF's numbers)."""
    hf = _hf_model(transformers, "mixtral")
    hf.save_pretrained(tmp_path)
    args = read_hf_config(tmp_path)
    assert args.moe.capacity_factor == 0  # imported dropless
    capped = build_model_on(dataclasses.replace(args, moe=dataclasses.replace(args.moe, capacity_factor=0.5)), "cpu")
    capped.init_weights(seed=0)
    load_hf_weights(capped, tmp_path)
    with torch.no_grad():
        assert (capped.train()(_ids()) - hf(_ids()).logits).abs().max() > 100 * ATOL
        torch.testing.assert_close(capped.eval()(_ids()), hf(_ids()).logits, atol=ATOL, rtol=0)


def test_fused_experts_of_transformers5_memory_get_a_hint(tmp_path, transformers):
    hf = _hf_model(transformers, "qwen3_moe")
    hf.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / WEIGHTS_NAME)  # not hub names
    with pytest.raises(CheckpointError, match=r"holds model\.layers\.0\.mlp\.experts\.gate_up_proj "
                                              r".*fused in-memory experts; save"):
        from_hf_pretrained(tmp_path)


# ---- shardline -> HF ----------------------------------------------------------------------------

_BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64)
SL_CASES = {
    "mixtral-sharded": (ModelArgs(**_BASE, ffn_dim=48, rope_theta=1e6,
                                  moe=MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=48)), 40_000),
    "mixtral-tied-8-experts": (ModelArgs(**{**_BASE, "n_layers": 3}, ffn_dim=32, tie_embeddings=True,
                                         moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=32)), None),
    "qwen3-dense-first": (ModelArgs(**{**_BASE, "n_layers": 3}, ffn_dim=96, head_dim=32, qk_norm=True,
                                    norm_eps=1e-6, moe=MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32,
                                                               first_dense_layers=1)), None),
    "qwen3-unnormalised-topk": (ModelArgs(**_BASE, ffn_dim=96, qk_norm=True,
                                          moe=MoEArgs(n_experts=8, top_k=3, expert_ffn_dim=24,
                                                      norm_topk=False)), None),
}


@pytest.mark.parametrize("case", list(SL_CASES))
def test_shardline_to_hf_logits_match(case, tmp_path, transformers):
    args, shard_size = SL_CASES[case]
    model = build_model_on(args, "cpu")
    model.init_weights(seed=11)
    _spread(model, seed=11)
    model.eval()
    kwargs = {"max_shard_size_bytes": shard_size} if shard_size else {}
    out = to_hf_pretrained(model, tmp_path / "hf", **kwargs)
    assert (out / INDEX_NAME).is_file() == bool(shard_size)
    names = _tensor_names(out)
    assert not any("expert_bias" in n for n in names)
    block = "block_sparse_moe" if case.startswith("mixtral") else "mlp"
    last = args.n_layers - 1
    expert = args.moe.n_experts - 1
    assert f"model.layers.{last}.{block}.experts.{expert}.{'w2' if block != 'mlp' else 'down_proj'}.weight" in names

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    family = "MixtralForCausalLM" if case.startswith("mixtral") else "Qwen3MoeForCausalLM"
    assert type(hf).__name__ == family and hf.dtype == torch.float32
    assert hf.config.num_experts_per_tok == args.moe.top_k
    hf.eval()
    with torch.no_grad():
        _logits_equal(hf(_ids(1)).logits, model(_ids(1)))
    assert read_hf_config(out) == args  # the config round-trips exactly


def test_capacity_and_balancing_bias_are_warned_about(tmp_path):
    args = SL_CASES["mixtral-sharded"][0]
    model = build_model_on(dataclasses.replace(args, moe=dataclasses.replace(args.moe, capacity_factor=1.25)), "cpu")
    model.init_weights(seed=0)
    with pytest.warns(UserWarning, match="capacity_factor=1.25 drops"):
        to_hf_pretrained(model, tmp_path / "capacity")
    model = build_model_on(args, "cpu")
    model.init_weights(seed=0)
    moe_layers(model)[0].router.expert_bias[0] = 0.5
    with pytest.warns(UserWarning, match="balancing bias"):
        to_hf_pretrained(model, tmp_path / "bias")


@pytest.mark.parametrize("moe, qk_norm, message", [
    (MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32, shared_experts=1), False, "shared_experts=1"),
    (MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32, router="sigmoid"), True, "router='sigmoid'"),
    (MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32, route_scale=2.5), True, "route_scale=2.5"),
    (MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32, first_dense_layers=1), False,
     "^moe first_dense_layers=1, norm_topk=True without qk_norm fit neither .*: train with moe.first_dense_layers=0 "
     "and moe.norm_topk=1"),
    (MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32, norm_topk=False), False, "fit neither"),
])
def test_shapes_without_an_hf_counterpart_are_refused(moe, qk_norm, message, tmp_path):
    model = build_model_on(ModelArgs(**_BASE, ffn_dim=32, qk_norm=qk_norm, moe=moe), "cpu")
    model.init_weights(seed=0)
    with pytest.raises(CheckpointError, match=message):
        to_hf_pretrained(model, tmp_path / "hf")
    assert not any(tmp_path.iterdir())  # nothing written


def test_tiny_moe_preset_is_refused_on_one_line(tmp_path):
    model = build_model_on(dataclasses.replace(PRESETS["tiny-moe"], vocab_size=VOCAB, n_layers=2), "cpu")
    model.init_weights(seed=0)
    with pytest.raises(CheckpointError, match="shared_experts=1") as err:
        to_hf_pretrained(model, tmp_path / "hf")
    assert "\n" not in str(err.value)  # ... and the next blocker with it (one retrained for the first met it after)
    assert "; and first_dense_layers=1, norm_topk=True without qk_norm fit neither" in str(err.value)


# ---- errors on import ----------------------------------------------------------------------------


def test_missing_expert_and_wrong_expert_shape_are_named(tmp_path, transformers):
    _hf_model(transformers, "mixtral").save_pretrained(tmp_path)
    model, _ = from_hf_pretrained(tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"lacks tensor model\.layers\.1\.block_sparse_moe\.experts\.2\.w3"
                                              r"\.weight, .*as expert 2 of layers\.1\.feed_forward\.experts\.w3"):
        load_hf_weights(model, tmp_path)
    tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = torch.zeros(16, 64)
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    before = model.layers["0"].feed_forward.experts.w1.detach().clone()
    with pytest.raises(CheckpointError, match=r"experts\.2\.w3\.weight .* has shape \[16, 64\] but the model "
                                              r"expects \[32, 64\]"):
        load_hf_weights(model, tmp_path)
    assert torch.equal(model.layers["0"].feed_forward.experts.w1, before)  # nothing copied


def test_a_fifth_expert_is_an_extra_tensor(tmp_path, transformers):
    _hf_model(transformers, "qwen3_moe").save_pretrained(tmp_path)
    model, _ = from_hf_pretrained(tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    tensors["model.layers.0.mlp.experts.4.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"holds tensor model\.layers\.0\.mlp\.experts\.4\.up_proj"):
        load_hf_weights(model, tmp_path)


# ---- config.json --------------------------------------------------------------------------------

# The published config.json files of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1e6, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
PUBLISHED = {  # preset: (config.json, total and active parameters as published, in billions)
    "mixtral-8x7b": (MIXTRAL_8X7B, 46.7, 12.9),
    "qwen3-moe-30b-a3b": (QWEN3_30B_A3B, 30.5, 3.3),
}


def _write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_configs_give_the_presets_and_their_parameter_counts(preset, tmp_path, transformers):
    cfg, total_b, active_b = PUBLISHED[preset]
    folder = _write_config(tmp_path, cfg)
    args = read_hf_config(folder)
    expected = PRESETS[preset]
    assert args == dataclasses.replace(expected, moe=dataclasses.replace(expected.moe, aux_loss_coef=0.0))

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    hf_total = sum(p.numel() for p in hf.parameters())
    experts = hf.model.layers[0].mlp.experts  # fused (transformers 5) or one module per expert (4)
    per_expert = sum(p.numel() for p in experts.parameters()) // args.moe.n_experts
    hf_active = hf_total - args.n_layers * (args.moe.n_experts - args.moe.top_k) * per_expert
    assert num_params(args) == hf_total and num_params(args, active=True) == hf_active
    assert round(hf_total / 1e9, 1) == total_b
    # Published actives: Mixtral rounds (12.88 -> 12.9), Qwen truncates (3.35 -> "3.3B").
    assert abs(hf_active / 1e9 - active_b) < 0.06


@pytest.mark.parametrize("family, fields, message", [
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
    ("mixtral", {"sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096"),
    ("mixtral", {"num_experts_per_tok": None}, "lacks 'num_experts_per_tok'"),
    ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 3}, "top_k=3 must be in 1..n_experts=2"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"dense layers \[1\]"),
    ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4}, r"dense layers \[0, 2\]"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "lacks 'moe_intermediate_size'"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=true"),
])
def test_unsupported_moe_configs_are_one_line_errors(family, fields, message, tmp_path):
    base = dict(MIXTRAL_8X7B if family == "mixtral" else QWEN3_30B_A3B)
    base.update(fields)
    with pytest.raises(CheckpointError, match=message) as err:
        read_hf_config(_write_config(tmp_path, {k: v for k, v in base.items() if v is not None}))
    assert "\n" not in str(err.value)


def test_family_defaults_and_spellings(tmp_path):
    """A key left out takes its family's transformers default; both expert-count spellings are read."""
    mixtral = {k: v for k, v in MIXTRAL_8X7B.items() if k not in ("rope_theta", "rms_norm_eps")}
    args = read_hf_config(_write_config(tmp_path / "mixtral", mixtral))
    assert (args.rope_theta, args.norm_eps) == (1e6, 1e-5)
    qwen = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("rope_theta", "norm_topk_prob", "num_experts")}
    qwen.update(num_local_experts=64, rope_parameters={"rope_type": "default", "rope_theta": 5e5})  # transformers 5
    args = read_hf_config(_write_config(tmp_path / "qwen", qwen))
    assert (args.rope_theta, args.moe.n_experts, args.moe.norm_topk) == (5e5, 64, False)


def test_an_export_keeps_the_starting_folders_balance_weight_unless_the_run_set_its_own(tmp_path):
    """A run from an HF folder starts with no balance loss (its weight is of another
    normalisation) and exports the folder's router_aux_loss_coef; one that set moe.aux_loss_coef
    exports that, converted (it once exported the starting folder's whatever the run trained with)."""
    from shardline.models.moe.args import balance_coef_to_hf

    written = {}
    for coef in (0.0, 0.01):
        args = ModelArgs(**_BASE, ffn_dim=48, moe=MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=48, aux_loss_coef=coef))
        model = build_model_on(args, "cpu")
        model.init_weights(seed=0)
        out = to_hf_pretrained(model, tmp_path / f"hf-{coef}", kept_fields={"router_aux_loss_coef": 0.001})
        written[coef] = json.loads((out / "config.json").read_text())["router_aux_loss_coef"]
    assert written == {0.0: 0.001, 0.01: pytest.approx(balance_coef_to_hf(0.01, 2, 2))}


@pytest.mark.parametrize("override, named", [("moe.route_scale=2.5", "route_scale=2.5"),
                                             ("moe.router=sigmoid", "router='sigmoid'")])
def test_router_overrides_an_hf_starts_tensor_names_cannot_carry_are_refused_before_the_launch(tmp_path, override,
                                                                                               named):
    """The dry run passed them; the launch then failed while loading the weights, with a message about
    export. The shape check names the folder and the overrides to drop."""
    from shardline.config import load_config
    from shardline.errors import ConfigError
    from shardline.interop.model_shape import model_shape

    folder = _write_config(tmp_path, QWEN3_30B_A3B)
    cfg = load_config(None, [f"model.hf_path={folder}", override])
    with pytest.raises(ConfigError, match=rf"^model.hf_path='{folder}': moe {re.escape(named)} has no Hugging Face "
                                          r"Mixtral or Qwen3-MoE counterpart .*drop those \[moe\] overrides"):
        model_shape(cfg.model, 1000, cfg.moe)
    fine = load_config(None, [f"model.hf_path={folder}", "moe.capacity_factor=1.25"])  # (the router's own setting)
    assert model_shape(fine.model, 1000, fine.moe).moe.capacity_factor == 1.25


def test_a_nan_in_one_expert_is_named_by_that_experts_tensor(tmp_path, transformers):
    """The refusal named expert 0's tensor whichever expert held the NaN."""
    _hf_model(transformers, "mixtral").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"][5, 1] = float("nan")
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"parameter layers\.1\.feed_forward\.experts\.w3 \(read from "
                                              r"tensor model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight\)"):
        from_hf_pretrained(tmp_path)


def test_routing_overrides_on_starting_weights_and_a_top_1_start_are_noted(tmp_path):
    """A top-1 HF folder (renormalised: every token's weight 1) could not be fine-tuned: refused, and
    its suggested way out (norm_topk=0) changed the model's outputs in silence, as any routing
    override on starting weights did. A top-1 start now trains as transformers trains it, noted; a
    routing override is noted as changing the start's outputs."""
    from shardline.config import load_config
    from shardline.errors import ConfigError
    from shardline.interop.model_shape import model_shape
    from shardline.launch_notes import launch_notes

    def notes(folder, *overrides):
        cfg = load_config(None, [f"model.hf_path={folder}", "metrics.peak_tflops=1", *overrides])
        return dict(launch_notes(cfg, "cpu", 1.0, 1, model=model_shape(cfg.model, 1000, cfg.moe)))

    top1 = _write_config(tmp_path / "top1", {**QWEN3_30B_A3B, "num_experts_per_tok": 1})
    said = notes(top1)
    assert "routing_changed" not in said and "the loss cannot move the router" in \
        said["router_trained_by_balance_alone"]["why"]
    top8 = _write_config(tmp_path / "top8", QWEN3_30B_A3B)
    assert "routing_changed" not in notes(top8) and "router_trained_by_balance_alone" not in notes(top8)
    with pytest.raises(ConfigError, match="moe.top_k=1 with renormalised weights"):  # (theirs are not top-1)
        notes(top8, "moe.top_k=1")
    changed = notes(top8, "moe.top_k=2", "moe.norm_topk=0")
    assert changed["routing_changed"]["top_k"] == [8, 2] and changed["routing_changed"]["norm_topk"] == [True, False]
    assert "their outputs change before the first step" in changed["routing_changed"]["why"]
    # The folder's router_aux_loss_coef (0.001) is not applied: said, with the weight of the same loss here
    # (0.001 x top_k 8 / 48 MoE layers); not where a balance loss is set
    off = notes(top8)["balance_loss_off"]
    assert off["router_aux_loss_coef"] == 0.001 and "moe.aux_loss_coef=0.0001667 weighs the same loss" in off["why"]
    assert "balance_loss_off" not in notes(top8, "moe.aux_loss_coef=0.01")
