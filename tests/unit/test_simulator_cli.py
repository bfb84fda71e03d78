"""`shardline simulate` from the command line: output contract, config files, user errors."""

from __future__ import annotations

import json

import pytest

from shardline.cli import main
from shardline.errors import ConfigError
from shardline.simulator.cli import simulate
from shardline.simulator.job import make_job
from shardline.simulator.settings import load_settings

SMALL = ["simulate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "1024", "--days", "10", "--seeds", "2"]


def run_json(capsys, *args: str) -> dict:
    """The report as JSON; a step time is given unless the test asks the planner (--fix)."""
    given = [] if "--fix" in args else ["--step-time", "2"]
    assert main([*SMALL, *given, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_keys_scripts_rely_on(capsys):
    report = run_json(capsys)
    assert isinstance(report["interruptions"], float) and report["interruptions"] > 0
    assert 0.0 < report["goodput"] < 1.0
    assert report["lost_gpu_hours"] == pytest.approx(sum(report["lost_gpu_hours_by_bucket"].values()))
    assert report["lost_gpu_hours_by_cause"] == report["lost_gpu_hours_by_bucket"]  # the older name
    assert report["lost_gpu_hours"] == pytest.approx(report["gpu_hours"] * (1 - report["goodput"]), rel=1e-6)
    assert report["optimal_checkpoint_interval_s"] == pytest.approx(report["daly_interval_s"])
    assert report["checkpoint"]["mode"] == "async"
    assert report["checkpoint"]["interval_steps"] == report["optimal_checkpoint_interval_steps"]


def test_step_time_source_names_the_planned_layout(capsys):
    report = run_json(capsys, "--fix", "tp=8")
    assert report["step_time_source"].startswith("planner: tp8 ")
    assert report["step_time_s"] > 0
    report = run_json(capsys, "--fix", "tp=8", "--mfu", "0.4")  # (accepted and unused, in silence)
    assert report["step_time_source"].endswith("(--mfu 0.4 not used: it prices a job the planner has no layout for)")


def test_text_output_and_fixed_interval(capsys):
    assert main([*SMALL, "--checkpoint-interval", "50", "--checkpoint-mode", "sync", "--step-time", "2"]) == 0
    out = capsys.readouterr().out
    assert "sync every 50 steps (100 s)" in out
    assert "step time       2 s (given" in out
    assert "goodput" in out and "recompute since last checkpoint" in out


def test_text_output_says_what_the_optimum_and_the_failures_assume(capsys):
    """No failures: no optimum (not "none = N steps"); a write longer than the MTBF, and the async
    optimum held at it, are named; planned stops are a rate a day whatever the job's size."""
    assert main([*SMALL, "--step-time", "2", "--failure-scale", "0", "--failures.planned_per_day=0"]) == 0
    out = capsys.readouterr().out
    assert "optimal         none: no failures to recover from" in out and "Young" not in out
    none = run_json(capsys, "--failure-scale", "0", "--failures.planned_per_day=0")
    assert none["optimal_checkpoint_interval_s"] is none["optimal_checkpoint_interval_steps"] is None  # (was the run)
    assert main([*SMALL, "--step-time", "2", "--save-time", "200000"]) == 0
    out = capsys.readouterr().out
    assert "(async: held at the write time" in out and "takes longer than the job's MTBF" in out
    assert "planned stops 0.87 a day whatever the job's size" in out
    assert "priced from: write --save-time, given; stall 1 s + " in out  # what each time rests on, and its keys
    assert main([*SMALL, "--step-time", "2", "--simulate.storage_gbps_total=3"]) == 0
    out = capsys.readouterr().out
    assert "TB (12 B a parameter) at 3 GB/s (min of 1 a node, 3 in all); stall" in out, out
    assert "save_overhead_s, host_copy_gbps, snapshot_overhead_s change them" in out
    assert main([*SMALL, "--step-time", "2", "--checkpoint-mode", "sync"]) == 0  # (its stall is the write)
    out = capsys.readouterr().out
    assert "priced from: write (the stall) 10 s + " in out and "host_copy" not in out, out
    assert main([*SMALL, "--step-time", "2", "--save-time", "30", "--snapshot-time", "2"]) == 0  # (both given)
    assert "priced from: write --save-time, given; stall --snapshot-time, given\n" in capsys.readouterr().out


def test_toml_config_and_overrides_change_the_failure_model(tmp_path, capsys):
    base = run_json(capsys)
    config = tmp_path / "flaky.toml"
    config.write_text("[failures]\nscale = 4.0\n\n[simulate]\ndetection_s = 600\n")
    flaky = run_json(capsys, "--config", str(config))
    assert flaky["interruptions_unexpected"] > 2 * base["interruptions_unexpected"]
    assert flaky["goodput"] < base["goodput"] - 0.02
    # An explicit flag beats the file; an override beats the file too.
    assert run_json(capsys, "--config", str(config), "--failure-scale", "1")["mtbf_hours"] == base["mtbf_hours"]
    no_gpu = run_json(capsys, "--failures.faulty_gpu=0", "--simulate.restart_s=60")
    assert no_gpu["interruptions_by_cause"]["faulty_gpu"] == 0 and no_gpu["mtbf_hours"] > base["mtbf_hours"]


def test_plot_writes_a_png_with_a_sweep(tmp_path, capsys):
    png = tmp_path / "goodput.png"
    report = run_json(capsys, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report["sweep"]) == {"sync", "async", "memory"}
    assert report["simulated_optimum_interval_s"] > 0
    run_json(capsys, "--plot", str(png))  # its own earlier plot is replaced


def test_plot_never_overwrites_a_file_that_is_not_a_png(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[model]\npreset = 'tiny'\n")
    assert main([*SMALL, "--plot", str(config)]) == 2
    assert "give a file name ending in" in capsys.readouterr().err
    assert config.read_text() == "[model]\npreset = 'tiny'\n"
    named = tmp_path / "notes.png"  # (a file named like a plot that is none)
    named.write_text("my notes\n")
    assert main([*SMALL, "--plot", str(named)]) == 2
    assert "exists and is not a PNG" in capsys.readouterr().err
    assert named.read_text() == "my notes\n"
    assert main([*SMALL, "--plot", str(tmp_path / "missing" / "g.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([*SMALL, "--plot", str(tmp_path / "p.txt")]) == 2  # (it wrote a PNG under that name)
    assert "p.txt: give a file name ending in .png, .svg, .pdf" in capsys.readouterr().err
    assert not (tmp_path / "p.txt").exists()


def test_plot_kind_follows_the_file_name(tmp_path, capsys):
    svg = tmp_path / "goodput.svg"
    run_json(capsys, "--plot", str(svg))
    assert svg.read_bytes().startswith(b"<?xml") and b"<svg" in svg.read_bytes()[:2000]
    run_json(capsys, "--plot", str(svg))  # its own earlier plot is replaced


@pytest.mark.parametrize("changes, message", [
    ({"--gpus": "1020"}, "not a multiple of --gpus-per-node 8: use 1016 or 1024"),
    ({"--days": "-3"}, "--days -3.0 must be a finite number > 0"),
    ({"--days": "inf"}, "--days inf must be a finite number > 0"),
    ({"--failure-scale": "-1"}, "--failure-scale -1.0 must be a finite number >= 0"),
    ({"--failure-scale": "1e12"}, "expected failures in"),  # (ran for minutes, in silence)
    ({"--gpu": "h300"}, "not a known accelerator"),
    ({"--model": "llama9-1t"}, "neither a preset"),
    ({"--checkpoint-interval": "0"}, "positive number of steps or 'optimal'"),
    ({"--checkpoint-interval": "often"}, "positive number of steps or 'optimal'"),
    ({"--seeds": "0"}, "--seeds 0"),
    ({"--failures.flux_capacitor=1e-6": None}, "failures.flux_capacitor is not a failure setting"),
    ({"--simulate.detection_s=-5": None}, "simulate.detection_s=-5 must be >= 0"),
    ({"--straggler-slowdown": "0.5"}, "straggler_slowdown=0.5 must be >= 1"),
    ({"--step-time": "1e-6", "--checkpoint-interval": "1"}, "use an interval of at least"),
    ({"--fix": "tq=8"}, "--fix key 'tq' is unknown"),
    ({"--fix": "tp=2,tp=4"}, "--fix gives tp twice (tp=2, tp=4): give it once"),
    ({"--simulate.fix=tp=x": None}, "--fix tp='x' must be an integer"),
    ({"--step-time": "2", "--mfu": "0.5"}, "--mfu shapes the step-time estimate, which --step-time replaces"),
    ({"--step-time": "2", "--simulate.seq_len=4096": None, "--simulate.fix=tp=8": None},
     "simulate.fix, simulate.seq_len shape the step-time estimate, which simulate.step_time_s replaces"),
    ({"--simulate.step_time_s=2": None, "--simulate.mfu=0.5": None}, "simulate.mfu shapes the step-time"),
    ({"--checkpoint-mode": "async", "--persist-every": "4"},
     "simulate.persist_every (used by memory) would be ignored under checkpoint mode async; remove it"),
    ({"--simulate.persist_interval_s=600": None}, "simulate.persist_interval_s (used by memory) would be ignored"),
    ({"--checkpoint-mode": "sync", "--snapshot-time": "3"},
     "simulate.snapshot_s (used by async and memory) would be ignored under checkpoint mode sync"),
])
def test_impossible_requests_are_user_errors(capsys, changes, message):
    flags = dict(zip(SMALL[1::2], SMALL[2::2], strict=True))  # SMALL is "simulate" + flag/value pairs
    flags.update(changes)
    argv = ["simulate"] + [item for flag, value in flags.items() for item in (flag, value) if item is not None]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline: error:") and message in err


def test_a_second_config_file_is_refused_not_silently_preferred(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*SMALL, "--config", "a.toml", "--config", "b.toml"])
    assert exit_.value.code == 2 and "--config given twice (a.toml, b.toml)" in capsys.readouterr().err


def test_errors_are_config_errors_in_the_api(tmp_path):
    with pytest.raises(ConfigError, match="not a multiple"):
        make_job("llama3-405b", "h100-sxm", 16380, 8, 54)
    with pytest.raises(ConfigError, match="must be a finite number > 0"):
        make_job("llama3-405b", "h100-sxm", 16384, 8, -1)
    with pytest.raises(ConfigError, match="h100-pcie-2"):
        make_job("llama3-405b", "h100-pcie-2", 16384, 8, 54)
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) cluster; valid: \[simulate\], \[failures\]$"):
        load_settings(bad, [], {})
    bad.write_text("[model]\npreset = 'llama3-8b'\n[parallel]\ntp = 8\n")  # a training config, given here
    with pytest.raises(ConfigError, match="a training config: simulate takes its model as --model and its layout "
                                          "as --fix"):
        load_settings(bad, [], {})


def test_a_16k_gpu_run_reports_llama3_like_numbers():
    job = make_job("llama3-405b", "h100-sxm", 16384, 8, 54)
    report = simulate(job, load_settings(None, [], {}), seeds=4)
    assert report["expected_interruptions"]["unexpected"] == pytest.approx(419)
    assert report["goodput"] > 0.9


def test_a_hardware_profile_shapes_the_planned_step_and_the_nodes(tmp_path, capsys):
    """A measured network (as `shardline comm-bench` writes it) reaches the planner's step time:
    a network 40x slower across nodes gives a slower step, named in the source; its nodes' size
    is the job's unless --gpus-per-node says otherwise; the file is read once (an edit after the
    job is made changes nothing)."""
    slow = tmp_path / "comm.toml"
    slow.write_text('base = "h100-sxm"\n[network]\ngpus_per_node = 4\ninter_bw_gbs = 1.25\nbw_efficiency = 1.0\n')
    plain = run_json(capsys, "--fix", "tp=4")
    measured = run_json(capsys, "--fix", "tp=4", "--profile", str(slow))
    assert measured["step_time_s"] > 1.5 * plain["step_time_s"]
    assert f"--profile {slow}" in measured["step_time_source"]
    assert (measured["gpus_per_node"], measured["nodes"], plain["gpus_per_node"]) == (4, 256, 8)
    assert make_job("llama3-8b", "h100-sxm", 1024, 8, 10, str(slow)).gpus_per_node == 8
    assert make_job("llama3-8b", "h100-sxm", 1024, None, 10).gpus_per_node == 8
    job = make_job("llama3-8b", "h100-sxm", 1024, None, 10, str(slow))
    slow.write_text('base = "h100-sxm"\n')
    assert json.loads(job.profile[1])["network"]["inter_bw_gbs"] == 1.25

    def refused(*args: str) -> str:
        assert main([*SMALL, *args]) == 2
        return capsys.readouterr().err

    bad = tmp_path / "bad.toml"
    bad.write_text("[network]\ninter_bw = 1.0\n")
    assert "unknown hardware key 'inter_bw'" in refused("--profile", str(bad))
    assert "describes 'h100-sxm' but the device is 'b200'" in refused("--profile", str(slow), "--gpu", "b200")
    bad.write_text("[network]\ngpus_per_node = 6\n")
    want = f"not a multiple of {bad}'s [network] gpus_per_node 6: use 1020 or 1026 (or give --gpus-per-node)"
    assert want in refused("--profile", str(bad))
    bad.write_text("[network]\ngpus_per_node = 0\n")
    assert f"{bad} [network]: gpus_per_node=0 must be a number >= 1" in refused("--profile", str(bad))
    assert "--profile shapes the step-time estimate, which --step-time replaces" in refused(
        "--profile", str(slow), "--step-time", "2")
    assert "which simulate.step_time_s replaces" in refused("--profile", str(slow), "--simulate.step_time_s=2")


def test_mode_settings_are_refused_only_where_no_simulated_mode_reads_them():
    """Defaults pass under every mode; a memory-mode key passes in memory mode, and under any mode
    when a plot simulates all of them (its memory curve reads it)."""
    from shardline.simulator.settings import MODES, check_mode_keys

    for mode in MODES:
        check_mode_keys(load_settings(None, [], {"checkpoint_mode": mode}), (mode,))
    memory = load_settings(None, ["--simulate.persist_interval_s=600"], {"checkpoint_mode": "memory",
                                                                         "persist_every": 3, "snapshot_s": 2.0})
    check_mode_keys(memory, ("memory",))
    async_ = load_settings(None, [], {"checkpoint_mode": "async", "persist_every": 3})
    check_mode_keys(async_, MODES)
    with pytest.raises(ConfigError, match="persist_every"):
        check_mode_keys(async_, ("async",))


def test_the_text_names_the_batch_it_priced_and_the_whole_steps_of_its_interval(capsys):
    """The step time is the planner's for a batch the simulator chose (one sequence a GPU): the line
    says which, as a plan of another batch prices another step; the optimum in seconds is rounded to
    whole steps, whose own seconds are said too; large seconds read as seconds."""
    from shardline.simulator.report import _secs

    assert main([*SMALL, "--fix", "tp=1,pp=1"]) == 0
    out = capsys.readouterr().out
    assert "a step of 1,024 sequences of 8,192 tokens (--global-batch or --global-batch-tokens, --seq-len))" in out
    line = next(x for x in out.splitlines() if x.startswith("optimal"))
    step = float(next(x for x in out.splitlines() if x.startswith("step time")).split()[2])
    steps, seconds = line.split("~ ")[1].split(" steps (")
    assert float(seconds.split(" s)")[0].replace(",", "")) == pytest.approx(int(steps.replace(",", "")) * step,
                                                                             rel=2e-3)
    assert "e+0" not in out
    assert (_secs(1950.4), _secs(999.7), _secs(999.4), _secs(153.2), _secs(None)) == (
        "1,950 s", "1,000 s", "999 s", "153 s", "none")


def test_the_batch_is_given_in_sequences_or_in_tokens_once(capsys, tmp_path):
    """`--global-batch SEQS` prices the step `--global-batch-tokens` does for as many tokens (plan
    takes both; simulate took tokens alone); a later source's batch replaces a file's in either unit,
    both in one source are refused, and neither goes with a given step time."""
    by_seqs = run_json(capsys, "--fix", "tp=1,pp=1", "--seq-len", "4096", "--global-batch", "256")
    by_tokens = run_json(capsys, "--fix", "tp=1,pp=1", "--seq-len", "4096", "--global-batch-tokens", str(256 * 4096))
    assert by_seqs["step_time_s"] == by_tokens["step_time_s"]
    assert "a step of 256 sequences of 4,096 tokens" in by_seqs["step_time_source"]
    config = tmp_path / "sim.toml"
    config.write_text("[simulate]\nglobal_batch_tokens = 1000\n", encoding="utf-8")
    settings = load_settings(config, [], {"global_batch": 64})
    assert (settings.global_batch, settings.global_batch_tokens) == (64, None)
    settings = load_settings(config, ["--simulate.global_batch=8"], {})
    assert (settings.global_batch, settings.global_batch_tokens) == (8, None)
    config.write_text("[simulate]\nglobal_batch_tokens = 1000\nglobal_batch = 8\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="simulate.global_batch .sequences. and simulate.global_batch_tokens both"):
        load_settings(config, [], {})
    with pytest.raises(ConfigError, match="simulate.global_batch .sequences. and simulate.global_batch_tokens both"):
        load_settings(None, ["--simulate.global_batch=8", "--simulate.global_batch_tokens=32768"], {})
    assert main([*SMALL, "--step-time", "2", "--global-batch", "64"]) == 2
    assert "--global-batch shapes the step-time estimate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*SMALL, "--global-batch", "64", "--global-batch-tokens", "100"])
    assert "not allowed with argument --global-batch" in capsys.readouterr().err


def test_the_text_says_how_flat_the_simulated_best_is_and_no_noise_as_a_cause(capsys):
    """--sweep's best at 8 seeds was 21% off Daly's, printed bare; a shortfall of interruptions within the
    seeds' spread got an explanation meant for a real one; a tiny job's lost hours read 0 of 0."""
    from shardline.simulator.report import _flat_around_best, _hours, format_text

    points = [{"interval_s": s, "goodput": g, "goodput_std": 0.004} for s, g in
              ((1000, 0.90), (2000, 0.9125), (3000, 0.9130), (4000, 0.9128), (8000, 0.905))]
    said = _flat_around_best(points, 8)  # two standard errors: 2 x 0.004 / sqrt(8) = 0.0028
    assert "from 2,000 s to 4,000 s: more --seeds narrows that" in said, said
    assert _flat_around_best(points, 10_000) == ""  # (a sharp top: nothing to say)
    assert _hours(0.0123, 0.05) == "0.0123" and _hours(255_804.4, 2_949_120) == "255,804"
    report = run_json(capsys, "--seeds", "8")
    text = format_text(report)
    shortfall = report["expected_interruptions"]["unexpected"] - report["interruptions_unexpected"]
    noise = 2 * report["interruptions_std"] / 8 ** 0.5
    assert ("below the expected" in text) == (shortfall > noise), (shortfall, noise)
