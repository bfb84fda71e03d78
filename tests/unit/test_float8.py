"""train.precision = fp8 (parallel/float8.py) on CPU, through torchao's float8 emulation.

Emulation quantises the operands to float8 exactly as the GPU recipe does and multiplies
them back in fp32, so which layers convert, the numerics of the casts, the gradients and
the trainer's path are all checked here; the real float8 GEMMs are tests/gpu's.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from shardline.errors import ConfigError  # noqa: E402
from shardline.layout import Layout  # noqa: E402
from shardline.models.factory import build_meta_model  # noqa: E402
from shardline.models.llama import ModelArgs  # noqa: E402
from shardline.models.moe import MoEArgs  # noqa: E402
from shardline.models.presets import PRESETS  # noqa: E402
from shardline.parallel import float8  # noqa: E402
from shardline.parallel.pipeline import split_backward_takes_custom_nodes  # noqa: E402
from shardline.precision import autocast  # noqa: E402
from shardline.preflight import check_config, preflight  # noqa: E402
from shardline.trainer import Trainer  # noqa: E402

# Every projection of a block is a multiple of 16 except w2's input (ffn 40): it must stay.
DENSE = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128)
BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def built(args: ModelArgs = DENSE, recipe: str | None = None) -> torch.nn.Module:
    """The model on meta, converted first when `recipe` is given (as the parallel plan does), then initialised."""
    model = build_meta_model(args)
    if recipe:
        float8.convert(model, recipe, emulate=True, fsdp_all_gather=False)
    model.init_weights(seed=0)
    return model


def train_losses(run_dir) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def converted_names(model: torch.nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converts_the_block_projections_only(recipe):
    model = built(recipe=recipe)
    expected = {f"layers.{i}.{name}" for i in range(DENSE.n_layers) for name in BLOCK_LINEARS}
    assert converted_names(model) == expected
    assert type(model.output) is torch.nn.Linear  # the logits stay bf16
    granularity = model.layers["0"].attention.wq.config.cast_config_weight.scaling_granularity.value
    assert granularity == ("tensorwise" if recipe == "tensorwise" else "axiswise")


def test_dims_not_multiple_of_16_and_moe_router_are_skipped():
    moe = MoEArgs(n_experts=4, top_k=2, expert_ffn_dim=32, shared_experts=1)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=40, moe=moe)
    names = converted_names(built(args, recipe="tensorwise"))
    assert "layers.0.feed_forward.router.gate" not in names and "layers.1.feed_forward.router.gate" not in names
    assert "layers.0.feed_forward.shared.w1" in names  # shared experts are a plain SwiGLU: converted
    assert not any("experts" in n and "shared" not in n for n in names)  # grouped experts: not Linear, bf16
    dense_ffn = {n for n in names if n.endswith(("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))}
    assert not dense_ffn  # ffn 40 is not a multiple of 16 (and no first_dense_layers here)


def test_under_tp_each_shard_of_a_converted_weight_stays_a_multiple_of_16():
    """ffn 80 = 5 x 16 converts alone, but tp 2 would give each rank 40 columns (w1, w3) or rows
    (w2), which the float8 matmul refuses: kept bf16; the attention's 64-wide dims convert at tp 2."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_dim=80)
    ffn = {"layers.0.feed_forward.w1", "layers.0.feed_forward.w2", "layers.0.feed_forward.w3"}
    for tp, want in ((1, ffn), (2, set()), (4, set())):
        model = build_meta_model(args)
        names = set(float8.convert(model, "tensorwise", emulate=True, fsdp_all_gather=False, tp=tp))
        assert names == converted_names(model)
        assert names & ffn == want, tp
        assert {n for n in names if ".attention." in n} == {f"layers.0.attention.w{x}" for x in "qkvo"}, tp


