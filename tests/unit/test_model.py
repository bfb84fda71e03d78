"""The Llama model: shapes, counts, masks, and meta-device construction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardline.models import PRESETS, Llama, ModelArgs, flops_per_token, num_params
from shardline.models.factory import build_meta_model

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96)


def small_model(**changes) -> Llama:
    model = build_meta_model(dataclasses.replace(SMALL, **changes))
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("name, billions", [("smollm-135m", 0.135), ("llama3.2-1b", 1.236), ("llama3-8b", 8.030),
                                            ("llama3-70b", 70.554), ("llama3-405b", 405.853)])
def test_presets_match_published_sizes_on_meta(name, billions):
    args = PRESETS[name]
    model = build_meta_model(args)  # no memory: 405B parameters on the meta device
    assert sum(p.numel() for p in model.parameters()) == num_params(args)
    assert num_params(args) / 1e9 == pytest.approx(billions, abs=1e-3)


def test_a_preset_sized_by_its_tokenizer_is_refused_without_a_vocabulary():
    """The tiny preset's vocab_size 0 (its tokenizer's size, filled in at launch) built Embedding(0, d)
    with a torch warning, and failed at the first forward in index_select."""
    from shardline.errors import ModelError

    with pytest.raises(ModelError, match=r"ModelArgs.vocab_size=0: give the tokenizer's size"):
        Llama(PRESETS["tiny"])
    assert Llama(dataclasses.replace(PRESETS["tiny"], vocab_size=97)).output.out_features == 97


def test_flops_per_token_formula():
    args = PRESETS["llama3-8b"]
    n_matmul = num_params(args) - args.vocab_size * args.dim - (2 * args.n_layers + 1) * args.dim
    assert flops_per_token(args, 4096) == 6 * n_matmul + 12 * 32 * 4096 * 4096


def test_init_is_seeded_and_scaled():
    a, b = small_model(), small_model()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert a.layers["0"].attention.wo.weight.std() < a.layers["0"].attention.wq.weight.std()
    assert torch.all(a.norm.weight == 1)


def test_tied_embeddings_share_storage():
    model = small_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("kv", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_attention_variants_and_explicit_head_dim(kv):
    model = small_model(n_kv_heads=kv, head_dim=24)
    x = torch.randint(0, 97, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 97) and torch.isfinite(logits).all()
    assert model.layers["0"].attention.wk.weight.shape == (kv * 24, 64)


def test_causality():
    model = small_model()
    x = torch.randint(0, 97, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 97  # change only the future
    torch.testing.assert_close(model(x)[:, :8], model(y)[:, :8])


def test_document_mask_isolates_packed_documents():
    model = small_model()
    doc_a, doc_b = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 7))
    packed = torch.cat([doc_a, doc_b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    out = model(packed, doc_ids)
    # Without RoPE offsets both documents would match their solo runs; with continuous
    # positions, doc_b sees its own tokens at positions 5..11: compare against doc_b
    # alone shifted by the same amount by checking that doc_a's tokens do not matter.
    other_a = torch.randint(0, 97, (1, 5))
    out2 = model(torch.cat([other_a, doc_b], dim=1), doc_ids)
    torch.testing.assert_close(out[:, 5:], out2[:, 5:])
    torch.testing.assert_close(out[:, :5], model(doc_a))
    # and without the mask, doc_b does depend on doc_a
    assert not torch.allclose(model(packed)[:, 5:], model(torch.cat([other_a, doc_b], dim=1))[:, 5:])


def test_llama3_rope_scaling_changes_only_low_frequencies():
    from shardline.models.llama import rope_frequencies

    base = dataclasses.replace(SMALL, head_dim=64, rope_theta=500000.0)
    scaled = dataclasses.replace(base, rope_scaling=PRESETS["llama3.2-1b"].rope_scaling)
    f0, f1 = rope_frequencies(base), rope_frequencies(scaled)
    assert torch.equal(f0[:4], f1[:4])  # high frequencies untouched
    torch.testing.assert_close(f1[-1], f0[-1] / 32)  # lowest frequency divided by the factor


def test_invalid_shape_is_reported():
    bad = dataclasses.replace(SMALL, n_heads=6, n_kv_heads=4)
    problems = bad.validate()
    assert any("not divisible by n_kv_heads" in p for p in problems)


def test_a_module_the_parameter_count_misses_is_refused_at_build(tiny_config, monkeypatch):
    """A researcher's added norm held 128 parameters that models/flops.num_params did not count: the
    start event's `params`, MFU and the planner read the formula, and were off in silence."""
    import torch

    from shardline.models.llama import parallelize
    from shardline.trainer import Trainer

    built = parallelize.build_meta_model

    def with_an_extra_norm(args):
        model = built(args)
        model.extra_norm = torch.nn.LayerNorm(args.dim, device="meta")
        return model

    monkeypatch.setattr(parallelize, "build_meta_model", with_an_extra_norm)
    with pytest.raises(ValueError, match="parameters where models/flops.num_params counts .*: a module added to the "
                                         "model needs its count there too"):
        Trainer(tiny_config("train.steps=1")).build()


def test_every_model_key_reaches_the_model():
    """A [model] key added to the config but not where model_shape applies the keys validated, was saved,
    and built the preset's model in silence (a walkthrough's new switch): each key here must change it."""
    import dataclasses

    from shardline.config import ModelConfig
    from shardline.interop.model_shape import model_shape

    base = model_shape(ModelConfig(preset="tiny"), 512)
    values = {"dim": 512, "n_layers": 3, "n_heads": 16, "n_kv_heads": 2, "head_dim": 32, "ffn_dim": 384,
              "vocab_size": 1024, "rope_theta": 123.0}
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("preset", "hf_path", "init_from"):  # (where the shape comes from, not a shape)
            continue
        value = int(not getattr(base, f.name)) if f.default == -1 else values[f.name]  # (a switch: the other way)
        built = model_shape(ModelConfig(preset="tiny", **{f.name: value}), 512)
        assert built != base, f"model.{f.name}={value} builds the preset's model: apply it in interop/model_shape.py"
