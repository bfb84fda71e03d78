"""Planner memory model against published figures and against what autograd really saves."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shardline.models import PRESETS
from shardline.models.llama import Llama, ModelArgs
from shardline.parallel.activation_checkpoint import apply_ac
from shardline.planner import activations as act
from shardline.planner.hardware import get_hardware
from shardline.planner.layout import Layout, Workload
from shardline.planner.memory import (
    GiB,
    expert_layer_params,
    layer_params,
    memory_breakdown,
    ranks,
    stage_params,
    state_bytes,
    zero_model_states,
    zero_stage,
)
from shardline.planner.offload import OUTSIDE_DEVICE, offloaded


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_7_5b_on_64_gpus(stage, expected_gb):
    # ZeRO paper, figure 1: Psi = 7.5B, N_d = 64, K = 12 (Adam, fp16 mixed precision).
    states = zero_model_states(7.5e9, 64, stage)
    assert sum(states.values()) / 1e9 == pytest.approx(expected_gb, abs=0.05)


def _gpt(s, b, h, a, **kw) -> float:
    return act.block_bytes_per_token(act.gpt_block(h, a, s), **kw) * s * b


@pytest.mark.parametrize("s, b, h, a, t", [(2048, 1, 12288, 96, 8), (4096, 4, 4096, 32, 4), (1024, 2, 2048, 16, 2)])
def test_korthikanti_gpt_formulas(s, b, h, a, t):
    sbh = s * b * h
    assert _gpt(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert _gpt(s, b, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert _gpt(s, b, h, a, tp=t, sp=True, megatron_sp=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert _gpt(s, b, h, a, tp=t, sp=True, megatron_sp=True, drop_scores=True) == pytest.approx(34 * sbh / t)
    assert act.boundary_bytes_per_token(h=h, value_bytes=2) * s * b == 2 * sbh  # full recompute


def _autograd_saved_bytes_per_token(args: ModelArgs, precision: str, b: int = 2, s: int = 37,
                                    compiled: bool = False, copies: dict | None = None, ac: str = "none",
                                    float8: bool = False, device: str = "cpu") -> float:
    """Bytes of the distinct tensors one real block saves for backward (weights, RoPE tables excluded;
    autocast's weight copies go to `copies`, storage -> bytes, when it is given), on `device`."""
    from shardline.models.moe.model import MoETransformer

    torch.manual_seed(0)
    model = (MoETransformer if args.moe is not None else Llama)(args).to(device)
    apply_ac(model, ac)  # eagerly, the checkpoint's own hooks would hide what it keeps: compiled only
    if float8:  # emulated on the CPU; its per-tensor scales (0-dim) are not counted
        from shardline.parallel.float8 import convert

        convert(model, "tensorwise", emulate=True, fsdp_all_gather=False)
    block = torch.compile(model.layers["0"]) if compiled else model.layers["0"]
    x = torch.randn(b, s, args.dim, requires_grad=True, device=device)
    rotary = model.rotary
    cos, sin = rotary(torch.arange(s), x.device)
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}
    shapes = _weight_shapes(model)

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        copy = precision != "fp32" and t.dtype == torch.bfloat16 and t.dim() in (2, 3) and tuple(t.shape) in shapes
        if ptr not in exclude and t.dim() > 0:
            (copies if copy and copies is not None else saved if not copy else {})[ptr] = t.untyped_storage().nbytes()
        return t

    mixed = precision in ("bf16", "fp8")
    ctx = torch.autocast(device, dtype=torch.bfloat16) if mixed else torch.autocast(device, enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        block(x, cos, sin, None)
    return sum(saved.values()) / (b * s)


def _weight_shapes(model) -> set[tuple[int, ...]]:
    shapes = set()
    for p in model.parameters():
        if p.dim() == 2:
            shapes |= {tuple(p.shape), tuple(p.shape[::-1])}
        if p.dim() == 3:  # (routed experts' stacked weights, cast for the grouped GEMM, and transposed)
            shapes |= {tuple(p.shape), (p.shape[0], p.shape[2], p.shape[1])}
    return shapes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads, dim, ffn", [(2, 64, 160), (4, 96, 256)])
def test_llama_block_constants_match_what_autograd_saves(precision, kv_heads, dim, ffn):
    # The autocast weight copies are not activations (the memory model counts them as
    # compute copies of the weights); 74 tokens keep activations from having a weight's shape.
    args = ModelArgs(dim=dim, n_layers=1, n_heads=4, n_kv_heads=kv_heads, vocab_size=97, ffn_dim=ffn)
    predicted = act.block_bytes_per_token(act.llama_block(args, precision))
    assert _autograd_saved_bytes_per_token(args, precision) == pytest.approx(predicted, rel=1e-9)


@pytest.mark.slow
def test_compiled_block_constants_match_what_a_compiled_block_saves():
    """train.compile's block keeps what the compiler's partition of it saves, counted here on
    a compiled block (GQA, bf16 autocast): about 60% of the eager block's bytes. An MoE block's
    routed experts run eagerly and are priced with eager's SwiGLU (4c, not 3c, a unit of width)."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=160)
    predicted = act.block_bytes_per_token(act.llama_compiled_block(args, "bf16"))
    copies: dict[int, int] = {}
    assert _autograd_saved_bytes_per_token(args, "bf16", compiled=True, copies=copies) == pytest.approx(
        predicted, rel=1e-9)
    # It keeps autocast's bf16 copy of each of its 7 weights for backward, as eager does (the
    # planner's `params` term): 2 B a weight parameter.
    assert len(copies) == 7 and sum(copies.values()) == 2 * sum(
        p.numel() for p in Llama(args).layers["0"].parameters() if p.dim() == 2)
    assert predicted < 0.7 * act.block_bytes_per_token(act.llama_block(args, "bf16"))
    # Op-level AC traced into the compiled block: the matmul and attention outputs but w2's (nothing
    # in backward needs it), and no weight copy (the policy recomputes the casts).
    copies.clear()
    op = act.block_bytes_per_token(act.llama_op_ac_block(args, "bf16", compiled=True))
    assert _autograd_saved_bytes_per_token(args, "bf16", compiled=True, copies=copies, ac="op") == pytest.approx(op)
    assert not copies and op < act.block_bytes_per_token(act.llama_op_ac_block(args, "bf16"))
    moe = PRESETS["tiny-moe"]
    dense = dataclasses.replace(moe, moe=None, ffn_dim=act.ffn_width(moe))
    routed = act.routed_ffn_width(moe)
    assert routed > 0 and act.block_bytes_per_token(act.llama_compiled_block(moe, "bf16")) == pytest.approx(
        act.block_bytes_per_token(act.llama_compiled_block(dense, "bf16")) + 2 * routed
        + act.block_bytes_per_token(act.routed_saved(moe, "bf16", compiled=True)))
    # A compiled MoE block (fp32: the CPU's grouped GEMM) keeps each slot's gathered row and output, to a few
    # bytes a token (the router's small tensors as the compiler partitions them)
    for top_k in (1, 4):
        one = _moe_block(top_k)
        assert _autograd_saved_bytes_per_token(one, "fp32", compiled=True) == pytest.approx(
            act.block_bytes_per_token(act.llama_compiled_block(one, "fp32")), rel=1e-3)


def _moe_block(top_k: int, shared: int = 0) -> ModelArgs:
    """One MoE block of tiny-moe's shape with `top_k` routed slots a token."""
    base = PRESETS["tiny-moe"]
    moe = dataclasses.replace(base.moe, top_k=top_k, first_dense_layers=0, shared_experts=shared, aux_loss_coef=0.0)
    return dataclasses.replace(base, dim=128, n_layers=1, moe=moe, vocab_size=97)  # (the preset's 0: its tokenizer's)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_an_moe_block_keeps_each_slots_rows_as_autograd_saves_them(top_k):
    """An MoE block keeps, for each routed slot, its gathered input, its output and the gate-weighted output
    (three rows of dim) beside the experts' SwiGLU: the estimate counted the SwiGLU alone, so a run at
    top_k 8 measured more than the dry run said, and one at top_k 2 less (fp32: the CPU's grouped GEMM)."""
    args = _moe_block(top_k, shared=top_k % 2)  # (a shared expert beside the routed ones, at top_k 1)
    saved = _autograd_saved_bytes_per_token(args, "fp32")
    assert saved == pytest.approx(act.block_bytes_per_token(act.llama_block(args, "fp32")), rel=1e-3)
    routed = act.routed_saved(args, "fp32")
    assert act.block_bytes_per_token(routed) > 12 * top_k * args.dim
    # Every tp rank routes the whole sequence and runs its experts on a slice of the rows: their input a
    # tp-th, the output (summed over tp) and its weighted copy whole
    assert act.block_bytes_per_token(routed) - act.block_bytes_per_token(routed, tp=2, sp=True) == pytest.approx(
        4 * top_k * args.dim / 2)


@pytest.mark.slow
def test_a_compiled_float8_block_keeps_no_linear_input_and_no_weight_copy():
    """Compiled with float8 Linear layers (tensorwise; emulated here), a block recasts the Linear
    inputs and the weights in backward from what it keeps: neither norm output, nor SwiGLU's
    product, nor any weight copy (the planner's fp8 activations and params)."""
    pytest.importorskip("torchao")
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=160)
    copies: dict[int, int] = {}
    kept = _autograd_saved_bytes_per_token(args, "fp8", compiled=True, copies=copies, float8=True)
    assert kept == pytest.approx(act.block_bytes_per_token(act.llama_compiled_block(args, "fp8")), rel=1e-9)
    assert not copies and kept < act.block_bytes_per_token(act.llama_compiled_block(args, "bf16"))


