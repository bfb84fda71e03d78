"""The benchmark scripts run end to end and write well-formed JSON.

No timing thresholds: a shared 2-core machine makes them meaningless here. What is
checked is that every variant produced a finite, positive throughput and that the
comparison (ratio, overhead) is computed. The runs use one torch thread: with two
threads on two busy cores, tiny steps can be descheduled mid-operation and take
~20x longer, which only slows the tests down.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardline.parallel.compile import config_problem as compile_problem

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, args: list[str], tmp_path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / f"{Path(script).stem}.json"
    env = {**os.environ, "SHARDLINE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args, "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_step_overhead_reports_both_variants_and_a_ratio(tmp_path, small_corpus):
    res, proc = run_benchmark("step_overhead.py",
                              ["--steps", "4", "--warmup", "1", "--block", "2", "--seq-len", "64", "--batch", "4",
                               "--vocab-size", "512", "--data", str(small_corpus), "--threads", "1"], tmp_path)
    assert set(res["variants"]) == {"shardline", "plain"}
    for name, v in res["variants"].items():
        assert positive(v["tokens_per_s"]), (name, v)
        assert positive(v["median_s"]) and v["steps"] == 4, (name, v)
    assert positive(res["ratio"]) and positive(res["paired_ratio"])
    assert math.isclose(res["overhead_pct"], (res["ratio"] - 1) * 100)
    # The comparison is fair only if both sides start from the same weights and see the same data.
    assert res["same_init"] is True
    assert res["max_loss_diff"] < 1e-3
    assert "overhead" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real GPU tests: run it by hand")
def test_gpu_check_script_runs_on_cpu_with_the_tiny_benchmark(tmp_path, small_corpus):
    """benchmarks/gpu_check.sh end to end, as a GPU machine runs it (its GPU tests skip here,
    gpu_train.py runs its CPU smoke shape): a broken script must not cost a GPU session."""
    results = tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": "", "TEST_BUDGET": "120", "BENCH_BUDGET": "120",
           "ALLOW_CPU": "1",  # without it the script stops at once on a machine with no CUDA device
           "GPU_TRAIN_ARGS": f"--tiny --data {small_corpus} --threads 1 --steps 2 --warmup 1 "
                             "--variants shardline-eager,shardline-cudnn,hf-eager,hf-compile --inject-oom hf-compile "
                             f"--profile {results}"}
    script = subprocess.Popen(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(results)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = script.communicate(timeout=300)
    finally:  # the script's own children (timeout, pytest, python) go with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == 0, out[-3000:] + err[-3000:]
    assert f"torch {torch.__version__}" in (results / "env.txt").read_text()
    tests = (results / "gpu-tests.txt").read_text()
    assert "SKIPPED" in tests and " passed" not in tests and "failed" not in tests  # no CUDA: every one skips
    assert (results / "gpu-tests.xml").exists()
    res = json.loads((results / "gpu_train.json").read_text())
    assert res["config"]["tiny"] is True and res["config"]["tokens_per_step"] == 4 * 64
    assert positive(res["config"]["flops_per_token"])
    assert list(res["variants"]) == ["shardline-eager", "shardline-cudnn", "hf-eager", "hf-compile"]
    # Out of memory is reported, not a failure (the script exits 0); the others still ran.
    oom = res["variants"].pop("hf-compile")
    assert oom["status"] == "oom" and "out of memory" in oom["error"]
    for name, v in res["variants"].items():
        assert v["status"] == "ok", (name, v)
        assert positive(v["tokens_per_s"]), (name, v)
        assert math.isfinite(v["loss"]), (name, v)
        assert len(v["losses"]) == 3 and v["losses"][-1] == v["loss"], (name, v)  # 1 warm-up + 2 measured
    table = (results / "gpu_train.txt").read_text()
    for name in ("shardline-eager", "shardline-cudnn"):  # the planner's figures beside the measured ones
        v = res["variants"][name]
        assert positive(v["planned_step_s"]) and v["planned_on"] == "cpu"
        row = next(line for line in table.splitlines() if line.startswith(name))
        assert row.split()[-2:] == [f"{v['planned_step_s']:.3f}", f"{v['planned_alloc_gib']:.1f}"]
    # Same initial weights on the same first batch: shardline's variants start from one loss.
    assert res["variants"]["shardline-eager"]["losses"][0] == res["variants"]["shardline-cudnn"]["losses"][0]
    # Same shape on both sides: the HF model has exactly shardline's parameter count.
    params = {v["params"] for v in res["variants"].values()}
    assert params == {res["config"]["params"]}
    assert "tokens/s" in (results / "gpu_train.txt").read_text()
    profile = (results / "profile-shardline-eager.txt").read_text()  # --profile: where the step's time goes
    assert "wall" in profile and "aten::mm" in profile


def test_a_cut_gpu_train_run_keeps_what_finished(tmp_path):
    """An interrupt (a time budget's signal) stops the run; the JSON, rewritten after each
    variant, holds the finished ones, and the cut one and those after it are marked."""
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_train.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_train.py"), "--tiny", "--threads", "1",
                           "--steps", "2", "--warmup", "1", "--variants", "hf-eager,hf-compile,shardline-compile",
                           "--inject-interrupt", "hf-compile", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # cut short: not a complete run
    res = json.loads(out.read_text())["variants"]
    assert res["hf-eager"]["status"] == "ok" and positive(res["hf-eager"]["tokens_per_s"])
    assert res["hf-compile"]["status"] == res["shardline-compile"]["status"] == "cut"
    assert "cut" in proc.stdout


def test_planner_validation_runs_a_torchrun_layout_and_rewrites_only_its_section(tmp_path, small_corpus):
    # A given profile skips the calibration: this checks the plumbing, not the model's accuracy
    # (benchmarks/RESULTS.md holds that, from the full run).
    profile = tmp_path / "cpu.toml"
    profile.write_text('base = "cpu"\n[cpu]\ncores = 2\nthreads = 1\n')
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept above\n\n<!-- planner-validation:start -->\nold\n"
                       "<!-- planner-validation:end -->\n\nkept below\n")
    res, proc = run_benchmark("planner_validation.py",
                              ["--configs", "none", "--layouts", "tiny-ddp2", "--steps", "3", "--profile", str(profile),
                               "--data", str(small_corpus), "--vocab-size", "512", "--results", str(results)],
                              tmp_path)
    row = res["configs"]["tiny-ddp2"]
    assert row["world"] == 2 and row["measured"]["world"] == 2
    assert positive(row["predicted"]["step_time_s"]) and positive(row["measured"]["step_time_s"])
    assert positive(row["measured"]["ranks_cpu_step_s"]) and len(row["measured"]["step_times_s"]) == 1
    # Peak memory is the maximum over ranks of whole processes: above the bare process baseline.
    assert row["measured"]["peak_gib"] > res["process_baseline_gib"] > 0.1
    assert math.isclose(row["wall_error_pct"],
                        100 * (row["predicted"]["step_time_s"] / row["measured"]["step_time_s"] - 1))
    text = results.read_text()
    assert text.startswith("# Results\n\nkept above\n") and text.endswith("kept below\n")
    assert "old" not in text and "| tiny-ddp2 | 2 |" in text and "tiny-ddp2" in proc.stdout


@pytest.mark.skipif(compile_problem(True, 2, "zbv") is not None, reason="needs torch >= 2.13 (a compiled weight pass)")
def test_split_backward_reports_its_variants_with_eager_gradients(tmp_path):
    """The benchmark compares each compiled variant's gradients with eager's. One compiled
    variant here (a cold compile of each costs ~20 s on 2 cores); `whole` runs the same code
    path, and tests/unit/test_compile.py compiles it too."""
    res, proc = run_benchmark("split_backward.py", ["--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
                                                    "--seq", "16", "--batch", "2", "--repeats", "1",
                                                    "--device", "cpu", "--variants", "shardline"], tmp_path)
    assert list(res["results"]) == ["eager", "shardline"]
    for name, r in res["results"].items():
        assert all(positive(r[key]) for key in ("forward", "one", "split")), (name, r)
        assert 0 <= r["grad_error"] < 1e-4 and (name != "eager" or r["grad_error"] == 0), (name, r)
    assert "split/one" in proc.stdout


def test_clip_fold_times_seven_ways_and_finds_the_folded_clips_equal(tmp_path):
    res, proc = run_benchmark("clip_fold.py", ["--params", "2e5", "--tensors", "4", "--steps", "2"], tmp_path)
    assert set(res["median_ms"]) == {"torch", "torch_fused", "apart", "folded", "folded_fused", "fused_apart",
                                     "fused_in_kernel"}
    assert all(map(positive, res["median_ms"].values()))
    assert res["vs_torch"]["torch"] == res["vs_torch_fused"]["torch_fused"] == 1
    assert res["apart_equals_folded"] is True and "bit for bit equal: True" in proc.stdout
    assert res["fused_close"] is True and "within 1e-6: True" in proc.stdout


def test_chat_packing_packs_every_mix_both_ways_and_best_fit_fills_less(tmp_path):
    res, proc = run_benchmark("chat_packing.py", ["--conversations", "3000", "--repeat", "1"], tmp_path)
    assert len(res["mixes"]) == 4
    for name, mix in res["mixes"].items():
        ours, base = mix["best_fit"], mix["next_fit"]
        assert 0 <= ours["fill"] < base["fill"] and ours["sequences"] < base["sequences"], name
        assert positive(ours["pack_s"]) and mix["useful_tokens_ratio"] > 1, name
    assert [r["shards"] for r in res["reads"]] == [4, 256]
    assert all(positive(r["chat_batches_per_s"]) and positive(r["text_batches_per_s"]) for r in res["reads"])
    assert "useful x" in proc.stdout


@pytest.mark.parametrize("script, args, says", [
    ("chat_packing.py", ["--conversations", "0"], "--conversations 0: must be at least 2049"),
    ("clip_fold.py", ["--params", "0"], "--params 0: must be at least --tensors (32)"),
    ("ssd_offload.py", ["--window", "0"], "--window 0: each must be at least 1"),
    ("step_overhead.py", ["--preset", "bogus"], "--preset 'bogus': one of tiny,"),
    ("planner_validation.py", ["--configs", "bogus"], "unknown config(s) bogus; valid: tiny-s256-b8x2,"),
])
def test_a_bad_argument_is_refused_in_one_line_before_any_output(script, args, says):
    """argparse's refusal (exit 2, one line), not a traceback, a crash after the work, or ratios of nothing."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert says in proc.stderr.splitlines()[-1]


def test_profile_kinds_of_the_kernels_an_h200_ran():
    """gpu_train --profile's buckets, on kernel names from its first H200 profile: inductor names a
    fused kernel after the ops it holds, so fp8's casts (`..._scaled_mm_...`) must not count as GEMMs,
    nor cuDNN's flash kernels (cutlass-built) or flex's triton template."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train", REPO / "benchmarks" / "gpu_train.py")
    gpu_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_train)
    kinds = {
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
        "nvjet_sm90_qrtst_128x160_128x5_1x2_h_bz_coopA_algo2_TNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64": "attention",
        "triton_tem_fused_flex_attention_0": "attention",
        "triton_poi_fused__scaled_mm__to_copy_add_clamp_clone_mul_reciprocal_silu_t_view_7": "compiled (triton)",
        "triton_red_fused__log_softmax__to_copy_prepare_softmax_online_view_0": "compiled (triton)",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>": "optimizer",
        "Memset (Device)": "copies",
    }
    assert {name: gpu_train.kernel_kind(name) for name in kinds} == kinds


def test_gpu_checks_variants_exist_and_the_docs_ones_run_their_kernel_compiled():
    """A name gpu_train.py does not know would cost a GPU session its benchmark (argparse exits):
    every variant gpu_check.sh lists is known, and the -docs ones train their kernel on documents."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("gpu_train", REPO / "benchmarks" / "gpu_train.py")
    gpu_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_train)
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    listed = re.search(r"^\s+--variants (\S+)", script, re.MULTILINE).group(1).split(",")  # the command line
    assert listed[:4] == ["shardline-compile", "hf-compile", "shardline-fp8", "hf-eager"]  # the targets' first
    assert set(listed) <= set(gpu_train.ALL_VARIANTS)
    args = gpu_train.parse_args(["--tiny", "--variants", ",".join(listed)])
    for kernel in ("flex", "varlen"):
        assert gpu_train.attention_overrides(args, f"shardline-{kernel}-docs") == [
            f"train.attention={kernel}", "train.document_mask=true"]
        assert f"shardline-{kernel}-docs" in gpu_train.COMPILED_WITH_ARGS
    assert gpu_train.attention_overrides(args, "shardline-compile") == ["train.attention=auto",
                                                                         "train.document_mask=false"]


