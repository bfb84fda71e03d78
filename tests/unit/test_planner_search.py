"""`shardline plan` / `estimate`: search results, the CLI contract, errors, emitted configs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.config import load_config
from shardline.models import PRESETS
from shardline.planner.hardware import get_hardware
from shardline.planner.layout import Workload, parse_fix
from shardline.planner.search import explain_no_fit, search

REPO = Path(__file__).parents[2]
PLAN_8B = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--seq-len", "4096",
           "--global-batch", "64"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_contract(capsys):
    code, out, _ = run_cli(capsys, *PLAN_8B, "--top", "4", "--json")
    assert code == 0
    cands = json.loads(out)["candidates"]
    assert len(cands) == 4
    for c in cands:
        assert {"layout", "mfu", "tokens_per_s", "step_time_s", "memory_gib_per_gpu", "breakdown"} <= c.keys()
        lay = c["layout"]
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["tp"] * lay["pp"] * lay["cp"] == 16
        assert c["tokens_per_s"] * c["step_time_s"] == pytest.approx(64 * 4096, rel=1e-4)  # global tokens/s
        assert c["memory_gib_per_gpu"] <= 79.6 and 0 < c["mfu"] < 1
        # (full AC said ac_every 1 where the emitted config writes its unread default)
        assert (lay["ac_every"] is None) == (lay["activation_checkpoint"] != "selective")
    rates = [c["tokens_per_s"] for c in cands]
    assert rates == sorted(rates, reverse=True)


def test_plan_table_names_the_reasons(capsys):
    code, out, _ = run_cli(capsys, *PLAN_8B, "--top", "3")
    assert code == 0
    assert "searched" in out and "fit" in out and "(memory: did not fit): memory" in out
    assert out.count("\n 1") == 1 and "tokens/s" in out and "MFU" in out


def test_fix_pins_keys_and_dp_is_plain_data_parallel(capsys):
    fixed = "tp=2,pp=2,pp_schedule=1f1b,dp_shard=4,zero=3,micro_batch_size=1,activation_checkpoint=full"
    code, out, _ = run_cli(capsys, *PLAN_8B, "--fix", fixed, "--json", "--top", "50")
    assert code == 0
    for c in json.loads(out)["candidates"]:
        lay = c["layout"]
        assert (lay["tp"], lay["pp"], lay["pp_schedule"], lay["dp_shard"], lay["activation_checkpoint"]) == \
            (2, 2, "1f1b", 4, "full")
    assert parse_fix("dp=8") == {"dp_replicate": 8, "dp_shard": 1}
    assert parse_fix("cp=2,cp_mode=ulysses,cp_balance=none") == {"cp": 2, "cp_mode": "ulysses", "cp_balance": "none"}


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h300"], "unknown device type 'h300'"),
    (["--fix", "bogus=1"], "--fix key 'bogus' is unknown"),
    (["--fix", "tp=3"], "tp=3"),
    (["--fix", "tp=32"], "does not divide --gpus 16"),
    (["--fix", "pp_schedule=fast"], "pp_schedule='fast' is invalid"),
    (["--fix", "cp_mode=spiral"], "--fix cp_mode='spiral' is invalid; valid: ring, ulysses, hybrid"),
    (["--fix", "cp_balance=even"], "--fix cp_balance='even' is invalid; valid: zigzag, none"),
    (["--fix", "micro_batch_size=0"], "--fix micro_batch_size=0 must be >= 1"),
    (["--fix", "ep=-2"], "--fix ep=-2 must be >= 1"),
    (["--fix", "zero=4"], "--fix zero=4 is invalid; valid: 1, 2, 3"),
    (["--model", "no-such-model"], "neither a preset"),
])
def test_bad_requests_exit_2_with_one_line(capsys, argv, message):
    args = list(PLAN_8B)
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_batch_in_tokens_must_be_whole_sequences(capsys):
    argv = [a for a in PLAN_8B if a not in ("--global-batch", "64")] + ["--global-batch-tokens", "1000"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "use a multiple of 4096" in err


def test_an_indivisible_batch_is_advised_within_the_search(capsys):
    """The layout a batch refusal names has the fewest data-parallel ranks the search tried: its
    advice to give ranks to tp, cp or pp (the trainer's, for one config) is no way out; pinned
    degrees are named as such."""
    base = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len", "4096",
            "--global-batch", "100"]
    code, _, err = run_cli(capsys, *base, "--fix", "tp=1,pp=1,cp=1")
    assert code == 2 and "use a multiple of 64, or fewer --gpus (or unpin tp, cp, pp in --fix)" in err
    assert "give ranks to" not in err
    code, _, err = run_cli(capsys, *base, "--fix", "tp=2,pp=1")
    assert code == 2 and "use a multiple of 8, or fewer --gpus (or unpin tp, pp in --fix)" in err


def test_a_model_that_fits_nowhere_says_what_is_missing(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "llama3-405b", "--gpu", "h100-sxm", "--gpus", "8",
                           "--seq-len", "8192", "--global-batch", "8")
    assert code == 2
    assert "does not fit" in err and "GiB per device" in err and "79.6 GiB" in err and "more devices" in err


def test_emitted_config_is_what_estimate_predicts(capsys, tmp_path):
    path = tmp_path / "plan.toml"
    code, out, _ = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--emit-config", str(path))
    assert code == 0
    best = json.loads(out)["candidates"][0]
    # 16 GPUs of 8 a node: one torchrun on each of 2 nodes, meeting at a rendezvous
    assert "on each of the 2 nodes: torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d" in path.read_text()
    cfg = load_config(path)
    assert cfg.model.preset == "llama3-8b" and cfg.train.seq_len == 4096 and cfg.train.global_batch_size == 64
    assert cfg.parallel.tp == best["layout"]["tp"] and cfg.parallel.dp_shard == best["layout"]["dp_shard"]
    assert cfg.memory.activation_checkpoint == best["layout"]["activation_checkpoint"]
    from shardline.launch_notes import unused_settings

    assert unused_settings(cfg) == {}  # it wrote ac_every and pp_microbatches where nothing reads them
    code, out, _ = run_cli(capsys, "estimate", "--config", str(path), "--gpu", "h100-sxm", "--json")
    assert code == 0
    assert json.loads(out)["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-6)
    # A plan replaces its own earlier config, never a file it did not write (a hand-written config).
    code, out, _ = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--gpus-per-node", "4", "--emit-config",
                           str(path))
    assert code == 0
    assert "--nnodes 4 --nproc-per-node 4" in path.read_text()  # the hardware's GPUs a node, as given
    # The dry run cannot be told the cluster the plan priced: the header says so, and how estimate prices it so
    priced = [line for line in path.read_text().splitlines() if line.startswith("# priced with --gpus-per-node 4")]
    assert len(priced) == 1 and "train --dry-run does not take" in priced[0], path.read_text()[:600]
    command = priced[0].split(": shardline ", 1)[1].removesuffix(" prices it so").split()
    code, est, _ = run_cli(capsys, *command, "--json")
    assert code == 0 and command[:2] == ["estimate", "--config"]
    assert json.loads(est)["step_time_s"] == pytest.approx(json.loads(out)["candidates"][0]["step_time_s"], rel=1e-6)
    # ... and the simulate command that prices its checkpoint interval runs, at this plan's step time
    simulate = path.read_text().split("(steps; shardline ", 1)[1].split(" prices an interval")[0].split()
    step_s = json.loads(out)["candidates"][0]["step_time_s"]
    assert simulate[:9] == ["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--gpus-per-node",
                            "4"] and float(simulate[simulate.index("--step-time") + 1]) == pytest.approx(step_s, 1e-3)
    code, sim, _ = run_cli(capsys, *[a if a != "D" else "2" for a in simulate], "--seeds", "1", "--json")
    assert code == 0 and json.loads(sim)["step_time_s"] == pytest.approx(step_s, rel=1e-3), sim[:300]
    # The training settings a plan does not choose are named where left at the tiny run's (lr 3e-3 at 8B).
    left = [line for line in path.read_text().splitlines() if line.startswith("# set before a real run")]
    assert len(left) == 1 and "optim.lr = 0.003 (the tiny preset's)" in left[0] and "data.path = ''" in left[0]
    assert run_cli(capsys, *PLAN_8B, "--runnable-only", "--emit-config", str(path), "--optim.lr=3e-4")[0] == 0
    assert "optim.lr" not in path.read_text().split("\n[")[0] and "train.steps = 200" in path.read_text()
    # A shape override reached the file while the search priced the preset as it is: now it prices it
    code, out, _ = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--emit-config", str(path),
                           "--model.n_layers=16")
    half = json.loads(out)["candidates"][0]
    assert code == 0 and load_config(path).model.n_layers == 16 and half["step_time_s"] < 0.7 * best["step_time_s"]
    assert json.loads(out)["request"]["model_overrides"] == ["model.n_layers=16"]  # (the header named the preset alone)
    code, out, _ = run_cli(capsys, *PLAN_8B, "--runnable-only", "--model.n_layers=16")
    assert out.startswith("plan: llama3-8b with model.n_layers=16 (")
    code, out, _ = run_cli(capsys, "estimate", "--config", str(path), "--gpu", "h100-sxm", "--json")
    assert json.loads(out)["step_time_s"] == pytest.approx(half["step_time_s"], rel=1e-6)
    # An override of what the plan chooses was dropped from the file without a word: refused, naming the option
    for override, way in (("--parallel.tp=2", "--fix tp=..."), ("--train.seq_len=64", "--seq-len"),
                          ("--train.precision=fp32", "--precision")):
        code, _, err = run_cli(capsys, *PLAN_8B, "--runnable-only", "--emit-config", str(path), override)
        assert code == 2 and f"{override.split('=')[0]} is one of the settings the plan chooses" in err
        assert err.rstrip().endswith(f"give it to the search as {way}")
    # ... unless it says what the plan's own option does (a script's shared overrides)
    assert run_cli(capsys, *PLAN_8B, "--runnable-only", "--emit-config", str(path), "--train.seq_len=4096",
                   "--model.preset=llama3-8b", "--train.document_mask=true", "--train.precision=auto")[0] == 0
    assert load_config(path).train.precision == "bf16"  # (auto: the plan's own choice on a GPU, written)
    # Starting weights named for the run are not read by the search, which prices --model (a checkpoint
    # on the training cluster, not on the planning host)
    code, out, _ = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--emit-config", str(path),
                           f"--model.init_from={tmp_path / 'not-here'}")
    assert code == 0 and json.loads(out)["candidates"][0]["step_time_s"] == pytest.approx(best["step_time_s"])
    assert load_config(path).model.init_from == str(tmp_path / "not-here")
    mine = tmp_path / "mine.toml"
    mine.write_text("[train]\nsteps = 5\n")
    code, _, err = run_cli(capsys, *PLAN_8B, "--runnable-only", "--emit-config", str(mine))
    assert code == 2 and "was not written by shardline plan" in err
    assert mine.read_text() == "[train]\nsteps = 5\n"


def test_estimate_needs_a_world_size_for_dp_shard_minus_one(capsys, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npreset = "llama3-8b"\n[train]\nseq_len = 2048\nglobal_batch_size = 32\n'
                    'micro_batch_size = 2\nprecision = "bf16"\n[parallel]\ntp = 2\ndp_shard = -1\n')
    code, out, _ = run_cli(capsys, "estimate", "--config", str(path), "--gpu", "h100-sxm", "--gpus", "16")
    assert code == 0 and "tp2 fsdp:8" in out and "memory on the busiest rank" in out
    code, out, err = run_cli(capsys, "estimate", "--config", str(path), "--gpu", "h100-sxm")
    assert "tp2 dp1" in out  # without --gpus, dp_shard=-1 counts as 1: said, and the 2-device job does not fit
    assert code == 1 and "--gpus not given: parallel.dp_shard=-1 taken as 1, the job priced on 2 device(s)" in err
    code, _, err = run_cli(capsys, "estimate", "--config", str(path), "--gpu", "h100-sxm", "--gpus", "6")
    assert code == 2 and "not divisible" in err


def test_search_over_16384_gpus_ranks_fitting_layouts():
    # How long it takes is the plan's header line (and benchmarks'), not a test's assertion.
    work = Workload(PRESETS["llama3-405b"], 8192, 2048, "bf16")
    result = search(work, get_hardware("h100-sxm"), 16384)
    assert result.candidates and result.evaluated > 10_000
    best = result.candidates[0]
    assert best.layout.world == 16384 and best.fits and 0.2 < best.mfu < 0.6


def test_emitted_tiny_plan_trains(tmp_path, small_prepared):
    path = tmp_path / "tiny.toml"
    run = tmp_path / "run"
    code = main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "1", "--seq-len", "64", "--global-batch", "8",
                 "--emit-config", str(path), f"--data.path={small_prepared}", "--data.vocab_size=512",
                 f"--run.dir={run}", "--train.steps=2", "--train.eval_interval=0", "--checkpoint.interval=0",
                 "--metrics.progress=none", "--metrics.tensorboard=false", "--model.dim=64", "--model.n_layers=2"])
    assert code == 0
    out = subprocess.run([sys.executable, "-m", "shardline", "train", "--config", str(path)], check=False, cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "train"] == [2]


def test_emitted_moe_plan_on_cpu_ranks_passes_the_launch_checks(tmp_path, capsys):
    """An expert-parallel plan for CPU ranks is one the trainer accepts (no offload: it saves nothing on CPU ranks)."""
    from shardline.preflight import check_device, preflight

    path = tmp_path / "moe.toml"
    code = main(["plan", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "2", "--seq-len", "64",
                 "--global-batch", "8", "--runnable-only", "--fix", "pp=1,cp=1", "--emit-config", str(path)])
    assert code == 0
    assert "offload" not in capsys.readouterr().out
    cfg = load_config(path)
    launch = preflight(cfg, 2, 4096)
    check_device(cfg, launch.layout, on_cuda=False)
    pinned = tmp_path / "ep.toml"
    assert main(["plan", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "2", "--seq-len", "64", "--global-batch",
                 "8", "--runnable-only", "--fix", "ep=2,pp=1,cp=1", "--emit-config", str(pinned)]) == 0
    cfg = load_config(pinned)
    assert cfg.parallel.ep == 2 and preflight(cfg, 2, 4096).layout.ep == 2


def test_the_search_has_ep_borrowing_the_cp_ranks():
    """With cp taking every rank (dp_shard 1), ep can only borrow cp ranks: ep 4 (all of them) is
    offered as runnable, ep 2 (part of them, not built) is pruned as the trainer's rule says."""
    work = Workload(PRESETS["mixtral-8x7b"], 131072, 8, "bf16")
    # pp 4: at pp 2 a stage's unsharded fp32 gradients (torch's pipeline reduces them once per
    # step) leave no layout that fits.
    result = search(work, get_hardware("h100-sxm"), 32, {"cp": 4, "dp_shard": 1, "tp": 2, "pp": 4},
                    runnable_only=True)
    assert {e.layout.ep for e in result.candidates} == {1, 4}
    assert result.pruned["trainer"] > 0


def test_every_pinned_key_is_searched_as_pinned_or_explained():
    """A pinned cp balance, Ulysses part or ZeRO stage under hybrid sharding is what the layouts
    found have (none was ever generated); a pinned pair the search would not try itself is
    tried, and the rule it breaks is the message."""
    work, hw = Workload(PRESETS["llama3-8b"], 65536, 8, "bf16"), get_hardware("h100-sxm")

    def found(**fixed):
        result = search(work, hw, 8, fixed)
        return result, [e.layout for e in result.candidates]

    _, unbalanced = found(cp=8, cp_mode="ring", cp_balance="none")
    assert unbalanced and {lay.cp_balance for lay in unbalanced} == {"none"}
    _, hybrid = found(cp=8, cp_mode="hybrid", cp_ulysses=2)
    assert hybrid and {(lay.cp_mode, lay.cp_ulysses) for lay in hybrid} == {("hybrid", 2)}
    result, _ = found(cp_ulysses=2)
    assert result.candidates and not [e for e in result.candidates if e.layout.cp_mode != "hybrid"]
    result, layouts = found(cp=8, cp_mode="ring", cp_ulysses=2)  # refused as the config refuses it
    assert not layouts and "cp_ulysses=2 applies to cp_mode='hybrid' only" in result.first_problem
    hsdp = [e.layout for e in search(Workload(PRESETS["llama3-8b"], 8192, 8, "bf16"), hw, 8,
                                     {"dp_replicate": 2, "zero": 2}).candidates]
    assert hsdp and {(lay.dp_replicate, lay.zero) for lay in hsdp} == {(2, 2)}
    result, layouts = found(pp=2, pp_schedule="zbv", pp_virtual_stages=1)
    assert not layouts and "places exactly 2 stages per rank" in result.first_problem


def test_offload_is_searched_wherever_the_trainer_builds_it():
    """CPU offload runs at zero 2 and 3 (not 1), under HSDP too; a pinned zero holds on one rank;
    a pinned combination nothing matches names the pinned keys."""
    work, hw = Workload(PRESETS["llama3-8b"], 8192, 64, "bf16"), get_hardware("h100-sxm")
    zero2 = [e.layout for e in search(work, hw, 8, {"zero": 2, "cpu_offload": True}).candidates]
    assert zero2 and {(lay.zero, lay.cpu_offload) for lay in zero2} == {(2, True)}
    assert any(lay.dp_replicate > 1 for lay in zero2)  # offload under HSDP
    hsdp = search(work, hw, 8, {"dp_replicate": 2, "zero": 3, "cpu_offload": True}).candidates
    assert hsdp and {(e.layout.dp_replicate, e.layout.zero, e.layout.cpu_offload) for e in hsdp} == {(2, 3, True)}
    one = search(work, hw, 1, {"zero": 2, "cpu_offload": True}).candidates
    assert one and {(e.layout.zero, e.layout.cpu_offload) for e in one} == {(2, True)}
    single = search(work, hw, 1, {"zero": 1})  # evaluated (8B's states do not fit one H100 without offload)
    assert single.evaluated and {lay.zero for lay in _all_layouts(work, hw, 1, {"zero": 1})} == {1}
    refused = search(work, hw, 1, {"zero": 1, "cpu_offload": True})  # tried, and the rule says why
    assert "use zero=2 or zero=3" in explain_no_fit(work, hw, 1, refused)
    nothing = search(work, hw, 8, {"cp": 1, "cp_ulysses": 2})
    assert not nothing.evaluated
    assert "pinned key (--fix cp=1,cp_ulysses=2)" in explain_no_fit(work, hw, 8, nothing)


def _all_layouts(work, hw, gpus, fixed):
    from shardline.planner.search import candidates

    return list(candidates(work, hw, gpus, fixed))


def test_a_request_that_fits_nowhere_with_offload_pinned_gives_offloads_needs(capsys):
    """Pinned offload: the leanest offload layout's device need and the hosts' need, in GiB."""
    code, _, err = run_cli(capsys, "plan", "--model", "llama3-405b", "--gpu", "h100-sxm", "--gpus", "8",
                           "--seq-len", "8192", "--global-batch", "8", "--fix", "cpu_offload=true")
    assert code == 2 and err.count("\n") == 1
    assert "+offload" in err and "GiB per device" in err and "GiB of host memory per node" in err
    work, hw = Workload(PRESETS["llama3-8b"], 8192, 8, "bf16"), get_hardware("h100-sxm")
    small = dataclasses.replace(hw, network=dataclasses.replace(hw.network, host_mem_gib=16.0))
    result = search(work, small, 8, {"cpu_offload": True, "activation_checkpoint": "full"})
    assert not result.candidates and result.smallest_host is not None  # the devices fit, the hosts do not
    text = explain_no_fit(work, small, 8, result)
    assert "with CPU offload the leanest layout (" in text and "GiB of host memory per node, which has 16 GiB" in text


def test_long_sequences_search_context_parallel_past_8():
    """128k-token sequences, 8 of them a step on 1024 GPUs: only cp >= 16 leaves every rank a
    sequence to share (Llama 3 trained 128k at cp 16); the search found nothing at cp <= 8."""
    work, hw = Workload(PRESETS["llama3-8b"], 131072, 8, "bf16"), get_hardware("h100-sxm")
    found = search(work, hw, 1024).candidates
    assert found and min(e.layout.cp for e in found) >= 16


def test_no_layout_names_the_rule_of_the_most_model_parallel_layout():
    """Nothing fits 2 sequences on 1024 GPUs: the message is the rule the layout with the fewest
    data-parallel ranks broke (a pipeline to fill), not plain data parallelism's "use a multiple
    of 1024", which points away from any layout that could run."""
    work, hw = Workload(PRESETS["llama3-8b"], 4096, 2, "bf16"), get_hardware("h100-sxm")
    result = search(work, hw, 1024)
    assert not result.candidates
    assert "multiple of 1024" not in result.first_problem and "cannot fill the pipeline" in result.first_problem


def test_an_abbreviated_or_misspelt_option_is_named(capsys):
    """`simulate --global-batch` was taken as --global-batch-tokens (sequences read as tokens, a
    goodput for a fraction of a sequence; it is its own option now): no option is abbreviated; a
    misspelt `--seqlen` was reported as --seq-len missing."""
    with pytest.raises(SystemExit) as stop:
        main(["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--days", "1",
              "--global-batch-tok", "2048"])
    assert stop.value.code == 2 and "unrecognized arguments: --global-batch-tok 2048" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--seqlen", "4096",
              "--global-batch", "8"])
    assert "required: --seq-len; not an option here: --seqlen" in capsys.readouterr().err


