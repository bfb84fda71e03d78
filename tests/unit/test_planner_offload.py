"""The planner's SSD tier (planner/offload.py, memory.ssd_offload_dir): where the moments go,
which layouts keep them there, when the page cache holds them, and what the SSD costs a step."""

from __future__ import annotations

import dataclasses

import pytest

from shardline.cli import main
from shardline.errors import ConfigError
from shardline.models import PRESETS
from shardline.planner.estimate import estimate
from shardline.planner.hardware import get_hardware
from shardline.planner.layout import Layout, Workload, to_config
from shardline.planner.memory import GiB, memory_breakdown
from shardline.planner.offload import host_fits, ssd_spill
from shardline.planner.search import explain_no_fit, search

W8B = Workload(PRESETS["llama3-8b"], 4096, 16, "bf16")
ON_SSD = dataclasses.replace(W8B, ssd_offload_dir="/nvme/shardline")
OFFLOAD = Layout(cpu_offload=True, activation_checkpoint="full", micro_batch_size=1)


def host(gib: float, read: float = 25.0, write: float = 12.0, name: str = "h100-sxm"):
    """A hardware entry whose nodes have `gib` of host memory and SSDs of these GB/s."""
    hw = get_hardware(name)
    return dataclasses.replace(hw, network=dataclasses.replace(hw.network, host_mem_gib=gib, ssd_read_gbs=read,
                                                                ssd_write_gbs=write))


def test_the_moments_move_from_the_host_to_the_ssd_and_nothing_else():
    hw = host(2048)
    plain, ssd = memory_breakdown(W8B, OFFLOAD, hw), memory_breakdown(ON_SSD, OFFLOAD, hw)
    moments = 8 * 8.03e9  # m and v in fp32, every parameter on the one rank
    assert ssd["ssd_offload"] == pytest.approx(moments, rel=0.01) and plain["ssd_offload"] == 0
    assert plain["host_offload"] - ssd["host_offload"] == pytest.approx(ssd["ssd_offload"])
    assert ssd["total"] == plain["total"]  # the device holds what it held
    # Where AdamW steps on the device, or under ZeRO-1, the folder is not used.
    for layout in (dataclasses.replace(OFFLOAD, cpu_offload=False), Layout(dp_shard=8, zero=1)):
        assert memory_breakdown(ON_SSD, layout, hw)["ssd_offload"] == 0


def test_on_cpu_ranks_the_moments_leave_the_ranks_memory():
    tiny = Workload(PRESETS["tiny"], 256, 8, "fp32")
    cpu = get_hardware("cpu")
    plain = memory_breakdown(tiny, Layout(), cpu)
    ssd = memory_breakdown(dataclasses.replace(tiny, ssd_offload_dir="/data"), Layout(), cpu)
    assert plain["optimizer"] - ssd["optimizer"] == pytest.approx(ssd["ssd_offload"]) and ssd["ssd_offload"] > 0
    assert plain["total"] - ssd["total"] == pytest.approx(ssd["ssd_offload"] * (1 + cpu.fragmentation))


def test_a_host_too_small_for_offload_fits_with_the_moments_on_an_ssd():
    """8B on one H100 with 128 GiB of host memory: CPU offload needs 120 GiB there (weights,
    gradients and moments, 16 B a parameter), more than the 90% usable; with the moments on the
    SSD, 60 GiB. The misfit message points at the option; the emitted config names the folder."""
    hw, fixed = host(128), {"activation_checkpoint": "full"}
    none = search(W8B, hw, 1, fixed, runnable_only=True)
    assert not none.candidates and "--ssd-offload-dir" in explain_no_fit(W8B, hw, 1, none)
    fits = search(ON_SSD, hw, 1, fixed, runnable_only=True)
    assert fits.candidates and all(e.layout.cpu_offload and e.host_ok for e in fits.candidates)
    best = fits.candidates[0]
    assert not host_fits(memory_breakdown(W8B, best.layout, hw), best.layout, hw)
    assert to_config(best.layout, ON_SSD).memory.ssd_offload_dir == "/nvme/shardline"
    assert to_config(Layout(dp_shard=8), ON_SSD).memory.ssd_offload_dir == ""  # AdamW on the GPUs
    assert to_config(Layout(), ON_SSD, on_cpu=True).memory.ssd_offload_dir == "/nvme/shardline"
    # a plan for CPU ranks runs them on the CPU (auto would take a GPU there, and its dry run price one)
    assert (to_config(Layout(), ON_SSD, on_cpu=True).run.device, to_config(Layout(), ON_SSD).run.device) == (
        "cpu", "auto")


