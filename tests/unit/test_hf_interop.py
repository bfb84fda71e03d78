"""HF Llama folders <-> shardline Llama: config mapping, weight mapping, logits parity.

Parity tests build random transformers models of several shapes and compare logits in
fp32 both ways. Weights are drawn wider than the usual 0.02 init (and norm weights away
from one) so that every layer, every norm and the rotary frequencies visibly move the
logits: a wrong name mapping or RoPE detail shows up far above the 1e-4 tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardline.errors import CheckpointError, DataError
from shardline.interop.hf import (
    INDEX_NAME,
    WEIGHTS_NAME,
    from_hf_pretrained,
    load_hf_weights,
    read_hf_config,
    to_hf_pretrained,
)
from shardline.interop.hf_files import EXPORT_MARK
from shardline.models.factory import build_meta_model
from shardline.models.flops import num_params
from shardline.models.llama import Llama, ModelArgs
from shardline.models.llama.model import rope_frequencies
from shardline.models.presets import PRESETS

VOCAB = 128
SEQ = 24
ATOL = 1e-4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LLAMA3_PAIRS = (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 32.0))


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@torch.no_grad()
def _spread(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(noise * 0.2 if p.ndim == 2 else 1.0 + 0.2 * noise)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_model(transformers, seed: int = 0, **overrides):
    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB,
                  max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager")
    kwargs.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    _spread(model, seed)
    return model.eval()


def _logits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape == (2, SEQ, VOCAB)
    assert b.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# ---- HF -> shardline --------------------------------------------------------------------------

HF_CASES = {
    "gqa-untied-sharded": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mqa-tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "mha-explicit-head-dim": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32),
    "rope-theta": dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0),
    "llama3-scaling-tied": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                rope_scaling=dict(LLAMA3), tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_to_shardline_logits_match(case, tmp_path, transformers):
    spec = HF_CASES[case]
    hf = _hf_model(transformers, **spec)
    sharded = case.endswith("sharded")
    hf.save_pretrained(tmp_path, max_shard_size="30KB" if sharded else "1GB")
    if sharded:
        assert (tmp_path / INDEX_NAME).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    else:
        assert (tmp_path / WEIGHTS_NAME).is_file()

    model, args = from_hf_pretrained(tmp_path)

    heads, kv = spec["num_attention_heads"], spec["num_key_value_heads"]
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (64, 2, heads, kv)
    assert (args.vocab_size, args.ffn_dim, args.max_seq_len, args.norm_eps) == (VOCAB, 96, 64, 1e-5)
    assert args.head_size == spec.get("head_dim", 64 // heads)
    assert args.rope_theta == spec.get("rope_theta", 10000.0)
    assert args.rope_scaling == (LLAMA3_PAIRS if "rope_scaling" in spec else None)
    assert args.tie_embeddings == spec.get("tie_word_embeddings", False)
    if args.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    model.eval()
    ids = _ids()
    with torch.no_grad():
        _logits_equal(model(ids), hf(ids).logits)


def test_llama3_scaling_changes_the_logits(tmp_path, transformers):
    """The llama3 case above really exercises the scaled frequencies."""
    hf = _hf_model(transformers, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                   rope_scaling=dict(LLAMA3))
    hf.save_pretrained(tmp_path)
    _, args = from_hf_pretrained(tmp_path)
    unscaled = Llama(dataclasses.replace(args, rope_scaling=None))
    load_hf_weights(unscaled, tmp_path)
    with torch.no_grad():
        diff = (unscaled(_ids()) - hf(_ids()).logits).abs().max()
    assert diff > 100 * ATOL


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b", "llama3.2-1b"])  # the last with llama3 scaling
def test_rotary_frequencies_are_bit_identical_to_hfs(preset, transformers):
    """The frequencies pretrained weights were trained with, to the bit (computed in float64
    a third of them differed by an ulp: ~1e-2 rad of angle at position 128k)."""
    args = PRESETS[preset]
    scaling = dict(args.rope_scaling, rope_type="llama3") if args.rope_scaling else None
    cfg = transformers.LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, head_dim=args.head_size,
                                   max_position_embeddings=131072, rope_theta=args.rope_theta,
                                   rope_scaling=scaling)  # transformers 4's keys, which 5 reads too
    want = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg).inv_freq
    assert torch.equal(rope_frequencies(args), want)


@pytest.mark.parametrize("name", [n for n, a in PRESETS.items() if a.vocab_size])  # (tiny ones: sized at launch)
def test_every_preset_counts_as_many_parameters_as_hfs_model_of_its_export_config(name, transformers):
    """The planner's, MFU's and the dry run's count (num_params) of each preset is the count of the
    model transformers builds from the config.json an export of it writes (on the meta device)."""
    from shardline.interop.hf_config import hf_config_dict

    args = PRESETS[name]
    fields = hf_config_dict(args, args.tie_embeddings, torch.float32, None, None)
    config = transformers.AutoConfig.for_model(**fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert num_params(args) == sum(p.numel() for p in hf.parameters()), name


def test_the_smollm_preset_counts_as_many_parameters_as_hfs_model_of_its_shape(transformers):
    """smollm-135m is HuggingFaceTB/SmolLM-135M's config.json: the planner's and the dry run's count
    (num_params) and the model built from the preset hold as many parameters as HF's model, tied output included."""
    args = PRESETS["smollm-135m"]
    cfg = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                   rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(cfg)
    want = sum(p.numel() for p in hf.parameters())  # a tied weight is one parameter here as well
    assert want == 134_515_008
    assert num_params(args) == want == sum(p.numel() for p in build_meta_model(args).parameters())
    assert (args.head_size, args.max_seq_len, args.tie_embeddings) == (64, 2048, True)


