"""The planner prices the attention kernel the trainer runs, and reports MFU as the trainer logs it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from shardline.config import Config
from shardline.devices import mfu_peak_dtype, peak_tflops
from shardline.models import PRESETS, flops_per_token
from shardline.models.attention import BLOCK, document_block_mask
from shardline.planner import attention as attn
from shardline.planner import compute as cmp
from shardline.planner import published as pb
from shardline.planner.estimate import estimate
from shardline.planner.hardware import get_hardware
from shardline.planner.layout import Layout, Workload

H100 = get_hardware("h100-sxm")
CPU = get_hardware("cpu")
W8 = Workload(PRESETS["llama3-8b"], 8192, 64, "bf16", document_mask=True)
ONE = Layout(micro_batch_size=1, dp_shard=8, zero=3)


def _priced(work: Workload, kernel: str, docs: float = 0.0, hw=H100, layout=ONE):
    return estimate(dataclasses.replace(work, attention=kernel, mean_doc_tokens=docs), layout, hw)


def test_auto_resolves_as_the_trainer_does_for_the_target():
    assert attn.kernel(W8, H100) == "flex" and attn.kernel(W8, CPU) == "sdpa"
    assert attn.kernel(dataclasses.replace(W8, document_mask=False), H100) == "sdpa"
    assert attn.kernel(W8, H100, ring=2) == "context"


def test_a_ring_is_priced_with_its_causal_skip_under_the_document_mask_too():
    """The trainer's ring skips chunk pairs wholly in the future with or without documents, and a
    pair inside one document runs unmasked or causal: about half the scores, as without a mask
    (priced at every score before: long-context ring plans 1.7x too slow, ranked below Ulysses)."""
    assert attn.computed_fraction("context", 131072, True) == attn.computed_fraction("context", 131072, False) == 0.5
    ring = Layout(micro_batch_size=1, cp=8, cp_mode="ring", dp_shard=8, zero=3)
    long = Workload(PRESETS["llama3-8b"], 131072, 8, "bf16")
    masked, unmasked = (estimate(dataclasses.replace(long, document_mask=m), ring, H100) for m in (True, False))
    assert masked.breakdown["compute"] == pytest.approx(unmasked.breakdown["compute"], rel=0.02)
    # and it holds no [b, s/cp, s] mask: a pair's is built as it runs (and again in its backward)
    assert masked.memory["total"] == pytest.approx(unmasked.memory["total"], rel=1e-6)


def test_ulysses_alone_is_priced_with_the_kernel_on_the_gathered_sequence():
    """After Ulysses' all-to-all a rank holds the whole sequence (a cp-th of the heads), where
    the trainer runs the resolved kernel: flex skips tiles; SDPA's dense mask spans all s x s."""
    ulysses = Layout(micro_batch_size=1, dp_shard=4, cp=2, cp_mode="ulysses", zero=3)
    assert attn.kernel(W8, H100, ring=ulysses.cp_degrees[0]) == "flex"
    sdpa, flex = (_priced(W8, k, docs=512, layout=ulysses) for k in ("sdpa", "flex"))
    assert flex.step_time_s < 0.9 * sdpa.step_time_s
    assert sdpa.memory["activations"] - flex.memory["activations"] == pytest.approx(8192 * 8192)


def test_short_documents_under_flex_and_varlen_are_priced_faster_than_the_dense_mask():
    sdpa, flex, varlen = (_priced(W8, k, docs=512) for k in ("sdpa", "flex", "varlen"))
    assert flex.step_time_s < 0.9 * sdpa.step_time_s and varlen.step_time_s < 0.9 * sdpa.step_time_s
    # Only SDPA holds the [b, 1, s, s] boolean mask.
    mask = ONE.micro_batch_size * 8192 * 8192
    assert sdpa.memory["activations"] - flex.memory["activations"] == pytest.approx(mask)
    assert flex.memory["activations"] == varlen.memory["activations"]
    # Model FLOPs do not change with the kernel: MFU moves with the time alone.
    assert flex.mfu / sdpa.mfu == pytest.approx(sdpa.step_time_s / flex.step_time_s)
    # Shorter documents, less work.
    assert _priced(W8, "flex", docs=128).step_time_s < flex.step_time_s < _priced(W8, "flex", docs=4096).step_time_s