def test_the_plan_header_counts_nodes_and_active_parameters(capsys):
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len",
                           "4096", "--global-batch", "8", "--top", "1")
    assert code == 0 and "(1 node x 8)" in out and "active" not in out.splitlines()[0]
    code, out, _ = run_cli(capsys, "plan", "--model", "tiny-moe", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len",
                           "1024", "--global-batch", "8", "--top", "1")
    assert code == 0 and "(8.8 M params, 5.3 M active)" in out.splitlines()[0]
    assert "N the active matmul parameters" in out


def test_a_misfit_of_activations_is_told_what_lowers_them():
    """A micro-batch's activations stay as they are on more data-parallel ranks: the advice is tp,
    cp or recompute, not devices; only where tp x cp x pp already holds every device (no data
    parallelism left) do larger degrees need more devices, and it says so."""
    work, hw = Workload(PRESETS["llama3-8b"], 131072, 8, "bf16"), get_hardware("h100-sxm")
    said = explain_no_fit(work, hw, 8, search(work, hw, 8, {"tp": 1, "cp": 1, "activation_checkpoint": "none"}))
    assert "activations are a micro-batch's" in said and "more devices" not in said, said
    bounded = explain_no_fit(work, hw, 8, search(work, hw, 8, {"tp": 8, "cp": 1, "activation_checkpoint": "none"}))
    assert "activations are a micro-batch's" in bounded and "larger ones need about" in bounded, bounded