@pytest.mark.parametrize("tied", [False, True])
def test_load_into_meta_built_model_as_the_trainer_does(tied, tmp_path, transformers):
    hf = _hf_model(transformers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)
    model = build_meta_model(read_hf_config(tmp_path))
    model.init_weights(seed=5)
    load_hf_weights(model, tmp_path)
    with torch.no_grad():
        _logits_equal(model(_ids()), hf(_ids()).logits)
        if tied:
            assert torch.equal(model.output.weight, model.tok_embeddings.weight)


def test_tied_model_with_a_separate_output_tensor_gets_the_embedding(tmp_path, transformers):
    hf = _hf_model(transformers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    model = Llama(read_hf_config(tmp_path))
    model.output.weight = torch.nn.Parameter(torch.zeros_like(model.output.weight))  # tie broken
    load_hf_weights(model, tmp_path)
    assert torch.equal(model.output.weight, hf.model.embed_tokens.weight)
    with torch.no_grad():
        _logits_equal(model(_ids()), hf(_ids()).logits)


def test_bf16_weights_load_into_fp32_model(tmp_path, transformers):
    hf = _hf_model(transformers, num_attention_heads=4, num_key_value_heads=2)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model, _ = from_hf_pretrained(tmp_path)
    assert model.tok_embeddings.weight.dtype == torch.float32
    expected = hf.model.embed_tokens.weight.float()
    assert torch.equal(model.tok_embeddings.weight, expected)


def test_mistral_and_qwen3_folders_read_as_the_llama_they_are(tmp_path, transformers):
    """Mistral (without a window; head_dim apart from hidden/heads, as Mistral-Nemo) is Llama's
    math under Llama's names; Qwen3 adds a norm on each query and key head (qk_norm). Both load
    with the logits of their transformers classes, and Qwen3 exports as Qwen3 again."""
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB,
                  max_position_embeddings=64, rms_norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, attn_implementation="eager")
    folders = {"mistral": transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None)),
               "qwen3": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))}
    for i, (family, hf) in enumerate(folders.items()):
        _spread(hf, seed=i)
        hf.eval().save_pretrained(tmp_path / family)
        model, args = from_hf_pretrained(tmp_path / family)
        assert (args.head_size, args.kv_heads, args.qk_norm) == (32, 2, family == "qwen3")
        with torch.no_grad():
            _logits_equal(model.eval()(_ids()), hf(_ids()).logits)
    out = to_hf_pretrained(model, tmp_path / "back")  # the Qwen3 model
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                   attn_implementation="eager")
    assert type(back).__name__ == "Qwen3ForCausalLM" and not any(info.values())
    with torch.no_grad():
        _logits_equal(back.eval()(_ids(1)).logits, model(_ids(1)))
    assert read_hf_config(out) == args