def test_the_ssd_costs_a_step_only_beyond_the_page_cache_and_what_hides_it():
    """Moments the page cache keeps are not read; once they do not all fit, a sweep in the same
    order each step misses throughout (least recently used goes first): every moment is read in
    the optimizer step (overlapping the host's AdamW). Every moment is dirtied each step: written
    back past the kernel's dirty limit in the optimizer step, the rest (where they must be clean
    to be evicted) under the next forward and backward. Only what sticks out shows in the step."""
    moments_gib = 8 * 8.03e9 / GiB  # 59.8: the host holds 59.8 more of weights and gradients
    fits, cliff = estimate(ON_SSD, OFFLOAD, host(134)), estimate(ON_SSD, OFFLOAD, host(132))
    assert ssd_spill(fits.memory, OFFLOAD, host(134)) == 0 and "ssd_io" not in fits.breakdown
    # Cached, every moment is still dirtied each step: past the dirty limit (15% of the 74 GiB left)
    # its write-back runs in the optimizer step, here longer than the step's host AdamW.
    slow = estimate(ON_SSD, OFFLOAD, host(134, write=2.0))
    blocking = (slow.memory["ssd_offload"] - 0.15 * (134 * GiB - slow.memory["host_offload"])) / 2e9
    assert slow.breakdown["ssd_io"] == pytest.approx(blocking - slow.breakdown["optimizer"]) and blocking > 12
    assert ssd_spill(cliff.memory, OFFLOAD, host(132)) == pytest.approx(moments_gib * GiB, rel=0.01)
    tight_hw = host(72, read=4.0, write=1.0)  # 12 GiB left beside the weights and gradients
    tight = estimate(ON_SSD, OFFLOAD, tight_hw)
    spill, optimizer, io = tight.memory["ssd_offload"], tight.breakdown["optimizer"], tight.breakdown["ssd_io"]
    # The reads cannot hide beyond the optimizer; nothing costs more than reading and writing it all.
    assert spill / 4e9 - optimizer <= io <= spill / 4e9 + spill / 1e9
    # Past the dirty limit (15% of the ~12 GiB left) the optimizer waits for the write-back too.
    assert io >= spill / 4e9 + (spill - 0.15 * (72 * GiB - tight.memory["host_offload"])) / 1e9 - optimizer
    faster = estimate(ON_SSD, OFFLOAD, host(72, read=400.0, write=100.0))
    assert faster.breakdown.get("ssd_io", 0.0) < io
    # A smaller host leaves less to hold dirty pages: more of the write-back blocks the optimizer
    # (while the background part hides under the forward and backward, as here: several seconds
    # of it for 8B, against ~2 s of background writing; where it did not, the two would trade).
    tighter = estimate(ON_SSD, OFFLOAD, host(68, read=4.0, write=1.0))
    assert tighter.breakdown["ssd_io"] > io + 0.5
    with pytest.raises(ConfigError, match="ssd_read_gbs=0"):
        estimate(ON_SSD, OFFLOAD, host(72, read=0.0))


def test_plan_takes_the_folder_from_the_flag_or_the_config_and_writes_it(tmp_path, capsys):
    profile = tmp_path / "workstation.toml"
    profile.write_text("[network]\nhost_mem_gib = 128.0\n")
    plan = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "1", "--seq-len", "4096", "--global-batch",
            "16", "--profile", str(profile), "--runnable-only", "--top", "2"]
    assert main(plan) != 0 and "--ssd-offload-dir" in capsys.readouterr().err  # the host is short without
    for how in (["--ssd-offload-dir", "/nvme/a"], ["--memory.ssd_offload_dir=/nvme/a"]):
        out = tmp_path / "plan.toml"
        out.unlink(missing_ok=True)
        assert main([*plan, *how, "--emit-config", str(out)]) == 0
        assert 'ssd_offload_dir = "/nvme/a"' in out.read_text() and "cpu_offload = true" in out.read_text()