def test_one_document_per_sequence_is_plain_causal_attention():
    causal = _priced(dataclasses.replace(W8, document_mask=False), "sdpa")
    for kernel in ("flex", "varlen"):
        assert _priced(W8, kernel).step_time_s == pytest.approx(causal.step_time_s)  # L unknown
        assert _priced(W8, kernel, docs=1e9).step_time_s == pytest.approx(causal.step_time_s, rel=1e-4)
    assert attn.causal_tiles(8192) == pytest.approx(0.5 + BLOCK / (2 * 8192))
    assert attn.computed_fraction("sdpa", 8192, document_mask=True) == 1.0


def test_the_within_document_share_has_the_right_limits():
    assert attn.within_document_share(8192, 0) == 0.5
    assert attn.within_document_share(8192, 1e7) == pytest.approx(0.5, abs=1e-3)
    assert attn.within_document_share(8192, 64) == pytest.approx(64 / 8192, rel=0.01)  # E[l²] = 2 L²
    # The tiles always cover the pairs they are made for.
    for docs in (64, 512, 4096):
        assert attn.flex_tiles(8192, docs) > attn.within_document_share(8192, docs)
        assert attn.varlen_tiles(8192, docs) > attn.within_document_share(8192, docs)


def _exponential_rows(rows: int, s: int, mean: float, seed: int = 0) -> torch.Tensor:
    """Document ids of rows cut from one stream of exponentially long documents (data/packing.py)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(rows * s // 4 + 64).exponential_(1 / mean, generator=g).ceil()).long()
    doc_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:rows * s]
    return doc_of_token.view(rows, s)


@pytest.mark.parametrize("s, mean", [(2048, 256), (2048, 1500), (4096, 100)])
def test_tile_counts_match_the_trainers_block_mask_and_document_pieces(s, mean):
    doc_ids = _exponential_rows(64, s, mean)
    mask = document_block_mask(doc_ids)  # the trainer's own BlockMask
    n = s // BLOCK
    flex = (mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item() / (64 * n * n)
    assert flex == pytest.approx(attn.flex_tiles(s, mean), rel=0.05)
    tiles = 0.0
    for row in doc_ids:
        pieces = torch.unique_consecutive(row, return_counts=True)[1]
        t = (pieces + BLOCK - 1) // BLOCK
        tiles += (t * (t + 1) / 2).sum().item()
    assert tiles / (64 * n * n) == pytest.approx(attn.varlen_tiles(s, mean), rel=0.05)


def test_fp8_mfu_is_against_the_bf16_peak_and_its_time_against_fp8():
    bf16, fp8 = (_priced(dataclasses.replace(W8, precision=p), "flex") for p in ("bf16", "fp8"))
    model_flops = fp8.tokens_per_s * flops_per_token(W8.model, W8.seq_len)
    assert fp8.mfu == pytest.approx(model_flops / (989e12 * ONE.world))
    assert fp8.step_time_s < bf16.step_time_s and fp8.mfu > bf16.mfu
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_time_s / fp8.step_time_s)


def test_trainer_and_planner_divide_by_the_same_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    for precision in ("bf16", "fp16", "fp8"):
        e = _priced(dataclasses.replace(W8, precision=precision), "flex")
        planner_peak = e.tokens_per_s * flops_per_token(W8.model, W8.seq_len) / (e.mfu * ONE.world) / 1e12
        assert planner_peak == pytest.approx(peak_tflops(torch.device("cuda"), precision))
        assert planner_peak == H100.peak_tflops[mfu_peak_dtype(precision)]


def test_fp8_runs_only_the_linear_gemms_in_float8():
    fp8 = dataclasses.replace(W8, precision="fp8")
    assert [g[0] for g in cmp.layer_gemm_dtypes(fp8, 1, 8192)] == ["fp8"] * 7
    # Attention and the output projection stay bf16: priced exactly as under bf16.
    assert cmp.attention_time(fp8, ONE, H100, 8192, 1.0) == cmp.attention_time(W8, ONE, H100, 8192, 1.0)
    assert cmp.head_times(fp8, ONE, H100, "both") == cmp.head_times(W8, ONE, H100, "both")
    # A weight whose dims are not multiples of 16 is not converted.
    odd = dataclasses.replace(fp8, model=dataclasses.replace(W8.model, ffn_dim=14344))
    assert [g[0] for g in cmp.layer_gemm_dtypes(odd, 1, 8192)][4:] == ["bf16"] * 3
    # Nor one whose tp shards are not (float8.converts): 14352 = 897 x 16 converts at tp 1, not at tp 2.
    split = dataclasses.replace(fp8, model=dataclasses.replace(W8.model, ffn_dim=14352))
    assert [g[0] for g in cmp.layer_gemm_dtypes(split, 1, 8192)][4:] == ["fp8"] * 3
    assert [g[0] for g in cmp.layer_gemm_dtypes(split, 2, 8192)] == ["fp8"] * 4 + ["bf16"] * 3


def test_fp8_moe_keeps_the_routed_experts_in_bf16():
    moe = Workload(PRESETS["mixtral-8x7b"], 4096, 64, "fp8", document_mask=False)
    gemms = cmp.layer_gemm_dtypes(moe, 1, 4096)
    bf16 = [g for g in gemms if g[0] == "bf16"]
    assert len(bf16) == 3  # w1, w3, w2 of the routed experts
    routed = sum(g[3] for g in bf16[:1])
    assert routed == pytest.approx(cmp.ffn_compute_width(moe.model))  # mixtral: no shared experts


def test_published_megatron_runs_are_priced_without_a_document_mask():
    for run in pb.load_runs():
        work = pb.workload(run)
        assert not work.document_mask and work.runtime.attention == "math"


def test_dry_run_reads_the_mean_document_length_of_a_prepared_folder(tmp_path):
    from shardline.dry_run import _mean_doc_tokens

    folder = tmp_path / "prepared"
    folder.mkdir()
    manifest = {"format_version": 1, "splits": {"train": {"documents": 4, "shards": [{"tokens": 3000},
                                                                                      {"tokens": 1000}]}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    cfg = Config()
    cfg.data.path = str(folder)
    assert _mean_doc_tokens(cfg)[0] == 1000.0
    cfg.data.path = ""
    assert _mean_doc_tokens(cfg) == (0.0, "")


def test_plan_refuses_a_negative_mean_document_length(capsys):
    from shardline.cli import main

    code = main(["plan", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "1", "--seq-len", "256",
                 "--global-batch", "8", "--mean-doc-tokens", "-5"])
    assert code == 2 and "--mean-doc-tokens -5.0 must be >= 0" in capsys.readouterr().err


def test_an_mfu_above_100_percent_is_explained_where_it_is_printed(capsys):
    """Model FLOPs count every score of a row; flex skips those between documents, so at long
    sequences of short documents MFU passes 100% (188% for a 1B model at 128k): said below it."""
    from shardline.cli import main

    argv = ["--model", "llama3.2-1b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "131072",
            "--global-batch", "8", "--runnable-only"]
    assert main(["plan", *argv, "--mean-doc-tokens", "4096"]) == 0
    skipped = capsys.readouterr().out
    rows = [float(line.split("%")[0].split()[-1]) for line in skipped.splitlines() if "% " in line and "cp" in line]
    assert rows and max(rows) > 100 and "MFU above 100%: model FLOPs count every score of a row" in skipped
    assert main(["plan", *argv]) == 0  # one document a row: every score computed, no such line
    assert "MFU above 100%" not in capsys.readouterr().out