def disk_folder(tmp_path: Path) -> Path:
    """A folder for mapped moments in the test's temporary folder; skips where that is a tmpfs (its
    mapped pages are shared memory, not file-backed, and no disk is read or written)."""
    from shardline.optim.ssd_offload import IN_MEMORY, filesystem

    folder = tmp_path / "ssd"
    folder.mkdir()
    if filesystem(folder) in IN_MEMORY:
        pytest.skip("the temporary folder is on tmpfs: its mapped pages are shared memory, not file-backed")
    return folder


def test_ssd_offload_reports_five_variants_and_moves_the_moments_out_of_anonymous_memory(tmp_path):
    """benchmarks/ssd_offload.py: the mapped moments are file-backed, not anonymous, memory (122 MiB
    of them here; the allocator's leftovers trimmed); paged out they are resident in neither, and
    the cold steps read them back from the file (major faults). Stepped a window at a time (256 Ki
    elements of tensors of 4 Mi), a step's temporaries are a window's, the moments in RAM or
    mapped: stepped whole, foreach's square root of every exp_avg_sq (4 bytes a parameter, half the
    moments) is resident at once too. (At 8 M parameters and 1 Mi windows the expected 26 MiB gap
    came within 3 MiB of the bound once in 8 runs, and failed once under load: peak-RSS noise of
    ~8 MiB; here the gap is ~57 MiB against a 30 MiB bound.)"""
    folder = disk_folder(tmp_path)
    result, _ = run_benchmark("ssd_offload.py", ["--params=16e6", "--tensors=4", "--steps=2", "--window=262144",
                                                 f"--folder={folder}"], tmp_path)
    assert set(result["step_s"]) == {"plain", "windowed", "warm", "cold", "cold_whole"}
    assert all(positive(s) for s in [*result["step_s"].values(), *result["writeback_s"].values()])
    rss, moments = result["rss_gib"], result["moments_gib"]
    assert rss["warm"]["RssFile"] == pytest.approx(moments, rel=0.1) and rss["cold"]["RssFile"] < moments / 4
    assert rss["plain"]["RssAnon"] - rss["warm"]["RssAnon"] == pytest.approx(moments, rel=0.1)
    assert rss["cold_whole"]["step_rise"] - rss["cold"]["step_rise"] > moments / 4  # ~0.44 x the moments
    assert rss["plain"]["step_rise"] - rss["windowed"]["step_rise"] > moments / 4  # in RAM too
    assert rss["cold"]["step_rise"] > moments  # the gradients and the moments read back
    assert all(result["cold_step_io"][v]["major_faults"] > 0 for v in ("cold", "cold_whole"))
    assert list(folder.iterdir()) == []  # its temporary folder and unlinked files: nothing left