def test_an_eager_float8_block_keeps_no_weight_copy():
    """Eager too, float8's Linear layers cast the fp32 weights themselves and save the weight, not a
    copy (planner/peak.float8_blocks). Their inputs: on the CPU, with CUDA autocast off, torchao
    keeps each norm's fp32 output once where a GPU keeps autocast's bf16 cast per Linear, as
    bf16 does (tests/gpu/test_float8_gpu.py counts it there): 4h per norm in place of a 2h cast per
    consuming Linear (3 and 2 of them), 2h fewer in all."""
    pytest.importorskip("torchao")
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=160)
    copies: dict[int, int] = {}
    kept = _autograd_saved_bytes_per_token(args, "fp8", copies=copies, float8=True)
    assert not copies
    assert kept == pytest.approx(act.block_bytes_per_token(act.llama_block(args, "fp8")) - (3 + 2) * 2 * 64
                                 + 2 * 4 * 64, rel=1e-9)


def test_llama_constants_in_units_of_h_for_a_gpt_shape():
    h = 4096
    args = ModelArgs(dim=h, n_layers=1, n_heads=32, vocab_size=10, ffn_dim=4 * h)
    bf16 = act.block_bytes_per_token(act.llama_block(args, "bf16"))
    assert bf16 == pytest.approx((26 + 8 + 32) * h + 4 * 32 + 8)  # 66h: vs GPT's 34h, see the docstring
    fp32 = act.block_bytes_per_token(act.llama_block(args, "fp32"))
    assert fp32 == pytest.approx((24 + 16 + 64) * h + 4 * 32 + 8)


