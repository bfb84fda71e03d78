"""The planner against published large GPU runs (planner/validation/gpu_runs.toml, issue 15).

Every row is predicted with its published layout pinned and compared in tokens/s (the
published figure converted with the paper's own FLOP formula). What is true today is
recorded: each row's error within a band of +-3 points, the mean absolute error under a
bound, and the rows outside 15% named with the reason the breakdown shows. A row that
improves or regresses out of its band fails, so the record has to be updated on purpose.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from shardline.errors import ConfigError
from shardline.models import flops_per_token
from shardline.planner import compute as cmp
from shardline.planner import published as pb
from shardline.planner.layout import Layout, Runtime

# Error (predicted / published - 1) of each row as of this commit; the bands are +-BAND.
RECORDED = {
    "megatron-1.7b": -0.012, "megatron-3.6b": 0.015, "megatron-7.5b": 0.035, "megatron-18.4b": 0.069,
    "megatron-39.1b": 0.110, "megatron-76.1b": 0.124, "megatron-145.6b": 0.115, "megatron-310.1b": 0.123,
    "megatron-529.6b": 0.086, "megatron-1008b": 0.116, "korthikanti-22b": 0.138, "korthikanti-175b": 0.061,
    "korthikanti-530b": 0.034, "korthikanti-1t": 0.040, "bloom-176b": 0.185, "opt-175b": 0.249,
}
# The megatron rows over pp and opt-175b moved up when the gradient reductions took Runtime.grad_bytes
# (2 under Megatron, fp16 gradients) instead of 4: their data-parallel traffic halved.
BAND = 0.03
MEAN_ABS_BOUND = 0.10  # measured 9.5% (8.9% while gradients were reduced in fp32 for every system)
# Rows outside 15%, each with what its breakdown and the published record show (docs/planner.md,
# "Published GPU runs"); both over-predicted, in compute, not in a convention or a network figure.
OUTLIERS = {
    "bloom-176b": "DeepSpeed's BF16_Optimizer (fp32 all-reduce, unsharded fp32 buffers), the embedding "
                  "partition and the tied-gradient all-reduce are modelled (18.1% -> 17.7%; 18.5% since the "
                  "TP rows moved); breakdown: compute 83%, bubble 7.5%, tp 3.9%, dp 3.5%, pp 1.8%, tied 0.8%. "
                  "BigScience measured TP8 x DP4 19% slower than TP4 x DP8 on these nodes, the planner 7% "
                  "(test_planner_memory_validation): TP is under-priced on Jean Zay; the node's NVLink "
                  "topology is not confirmed, so not changed",
    "opt-175b": "'147' is Megatron's recompute convention to 0.2% (the logbook: 33 days for 300B tokens on "
                "1024 A100), a steady rate, not wall time; the error turns on the unpublished micro-batch "
                "(8 x 1: +22.5% when written, +24.9% now; 4 x 2: -14.6%, FSDP's gathers exposed) and on "
                "metaseq priced with Megatron-2021's kernels; breakdown: compute 89%, tp 10.6%, fsdp 0.7%",
}


@pytest.fixture(scope="module")
def predictions() -> dict[str, pb.Prediction]:
    return {r.id: pb.predict(r) for r in pb.load_runs()}


def test_every_row_is_predicted_and_reported(predictions, capsys):
    assert set(predictions) == set(RECORDED)  # a new row needs its recorded error
    with capsys.disabled():
        print("\n" + pb.table(list(predictions.values())))


@pytest.mark.parametrize("run_id", sorted(RECORDED))
def test_row_stays_in_its_band(predictions, run_id):
    assert predictions[run_id].error == pytest.approx(RECORDED[run_id], abs=BAND)


def test_outliers_are_exactly_the_rows_outside_15_percent(predictions):
    outside = {k for k, p in predictions.items() if abs(p.error) > 0.15}
    assert outside == set(OUTLIERS)


def test_mean_absolute_error(predictions):
    assert statistics.mean(abs(p.error) for p in predictions.values()) < MEAN_ABS_BOUND


def test_published_layouts_fit_in_memory(predictions):
    # The memory model must not reject layouts the runs used on the same hardware.
    for p in predictions.values():
        assert p.estimate.fits, (p.run.id, p.estimate.memory["total"] / 2**30)


def test_a_layout_that_does_not_fit_is_still_timed_and_says_so():
    run = next(r for r in pb.load_runs() if r.id == "korthikanti-1t")
    eager = dataclasses.replace(run, runtime=Runtime(), micro_batch=1)  # shardline's block: 147 GiB
    p = pb.predict(eager)
    assert not p.estimate.fits and p.estimate.layout == pb.published_layout(eager)
    assert p.estimate.memory["total"] > p.estimate.capacity and -0.5 < p.error < 0


def test_rows_agree_with_the_papers_aggregate_column():
    # Table 1 gives TFLOP/s per GPU and aggregate PFLOP/s: the two must agree (a transcription check).
    rows = [r for r in pb.load_runs() if r.aggregate_pflops]
    assert len(rows) == 10
    for r in rows:
        assert r.tflops_per_gpu * r.gpus / 1000 == pytest.approx(r.aggregate_pflops, rel=0.01), r.id


def test_megatron_model_flops_equal_shardlines_mfu_convention():
    # Korthikanti's MFU counts 72 B s l h^2 (1 + s/6h + V/12lh): for the GPT shape written as a
    # SwiGLU of 8h/3 that is shardline's 6N + 12 L d s, up to the width's rounding to 64.
    for r in pb.load_runs():
        model = dataclasses.replace(r, convention="megatron_model")
        assert pb.paper_flops_per_token(model) == pytest.approx(flops_per_token(pb.model_args(r), r.seq_len),
                                                                rel=0.002), r.id


def test_megatron_runtime_moves_the_costs_it_names():
    run = next(r for r in pb.load_runs() if r.id == "megatron-18.4b")
    fused, eager = pb.workload(run), dataclasses.replace(pb.workload(run), runtime=Runtime())
    assert cmp.elementwise_bytes_per_token(fused, 8, False) < 0.3 * cmp.elementwise_bytes_per_token(eager, 8, False)
    lay = Layout(tp=8, dp_replicate=32, micro_batch_size=4, activation_checkpoint="full", sequence_parallel=False)
    flash = dataclasses.replace(fused, runtime=dataclasses.replace(fused.runtime, attention="flash"))
    # A math kernel moves every score through memory: slower than flash at s = 2048.
    assert cmp.layer_times(fused, lay, pb.hardware(run)).forward > cmp.layer_times(flash, lay, pb.hardware(run)).forward


def test_a_bad_validation_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "runs.toml"
    bad.write_text('[[run]]\nid = "x"\nsytem = "megatron"\n')
    with pytest.raises(ConfigError, match="sytem"):
        pb.load_runs(bad)
    bad.write_text('[[run]]\nid = "x"\nsystem = "nope"\n')
    with pytest.raises(ConfigError, match="names system 'nope'"):
        pb.load_runs(bad)