def test_estimate_prices_a_configs_folder_and_refuses_what_the_trainer_refuses(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "llama3.2-1b"\n[train]\nseq_len = 1024\nglobal_batch_size = 8\n'
                      '[memory]\ncpu_offload = true\nssd_offload_dir = "/nvme/x"\n')
    args = ["estimate", "--config", str(config), "--gpu", "h200", "--gpus", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "on the SSD" in out and "memory.ssd_offload_dir: AdamW's moments; the page cache holds them" in out
    assert main([*args, "--memory.cpu_offload=false"]) != 0
    assert "needs memory.cpu_offload=true on a GPU" in capsys.readouterr().err


def test_the_host_adamw_is_priced_by_its_implementation():
    """Offloaded AdamW steps on the host: the fused kernel (auto's choice) at its measured rate,
    foreach at its own, slower one (optim.implementation, read from the config)."""
    from shardline.config import load_config
    from shardline.planner.estimate import CPU_ADAM_BYTES_PER_S, CPU_ADAM_FOREACH_BYTES_PER_S

    hw = host(2048)
    auto = Workload.from_config(load_config(None, ["train.precision=bf16"]), PRESETS["llama3-8b"])
    foreach = Workload.from_config(load_config(None, ["optim.implementation=foreach", "train.precision=bf16"]),
                                   PRESETS["llama3-8b"])
    assert auto.host_adam_fused and not foreach.host_adam_fused
    fast, slow = (estimate(w, OFFLOAD, hw).breakdown["optimizer"] for w in (auto, foreach))
    assert slow / fast == pytest.approx(CPU_ADAM_BYTES_PER_S / CPU_ADAM_FOREACH_BYTES_PER_S, rel=1e-6)
    # A GPU's AdamW is priced as the fused kernel whatever the setting (a simplification the docs name).
    on_device = dataclasses.replace(OFFLOAD, cpu_offload=False)
    gpu = [estimate(w, on_device, hw).breakdown["optimizer"] for w in (auto, foreach)]
    assert gpu[0] == gpu[1] < fast


def test_plan_prices_the_host_adamw_the_config_names(capsys):
    """plan priced an offloaded AdamW as fused whatever optim.implementation said, then emitted a
    config that estimate priced at foreach's rate: the same plan, two optimizer times."""
    import json

    plan = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "1", "--seq-len", "4096", "--global-batch",
            "16", "--fix", "cpu_offload=true", "--top", "1", "--json"]
    times = []
    for impl in ("auto", "foreach"):
        assert main([*plan, f"--optim.implementation={impl}"]) == 0
        times.append(json.loads(capsys.readouterr().out)["candidates"][0]["breakdown"]["time_s"]["optimizer"])
    assert times[1] / times[0] == pytest.approx(40 / 15, rel=1e-3)


def test_cpu_ranks_of_one_host_share_its_memory():
    """Each CPU rank "fitting" the host's memory is no plan where four of them run on it: a layout
    whose ranks together hold more than its usable memory is pruned for host memory."""
    cpu = get_hardware("cpu")
    work = Workload(PRESETS["tiny"], 256, 8, "fp32")
    one = memory_breakdown(work, Layout(), cpu)["total"]
    small = dataclasses.replace(cpu, mem_gib=3.5 * one / GiB,
                                network=dataclasses.replace(cpu.network, host_mem_gib=3.5 * one / GiB))
    assert host_fits(memory_breakdown(work, Layout(), small), Layout(), small)
    replicas = Layout(dp_replicate=4, dp_shard=1)
    assert not host_fits(memory_breakdown(work, replicas, small), replicas, small)  # 4 x one > 90% of 3.5 x one
    found = search(work, small, 4, {"dp_replicate": 4, "dp_shard": 1})
    assert not found.candidates and found.pruned["host memory"] > 0


def test_cpu_ranks_that_fit_alone_but_not_together_are_said_so(capsys):
    """The refusal said the ranks' per-device need against the host's whole memory, and advised more
    devices, which on one host only divides it further."""
    cpu = get_hardware("cpu")
    work = Workload(PRESETS["tiny"], 256, 8, "fp32")
    one = memory_breakdown(work, Layout(dp_replicate=4, dp_shard=1), cpu)["total"]
    small = dataclasses.replace(cpu, mem_gib=3.5 * one / GiB,
                                network=dataclasses.replace(cpu.network, host_mem_gib=3.5 * one / GiB))
    found = search(work, small, 4, {"dp_replicate": 4, "dp_shard": 1, "activation_checkpoint": "none"})
    said = explain_no_fit(work, small, 4, found)
    assert "GiB for the 4 ranks sharing this host, more than 90% of its" in said and "more devices" not in said