def test_activation_checkpointing_modes_are_ordered():
    m = PRESETS["llama3-8b"]
    per = {mode: act.layer_bytes_per_token(m, "bf16", 1, False, mode, 2) for mode in act_modes()}
    assert per["full"] < per["op"] < per["selective"] < per["none"]
    assert per["full"] == 4 * m.dim
    assert per["selective"] == pytest.approx((per["none"] + per["full"]) / 2)


def test_op_level_ac_keeps_the_row_parallel_outputs_whole_under_sequence_parallelism():
    """Op-level AC saves every matmul output; the row-parallel ones (wo, w2) are full-sequence
    partial sums on each rank before their reduce-scatter, so sequence parallelism divides
    only the block input and tensor parallelism the column-parallel outputs."""
    m = PRESETS["llama3-8b"]
    h, q, kv, f, a, t = m.dim, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_dim, m.n_heads, 8
    expected = (4 * h + 2 * (q + 2 * kv) + 2 * q + 4 * a + 2 * 2 * f) / t + 2 * 2 * h
    assert act.layer_bytes_per_token(m, "bf16", t, True, "op", 1) == pytest.approx(expected)


def act_modes():
    return ("none", "op", "selective", "full")


def test_trainer_model_states_by_layout():
    w = Workload(PRESETS["llama3-8b"], 4096, 64, "bf16")
    psi = 8.0e9
    single = state_bytes(w, Layout(), psi)
    assert sum(single.values()) == pytest.approx(18 * psi)  # fp32 master+m+v 12, fp32 grads 4, bf16 copy 2
    fsdp = state_bytes(w, Layout(dp_shard=8, zero=3), psi)
    assert sum(fsdp.values()) == pytest.approx(16 * psi / 8)
    zero2 = state_bytes(w, Layout(dp_shard=8, zero=2), psi)
    assert sum(zero2.values()) == pytest.approx(2 * psi + 16 * psi / 8)
    fp32 = state_bytes(Workload(PRESETS["llama3-8b"], 4096, 64, "fp32"), Layout(), psi)
    assert sum(fp32.values()) == pytest.approx(16 * psi)
    lay = Layout(dp_shard=8, zero=3, cpu_offload=True)
    kept, host, ssd = offloaded(state_bytes(w, lay, psi), lay, w, get_hardware("h200"), zero_stage(lay), psi / 8)
    assert sum(kept.values()) == 0 and host == pytest.approx(16 * psi / 8) and ssd == 0


