"""The mixture-of-experts layer on one process: routing, experts, capacity, balancing, config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardline.config import load_config
from shardline.errors import ConfigError
from shardline.models import PRESETS, flops_per_token, num_params
from shardline.models.factory import args_from_json, args_to_json, build_model_on
from shardline.models.llama.model import ModelArgs
from shardline.models.moe import MoEArgs
from shardline.models.moe.layer import MoEFeedForward, grouped_mm_usable, loop_experts, moe_layers, update_bias
from shardline.parallel.activation_checkpoint import apply_ac
from shardline.interop.model_shape import model_shape

MOE = MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=8)
ARGS = ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32, ffn_dim=24, moe=MOE)


def _layer(moe: MoEArgs = MOE, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(dataclasses.replace(ARGS, moe=moe))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.router.expert_bias.zero_()
    return layer


def _x(b=2, s=8, seed=1):
    return torch.randn(b, s, ARGS.dim, generator=torch.Generator().manual_seed(seed))


def _naive(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time (the definition)."""
    flat = x.reshape(-1, x.shape[-1])
    _, _, chosen, weights = layer.router(flat)
    e = layer.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for k in range(chosen.shape[1]):
            i = int(chosen[t, k])
            h = F.silu(flat[t] @ e.w1[i].T) * (flat[t] @ e.w3[i].T)
            out[t] += weights[t, k] * (h @ e.w2[i].T)
    out = out.view_as(x)
    return out + layer.shared(x) if layer.shared is not None else out