def test_an_emitted_config_leaves_a_base_configs_idle_settings_at_their_defaults(capsys, tmp_path):
    """A base config's ac_every=4 was kept under a plan choosing full checkpointing, and the launch
    then named it unused."""
    from shardline.launch_notes import unused_settings

    path = tmp_path / "plan.toml"  # (a plan's base config: its overrides; one the plan sets is refused)
    code, _, err = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--memory.ac_every=4",
                           "--fix", "activation_checkpoint=full", "--emit-config", str(path))
    assert code == 2 and err.rstrip().endswith("give it to the search as --fix ac_every=...")
    code, _, err = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--fix",
                           "activation_checkpoint=full,ac_every=4", "--emit-config", str(path))
    assert code == 2 and "--fix ac_every=4 is read by selective checkpointing only" in err  # (it crashed, then
    code, out, _ = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--fix",  # was dropped)
                           "activation_checkpoint=full", "--emit-config", str(path))
    assert code == 0, out
    cfg = load_config(path)
    assert cfg.memory.activation_checkpoint == "full" and cfg.memory.ac_every == 2 and unused_settings(cfg) == {}
    code, out, _ = run_cli(capsys, *PLAN_8B, "--json", "--runnable-only", "--fix",
                           "activation_checkpoint=selective,ac_every=4", "--emit-config", str(path))
    assert code == 0, out
    assert load_config(path).memory.ac_every == 4
    assert run_cli(capsys, *PLAN_8B, "--fix", "ac_every=0")[0] == 2  # (a ZeroDivisionError in the search)


