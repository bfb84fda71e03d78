"""The planner's memory model against published per-GPU figures (issue 15: within 10%).

Two kinds of evidence: the ZeRO paper's Table 1 (model states of mixed-precision Adam by
stage and data-parallel degree, exact arithmetic the paper prints rounded), and memory that
BigScience read with nvidia-smi on the 48 A100 nodes that trained BLOOM, for BLOOM's program
and shape in five layouts (planner/validation/gpu_runs.toml, the bloom row and its [[memory]]
rows). Also: every published layout fits on its hardware, and a layout that does not fit is
reported with its largest term.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardline.planner import published as pb
from shardline.planner.layout import Runtime
from shardline.planner.memory import GiB, largest_term, ranks, zero_model_states
from shardline.planner.report import estimate_text
from shardline.planner.search import explain_no_fit, search

TOLERANCE = 0.10  # the bound for memory where a figure is published

# Rajbhandari et al. 2020 (ZeRO), Table 1: GB per device for P_os, P_os+g, P_os+g+p at DP degree N_d.
ZERO_TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}
# BigScience's tokens/s for the [[memory]] rows against the planner (recorded like the [[run]]
# rows, +-3 points): TP8 x DP4 runs 19% longer than TP4 x DP8 on their cluster, the planner says 7%.
BENCHMARK_ERRORS = {"bloom-176b-h64": 0.185, "bloom-176b-h128": 0.180, "bloom-176b-h64-mbs4": 0.118,
                    "bloom-176b-h64-tp8-dp4": 0.323}


@pytest.mark.parametrize("psi", sorted(ZERO_TABLE_1))
def test_zero_paper_table_1(psi):
    for n, row in ZERO_TABLE_1[psi].items():
        for stage, published in zip((1, 2, 3), row):
            got = sum(zero_model_states(psi, n, stage).values()) / 1e9
            assert got == pytest.approx(published, rel=0.03), (psi, n, stage)  # printed to 2-3 digits


@pytest.fixture(scope="module")
def memory_rows() -> list[pb.PublishedRun]:
    return pb.load_memory_rows()


def test_published_memory_within_10_percent(memory_rows, capsys):
    assert len(memory_rows) == 5
    lines = []
    for run in memory_rows:
        e, err = pb.memory_error(run)
        lines.append(f"{run.id:24s} tp{run.tp} pp{run.pp} dp{run.dp} mbs{run.micro_batch} heads {run.heads}: "
                     f"{e.memory['total'] / GiB:.1f} GiB vs {run.mem_gib:.0f} ({100 * err:+.1f}%)")
        assert abs(err) < TOLERANCE, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_bloom_memory_needs_the_bf16_optimizers_unsharded_buffers(memory_rows):
    # The term that carries the match: with shardline's ZeRO-1 (the fp32 master whole, but no fp32
    # gradient buffer beside the 16-bit gradients) the same rows come out low: -15.2% with its
    # step's all-gather counted (memory.zero1_step_bytes; -20.7% before), against +6.4%.
    run = memory_rows[0]
    sharded = dataclasses.replace(run, runtime=dataclasses.replace(run.runtime, zero1="shardline"))
    assert pb.memory_error(sharded)[1] < -0.12 and abs(pb.memory_error(run)[1]) < 0.10


def test_every_published_layout_fits_its_hardware(memory_rows):
    for run in [*pb.load_runs(), *memory_rows]:
        e = pb.estimate(pb.workload(run), pb.published_layout(run), pb.hardware(run))
        assert e.fits, (run.id, e.memory["total"] / GiB)


@pytest.mark.parametrize("run_id", sorted(BENCHMARK_ERRORS))
def test_bigscience_benchmarks_throughput_is_recorded(memory_rows, run_id):
    run = next(r for r in memory_rows if r.id == run_id)
    assert pb.predict(run).error == pytest.approx(BENCHMARK_ERRORS[run_id], abs=0.03)


def test_does_not_fit_names_the_largest_term():
    run = next(r for r in pb.load_runs() if r.id == "korthikanti-1t")
    eager = dataclasses.replace(run, runtime=Runtime(), micro_batch=1)  # shardline's block: no fit
    e = pb.estimate(pb.workload(eager), pb.published_layout(eager), pb.hardware(eager))
    name, size = largest_term(e.memory)
    assert not e.fits and f"largest term {name} {size / GiB:.1f}" in estimate_text(pb.workload(eager),
                                                                                   pb.hardware(eager), e)


def test_no_layout_fits_message_names_the_largest_term():
    run = next(r for r in pb.load_runs() if r.id == "korthikanti-1t")
    work, hw = pb.workload(dataclasses.replace(run, runtime=Runtime())), pb.hardware(run)
    result = search(work, hw, 64, {"tp": 8, "pp": 8, "cp": 1, "dp_replicate": 1, "dp_shard": 1})
    assert not result.candidates and result.smallest_unfit is not None
    name, size = largest_term(result.smallest_unfit[2])
    assert f"largest term {name} {size / GiB:.1f} GiB" in explain_no_fit(work, hw, 64, result)


def test_a_no_fit_line_adds_up_and_offers_the_chunked_loss_for_logits():
    """Its terms left out recompute, fragmentation and the reserve (843 GiB named, 826 listed); where the
    logits were the largest, the chunked loss, which the planner prices, was never offered."""
    import re

    from shardline.models.presets import PRESETS
    from shardline.planner.hardware import get_hardware
    from shardline.planner.layout import Workload

    work, hw = Workload(PRESETS["llama3-8b"], 1_000_000, 8, "bf16", True, "llama3-8b"), get_hardware("h100-sxm")
    text = explain_no_fit(work, hw, 8, search(work, hw, 8, {}))
    need, terms = re.search(r"needs ([\d.]+) GiB per device, largest term logits [\d.]+ GiB \(([^)]*)\)", text).groups()
    assert sum(float(t.rsplit(" ", 1)[1]) for t in terms.split(", ")) == pytest.approx(float(need), abs=0.3), text
    assert "the logits go with --train.loss_chunk_tokens=4096" in text
    assert "loss_chunk_tokens" not in explain_no_fit(work, hw, 8, search(work, hw, 8, {}), overrides=False)  # simulate


def test_bloom_stages_follow_megatron_deepspeeds_embedding_partition():
    # tr11-176B-ml/README.md: [embed | 5 blocks], 6 blocks x 10, [5 blocks | embed].
    run = next(r for r in pb.load_runs() if r.id == "bloom-176b")
    stages = ranks(pb.workload(run), pb.published_layout(run))
    assert [s.layers for s in stages] == [5] + [6] * 10 + [5]
    assert stages[0].first and stages[-1].last and sum(s.layers for s in stages) == 70