def test_a_phi3_folder_reads_its_fused_tensors_as_llamas_parts_and_exports_as_llama(tmp_path, transformers):
    """Phi-3 (and Phi-4) is Llama's math with q/k/v and gate/up each one tensor a layer: loaded with
    its transformers class's logits, whole or a sharded run's parameters at a time (each part's rows
    read from the fused tensor), exported as Llama (as Mistral is); a fused tensor whose rows do not
    match the config's shape is named."""
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager"))
    _spread(hf, seed=5)
    folder = tmp_path / "phi3"
    hf.eval().save_pretrained(folder, max_shard_size="30KB")
    assert "model.layers.1.self_attn.qkv_proj.weight" in json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    model, args = from_hf_pretrained(folder)
    assert (args.kv_heads, args.ffn_dim, args.tie_embeddings, args.qkv_bias) == (2, 96, False, False)
    fused = hf.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(model.layers["1"].attention.wk.weight, fused[64:96])  # rows: q 64, k 32, v 32
    assert torch.equal(model.layers["1"].feed_forward.w3.weight, hf.model.layers[1].mlp.gate_up_proj.weight[96:])
    with torch.no_grad():
        _logits_equal(model.eval()(_ids()), hf(_ids()).logits)
    from shardline.interop.hf import hf_state_dict_chunks

    want = dict(model.named_parameters())
    got = {n: t for chunk in hf_state_dict_chunks(folder, set(want), max_bytes=40_000) for n, t in chunk.items()}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n].detach()) for n in want)
    out = to_hf_pretrained(model, tmp_path / "back")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        _logits_equal(back.eval()(_ids(1)).logits, model(_ids(1)))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight in .* has 128 rows where the config's shape gives "
                                              r"64 \+ 16 \+ 16 = 96"):
        from_hf_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))
    # A folder's faults named as the folder holds its tensors, fused, not as the parts they are read as.
    index = json.loads((folder / INDEX_NAME).read_text())
    fused_name = "model.layers.1.mlp.gate_up_proj.weight"
    shard = index["weight_map"][fused_name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != shard)
    for weight_map, message in (
            ({k: v for k, v in index["weight_map"].items() if k != fused_name}, f"lacks tensor {fused_name}"),
            ({**index["weight_map"], fused_name: other}, f"places tensor {fused_name} in {other}, which does not"),
            ({**index["weight_map"], "model.layers.1.mlp.up_proj.weight": shard},
             f"holds both {fused_name} and model.layers.1.mlp.up_proj.weight")):
        (folder / INDEX_NAME).write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(CheckpointError, match=message):
            from_hf_pretrained(folder)


def test_a_sliding_window_is_kept_held_to_and_written_back_as_mistral(tmp_path, transformers):
    """Phi-3-mini's window (2047 of 4096 positions) and Mistral 7B v0.1's (4096 of 32768): a token
    attends to itself and the window - 1 before it, so a sequence no longer than the window sees what
    the whole sequence gives it. The window is read, a launch is held to it (one line past it), and
    the export is Mistral with the window, whose logits match within it (past it the model's own forward
    refuses: it attends to the whole sequence)."""
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager"))
    _spread(hf, seed=7)
    hf.eval().save_pretrained(tmp_path / "phi3")
    model, args = from_hf_pretrained(tmp_path / "phi3")
    assert args.sliding_window == 16
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, atol=ATOL, rtol=0)
        past = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
        with pytest.raises(ValueError, match="17 tokens are past this model's sliding window of 16"):
            model(past)  # one past it the window matters: its logits were far from HF's, in silence
    out = to_hf_pretrained(model, tmp_path / "back")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 16
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(past).logits, hf(past).logits, atol=ATOL, rtol=0)
    assert read_hf_config(out) == args
    assert read_hf_config(_write_config(tmp_path / "m", model_type="mistral", max_position_embeddings=8192)
                          ).sliding_window == 4096  # MistralConfig's window when config.json leaves it out
    assert read_hf_config(_write_config(tmp_path / "n", model_type="mistral", sliding_window=4096)).sliding_window \
        == 4096  # as long as the context: kept, so a run past the context is held to it too
    assert read_hf_config(_write_config(tmp_path / "o", model_type="mistral", sliding_window=None)).sliding_window \
        is None
    from shardline.config import load_config
    from shardline.errors import ConfigError
    from shardline.preflight import check_layout  # (what a launch, a dry run and the planner check)

    check_layout(load_config(None, ["train.seq_len=16"]), 1, args)
    with pytest.raises(ConfigError, match="train.seq_len=32 is longer than the model's sliding window of 16 tokens"):
        check_layout(load_config(None, ["train.seq_len=32"]), 1, args)
    odd = dataclasses.replace(args, sliding_window=15)  # (Phi-3-mini's 2047 is odd too)
    with pytest.raises(ConfigError, match=r"use train.seq_len <= 15 \(14 is the longest this layout also takes\)"):
        check_layout(load_config(None, ["train.seq_len=32", "parallel.tp=2"]), 2, odd)  # sequence parallel: even