def test_a_request_only_the_trainers_rules_refuse_says_why():
    """Weights with a sliding window shorter than the sequence: every layout fits and none can be
    trained (the window is not built), so `plan --runnable-only` said only {'trainer': N}."""
    model = dataclasses.replace(PRESETS["llama3.2-1b"], sliding_window=2047)
    work = Workload(model, 4096, 64, "bf16")
    hw = get_hardware("h100-sxm")
    result = search(work, hw, 8, runnable_only=True)
    assert not result.candidates and set(result.pruned) >= {"trainer"}
    message = explain_no_fit(work, hw, 8, result)
    assert ("layouts that fit `shardline train` cannot run: train.seq_len=4096 is longer than the model's sliding "
            "window") in message
    assert search(dataclasses.replace(work, seq_len=2046), hw, 8, runnable_only=True).candidates  # within it: runs


def test_the_plan_says_whether_it_prices_the_blocks_compiled(capsys):
    """A torchtitan user (who compiles) got eager prices without a word, and --train.compile=true
    ranked layouts otherwise: the request line says which, and how to ask for the other."""
    argv = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "1", "--seq-len", "64", "--global-batch", "8",
            "--top", "1"]
    assert main(argv) == 0
    assert "eager blocks (train.compile=false; --train.compile=true prices them compiled)" in capsys.readouterr().out
    assert main([*argv, "--train.compile=true"]) == 0
    assert "compiled blocks (train.compile;" in capsys.readouterr().out