def test_grouped_matmul_equals_the_loop_of_experts():
    assert grouped_mm_usable(torch.zeros(1))  # this CPU build has it; else the loop would be tested twice
    layer = _layer()
    x = torch.randn(10, ARGS.dim, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])
    got = layer.experts(x, counts)
    want = loop_experts(x, counts, layer.experts.w1, layer.experts.w3, layer.experts.w2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    (wx,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("moe", [MOE, dataclasses.replace(MOE, shared_experts=1),
                                 dataclasses.replace(MOE, router="sigmoid", route_scale=2.5),
                                 dataclasses.replace(MOE, norm_topk=False, top_k=1)])
def test_dropless_layer_computes_every_token_through_its_experts(moe):
    layer = _layer(moe)
    x = _x()
    torch.testing.assert_close(layer(x), _naive(layer, x), rtol=1e-5, atol=1e-5)


def test_sigmoid_router_weights_are_normalised_then_scaled():
    layer = _layer(dataclasses.replace(MOE, router="sigmoid", route_scale=2.5))
    _, scores, chosen, weights = layer.router(_x().reshape(-1, ARGS.dim))
    torch.testing.assert_close(weights.sum(-1), torch.full((16,), 2.5))
    assert (scores > 0).all() and (scores < 1).all()


def test_capacity_drops_the_overflow_and_counts_it():
    moe = dataclasses.replace(MOE, capacity_factor=0.5)
    layer = _layer(moe)
    x = _x()
    layer.train()
    out = layer(x)
    flat = x.reshape(-1, ARGS.dim)
    _, _, chosen, weights = layer.router(flat)
    cap = moe.capacity(flat.shape[0])  # ceil(0.5 * 16 * 2 / 4) = 4
    assert cap == 4
    counts = torch.bincount(chosen.flatten(), minlength=4)
    assert float(layer.dropped) == float((counts - counts.clamp(max=cap)).sum()) > 0
    # The reference keeps each expert's first `cap` (token, slot) pairs in token order.
    seen = [0] * 4
    keep = torch.zeros_like(weights)
    for t in range(flat.shape[0]):
        for k in range(2):
            i = int(chosen[t, k])
            keep[t, k] = float(seen[i] < cap)
            seen[i] += 1
    full = _naive(layer, x).reshape(-1, ARGS.dim)
    torch.testing.assert_close(out.reshape(-1, ARGS.dim)[keep.sum(1) == 2], full[keep.sum(1) == 2])
    assert not torch.allclose(out.reshape(-1, ARGS.dim)[keep.sum(1) < 2], full[keep.sum(1) < 2])


def test_capacity_drops_in_training_only():
    """Evaluation is dropless: a cut by capacity depends on which tokens share the micro-batch,
    so the held-out loss would change with the micro-batch size."""
    layer = _layer(dataclasses.replace(MOE, capacity_factor=0.5))
    x = _x()
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _naive(layer, x), rtol=1e-5, atol=1e-5)
        one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
        torch.testing.assert_close(one_by_one, layer(x), rtol=1e-5, atol=1e-5)
    layer.train()
    assert not torch.allclose(layer(x).detach(), _naive(layer, x).detach())


def test_routing_runs_in_fp32_under_autocast():
    """bf16 autocast must not round the router's logits: the experts chosen would change
    with the compute dtype."""
    from shardline.models.moe.layer import Router

    torch.manual_seed(0)
    router = Router(64, MoEArgs(n_experts=32, top_k=8, expert_ffn_dim=8))
    router.gate.weight.data.normal_(std=0.02)
    x = torch.randn(256, 64)
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch.equal(got[2], want[2])


def test_moe_presets_pull_as_hard_as_their_published_balance_coefficients():
    """Our balance loss is 1 per layer at perfect balance (summed over layers), HF's top_k with
    the layers pooled: the presets rescale the published router_aux_loss_coef to match, and an
    export scales it back."""
    from shardline.interop.hf_config import hf_balance_coef

    layer = _layer(dataclasses.replace(MOE, aux_loss_coef=1.0))
    even = torch.full((8, 4), 0.25)
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(layer.balance_loss(even.log(), even, chosen, 1, 8)) == pytest.approx(1.0)  # per layer, balanced
    for name, published in (("mixtral-8x7b", 0.02), ("qwen3-moe-30b-a3b", 0.001)):
        args = PRESETS[name]
        ours_at_balance = args.moe.aux_loss_coef * args.n_layers  # every layer is MoE in both
        assert ours_at_balance == pytest.approx(published * args.moe.top_k), name
        # ... and an export writes the published coefficient back
        assert hf_balance_coef(args) == pytest.approx(published), name


def test_balance_loss_is_a_sum_over_sequences_and_trains_through_the_output():
    moe = dataclasses.replace(MOE, aux_loss_coef=0.1, z_loss_coef=0.01)
    layer = _layer(moe)
    x = _x(b=2)
    flat = x.reshape(-1, ARGS.dim)
    logits, scores, chosen, _ = layer.router(flat)
    both = layer.balance_loss(logits, scores, chosen, 2, 8)
    parts = [layer.balance_loss(*(t.view(2, 8, -1)[i] for t in (logits, scores, chosen)), 1, 8) for i in range(2)]
    torch.testing.assert_close(both, parts[0] + parts[1])
    # Switch loss of a perfectly balanced router is coef exactly; this one is above it.
    assert both > 2 * 0.1
    # The gradient of out.sum() includes scale x d(aux): as if scale x aux were in the loss.
    layer.aux_grad_scale.fill_(0.5)
    layer(x).sum().backward()
    got = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    logits, scores, chosen, _ = layer.router(flat)
    out, _ = layer.route(flat, chosen, layer.router(flat)[3])
    (out.sum() + 0.5 * layer.balance_loss(logits, scores, chosen, 2, 8)).backward()
    torch.testing.assert_close(got, layer.router.gate.weight.grad)


def _imbalance(layer: MoEFeedForward, x: torch.Tensor) -> float:
    _, _, chosen, _ = layer.router(x.reshape(-1, ARGS.dim))
    load = torch.bincount(chosen.flatten(), minlength=layer.moe.n_experts).float()
    return float(load.max() / load.mean())


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_bias_update_evens_out_a_skewed_load(rate):
    moe = dataclasses.replace(MOE, n_experts=8, bias_update_rate=rate)
    layer = _layer(moe)
    with torch.no_grad():
        layer.router.gate.weight[0] += 0.5  # with inputs of positive mean, expert 0 wins most tokens
        layer.router.gate.weight[1] += 0.25
    x = _x(b=8, s=16) + 0.5
    before = _imbalance(layer, x)
    for _ in range(300):
        _, _, chosen, _ = layer.router(x.reshape(-1, ARGS.dim))
        update_bias(layer, torch.bincount(chosen.flatten(), minlength=8).float())
    after = _imbalance(layer, x)
    assert before > 2.0
    if rate:
        assert after < min(1.75, before / 2), (before, after)  # sign steps leave some jitter
    else:
        assert after == before


def test_activation_checkpointing_counts_each_forward_once():
    args = dataclasses.replace(ARGS, moe=dataclasses.replace(MOE, aux_loss_coef=0.01))
    model = build_model_on(args, "meta")
    model.init_weights(seed=0)
    apply_ac(model, "full", 1)
    model.train()
    model(torch.randint(0, 32, (2, 8))).sum().backward()  # backward recomputes every block's forward
    for layer in moe_layers(model):
        assert int(layer.forwards) == 1 and float(layer.load.sum()) == 2 * 8 * 2


def test_presets_count_published_total_and_active_parameters():
    mixtral, qwen = PRESETS["mixtral-8x7b"], PRESETS["qwen3-moe-30b-a3b"]
    assert round(num_params(mixtral) / 1e9, 1) == 46.7 and round(num_params(mixtral, active=True) / 1e9, 1) == 12.9
    assert round(num_params(qwen) / 1e9, 1) == 30.5 and round(num_params(qwen, active=True) / 1e9, 1) == 3.4
    tiny = dataclasses.replace(PRESETS["tiny-moe"], vocab_size=512)
    model = build_model_on(tiny, "meta")
    assert sum(p.numel() for p in model.parameters()) == num_params(tiny)
    dense_twin = dataclasses.replace(tiny, moe=None)
    # MFU counts active parameters: 2 of 8 experts + the shared one cost less than 8.
    assert flops_per_token(dense_twin, 256) < flops_per_token(tiny, 256)
    assert num_params(tiny, active=True) < num_params(tiny)


def test_model_args_round_trip_through_checkpoint_json():
    args = PRESETS["qwen3-moe-30b-a3b"]
    assert args_from_json(args_to_json(args)) == args


def test_moe_section_overrides_the_preset_or_makes_a_dense_one_moe():
    cfg = load_config(None, ["model.preset=tiny-moe", "moe.num_experts=16", "moe.top_k=4", "moe.router=sigmoid",
                             "moe.capacity_factor=1.25", "moe.aux_loss_coef=0", "moe.route_scale=2.5"])
    moe = model_shape(cfg.model, 512, cfg.moe).moe
    assert (moe.n_experts, moe.top_k, moe.router, moe.capacity_factor, moe.aux_loss_coef, moe.route_scale) == (
        16, 4, "sigmoid", 1.25, 0, 2.5)
    assert moe.shared_experts == 1 and moe.first_dense_layers == 1  # kept from the preset
    cfg = load_config(None, ["moe.num_experts=4", "moe.top_k=1", "moe.expert_ffn_dim=64", "moe.norm_topk=0"])
    assert model_shape(cfg.model, 512, cfg.moe).moe == MoEArgs(n_experts=4, top_k=1, expert_ffn_dim=64,
                                                               norm_topk=False)
    assert model_shape(load_config(None, []).model, 512, load_config(None, []).moe).moe is None


def test_top_1_routing_with_renormalised_weights_is_refused_since_the_router_would_not_learn():
    """Renormalised, a token's one weight is s / s = 1: no gradient of the loss reaches the gate."""
    from shardline.models.moe.layer import Router

    x = torch.randn(8, 64)
    for norm_topk, learns in ((True, False), (False, True)):  # the trap itself, and the way out
        router = Router(64, dataclasses.replace(MOE, top_k=1, norm_topk=norm_topk))
        router.gate.weight.data.normal_(std=0.02)
        (router(x)[3] * torch.randn(8, 1)).sum().backward()
        assert bool(router.gate.weight.grad.abs().max() > 1e-4) is learns
    for preset in ("tiny-moe", "tiny"):
        cfg = load_config(None, [f"model.preset={preset}", "moe.num_experts=4", "moe.top_k=1", "moe.expert_ffn_dim=64"])
        with pytest.raises(ConfigError, match="moe.top_k=1 with renormalised weights .* set moe.norm_topk=0"):
            model_shape(cfg.model, 512, cfg.moe)
    # Every block dense: the dry run said "8 experts, top 2" of a dense model, and ep laid out none
    cfg = load_config(None, ["model.preset=tiny-moe", "model.n_layers=4", "moe.first_dense_layers=4"])
    with pytest.raises(ConfigError, match=r"moe.first_dense_layers=4 must be in 0..3, below model.n_layers=4: at 4 "
                                          "no block has experts"):
        model_shape(cfg.model, 512, cfg.moe)


@pytest.mark.parametrize("override, message", [
    ("moe.router=relu", "moe.router='relu' is invalid"),
    ("moe.capacity_factor=-2", "moe.capacity_factor=-2"),
    ("moe.num_experts=-1", "moe.num_experts=-1"),
    ("moe.norm_topk=2", "moe.norm_topk=2 is invalid: -1"),
    ("moe.route_scale=0", "moe.route_scale=0.0 is invalid: must be > 0"),
])
def test_bad_moe_keys_get_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [override]).check_sections()