@pytest.mark.parametrize("tied", [False, True])
def test_a_qwen2_folder_reads_as_llama_with_qkv_biases_and_exports_as_qwen2(tmp_path, transformers, tied):
    """Qwen2 (and Qwen2.5, tied at its small sizes) is Llama with bias terms on the query, key
    and value projections: loaded with its transformers class's logits, exported as Qwen2 again
    (transformers reads every tensor), read back to the same shape."""
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        attn_implementation="eager"))
    _spread(hf, seed=3)  # the biases too: far from zero
    hf.eval().save_pretrained(tmp_path / "qwen2")
    model, args = from_hf_pretrained(tmp_path / "qwen2")
    assert (args.qkv_bias, args.qk_norm, args.tie_embeddings, args.kv_heads) == (True, False, tied, 2)
    assert torch.equal(model.layers["1"].attention.wk.bias, hf.model.layers[1].self_attn.k_proj.bias)
    assert sum(p.numel() for p in model.parameters()) == num_params(args) == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        _logits_equal(model.eval()(_ids()), hf(_ids()).logits)
    out = to_hf_pretrained(model, tmp_path / "back")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "attention_bias" not in config
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                   attn_implementation="eager")
    assert type(back).__name__ == "Qwen2ForCausalLM" and not any(info.values())
    with torch.no_grad():
        _logits_equal(back.eval()(_ids(1)).logits, model(_ids(1)))
    assert read_hf_config(out) == args


def test_qkv_biases_start_at_zero_and_a_shape_no_hf_family_has_is_not_exported(tmp_path):
    """A Qwen2-shaped model from scratch starts its biases at zero (a layout-independent
    initial value like every other); biases with a query/key norm are no HF family. The
    parameter count of Qwen2.5-0.5B's shape is transformers' (494,032,768)."""
    qwen25 = ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
                       tie_embeddings=True, qkv_bias=True)
    assert num_params(qwen25) == 494_032_768
    model = Llama(ModelArgs(**_BASE, qkv_bias=True))
    model.init_weights(seed=0)
    assert all(torch.equal(b.attention.wq.bias, torch.zeros(64)) for b in model.layers.values())
    with pytest.raises(CheckpointError, match="no Hugging Face family has bias terms on q, k and v"):
        to_hf_pretrained(Llama(ModelArgs(**_BASE, qkv_bias=True, qk_norm=True)), tmp_path / "none")
    assert not (tmp_path / "none").exists()


# ---- shardline -> HF --------------------------------------------------------------------------

_BASE = dict(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, ffn_dim=96, max_seq_len=64)
SL_CASES = {
    "gqa-untied": (ModelArgs(**_BASE, n_kv_heads=2), None),
    "mqa-tied": (ModelArgs(**_BASE, n_kv_heads=1, tie_embeddings=True), None),
    "head-dim-llama3": (ModelArgs(**_BASE, n_kv_heads=2, head_dim=32, rope_theta=500000.0,
                                  rope_scaling=LLAMA3_PAIRS), None),
    "mha-theta-sharded": (ModelArgs(**_BASE, rope_theta=123456.0, norm_eps=1e-6), 40_000),
}


@pytest.mark.parametrize("case", list(SL_CASES))
def test_shardline_to_hf_logits_match(case, tmp_path, transformers):
    args, shard_size = SL_CASES[case]
    model = Llama(args)
    model.init_weights(seed=11)
    _spread(model, seed=11)
    model.eval()
    kwargs = {"max_shard_size_bytes": shard_size} if shard_size else {}
    out = to_hf_pretrained(model, tmp_path / "hf", **kwargs)
    assert out == tmp_path / "hf"
    if shard_size:
        index = json.loads((out / INDEX_NAME).read_text())
        shards = sorted(out.glob("*.safetensors"))
        assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
        assert all(p.stat().st_size <= shard_size + 4096 for p in shards)  # header slack
    else:
        assert (out / WEIGHTS_NAME).is_file() and not (out / INDEX_NAME).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folders left behind

    hf, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True,
                                                             attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.dtype == torch.float32
    assert hf.config.tie_word_embeddings == args.tie_embeddings
    assert hf.config.head_dim == args.head_size and hf.config.num_key_value_heads == args.kv_heads
    hf.eval()
    with torch.no_grad():
        _logits_equal(hf(_ids(1)).logits, model(_ids(1)))

    assert read_hf_config(out) == args  # the config round-trips exactly
    # Both config layouts are written, so transformers < 5 reads the folder too.
    cfg = json.loads((out / "config.json").read_text())
    scaling = {"rope_type": "llama3", **dict(LLAMA3_PAIRS)} if args.rope_scaling else None
    assert (cfg["rope_theta"], cfg["rope_scaling"]) == (args.rope_theta, scaling)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": args.rope_theta, **(scaling or {})}


