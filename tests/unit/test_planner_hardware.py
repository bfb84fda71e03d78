"""The one hardware table: contents, overrides from TOML, and the trainer's view of it."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib

import pytest
import torch

from shardline import devices as trainer_hw
from shardline.errors import ConfigError
from shardline.planner.hardware import DEVICE_NAMES, GPUS, get_hardware, to_toml


def test_table_has_the_issue_devices_with_datasheet_peaks():
    assert set(DEVICE_NAMES) == {"h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "a100-80gb", "b200",
                                 "mi300x", "cpu"}
    assert GPUS["h100-sxm"].peak_tflops["bf16"] == 989.0
    assert GPUS["h200"].mem_gib > GPUS["h100-sxm"].mem_gib
    assert "fp8" not in GPUS["a100-80gb"].peak_tflops
    with pytest.raises(ConfigError, match="has no fp8 peak"):
        GPUS["a100-80gb"].peak("fp8")
    for hw in GPUS.values():
        assert hw.network.gpus_per_node == 8 and hw.network.intra_bw_gbs > hw.network.inter_bw_gbs


def test_matmul_curve_reaches_the_measured_h200_ceiling():
    # Measured on one H200 (torch 2.11, CUDA 13): a bf16 8192^3 matmul on H200 runs at 80.9% of the 989 TFLOP/s peak.
    from shardline.planner.compute import matmul_efficiency

    assert matmul_efficiency(GPUS["h200"], "bf16", 8192, 8192, 8192) == pytest.approx(0.809, abs=0.005)
    assert matmul_efficiency(GPUS["h200"], "bf16", 8192, 8192, 512) < 0.75  # a thin TP shard runs slower


def test_a_cuda_device_name_finds_its_own_card():
    """The H100 PCIe and NVL cards are not the SXM part (756 and 835 bf16 TFLOP/s, not 989):
    their MFU and plans would be off by a quarter and a sixth."""
    names = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 NVL": "h100-nvl",
             "NVIDIA H200": "h200", "NVIDIA H200 NVL": "h200-nvl", "NVIDIA A100-SXM4-80GB": "a100-80gb",
             "NVIDIA B200": "b200"}
    assert {name: trainer_hw.local_datasheet(name).name for name in names} == names
    assert trainer_hw.local_datasheet("NVIDIA GeForce RTX 4090") is None
    assert GPUS["h100-pcie"].peak_tflops["bf16"] == 756.0 < GPUS["h100-nvl"].peak_tflops["bf16"] == 835.0


def test_trainer_peak_reads_the_same_table():
    assert trainer_hw.PEAK_TFLOPS["h100-sxm"][1] == GPUS["h100-sxm"].peak_tflops
    assert trainer_hw.peak_tflops(torch.device("cpu"), "fp32") == trainer_hw.cpu_peak_tflops()
    assert get_hardware("cpu").peak_tflops["fp32"] == trainer_hw.cpu_peak_tflops()


def test_a_cpu_with_16_bit_dot_products_has_twice_the_peak_in_them(monkeypatch):
    """A bf16 run on an avx512_bf16 CPU logged mfu 103% against the fp32 peak."""
    monkeypatch.setattr(trainer_hw, "_cpu_vendor_family", lambda: ("GenuineIntel", 6))  # (not the host's: on a
    monkeypatch.setattr(trainer_hw, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})  # Zen 4, fp32 is 32)
    fp32 = trainer_hw.cpu_peak_tflops()
    assert trainer_hw.peak_tflops(torch.device("cpu"), "bf16") == 2 * fp32
    assert trainer_hw.peak_tflops(torch.device("cpu"), "fp16") == fp32  # no avx512_fp16 / amx_fp16
    from shardline.planner.compute import matmul_time
    from shardline.planner.hardware import cpu_hardware

    flagged = cpu_hardware()  # the planner divides MFU by the trainer's peak; its predicted times stay
    assert flagged.peak_tflops["bf16"] == 2 * fp32 == trainer_hw.peak_tflops(torch.device("cpu"), "bf16")
    monkeypatch.setattr(trainer_hw, "_cpu_flags", lambda: {"avx2", "avx512f"})  # no 16-bit dot products
    assert trainer_hw.peak_tflops(torch.device("cpu"), "bf16") == fp32
    plain = cpu_hardware()
    assert matmul_time(flagged, "bf16", 512, 512, 512) == pytest.approx(matmul_time(plain, "bf16", 512, 512, 512))
    # AMX tiles: 1024 multiply-adds a cycle a core (a bf16 run logged mfu 112% against twice AVX-512's peak)
    monkeypatch.setattr(trainer_hw, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    assert trainer_hw.peak_tflops(torch.device("cpu"), "bf16") == pytest.approx(32 * fp32)  # 2048 / 64 FLOP a cycle
    assert trainer_hw.peak_tflops(torch.device("cpu"), "fp16") == fp32  # AMX for bf16 alone
    amx = matmul_time(cpu_hardware(), "bf16", 512, 512, 512)
    assert amx == pytest.approx(matmul_time(plain, "bf16", 512, 512, 512))  # (the planner's times stay)


def test_an_avx512_cpu_has_twice_avx2s_fp32_peak_and_the_planner_prices_it_faster(monkeypatch):
    """A 20-step fp32 run on an AVX-512 host logged mfu 97% against AVX2's 32 FLOP/cycle. The
    planner's uncalibrated CPU efficiencies are shares of the host's own peak, so its GEMMs run
    twice as fast there (that host's measured 0.94 of the doubled peak; kept at AVX2's FLOP/s the
    planner said a tiny run makes 1,320 tokens/s where it made 6,300)."""
    from shardline.models import PRESETS
    from shardline.planner.compute import matmul_time
    from shardline.planner.hardware import cpu_hardware
    from shardline.planner.layout import Workload
    from shardline.planner.search import search

    monkeypatch.setattr(trainer_hw, "_cpu_vendor_family", lambda: ("GenuineIntel", 6))
    monkeypatch.setattr(trainer_hw, "_cpu_flags", lambda: {"fma", "avx2"})
    avx2, plain = trainer_hw.cpu_peak_tflops(), cpu_hardware()
    monkeypatch.setattr(trainer_hw, "_cpu_flags", lambda: {"fma", "avx2", "avx512f"})
    assert trainer_hw.cpu_peak_tflops() == 2 * avx2
    wide = cpu_hardware()
    assert wide.peak_tflops["fp32"] == 2 * plain.peak_tflops["fp32"]
    assert wide.matmul_eff_max == plain.matmul_eff_max and wide.attn_eff == plain.attn_eff
    for dtype in ("fp32", "bf16"):
        assert matmul_time(wide, dtype, 512, 512, 512) == pytest.approx(matmul_time(plain, dtype, 512, 512, 512) / 2)
        work = Workload(dataclasses.replace(PRESETS["tiny"], vocab_size=512), 256, 8, dtype)
        fast, slow = (search(work, hw, 2).candidates[0] for hw in (wide, plain))
        assert fast.step_time_s < 0.8 * slow.step_time_s
    monkeypatch.setattr(trainer_hw, "_cpu_vendor_family", lambda: ("AuthenticAMD", 25))  # Zen 4: 256-bit units
    assert trainer_hw.cpu_peak_tflops() == avx2
    monkeypatch.setattr(trainer_hw, "_cpu_vendor_family", lambda: ("AuthenticAMD", 26))  # Zen 5: 512-bit
    assert trainer_hw.cpu_peak_tflops() == 2 * avx2
    monkeypatch.setattr(trainer_hw, "_cpu_flags", lambda: set())  # no x86 flags (ARM): AVX2's figure
    assert trainer_hw.cpu_peak_tflops() == avx2


def test_overrides_from_toml(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('base = "h100-sxm"\nmem_gib = 94.0\n[peak_tflops]\nbf16 = 800\n'
                    '[network]\ninter_bw_gbs = 25.0\noversubscription = 2.0\n[measured]\nanything = [1, 2]\n')
    hw = get_hardware("h100-sxm", path)
    assert hw.mem_gib == 94.0 and hw.peak_tflops["bf16"] == 800.0 and hw.peak_tflops["fp8"] == 1979.0
    assert hw.network.inter_bw_gbs == 25.0 and hw.network.oversubscription == 2.0
    assert hw.network.intra_bw_gbs == GPUS["h100-sxm"].network.intra_bw_gbs


@pytest.mark.parametrize("text, message", [
    ("mem_gbs = 1", "unknown hardware key 'mem_gbs'"),
    ('base = "b200"', "describes 'b200' but the device is 'h100-sxm'"),
    ("mem_gib = -3", "mem_gib=-3 must be a number > 0"),
    ("reserved_gib = -3", "reserved_gib=-3 must be a number >= 0"),
    ("[network]\nlatency = 1", "unknown hardware key 'latency'"),
    ("mem_gib = [", "not valid TOML"),
])
def test_bad_overrides_name_the_key(tmp_path, text, message):
    path = tmp_path / "hw.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        get_hardware("h100-sxm", path)


@pytest.mark.parametrize("text, message", [
    ("[network]\noversubscription = 0", "[network]: oversubscription=0 must be a number >= 1"),
    ("[network]\noversubscription = 0.5", "oversubscription=0.5 must be a number >= 1"),
    ("[network]\ngpus_per_node = 0", "[network]: gpus_per_node=0 must be a number >= 1"),
    ("[network]\nbw_efficiency = 0", "bw_efficiency=0 must be a number > 0"),
    ("[network]\ninter_bw_gbs = 0", "inter_bw_gbs=0 must be a number > 0"),
    ("[network]\nintra_bw_gbs = 0.0", "intra_bw_gbs=0.0 must be a number > 0"),
    ("[network]\nhost_bw_gbs = 0", "host_bw_gbs=0 must be a number > 0"),
    ("[network.bw_by_world_gbs]\n2 = 0", "bw_by_world_gbs.2=0 must be a number > 0"),
    ("[peak_tflops]\nbf16 = 0", "peak_tflops.bf16=0 must be a number > 0"),
    ("[matmul_eff_max]\nbf16 = 0", "matmul_eff_max.bf16=0 must be a number > 0"),
    # A table's entries are names too, and a link's share has a ceiling: "allreduce" was kept (the base's
    # factor priced instead), a rank of 0 threads passed.
    ("[network.op_factor]\nallreduce = 1.26", "unknown op_factor entry 'allreduce'; valid: all_reduce"),
    ("[matmul_eff_max]\nfp32x = 0.98", "unknown matmul_eff_max entry 'fp32x'; valid: bf16, fp16, fp8, fp32"),
    ("[network.op_factor]\nall_reduce = 0", "op_factor.all_reduce=0 must be a number > 0"),
    ("[network]\nbw_efficiency = 1.2", "bw_efficiency=1.2 must be at most 1"),
    ("[cpu]\nthreads = 0", "[cpu]: threads=0 must be a number >= 1"),
    ("mem_bw_gbs = 0", "mem_bw_gbs=0 must be a number > 0"),
    ("mem_gib = 0", "mem_gib=0 must be a number > 0"),
    ("[cpu]\ncorun_matmul_eff = 0", "[cpu]: corun_matmul_eff=0 must be a number > 0"),
    ("[network.latency_by_world_us]\n2 = 50\n[network.bw_by_world_gbs]\n4 = 1.0",
     "latency_by_world_us (sizes 2) and bw_by_world_gbs (sizes 4) share no group size"),
    ("[network.latency_by_world_us]\nfour = 50\n[network.bw_by_world_gbs]\nfour = 1.0",
     "latency_by_world_us key 'four' must be a group size, a whole number >= 1"),
])
def test_a_profile_figure_the_planner_divides_by_is_refused_at_zero(tmp_path, text, message):
    """0 (or a ratio below 1) would pass as >= 0 and then divide by zero, or fail far from the
    profile, inside a search: the profile is refused in one line naming the key."""
    path = tmp_path / "hw.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        get_hardware("h100-sxm", path)
    assert "\n" not in str(err.value)


def test_figures_that_may_be_zero_stay_accepted(tmp_path):
    """Latencies, launch overheads, reserves, half-sizes and the CPU's cores (0: split evenly) mean
    "none" at 0: priced, not refused."""
    from shardline.models import PRESETS
    from shardline.planner.layout import Workload
    from shardline.planner.search import search

    path = tmp_path / "hw.toml"
    path.write_text("reserved_gib = 0\nfragmentation = 0\nmatmul_half_dim = 0\nop_overhead_us = 0\n[cpu]\ncores = 0\n"
                    "[network]\nintra_latency_us = 0\ninter_latency_us = 0\noversubscription = 1\n"
                    "[network.latency_by_world_us]\n2 = 0\n8 = 0\n[network.bw_by_world_gbs]\n2 = 300.0\n")
    hw = get_hardware("h100-sxm", path)
    assert hw.network.inter_latency_us == 0 and hw.network.latency_by_world_us == {"2": 0.0, "8": 0.0}
    assert search(Workload(PRESETS["llama3-8b"], 4096, 32, "bf16"), hw, 16, {"tp": 2, "pp": 1}).candidates


def test_unknown_device_and_missing_profile():
    with pytest.raises(ConfigError, match="unknown device type 'h300'.*h100-sxm"):
        get_hardware("h300")
    with pytest.raises(ConfigError, match="does not exist"):
        get_hardware("cpu", "/no/such/profile.toml")


def test_profile_writer_round_trips():
    values = {"base": "cpu", "mem_bw_gbs": 12.5, "shared_compute": True, "attn_eff": {"fp32": 0.2},
              "measured": {"points": [1.0, 2.5]}}
    assert tomllib.loads(to_toml(values, "a comment\nsecond line")) == values
    # a slow link's small figure keeps its digits (fixed decimals once cut 0.0123456 GB/s to 0.012346)
    small = tomllib.loads(to_toml({"inter_bw_gbs": 0.0123456789, "latency_us": 1743.123456789}))
    assert small == {"inter_bw_gbs": 0.01234568, "latency_us": 1743.123}


def test_this_machines_card_is_estimated_at_its_own_memory(monkeypatch):
    """`estimate --config` without --gpu on an A100-SXM4-40GB: the table's "A100" entry is the
    80 GB card, so its memory is the card's own; a card the entry describes keeps the entry."""
    from types import SimpleNamespace

    import torch

    from shardline.planner.hardware import get_hardware, with_local_memory

    entry = get_hardware("a100-80gb")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=39.4 * 2**30))
    assert with_local_memory(entry).mem_gib == pytest.approx(39.4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=79.15 * 2**30))
    assert with_local_memory(entry) is entry


