"""train.compile compiles each transformer block and the loss, and trains like eager."""

from __future__ import annotations

import pytest
import torch

from shardline.config import load_config
from shardline.metrics import history
from shardline.parallel.compile import config_problem as compile_problem
from shardline.preflight import preflight
from shardline.trainer import Trainer
from tests.conftest import autograd_nodes, tiny_overrides
from tests.distributed.harness import assert_same_grad_norms, losses

SHORT = ["train.steps=3", "train.eval_interval=3", "checkpoint.interval=0", "train.micro_batch_size=2"]
# Evaluation runs the blocks under no_grad, which dynamo compiles as graphs of their own (~30%
# of a cold compile): the dense run checks it, the other compiled runs train only.
NO_EVAL = "train.eval_interval=0"


def _same_weights(compiled: Trainer, eager: Trainer) -> None:
    """The trained parameters agree, not only the losses (which a gradient scaled or lost in
    backward barely moves over three steps; the parameters move 4e-4 and more). 1e-4: inductor
    sums in its own order, and AdamW's first steps carry that to ~2e-5 in a few elements."""
    want = eager.model.state_dict()
    for name, value in compiled.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # inductor on 2 CPU cores: ~30 s of compilation
def test_compiled_run_trains_like_eager_with_chunked_loss_and_ac(tmp_path, small_corpus):
    runs = {}
    for name, extra in {"eager": [], "compiled": ["train.compile=true"]}.items():
        cfg = load_config(None, tiny_overrides(tmp_path / name, small_corpus, *SHORT, "train.loss_chunk_tokens=24",
                                               "memory.activation_checkpoint=full", *extra))
        trainer = Trainer(cfg).build()
        if name == "compiled":  # every block runs compiled code, and the loss's scoring too
            assert all(b._compiled_call_impl is not None for b in trainer.model.layers.values())
            assert trainer.model.loss.score is not runs["eager"].model.loss.score
        trainer.train()
        runs[name] = trainer
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    # The first step's compilation is start-up in the goodput account, not useful training (the excess over
    # step 2's time moved: what stays useful is about three step-2 times, under step 1's own; all three before)
    records = history(tmp_path / "compiled")
    first, second = [r["step_time_s"] for r in records if r["kind"] == "train"][:2]
    (end,) = [r for r in records if r.get("event") == "end"]
    assert first > 3 * second and end["seconds"]["useful"] < first, (first, second, end["seconds"])
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5), (step, compiled, eager)
    assert_same_grad_norms(tmp_path / "compiled", tmp_path / "eager")
    _same_weights(runs["compiled"], runs["eager"])
    # evaluation too, through the blocks' no_grad graphs
    eager, compiled = losses(tmp_path / "eager", "eval"), losses(tmp_path / "compiled", "eval")
    assert sorted(compiled) == sorted(eager) == [3]
    assert compiled[3] == pytest.approx(eager[3], rel=1e-5), (compiled, eager)


@pytest.mark.slow  # inductor on 2 CPU cores: ~45 s with a cold cache
def test_compiled_moe_trains_like_eager_with_only_the_experts_eager(tmp_path, small_corpus):
    from torch._dynamo.utils import counters

    runs, trainers = {}, {}
    for name, extra in {"eager": [], "compiled": ["train.compile=true"]}.items():
        counters.clear()
        # Both blocks MoE (no dense first block): one block graph to compile, not two.
        cfg = load_config(None, tiny_overrides(tmp_path / name, small_corpus, *SHORT, NO_EVAL, "model.preset=tiny-moe",
                                               "moe.first_dense_layers=0", *extra))
        trainer = Trainer(cfg).build()
        trainer.train()
        runs[name], trainers[name] = dict(counters["graph_break"]), trainer
        if name == "compiled":
            assert all(b._compiled_call_impl is not None for b in trainer.model.layers.values())
            assert counters["stats"]["unique_graphs"] >= 1
    # The blocks break only where the MoE layer runs eagerly on purpose (the experts and
    # the load bookkeeping): a data-dependent op would add another break and fail here.
    assert runs["compiled"] and all("torch.compiler.disable" in reason for reason in runs["compiled"]), runs
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5), (step, compiled, eager)
    assert_same_grad_norms(tmp_path / "compiled", tmp_path / "eager")
    _same_weights(trainers["compiled"], trainers["eager"])