def test_fp16_under_fsdp_gathers_fp32_and_keeps_autocasts_copies():
    """fp16 FSDP gathers fp32 weights (data_parallel._PARAM_DTYPES) and autocast casts them:
    zero=2 keeps 4 bytes gathered plus the 2-byte copies (bf16: the 2 gathered only); zero=3
    gathers two blocks at 4 bytes and autocast's cache holds every weight's copy to the end of
    the forward. The gather traffic doubles too."""
    from shardline.planner.estimate import estimate

    hw = get_hardware("h200")
    lay2 = Layout(dp_shard=8, zero=2, micro_batch_size=1, activation_checkpoint="full")
    lay3 = Layout(dp_shard=8, zero=3, micro_batch_size=1, activation_checkpoint="full")
    bf16, fp16 = (Workload(PRESETS["llama3-8b"], 4096, 32, p) for p in ("bf16", "fp16"))
    psi = stage_params(bf16, lay2, ranks(bf16, lay2)[0])
    assert memory_breakdown(fp16, lay2, hw)["params"] - memory_breakdown(bf16, lay2, hw)["params"] == \
        pytest.approx(4 * psi)
    extra = memory_breakdown(fp16, lay3, hw)["buffers"] - memory_breakdown(bf16, lay3, hw)["buffers"]
    assert extra == pytest.approx(2 * psi + 2 * 2 * layer_params(bf16, 1))  # the copies; two blocks at 4, not 2
    gathers = [estimate(w, lay3, hw).info["dp_comm_total_s"] for w in (bf16, fp16)]
    assert gathers[1] > 1.3 * gathers[0]
    # under pp each stage's weights stay gathered from backward: 4 bytes, not 2, and the copies
    pp = Layout(dp_shard=4, pp=2, zero=3, micro_batch_size=1, activation_checkpoint="full")
    extra_pp = memory_breakdown(fp16, pp, hw)["buffers"] - memory_breakdown(bf16, pp, hw)["buffers"]
    assert extra_pp > 3.5 * psi / 2  # (2 + 2) bytes of about half the model


def test_zero1_peaks_at_its_step_gather_when_activations_are_small():
    """After the optimizer step ZeRO-1 all-gathers the updated slices while the whole fp32
    weights and gradients are alive: 12 + 16/N bytes per parameter, the peak of a run whose
    full AC keeps the backward's activations smaller than that (llama3-8b on 8 ranks)."""
    w = Workload(PRESETS["llama3-8b"], 4096, 32, "bf16")
    lay = Layout(dp_shard=8, zero=1, micro_batch_size=1, activation_checkpoint="full")
    mem = memory_breakdown(w, lay, get_hardware("h200"))
    psi = stage_params(w, lay, ranks(w, lay)[0])
    allocated = sum(v for k, v in mem.items() if k not in ("fragmentation", "reserved", *OUTSIDE_DEVICE))
    assert allocated == pytest.approx((12 + 16 / 8) * psi)
    fsdp = memory_breakdown(w, Layout(dp_shard=8, zero=3, micro_batch_size=1, activation_checkpoint="full"),
                            get_hardware("h200"))
    assert fsdp["total"] < 0.5 * mem["total"]  # no such gather under FSDP