def test_export_bf16_and_tokenizer(tmp_path, transformers):
    model = Llama(ModelArgs(**_BASE, n_kv_heads=2))
    model.init_weights(seed=2)
    tok = tmp_path / "tok.json"
    tok.write_text('{"model": {}}')
    out = to_hf_pretrained(model, tmp_path / "hf", dtype=torch.bfloat16, tokenizer_path=tok,
                           bos_token_id=3, eos_token_id=4)
    assert (out / "tokenizer.json").read_text() == '{"model": {}}'
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["dtype"], cfg["bos_token_id"], cfg["eos_token_id"]) == ("bfloat16", 3, 4)
    tensors = load_file(out / WEIGHTS_NAME)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.layers.1.mlp.gate_proj.weight"],
                       model.layers["1"].feed_forward.w1.weight.bfloat16())
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16


def test_a_float16_export_of_weights_past_its_range_is_refused_before_writing(tmp_path):
    """An fp32 fine-tune exported as float16 (a Llama 2 folder's torch_dtype): a weight past 65504
    became inf, which transformers and vLLM load without a word."""
    model = Llama(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=96))
    with torch.no_grad():
        model.layers["0"].feed_forward.w2.weight[0, 0] = 70000.0
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.down_proj.weight is not finite as float16: its values "
                                              r"pass float16's range"):
        to_hf_pretrained(model, tmp_path / "out", dtype=torch.float16)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    to_hf_pretrained(model, tmp_path / "out", dtype=torch.bfloat16)  # its range is fp32's


def test_exported_weights_follow_the_umask(tmp_path):
    model = Llama(ModelArgs(**_BASE, n_kv_heads=2))
    model.init_weights(seed=1)
    old = os.umask(0o022)
    try:
        out = to_hf_pretrained(model, tmp_path / "hf")
    finally:
        os.umask(old)
    assert (out / WEIGHTS_NAME).stat().st_mode & 0o777 == 0o644  # readable by the group and others


def test_export_keeps_untied_copy_of_tied_model_faithful(tmp_path):
    """A tied model whose output weight has become a separate, different tensor is
    written untied, so the HF model computes what the shardline model computes."""
    model = Llama(ModelArgs(**_BASE, tie_embeddings=True))
    model.init_weights(seed=0)
    model.output.weight = torch.nn.Parameter(model.tok_embeddings.weight.detach() + 1.0)
    with pytest.warns(UserWarning, match="untied"):
        out = to_hf_pretrained(model, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in load_file(out / WEIGHTS_NAME)


# ---- config.json formats ------------------------------------------------------------------------


def _write_config(folder: Path, **fields) -> Path:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096}
    cfg.update(fields)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_reads_transformers4_config_layout(tmp_path):
    """transformers < 5: rope_theta at the top level, scaling under rope_scaling."""
    scaling = dict(LLAMA3)
    old = _write_config(tmp_path / "old", rope_theta=500000.0, rope_scaling=scaling, head_dim=None,
                        tie_word_embeddings=True)
    args = read_hf_config(old)
    assert args.rope_theta == 500000.0 and args.rope_scaling == LLAMA3_PAIRS
    assert args.head_dim is None and args.head_size == 16 and args.tie_embeddings
    # the pre-"rope_type" spelling, and no original_max_position_embeddings (taken from max_position_embeddings)
    legacy = {k: v for k, v in scaling.items() if k not in ("rope_type", "original_max_position_embeddings")}
    legacy["type"] = "llama3"
    args = read_hf_config(_write_config(tmp_path / "legacy", rope_theta=5e5, rope_scaling=legacy))
    assert dict(args.rope_scaling)["original_max_position_embeddings"] == 4096.0


def test_reads_transformers5_config_layout(tmp_path):
    """transformers 5: everything under rope_parameters, no top-level rope_theta."""
    folder = _write_config(tmp_path, rope_parameters={**LLAMA3, "rope_theta": 250000.0})
    args = read_hf_config(folder)
    assert args.rope_theta == 250000.0 and args.rope_scaling == LLAMA3_PAIRS
    folder = _write_config(tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 7.0e4})
    args = read_hf_config(folder)
    assert args.rope_theta == 70000.0 and args.rope_scaling is None
    assert read_hf_config(_write_config(tmp_path / "none")).rope_theta == 10000.0