@pytest.mark.parametrize("extra", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                   ["parallel.tp=2", "memory.activation_checkpoint=op"],
                                   ["model.preset=tiny-moe"], ["model.preset=tiny-moe", "parallel.ep=2"],
                                   ["model.preset=tiny-moe", "parallel.tp=2", "memory.activation_checkpoint=full"]])
def test_compile_passes_preflight_with_tensor_parallel_and_moe(extra):
    launch = preflight(load_config(None, ["train.compile=true", *extra]), 2, 512)
    assert (launch.layout.tp, launch.layout.ep) == (2 if "parallel.tp=2" in extra else 1,
                                                    2 if "parallel.ep=2" in extra else 1)
    assert (launch.model_args.moe is not None) == ("model.preset=tiny-moe" in extra)


@pytest.mark.parametrize("version, schedule, refused", [("2.11.0+cu130", "zbv", True), ("2.11.0", "dualpipev", True),
                                                        ("2.11.0", "1f1b", False), ("2.13.0+cpu", "zbv", False),
                                                        ("2.14.1", "dualpipev", False)])
def test_compile_with_a_split_backward_schedule_needs_torch_2_13(version, schedule, refused):
    problem = compile_problem(True, 2, schedule, torch_version=version)
    assert (problem is not None) == refused
    assert not refused or f"pp_schedule={schedule!r} needs torch >= 2.13 (this is {version}" in problem
    assert compile_problem(False, 2, schedule, torch_version=version) is None
    assert compile_problem(True, 1, schedule, torch_version=version) is None  # no pipeline, no split backward


TAG = "shardline-no-donated-buffers"


@pytest.mark.parametrize("user_tag, expected", [("", TAG), ("mine", f"mine,{TAG}"), (f"mine,{TAG}", f"mine,{TAG}")])
def test_a_split_backward_compile_tags_the_cache_key_keeping_the_users_tag(user_tag, expected):
    from shardline.parallel.compile import _NO_DONATION_TAG, _tag_cache

    assert _NO_DONATION_TAG == TAG
    before = torch.compiler.config.cache_key_tag
    with torch.compiler.config.patch(cache_key_tag=user_tag):
        _tag_cache(_NO_DONATION_TAG)
        _tag_cache(_NO_DONATION_TAG)  # a second run in the process adds nothing
        assert torch.compiler.config.cache_key_tag == expected
    assert torch.compiler.config.cache_key_tag == before  # the suite's other compiles keep their key


def test_the_cache_tag_keeps_a_donating_backward_out_of_a_compile_without_donation(tmp_path, monkeypatch):
    """The premise and the fix: inductor's FX graph cache serves a backward compiled with
    donated buffers to a compile that turned donation off (the key ignores it; a split
    backward's weight pass then reads buffers the kernel overwrote), and not once tagged."""
    from torch._dynamo.utils import counters

    from shardline.parallel.compile import _NO_DONATION_TAG, _tag_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # read at each lookup: a cold cache
    x, w = torch.randn(16, 16), torch.randn(16, 16, requires_grad=True)

    def cache_hits() -> int:
        torch._dynamo.reset()
        counters.clear()
        torch.compile(lambda a, b: (a * b).sin().cos().sum())(x, w).backward()
        return counters["inductor"]["fxgraph_cache_hit"]

    with torch._functorch.config.patch(donated_buffer=True), torch.compiler.config.patch(cache_key_tag=""), \
            torch._inductor.config.patch(fx_graph_cache=True):
        assert cache_hits() == 0  # compiled, forward and a donating backward cached
        torch._functorch.config.donated_buffer = False  # what a split backward sets (restored by the patch)
        assert cache_hits() == 2  # both served back, the donating backward included
        _tag_cache(_NO_DONATION_TAG)
        assert cache_hits() == 0
    torch._dynamo.reset()