@pytest.mark.parametrize("precision, held", [("bf16", 6), ("fp32", 4)])
def test_zero1_keeps_the_fp32_parameters_whole_and_shards_adams_moments(precision, held):
    """As parallel/zero1.py builds it: every rank holds the fp32 parameters (the master; in bf16
    also autocast's copies) and fp32 gradients whole, and 1/N of Adam's m and v."""
    w = Workload(PRESETS["llama3-8b"], 4096, 64, precision)
    hw = get_hardware("h100-sxm")
    psi = stage_params(w, Layout(dp_shard=8), ranks(w, Layout(dp_shard=8))[0])
    zero1 = memory_breakdown(w, Layout(dp_shard=8, zero=1), hw)
    assert zero1["params"] == pytest.approx(held * psi) and zero1["grads"] == pytest.approx(4 * psi)
    assert zero1["optimizer"] == pytest.approx(8 * psi / 8)


def test_hsdp_with_zero2_keeps_the_gathered_weights_as_zero2_does():
    w = Workload(PRESETS["llama3-8b"], 4096, 64, "bf16")
    hw = get_hardware("h100-sxm")
    hsdp = {z: memory_breakdown(w, Layout(dp_replicate=2, dp_shard=4, zero=z, activation_checkpoint="full"), hw)
            for z in (2, 3)}
    zero2 = memory_breakdown(w, Layout(dp_shard=4, zero=2, activation_checkpoint="full"), hw)
    assert hsdp[2]["params"] == pytest.approx(zero2["params"]) and hsdp[3]["params"] == 0
    assert hsdp[2]["params"] > 0


def test_zero1_under_ep_holds_an_ep_th_of_the_experts_and_a_share_of_all_states():
    """As parallel/zero1.py builds it: a rank's ep-th of the routed experts whole, their states
    cut over efsdp (dp_shard / ep), so states per rank are those of all parameters over dp_shard."""
    w = Workload(PRESETS["mixtral-8x7b"], 4096, 64, "bf16")
    hw = get_hardware("h100-sxm")
    psi = stage_params(w, Layout(dp_shard=8), ranks(w, Layout(dp_shard=8))[0])
    experts = w.model.n_layers * expert_layer_params(w, 1)
    plain = memory_breakdown(w, Layout(dp_shard=8, zero=1), hw)
    ep4 = memory_breakdown(w, Layout(dp_shard=8, zero=1, ep=4), hw)
    # fp32 parameters (the master) and autocast's bf16 copies: 6 bytes of each parameter held
    assert plain["params"] - ep4["params"] == pytest.approx(6 * experts * 3 / 4)
    assert plain["grads"] - ep4["grads"] == pytest.approx(4 * experts * 3 / 4)
    assert ep4["optimizer"] == plain["optimizer"] == pytest.approx(8 * psi / 8)
    fsdp = memory_breakdown(w, Layout(dp_shard=8, ep=4), hw)  # FSDP: ep moves no state bytes
    assert fsdp["grads"] == memory_breakdown(w, Layout(dp_shard=8), hw)["grads"]


def test_fsdp_under_ep_gathers_only_its_own_experts():
    """A block's gathered bf16 weights (this one and the prefetched) and its unsharded gradient
    (bf16, and the fp32 reduce-scatter input) hold this ep rank's experts only: 10 bytes for
    each of the other ranks' expert parameters less than without ep."""
    w = Workload(PRESETS["mixtral-8x7b"], 4096, 256, "bf16")
    hw = get_hardware("h100-sxm")
    whole, ep8 = (memory_breakdown(w, Layout(dp_shard=64, ep=ep), hw) for ep in (1, 8))
    assert whole["buffers"] - ep8["buffers"] == pytest.approx(10 * expert_layer_params(w, 1) * 7 / 8)
    assert ep8["buffers"] < 4 * GiB < whole["buffers"]