@pytest.mark.parametrize("fields, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"model_type": "gemma"},
     "model_type='gemma'; only Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE folders"),
    ({"model_type": "mixtral", "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
     "sliding_window=16 is not supported for Mixtral"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0 must be >= 1"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "'longrope' is not supported"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
    ({"model_type": "phi3", "rope_scaling": dict(LLAMA3)}, "a Phi-3 config with llama3 RoPE scaling"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]},
     "'sliding_attention'] is not supported"),
    ({"model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 1}, "use_sliding_window=true is not"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0, "sliding_window": 16},
     "use_sliding_window=true is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True, "num_hidden_layers": 30}, "use_sliding_window=true"),
    ({"model_type": "qwen3_moe", "use_sliding_window": True, "max_window_layers": 99, "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "use_sliding_window=true"),  # (every layer there)
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_attention_heads": None}, "lacks 'num_attention_heads'"),
    ({"num_key_value_heads": 3}, "not divisible"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "lacks 'low_freq_factor'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "a quantized model .quant_method='fp8'.; shardline reads unquantized float weights"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq'"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be >= 1"),  # (was a ZeroDivisionError)
    ({"head_dim": 0}, "head_dim=0 must be >= 1"),  # (was taken for "not set")
    ({"max_position_embeddings": -5}, "max_position_embeddings=-5 must be >= 1"),  # (saved as max_seq_len -5)
])
def test_unsupported_configs_are_clear_errors(fields, message, tmp_path):
    with pytest.raises(CheckpointError, match=message):
        read_hf_config(_write_config(tmp_path, **fields))


def test_state_dict_chunks_stream_the_parameters_asked_for(tmp_path):
    """What a sharded run loads from: the parameters it holds (all, or a pipeline stage's), a
    bounded chunk at a time; the tied output from the embedding; a name the folder cannot fill
    is an error before anything is read."""
    from shardline.interop.hf import hf_state_dict_chunks

    for tied in (False, True):
        model, folder = _exported(tmp_path / str(tied), tie_embeddings=tied)
        want = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        chunks = list(hf_state_dict_chunks(folder, set(want), max_bytes=40_000))
        assert len(chunks) > 2 and all(sum(t.nbytes for t in c.values()) < 40_000 + 4 * 64 * VOCAB for c in chunks)
        got = {n: t for c in chunks for n, t in c.items()}
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n].detach()) for n in want)
        stage = {"layers.1.attention.wq.weight", "norm.weight", "output.weight"}
        assert {n for c in hf_state_dict_chunks(folder, stage) for n in c} == stage
        with pytest.raises(CheckpointError, match="has no tensor for parameter layers.7.ffn_norm.weight"):
            next(hf_state_dict_chunks(folder, {"layers.7.ffn_norm.weight"}))


# ---- errors -------------------------------------------------------------------------------------


def _exported(tmp_path: Path, **kw) -> tuple[Llama, Path]:
    model = Llama(ModelArgs(**_BASE, n_kv_heads=2, **kw))
    model.init_weights(seed=1)
    return model, to_hf_pretrained(model, tmp_path / "hf")


def test_missing_folder_or_config(tmp_path):
    for fn in (read_hf_config, from_hf_pretrained):
        with pytest.raises(CheckpointError, match="does not exist"):
            fn(tmp_path / "nowhere")
    model = Llama(ModelArgs(**_BASE))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_weights(model, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        from_hf_pretrained(tmp_path / "empty")
    _write_config(tmp_path / "noweights")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        from_hf_pretrained(tmp_path / "noweights")


def test_missing_tensor_is_named(tmp_path):
    _, folder = _exported(tmp_path)
    tensors = load_file(folder / WEIGHTS_NAME)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"lacks tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf_pretrained(folder)


def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tmp_path, transformers):
    """A folder with NaN weights trained with every step skipped as an anomaly, and exited 0. The
    refusal names the parameter and the tensor of the folder it came from (Phi-3's fused one)."""
    _, folder = _exported(tmp_path)
    tensors = load_file(folder / WEIGHTS_NAME)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, folder / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"parameter layers\.1\.feed_forward\.w3\.weight \(read from tensor "
                                              r"model\.layers\.1\.mlp\.up_proj\.weight\) holds NaN or inf"):
        from_hf_pretrained(folder)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        hf.model.layers[0].self_attn.qkv_proj.weight[70, 1] = float("inf")  # a row of k (q has 64)
    hf.save_pretrained(tmp_path / "phi3")
    with pytest.raises(CheckpointError, match=r"parameter layers\.0\.attention\.wk\.weight \(read from tensor "
                                              r"model\.layers\.0\.self_attn\.qkv_proj\.weight\) holds NaN"):
        from_hf_pretrained(tmp_path / "phi3")