@pytest.mark.slow  # two compiles of a one-block model: ~15 s
@pytest.mark.skipif(compile_problem(True, 2, "zbv") is not None,
                    reason="torch < 2.13 fails a compiled weight pass (preflight refuses compile with zbv there)")
def test_a_split_backward_runs_no_linear_weight_gradient_through_compiled_code_twice():
    """A zero-bubble schedule's weight pass reruns each compiled region it reaches, whose
    backward computes every gradient of the region: a whole compiled block runs its backward
    twice (the premise), while with the Linear layers kept eager (apply_compile's
    split_backward) no region it reruns holds a Linear weight. The gradients match eager's."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from shardline.models.factory import build_model_on
    from shardline.models.llama import ModelArgs
    from shardline.parallel.compile import apply_compile

    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    x = torch.randn(2, 16, 32)
    grads = {}
    with torch._functorch.config.patch(donated_buffer=False), torch.compiler.config.patch(cache_key_tag=""):
        for mode in ("eager", "whole_block", "split_backward"):
            model = build_model_on(args, "cpu")
            model.init_weights(seed=0)
            if mode != "eager":
                apply_compile(model, split_backward=mode == "split_backward")
                assert (TAG in torch.compiler.config.cache_key_tag) == (mode == "split_backward")
            block, inp = model.layers["0"], x.clone().requires_grad_()
            cos, sin = model.rotary(torch.arange(16), x.device)
            out = block(inp, cos, sin, None)
            calls = {"input": [], "weight": []}
            phase = "input"
            for node in [n for n in autograd_nodes(out) if type(n).__name__ == "CompiledFunctionBackward"]:
                node.register_prehook(lambda *_, node=node: calls[phase].append(node))
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [inp], block.parameters())
            phase = "weight"
            stage_backward_weight(block.parameters(), groups)
            grads[mode] = {"input": inp.grad, **{n: p.grad for n, p in block.named_parameters()}}
            linear_weights = {id(m.weight) for m in block.modules() if isinstance(m, torch.nn.Linear)}
            rerun_linears = [node for node in calls["weight"] for next_node, _ in node.next_functions
                             if id(getattr(next_node, "variable", None)) in linear_weights]
            if mode == "whole_block":
                assert len(calls["input"]) == len(calls["weight"]) == 1 and rerun_linears  # the premise
            if mode == "split_backward":
                assert len(calls["input"]) > 1 and calls["weight"] and not rerun_linears, calls
    for mode in ("whole_block", "split_backward"):
        for name, want in grads["eager"].items():
            torch.testing.assert_close(grads[mode][name], want, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")


@pytest.mark.parametrize("overrides, world, expected", [
    ([], 1, "off (train.compile=false)"),
    (["train.compile=true"], 1, "each transformer block whole; the loss's cross-entropy"),
    pytest.param(["train.compile=true", "parallel.pp=2", "parallel.pp_schedule=dualpipev", "train.micro_batch_size=2"],
                 2, "each block between its Linear layers, which run eagerly (dualpipev's weight pass",
                 marks=pytest.mark.skipif(compile_problem(True, 2, "dualpipev") is not None,
                                          reason="torch < 2.13 refuses compile with dualpipev at preflight")),
    (["train.compile=true", "parallel.tp=2", "parallel.loss_parallel=true", "memory.activation_checkpoint=op"], 2,
     "each block's forward, inside its activation checkpoint; the loss eager (loss parallelism)"),
    (["train.compile=true", "model.preset=tiny-moe"], 1, "each transformer block whole; routed experts eager;"),
    (["train.compile=true", "parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2"], 4,
     "each transformer block whole; the cp ring's attention eager; the loss's"),
    (["train.compile=true", "parallel.cp=2", "parallel.cp_mode=ulysses"], 2,
     "each transformer block whole; the loss's cross-entropy"),
])
def test_what_compile_compiles_is_named_in_one_line_for_the_dry_run_and_the_log(overrides, world, expected):
    from shardline.parallel.compile import describe

    cfg = load_config(None, overrides)
    launch = preflight(cfg, world, 512)
    line = describe(cfg.train.compile, launch.layout, cfg.memory.activation_checkpoint, launch.model_args.moe)
    assert line.startswith(expected), line