def test_ssd_pressure_runs_both_variants_beside_a_hog(tmp_path):
    """benchmarks/ssd_pressure.py's mechanics at a size that presses nothing (a 50 MiB hog, 4 M
    parameters): both variants step, the disk's counters are read where /proc/diskstats lists the
    folder's disk, the hog starts (and exits with the benchmark: its stdin closes)."""
    folder = disk_folder(tmp_path)
    result, proc = run_benchmark("ssd_pressure.py", ["--params=4e6", "--hog-gib=0.05", "--steps=1", "--rounds=1",
                                                     f"--folder={folder}"], tmp_path)
    assert result["hog_gib"] == 0.05 and result["moments_gib"] == pytest.approx(8 * 4e6 / 2**30, abs=1e-3)
    assert set(result["variants"]) == {"whole", "windowed"}
    for v in result["variants"].values():
        assert positive(v["step_s"])
        if result["disk_counted"]:  # the folder's disk is in /proc/diskstats: the moments' files were written
            assert v["read_gib"] >= 0 and v["written_gib"] >= 0
        else:
            assert v["read_gib"] is None and v["written_gib"] is None
    assert list(folder.iterdir()) == []  # the temporary folder and unlinked files: nothing left


def test_context_parallel_runs_within_two_processes_with_max_cp_2():
    """Its cp4 runs started 4 gloo processes whatever the machine: --max-cp 2 runs cp1 and cp2 alone."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "context_parallel.py"), "--max-cp", "2",
                           "--seq-len", "512", "--repeats", "1", "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert [r["run"] for r in rows] == ["cp1", "cp2 ring"]
    assert all(positive(r["tokens_per_s"]) for r in rows) and rows[1]["activation_vs_cp1"] < 1.0, rows