def test_missing_lm_head_of_untied_model_is_named(tmp_path):
    _, folder = _exported(tmp_path)
    tensors = load_file(folder / WEIGHTS_NAME)
    del tensors["lm_head.weight"]
    save_file(tensors, folder / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"lacks tensor lm_head\.weight"):
        from_hf_pretrained(folder)


def test_extra_tensor_and_missing_shard(tmp_path):
    model, folder = _exported(tmp_path)
    tensors = load_file(folder / WEIGHTS_NAME)
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, folder / WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match=r"holds tensor model\.layers\.2\.self_attn\.q_proj\.weight"):
        load_hf_weights(model, folder)

    sharded = to_hf_pretrained(model, tmp_path / "sharded", max_shard_size_bytes=40_000)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {victim.name}, which is missing"):
        load_hf_weights(model, sharded)


def test_shape_mismatch_is_named_and_nothing_is_copied(tmp_path):
    _, folder = _exported(tmp_path)
    other = Llama(ModelArgs(**{**_BASE, "ffn_dim": 128}, n_kv_heads=2))
    other.init_weights(seed=9)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight .* has shape \[\d+, \d+\]"):
        load_hf_weights(other, folder)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_tied_model_rejects_a_different_lm_head(tmp_path):
    _, folder = _exported(tmp_path)  # untied: embed and lm_head differ
    tied = Llama(ModelArgs(**_BASE, n_kv_heads=2, tie_embeddings=True))
    before = tied.tok_embeddings.weight.detach().clone()
    with pytest.raises(CheckpointError, match="lm_head.weight that differs"):
        load_hf_weights(tied, folder)
    assert torch.equal(tied.tok_embeddings.weight, before)


def test_destination_rules(tmp_path, monkeypatch):
    model = Llama(ModelArgs(**_BASE))
    model.init_weights(seed=0)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        to_hf_pretrained(model, precious)
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]

    (tmp_path / "empty").mkdir()
    to_hf_pretrained(model, tmp_path / "empty")
    assert (tmp_path / "empty" / WEIGHTS_NAME).is_file()

    # An earlier export is replaced as a whole: its stale shards go.
    folder = to_hf_pretrained(model, tmp_path / "hf", max_shard_size_bytes=40_000, provenance={"checkpoint": "c"})
    assert (folder / INDEX_NAME).is_file()
    assert json.loads((folder / EXPORT_MARK).read_text()) == {"written_by": "shardline", "checkpoint": "c"}
    to_hf_pretrained(model, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHTS_NAME, EXPORT_MARK]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf", "precious"]
    # Given through a link (a shared drive's folder linked in): the folder it names is replaced, the link kept
    (tmp_path / "link").symlink_to(folder)
    to_hf_pretrained(model, tmp_path / "link", max_shard_size_bytes=40_000)
    assert (tmp_path / "link").is_symlink() and (folder / INDEX_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf", "link", "precious"]
    (tmp_path / "link").unlink()
    long = tmp_path / ("h" * 250)  # (the temporary folder's name once added to it: "File name too long")
    to_hf_pretrained(model, long)
    assert (long / WEIGHTS_NAME).is_file()
    shutil.rmtree(long)
    to_hf_pretrained(model, folder)
    # ... unless it holds what no export writes: a user's notes, a checkpoint or run dir put inside.
    for extra in ("README.md", "ckpt/step-000006"):
        (folder / extra).parent.mkdir(parents=True, exist_ok=True)
        (folder / extra).write_text("keep me")
        with pytest.raises(CheckpointError, match=f"is an earlier export but also holds {extra.split('/')[0]}, which"):
            to_hf_pretrained(model, folder)
        assert (folder / extra).read_text() == "keep me"
        (folder / extra).unlink()
        if "/" in extra:
            (folder / extra).parent.rmdir()
    to_hf_pretrained(model, folder)

    # An HF folder shardline did not write (the one a run started from, say) keeps its other files.
    (folder / EXPORT_MARK).unlink()
    (folder / "generation_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="without shardline_export.json"):
        to_hf_pretrained(model, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", WEIGHTS_NAME]
    # The current folder (or one above it) cannot be swapped out from under the process.
    monkeypatch.chdir(tmp_path / "empty")
    for here in (".", ".."):
        with pytest.raises(CheckpointError, match="is the current folder or holds it"):
            to_hf_pretrained(model, here)

    with pytest.raises(DataError, match="tokenizer"):
        to_hf_pretrained(model, tmp_path / "other", tokenizer_path=tmp_path / "missing.json")
    assert not (tmp_path / "other").exists()


def test_module_does_not_import_transformers():
    code = "import sys, shardline.interop.hf; assert 'transformers' not in sys.modules, 'imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")})
    assert result.returncode == 0, result.stderr