def test_memory_breakdown_of_70b_on_h100_layouts():
    w = Workload(PRESETS["llama3-70b"], 8192, 256, "bf16", document_mask=False)
    hw = get_hardware("h100-sxm")
    fsdp = memory_breakdown(w, Layout(dp_shard=256, activation_checkpoint="full"), hw)
    # 70.6B params: fp32 master + Adam = 12 B/param over 256 ranks = 3.1 GiB. One micro-batch a
    # step: its backward starts with no gradient but the output projection's (its 1/256 shard).
    assert fsdp["optimizer"] / GiB == pytest.approx(12 * 70.55e9 / 256 / GiB, rel=0.01)
    assert fsdp["grads"] == pytest.approx(4 * 128256 * 8192 / 256)
    accumulating = memory_breakdown(dataclasses.replace(w, global_batch=512), Layout(dp_shard=256,
                                                                                    activation_checkpoint="full"), hw)
    assert accumulating["grads"] / GiB == pytest.approx(4 * 70.55e9 / 256 / GiB, rel=0.01)  # all, from the 2nd
    # Full AC keeps the fp32 residual (4h bytes per token) of 80 layers: 20 GiB at 8192 tokens.
    assert fsdp["activations"] / GiB == pytest.approx(80 * 8192 * 4 * 8192 / GiB, rel=1e-6)
    # Logits + loss: 12 B per vocabulary entry per token, plus the final norm.
    assert fsdp["logits"] / GiB == pytest.approx(8192 * (12 * 128256 + 10 * 8192) / GiB, rel=1e-6)
    ddp = memory_breakdown(w, Layout(dp_replicate=256, activation_checkpoint="full"), hw)
    assert ddp["total"] > 18 * 70e9  # a replicated 70B model cannot fit an 80 GB device
    tp_sp = memory_breakdown(w, Layout(tp=8, dp_shard=32, activation_checkpoint="full"), hw)
    assert tp_sp["activations"] == pytest.approx(fsdp["activations"] / 8)


@pytest.mark.parametrize("chunk", [0, 1024])
def test_gpipe_last_stage_holds_every_microbatchs_loss_graph(chunk):
    """All forwards run before any backward: each micro-batch's loss keeps its graph (the head
    input, and unchunked its bf16 logits, which the stage keeps for backward, and the fp32
    log-softmax) on the last stage until its backward; 1F1B's last stage runs each backward
    right after its forward (and the schedule keeps no outputs: test_parity checks it)."""

    from shardline.planner.memory import activation_bytes, peak_candidates

    w = dataclasses.replace(Workload(PRESETS["llama3-8b"], 4096, 64, "bf16", document_mask=False),
                            loss_chunk_tokens=chunk)
    logits = {}
    for schedule in ("1f1b", "gpipe"):
        lay = Layout(pp=4, dp_shard=2, pp_microbatches=8, pp_schedule=schedule)
        (last,) = [stage for stage in peak_candidates(w, lay) if stage.last]
        logits[schedule] = activation_bytes(w, lay, last)["logits"]
    m = w.model
    kept = (8 + 2) * m.dim + (0 if chunk else (4 + 2) * m.vocab_size)  # per token of each earlier micro-batch
    assert logits["gpipe"] - logits["1f1b"] == pytest.approx(7 * kept * 4096)


def test_pipeline_first_stage_holds_p_microbatches():
    w = Workload(PRESETS["llama3-70b"], 4096, 256, "bf16", document_mask=False)
    hw = get_hardware("h100-sxm")
    one = memory_breakdown(w, Layout(tp=8, pp=4, dp_shard=8, pp_microbatches=32), hw)
    gpipe = memory_breakdown(w, Layout(tp=8, pp=4, dp_shard=8, pp_microbatches=32, pp_schedule="gpipe"), hw)
    assert gpipe["activations"] / one["activations"] == pytest.approx(32 / 4)
    inter = memory_breakdown(w, Layout(tp=8, pp=4, dp_shard=8, pp_microbatches=32, pp_schedule="interleaved_1f1b",
                                       pp_virtual_stages=2), hw)
    # Korthikanti: interleaving multiplies the first stage's activations by 1 + (p-1)/(p v).
    assert inter["activations"] / one["activations"] == pytest.approx(1 + 3 / 8)
    assert math.isfinite(inter["total"])