def test_emulated_forward_is_close_to_bf16_and_gradients_flow():
    torch.manual_seed(0)
    reference = built()
    fp8 = built(recipe="tensorwise")
    fp8.load_state_dict(reference.state_dict())  # same names and values: conversion keeps parameters
    tokens = torch.randint(0, DENSE.vocab_size, (2, 32))
    with autocast(torch.device("cpu"), "bf16"):
        want = reference(tokens).float()
    with autocast(torch.device("cpu"), "fp8"):
        got = fp8(tokens).float()
    assert not torch.equal(got, want)  # the casts did something
    assert (got - want).norm() / want.norm() < 5e-2
    with autocast(torch.device("cpu"), "fp8"):
        loss = fp8(tokens, labels=torch.roll(tokens, -1, 1))
    loss.backward()
    wq = fp8.layers["0"].attention.wq.weight
    assert wq.grad is not None and torch.isfinite(wq.grad).all() and wq.grad.abs().sum() > 0
    assert wq.dtype == torch.float32  # fp32 master weight


def test_trainer_fp8_emulated_trains(tiny_config, tmp_path):
    trainer = Trainer(tiny_config("train.precision=fp8", "optim.lr=1e-2", "train.steps=8",
                                  "train.eval_interval=0", "checkpoint.interval=0")).build()
    assert len(converted_names(trainer.model)) == 14 and trainer.scaler.enabled is False
    trainer.train()
    losses = train_losses(tmp_path / "run")
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1] - 0.5


def test_trainer_fp8_rowwise_builds(tiny_config):
    trainer = Trainer(tiny_config("train.precision=fp8", "fp8.recipe=rowwise", "train.steps=1")).build()
    layer = trainer.model.layers["0"].feed_forward.w1
    assert isinstance(layer, Float8Linear) and layer.config.emulate
    assert layer.config.cast_config_input.scaling_granularity.value == "axiswise"


def test_fsdp_all_gather_only_for_tensorwise():
    assert float8.linear_config("tensorwise", True, True).enable_fsdp_float8_all_gather
    assert not float8.linear_config("rowwise", True, True).enable_fsdp_float8_all_gather
    assert not float8.linear_config("tensorwise", True, False).enable_fsdp_float8_all_gather


def test_capability_below_ada_is_refused_in_one_line():
    message = float8.capability_problem((8, 0))
    assert message.count("\n") == 0 and "train.precision=fp8" in message and "8.9" in message
    assert "train.precision=bf16" in message and "8.0" in message
    assert float8.capability_problem((8, 9)) is None and float8.capability_problem((9, 0)) is None
    assert float8.capability_problem(None) is None  # CPU: emulated


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp_passes_preflight(tiny_config, recipe):
    """Tensor parallelism is built for fp8 (plain TP styles; tests/distributed/test_float8_fsdp.py runs it)."""
    launch = preflight(tiny_config("train.precision=fp8", f"fp8.recipe={recipe}", "parallel.tp=2"), 2, 512)
    assert launch.layout.tp == 2


def test_fp8_where_no_layer_can_run_in_float8_is_refused_not_trained_in_bf16(tiny_config):
    """model.dim=40 (or 48 under tp 2): no projection converted, and the run logged precision=fp8 while
    its losses were bf16's bit for bit."""
    shape = ["model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96"]
    with pytest.raises(ConfigError, match=r"^train.precision='fp8' would run no layer in float8: every projection "
                                          r"has model.dim=40 as a side.* \(so 16\); it would train in bf16"):
        preflight(tiny_config("train.precision=fp8", "model.dim=40", *shape), 1, 512)
    with pytest.raises(ConfigError, match=r"x parallel.tp=2 \(so 32\).*multiple of 32, or a lower parallel.tp$"):
        preflight(tiny_config("train.precision=fp8", "model.dim=48", "parallel.tp=2", *shape), 2, 512)
    assert preflight(tiny_config("train.precision=fp8", "model.dim=48", *shape), 1, 512).layout.tp == 1