def test_a_shape_inference_forward_on_garbage_leaves_the_steps_balance_loss_finite():
    """A pipeline schedule's first step runs one forward more, on uninitialised inputs that may
    be NaN: it is taken out of the step's counts, its balance loss too (NaN - NaN was NaN)."""
    from shardline.layout import Layout
    from shardline.parallel.dims import ParallelDims
    from shardline.parallel.expert.balance import ExpertBalance

    layer = _layer(dataclasses.replace(MOE, aux_loss_coef=0.01))
    model = torch.nn.ModuleDict({"ffn": layer})
    balance = ExpertBalance(model, ParallelDims(Layout(micro_batch_size=2)), global_batch=4)  # 2 micro-batches
    balance.begin_step(torch.ones(()))
    layer.train()
    real = [_x(seed=s) for s in (1, 2)]
    layer(torch.full_like(real[0], float("nan")))  # the inference pass
    for x in real:
        layer(x)
    balance.end_step()
    expected = _layer(dataclasses.replace(MOE, aux_loss_coef=0.01))
    expected.train()
    plain = ExpertBalance(torch.nn.ModuleDict({"ffn": expected}), ParallelDims(Layout(micro_batch_size=2)), 4)
    plain.begin_step(torch.ones(()))
    for x in real:
        expected(x)
    plain.end_step()
    assert torch.isfinite(layer.aux_value) and layer.aux_value.item() == pytest.approx(expected.aux_value.item())
    assert torch.equal(balance.loads[0], expected.load)