def test_a_plan_whose_layouts_use_a_cp_ring_names_its_attention_too(capsys):
    """The header priced flex for the request while the layouts shown ran a cp ring (another kernel)."""
    from shardline.cli import main

    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len", "8192",
                 "--global-batch", "512", "--top", "3", "--fix", "cp=2"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "attention flex: " in head and head.endswith("; with cp > 1, context parallelism's ring: 50% of them")
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len", "8192",
                 "--global-batch", "512", "--top", "3", "--fix", "cp=1"]) == 0
    assert "context parallelism's ring" not in capsys.readouterr().out.splitlines()[0]


def test_a_gpu_plan_says_what_its_ranking_rests_on(capsys):
    """Its top rows beat published runs (tp4 pp32 zbv cp8 at 43% for 405B on 16k GPUs, Meta's own layout
    27% here): the table says they are the cost model's, with this trainer not yet run on many GPUs."""
    from shardline.cli import main
    from shardline.planner.report import PLAN_CAVEAT

    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "4096",
                 "--global-batch", "64", "--top", "2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(PLAN_CAVEAT) and "not yet on many" in PLAN_CAVEAT
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "1", "--seq-len", "64", "--global-batch",
                 "8"]) == 0
    assert PLAN_CAVEAT not in capsys.readouterr().out  # (a CPU plan: the runs here measure it)