@pytest.mark.parametrize("version, schedule, refused", [("2.11.0+cu130", "zbv", True), ("2.11.0", "dualpipev", True),
                                                        ("2.11.0", "interleaved_1f1b", False),
                                                        ("2.13.0+cpu", "zbv", False), ("2.14.1", "dualpipev", False)])
def test_fp8_with_a_split_backward_schedule_needs_torch_2_13(version, schedule, refused):
    problem = float8.config_problem("fp8", 2, schedule, torch_version=version)
    assert (problem is not None) == refused
    assert not refused or (f"pp_schedule={schedule!r} needs torch >= 2.13 (this is {version}" in problem
                           and "\n" not in problem)
    assert float8.config_problem("bf16", 2, schedule, torch_version=version) is None
    assert float8.config_problem("fp8", 1, schedule, torch_version=version) is None  # no pipeline, no split


@pytest.mark.parametrize("takes_it", [True, False])
def test_preflight_and_the_planner_refuse_fp8_under_zbv_where_torch_cannot_split_it(tiny_config, monkeypatch,
                                                                                    takes_it):
    """Both ask the same question (the planner marks what `shardline train` would refuse)."""
    from shardline.planner.layout import Workload
    from shardline.planner.search import runnable_problem

    monkeypatch.setattr(float8, "split_backward_takes_custom_nodes", lambda *_: takes_it)
    cfg = tiny_config("train.precision=fp8", "parallel.pp=2", "parallel.pp_schedule=zbv",
                      "parallel.pp_virtual_stages=2")
    lay = Layout(pp=2, pp_schedule="zbv", pp_virtual_stages=2, dp_shard=1, pp_microbatches=8)
    work = Workload(PRESETS["tiny"], 32, 8, "fp8")
    if takes_it:
        check_config(cfg)
        assert runnable_problem(work, lay) is None
    else:
        with pytest.raises(ConfigError, match="needs torch >= 2.13"):
            check_config(cfg)
        assert "needs torch >= 2.13" in runnable_problem(work, lay)


def test_missing_torchao_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"train.precision=fp8 needs torchao.*pip install 'torchao==") as err:
        float8.require_torchao()
    assert "\n" not in str(err.value)


def test_conversion_keeps_state_dict_keys():
    plain, converted = built(), built(recipe="rowwise")
    assert list(plain.state_dict()) == list(converted.state_dict())
    copied = copy.deepcopy(converted)  # checkpoints and pipeline stages may copy it
    assert [type(m) for m in copied.modules()] == [type(m) for m in converted.modules()]
    assert all(torch.equal(a, b) for a, b in zip(copied.state_dict().values(), converted.state_dict().values()))


def built_split(recipe: str = "tensorwise") -> torch.nn.Module:
    """As built(recipe), with the float8 Linear layers a split backward's schedule gets."""
    model = build_meta_model(DENSE)
    float8.convert(model, recipe, emulate=True, fsdp_all_gather=False, split_backward=True)
    model.init_weights(seed=0)
    return model


def block_run(model, x):
    """Block 0 of `model` on `x` under fp8's autocast."""
    cos, sin = model.rotary(torch.arange(x.shape[1]), x.device)
    with autocast(torch.device("cpu"), "fp8"):
        return model.layers["0"](x, cos, sin, None)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_split_backward_float8_linear_gives_torchaos_outputs_and_gradients_bit_for_bit(recipe):
    """Its backward casts and multiplies on its own (`_SplitFloat8Matmul`): it must be
    torchao's recipe exactly, both gradients, for both recipes."""
    x = torch.randn(2, 16, DENSE.dim)
    runs = []
    for model in (built(recipe=recipe), built_split(recipe)):
        inp = x.clone().requires_grad_()
        out = block_run(model, inp)
        out.pow(2).sum().backward()
        runs.append((out, inp.grad, {n: p.grad for n, p in model.layers["0"].named_parameters()}))
    (out_ao, dx_ao, dw_ao), (out, dx, dw) = runs
    assert torch.equal(out, out_ao) and torch.equal(dx, dx_ao)
    assert dw.keys() == dw_ao.keys() and all(torch.equal(dw[n], dw_ao[n]) for n in dw)