def test_ranks_sharing_a_hosts_cores_share_its_peak(monkeypatch):
    """8 single-thread ranks on 2 cores each claimed a whole core's peak: 4x the host's between them,
    so their MFU could not be compared with one process's. A rank's peak is now at most its share."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(trainer_hw, "_launcher_cores", lambda: cores)  # not pinned: as the test's own launcher
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = trainer_hw.cpu_peak_tflops()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert trainer_hw.cpu_peak_tflops() == pytest.approx(alone / 4)  # the 4 * cores ranks: the host's cores
    assert trainer_hw.cpu_peak_tflops(shared=False) == alone  # the planner's profile shares cores itself
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert trainer_hw.cpu_peak_tflops() == alone  # one thread a core: each its own
    # A rank pinned to fewer cores than its launcher's (numactl, a cpu-bind) has its share already; a
    # job's cpuset, which every rank inherits from the launcher, is no pinning (shared, as above).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    monkeypatch.setattr(trainer_hw, "_launcher_cores", lambda: 4 * cores)  # each rank pinned to its own core
    assert trainer_hw.cpu_peak_tflops() == alone
    monkeypatch.setattr(trainer_hw, "_launcher_cores", lambda: 2 * cores)  # a NUMA node's cores, 2 ranks a core
    assert trainer_hw.cpu_peak_tflops() == pytest.approx(alone / 2)