def test_fsdp_under_pp_holds_the_stages_unsharded_fp32_gradients_and_gathered_weights():
    """torch's pipeline stages skip FSDP's gradient sync until the last micro-batch: a stage's
    gradients accumulate unsharded in fp32 and a backward leaves its weights gathered."""
    w = Workload(PRESETS["llama3-8b"], 4096, 64, "bf16", document_mask=False)
    hw = get_hardware("h100-sxm")
    lay = {"pp": 2, "dp_shard": 8, "pp_microbatches": 4}
    stage = max(ranks(w, Layout(**lay)), key=lambda r: stage_params(w, Layout(**lay), r))
    psi = stage_params(w, Layout(**lay), stage)
    zero3 = memory_breakdown(w, Layout(**lay), hw)
    zero2 = memory_breakdown(w, Layout(**lay, zero=2), hw)
    assert zero3["buffers"] > 6 * psi  # 4 B of fp32 gradient and 2 B of bf16 weight per parameter
    assert zero2["buffers"] > 4 * psi and zero2["params"] >= 2 * psi  # zero=2: weights gathered at rest
    # Without pp FSDP reduce-scatters every micro-batch: a block and the root (embedding, output)
    # gathered, not the whole model (8B: 8.5 GB, where 6 B a parameter would be 48 GB).
    flat_layout = Layout(dp_shard=16)
    whole_model = stage_params(w, flat_layout, ranks(w, flat_layout)[0])  # one stage holds every parameter
    all_gathered = 6 * whole_model  # what pp would hold: fp32 gradients and bf16 weights of every parameter
    assert memory_breakdown(w, flat_layout, hw)["buffers"] < 1.1 * all_gathered / 4


def test_one_gpu_offload_moves_every_state_to_the_host_and_the_search_finds_it():
    """CPU offload on one GPU is FSDP2 over a one-rank shard dimension (as the trainer builds it,
    layout.Layout.offload_fsdp): all states go to the host, and it is what lets 8B train on one H200."""
    from shardline.planner.search import search

    w = Workload(PRESETS["llama3-8b"], 4096, 8, "bf16")
    psi = 8.0e9
    lay = Layout(cpu_offload=True, activation_checkpoint="full")
    assert lay.dp_mode == "fsdp"
    kept, host, _ = offloaded(state_bytes(w, lay, psi), lay, w, get_hardware("h200"), zero_stage(lay), psi)
    assert sum(kept.values()) == 0 and host == pytest.approx(16 * psi)
    hw = get_hardware("h200")
    assert memory_breakdown(w, Layout(activation_checkpoint="full"), hw)["total"] > hw.mem_gib * GiB
    assert memory_breakdown(w, lay, hw)["total"] < hw.mem_gib * GiB
    fits = search(w, hw, 1, {"activation_checkpoint": "full", "micro_batch_size": 1}, runnable_only=True)
    assert fits.candidates and all(e.layout.cpu_offload for e in fits.candidates)


def test_the_loss_term_is_what_the_cross_entropy_keeps_eager_and_compiled():
    """Eager, the cross-entropy keeps the fp32 log-softmax for backward (4 B an entry, of the 12
    that coexist as backward starts); compiled (train.compile), the bf16 logits alone (2 B, of
    2 x 2 with their gradient): counted here with saved-tensor hooks, then the model's terms."""

    from shardline.models.loss import cross_entropy_sum

    tokens, vocab = 64, 1024

    def kept_bytes_per_entry(score) -> float:
        logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
        seen: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append(t), t)[1], lambda t: t):
            score(logits, torch.randint(0, vocab, (tokens,)))
        whole = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in seen if t.numel() >= vocab}
        return sum(whole.values()) / (tokens * vocab)

    assert kept_bytes_per_entry(cross_entropy_sum) == 4.0
    assert kept_bytes_per_entry(torch.compile(cross_entropy_sum)) == 2.0
    assert act.loss_bytes_per_token(vocab, "bf16", 1, False) == 12 * vocab
    assert act.loss_bytes_per_token(vocab, "bf16", 1, False, compiled=True) == 4 * vocab
    w = Workload(PRESETS["llama3.2-1b"], 4096, 4, "bf16", document_mask=False)
    hw, lay, n = get_hardware("h200"), Layout(micro_batch_size=4), 4 * 4096
    head = (8 + 2) * w.model.dim * n  # the output projection's input, kept either way
    assert memory_breakdown(w, lay, hw)["logits"] == pytest.approx(head + 12 * w.model.vocab_size * n)
    compiled = dataclasses.replace(w, compiled=True)
    assert memory_breakdown(compiled, lay, hw)["logits"] == pytest.approx(head + 4 * w.model.vocab_size * n)
    tp = Layout(tp=2, micro_batch_size=4, loss_parallel=True)  # the vocab-parallel loss stays eager
    assert memory_breakdown(compiled, tp, hw)["logits"] == memory_breakdown(w, tp, hw)["logits"]