def test_the_split_linear_takes_a_leaf_input_under_autograd_grad_and_pickles():
    """A pipeline's input pass asks autograd.grad for the stage's received activation, a leaf,
    which autograd cannot be asked about; and a model with the split Linear saves and loads."""
    import pickle

    model = built_split()
    linear = model.layers["0"].attention.wq
    x = torch.randn(2, 16, DENSE.dim, requires_grad=True)
    (dx,) = torch.autograd.grad(linear(x).sum(), [x])
    assert dx.shape == x.shape and dx.abs().sum() > 0
    again = pickle.loads(pickle.dumps(linear))
    assert again.forward.args[0] is again and torch.equal(again(x), linear(x))


def _count_mm(phase_fn) -> int:
    """aten.mm calls (each float8 GEMM is one, whatever its operands) while `phase_fn` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    with Count():
        phase_fn()
    return Count.n


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("split", [False, True], ids=["torchao", "split"])
def test_zero_bubble_passes_run_each_float8_backward_gemm_once_with_the_split_linear(split, recipe):
    """zbv/dualpipev's input pass and weight pass each call every float8 Linear's one autograd
    node. torchao's Linear runs both backward GEMMs in each pass (7 Linear layers: 14 + 14,
    the premise of building `_SplitFloat8Matmul`; if torchao splits them one day, this case
    fails); the split Linear runs the input gradient's in the first, the weight's in the
    second (7 + 7), with the same gradients as one whole backward."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    if not split_backward_takes_custom_nodes():  # torch < 2.13: the weight pass refuses any custom Function
        pytest.skip("torch < 2.13 cannot run a split backward over a custom autograd Function")
    # (a copy, as pipeline stages and checkpoints may make: its Linear layers keep their own binding)
    model = copy.deepcopy(built_split(recipe)) if split else built(recipe=recipe)
    block, x = model.layers["0"], torch.randn(2, 16, DENSE.dim, requires_grad=True)
    out = block_run(model, x)
    groups = []
    input_mms = _count_mm(lambda: groups.extend(
        stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())[1]))
    weight_mms = _count_mm(lambda: stage_backward_weight(block.parameters(), groups))
    n = len(BLOCK_LINEARS)
    assert (input_mms, weight_mms) == ((n, n) if split else (2 * n, 2 * n))
    whole = built(recipe=recipe)
    whole_x = x.detach().clone().requires_grad_()
    block_run(whole, whole_x).sum().backward()
    assert torch.equal(x.grad, whole_x.grad)
    for (name, p), q in zip(block.named_parameters(), whole.layers["0"].parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("world, extra, tokens", [(1, ["train.seq_len=24", "train.micro_batch_size=2"], 48),
                                                  (1, ["train.seq_len=24", "train.micro_batch_size=1"], 24),
                                                  (4, ["train.seq_len=32", "train.micro_batch_size=1",
                                                       "parallel.cp=4"], 8)])
def test_fp8_needs_a_ranks_micro_batch_tokens_a_multiple_of_16(tiny_config, world, extra, tokens):
    """The weight gradient's float8 GEMM multiplies over those tokens (torch._scaled_mm: inner
    dims multiples of 16); emulated on a CPU it ran, on a GPU it failed at the first backward.
    A layout rule: the launch, the dry run and the planner all ask it."""
    from shardline.preflight import check_layout_before_data

    cfg = tiny_config("train.precision=fp8", *extra)
    if tokens % 16 == 0:
        check_layout_before_data(cfg, world)
        return
    with pytest.raises(ConfigError, match=rf"train.seq_len / parallel.cp = {tokens}\) to be a multiple of 16"):
        check_layout_before_data(cfg, world)
    check_layout_before_data(tiny_config("train.precision=bf16", *extra), world)  # bf16 takes any count