def test_a_pinned_pipeline_schedule_asks_for_a_pipeline():
    """`--fix pp_schedule=zbv` was met by layouts without one (pp=1 keeps any schedule name), so a
    pinned schedule with full activation checkpointing, which zbv refuses, listed ten pp=1 rows."""
    work, hw = Workload(PRESETS["llama3-8b"], 8192, 32, "bf16"), get_hardware("h100-sxm")
    found = search(work, hw, 8, {"pp_schedule": "zbv"}).candidates
    assert found and {e.layout.pp_schedule for e in found} == {"zbv"} and min(e.layout.pp for e in found) > 1
    refused = search(work, hw, 8, {"pp_schedule": "zbv", "activation_checkpoint": "full"})
    assert not refused.candidates and "zbv" in refused.first_problem
    assert search(work, hw, 8, {"pp_schedule": "zbv", "pp": 1}).candidates  # (pp pinned too: as asked)
    for plain in ({"pp_schedule": "1f1b"}, {"pp_virtual_stages": 1}):  # (what pp=1 runs: no pipeline asked for)
        assert 1 in {e.layout.pp for e in search(work, hw, 8, plain).candidates}, plain


def test_an_odd_sequence_that_does_not_fit_is_told_that_no_tp_or_cp_splits_it(capsys):
    """seq 131071 (prime) did not fit, and the advice was "a larger tp or cp": neither splits an odd
    length (the search offers none), so the line names the length and an even one."""
    code, _, err = run_cli(capsys, "plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len",
                           "131071", "--global-batch", "64", "--train.loss_chunk_tokens=4096")
    assert code != 0
    assert "a seq_len such as 131072 with a larger tp or cp (neither splits seq 131071, an odd length)" in err