def test_the_dropped_slots_are_logged_with_their_share_of_the_steps_and_each_layers_load(tiny_config, tmp_path):
    """"dropped 4,261" had no denominator: 69% of a step's (token, slot) pairs read as a few; and the
    load was the worst layer's alone, which did not say which layer collapsed."""
    import json

    from shardline.metrics import format_line
    from shardline.trainer import Trainer

    cfg = tiny_config("model.preset=tiny-moe", "moe.capacity_factor=0.5", "train.steps=2", "train.eval_interval=0",
                      "metrics.log_interval=1", "checkpoint.interval=0")
    trainer = Trainer(cfg).build()
    args = trainer.model_args  # (the shape it trains: TINY_OVERRIDES over the preset)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "train"]
    slots = cfg.train.global_batch_size * cfg.train.seq_len * args.moe.top_k * (args.n_layers
                                                                                 - args.moe.first_dense_layers)
    assert len(trained) == 2
    for record in trained:
        assert record["dropped_tokens"] > 0
        assert record["dropped_share"] == pytest.approx(record["dropped_tokens"] / slots)
        assert f"({100 * record['dropped_share']:.1f}%)" in format_line(record, 2)
        # each MoE layer's own imbalance, by its index (the first block is dense): the worst is the logged max
        assert list(record["expert_load_by_layer"]) == [str(i) for i in range(args.moe.first_dense_layers,
                                                                              args.n_layers)]
        assert max(record["expert_load_by_layer"].values()) == pytest.approx(record["expert_load_max"], abs=1e-4)