def test_a_qwen2_window_asked_for_in_no_layer_reads_as_whole_sequence_attention(tmp_path, transformers):
    """use_sliding_window=true with max_window_layers >= its layers windows no layer in transformers:
    it was refused as a window. Read, its logits are transformers' past a window of 4 tokens."""
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=2, attn_implementation="eager"))
    _spread(hf, seed=3)
    hf.eval().save_pretrained(tmp_path / "qwen2")
    model, _ = from_hf_pretrained(tmp_path / "qwen2")
    with torch.no_grad():
        _logits_equal(model.eval()(_ids()), hf(_ids()).logits)
    hf.config.max_window_layers = 1  # the second layer windowed: refused, as before
    hf.config.layer_types = None
    hf.config.save_pretrained(tmp_path / "windowed")
    config = json.loads((tmp_path / "windowed" / "config.json").read_text())
    config.pop("layer_types", None)
    (tmp_path / "windowed" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="use_sliding_window=true is not supported"):
        read_hf_config(tmp_path / "windowed")


@pytest.mark.parametrize("fields", [{"max_window_layers": 99}, {"max_window_layers": 2}, {"sliding_window": None},
                                    {"layer_types": ["full_attention", "full_attention"], "max_window_layers": 0}])
def test_a_qwen_window_that_windows_no_layer_is_read(fields, tmp_path):
    """transformers windows a Qwen2/Qwen3 layer only from max_window_layers on, with a window, unless
    layer_types says otherwise: none here (each branch of the rule apart)."""
    for family in ("qwen2", "qwen3"):
        read_hf_config(_write_config(tmp_path / family, model_type=family, use_sliding_window=True, **fields))


def test_a_side_file_linked_out_of_its_folder_is_not_copied(tmp_path, capsys):
    """A folder someone gave, holding `special_tokens_map.json -> ~/.ssh/id_rsa`, had that file copied
    by content into the run dir and every export, readable by all. Links into the folder, and into
    the Hugging Face cache's blobs beside a snapshot, are followed as before."""
    from shardline.interop.hf_files import copy_side_files

    secret = tmp_path / "secret"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    snapshot = tmp_path / "models--org--m" / "snapshots" / "abc"
    (tmp_path / "models--org--m" / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--m" / "blobs" / "f00").write_text('{"model_max_length": 8}')
    (snapshot / "tokenizer_config.json").symlink_to("../../blobs/f00")  # (the hub cache's own links)
    (snapshot / "special_tokens_map.json").symlink_to(secret)
    (snapshot / "merges.txt").write_text("#version: 0.2\n")
    (snapshot / "vocab.json").symlink_to(snapshot / "merges.txt")  # (a link inside the folder)
    out = tmp_path / "out"
    out.mkdir()
    copy_side_files(snapshot, out)
    assert sorted(p.name for p in out.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 8}'
    assert f"note: {snapshot / 'special_tokens_map.json'} links to {secret}, outside its folder: not copied" \
        in capsys.readouterr().err


def test_a_qwen_folders_window_settings_survive_a_round_trip(tmp_path, transformers):
    """A Qwen2.5 config.json names a window it leaves off (sliding_window 32768, use_sliding_window false,
    max_window_layers 21): the export wrote null and the layer count, so a diff of the two configs flagged
    them. They are written back as they were; the model is the same either way."""
    from shardline.interop.convert import convert

    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        rms_norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2))
    hf.save_pretrained(tmp_path / "qwen2")
    config = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    config.update(sliding_window=32768, use_sliding_window=False, max_window_layers=21)
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps(config))
    convert("from-hf", str(tmp_path / "qwen2"), str(tmp_path / "ckpt"))
    convert("to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back"))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["sliding_window"], back["use_sliding_window"], back["max_window_layers"]) == (32768, False, 21)
    assert read_hf_config(tmp_path / "back") == read_hf_config(tmp_path / "qwen2")