def test_a_long_sequence_plan_says_how_much_of_the_counted_flops_the_devices_run(capsys):
    """At 128k tokens the table showed 58.9% MFU for 8B where the devices run about 35% of peak: the
    scores are 82% of the model FLOPs, and a causal kernel computes half of them."""
    code, out, _ = run_cli(capsys, "plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len",
                           "131072", "--global-batch", "64", "--top", "1")
    assert code == 0
    assert ("at seq 131,072 the scores are 82% of the FLOPs MFU counts and the cp ring computes 50% of them: the "
            "devices run about 59% of the FLOPs counted") in out
    assert "the scores are" not in run_cli(capsys, *PLAN_8B, "--top", "1")[1]  # (seq 4096: 6N is most of them)


def test_the_network_between_nodes_is_given_on_the_command_line(capsys):
    """An ops engineer's cluster (a 100G NIC a GPU, a 2:1 fabric) needed a --profile file: the flags price
    it, the report says so, and nonsense is one line."""
    from shardline.cli import main

    argv = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len", "8192",
            "--global-batch", "512", "--top", "1", "--json"]
    assert main(argv) == 0
    fast = json.loads(capsys.readouterr().out)
    assert main([*argv, "--inter-bw-gbs", "12.5", "--oversubscription", "2"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["candidates"][0]["tokens_per_s"] < fast["candidates"][0]["tokens_per_s"]
    assert slow["priced_by"].endswith("; between nodes --inter-bw-gbs 12.5 --oversubscription 2"), slow["priced_by"]
    for bad, says in ((["--inter-bw-gbs", "0"], "--inter-bw-gbs 0 must be > 0"),
                      (["--oversubscription", "0.5"], "--oversubscription 0.5 must be >= 1")):
        assert main([*argv, *bad]) == 2 and says in capsys.readouterr().err
