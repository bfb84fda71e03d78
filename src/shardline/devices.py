"""Accelerator datasheets: peak dense FLOP/s per dtype, memory and its bandwidth.

One table, below both the trainer (the MFU denominator) and the planner (which adds
networks and measured efficiencies on top, planner/hardware.py). `metrics.peak_tflops`
overrides the peak the trainer uses.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Datasheet:
    name: str
    marker: str  # substring of torch.cuda.get_device_name() that identifies it
    peak_tflops: dict[str, float]  # dense, per dtype
    mem_gib: float  # capacity one process can use
    mem_bw_gbs: float  # device memory bandwidth, GB/s


def _sheet(name: str, marker: str, peaks: tuple[float, float, float | None, float], mem_gib: float,
           mem_bw: float) -> Datasheet:
    bf16, fp16, fp8, fp32 = peaks
    table = {"bf16": bf16, "fp16": fp16, "fp32": fp32}
    if fp8 is not None:
        table["fp8"] = fp8
    return Datasheet(name, marker, table, mem_gib, mem_bw)


DATASHEETS: dict[str, Datasheet] = {s.name: s for s in (
    _sheet("h100-sxm", "H100", (989.0, 989.0, 1979.0, 67.0), 79.6, 3350.0),
    # The PCIe and NVL cards share the name "H100" but not the SXM part's clocks and power.
    _sheet("h100-pcie", "H100 PCIe", (756.0, 756.0, 1513.0, 51.0), 79.6, 2000.0),
    _sheet("h100-nvl", "H100 NVL", (835.0, 835.0, 1671.0, 60.0), 93.6, 3900.0),
    _sheet("h200", "H200", (989.0, 989.0, 1979.0, 67.0), 139.8, 4800.0),
    _sheet("h200-nvl", "H200 NVL", (835.0, 835.0, 1671.0, 60.0), 139.8, 4800.0),
    _sheet("a100-80gb", "A100", (312.0, 312.0, None, 19.5), 79.2, 2039.0),
    _sheet("b200", "B200", (2250.0, 2250.0, 4500.0, 80.0), 179.0, 8000.0),
    _sheet("mi300x", "MI300X", (1307.4, 1307.4, 2614.9, 163.4), 191.5, 5300.0),
)}

# name: (substring of torch.cuda.get_device_name(), {dtype: TFLOP/s}), derived from the table.
PEAK_TFLOPS: dict[str, tuple[str, dict[str, float]]] = {
    name: (s.marker, dict(s.peak_tflops)) for name, s in DATASHEETS.items()
}

# A CPU has no datasheet peak we can read; assume 3 GHz x 32 fp32 FLOP/cycle per core (two FMA units
# of 8 lanes: AVX2), 64 where the CPU has AVX-512 on 512-bit units (two of 16 lanes; an Intel part
# with one unit reads half its MFU; AMD's Zen 4 runs AVX-512 on 256-bit units: 32), over the
# threads torch uses. It makes CPU MFU comparable between runs on one machine,
# not with GPUs.
AVX2_FLOP_PER_CYCLE, _AVX512_FLOP_PER_CYCLE, _CPU_HZ = 32, 64, 3.0e9
# The launch's line: short, a newcomer's first. The rule in full: 3 GHz x 32 fp32 FLOP/cycle a torch
# thread (64 with avx512f, but AMD before Zen 5), at most a rank's share of the host's cores; twice that
# in bf16 or fp16 where the CPU has 16-bit dot products (avx512_bf16, avx512_fp16), 2048 with AMX tiles
# for the dtype (amx_bf16, amx_fp16). `shardline estimate` prices the same peak unless given a profile.
CPU_PEAK_ASSUMED = ("a rank's peak assumed from the CPU's vector units and the threads torch uses: the log's mfu "
                    "(over every rank's peak) compares runs on this machine, not with GPUs; metrics.peak_tflops "
                    "sets a rank's own (its share of the machine's)")
# CPU flags whose 16-bit dot products do twice an fp32 FMA's work a lane (a bf16 run's MFU passed 100% without).
_CPU_HALF_FLAGS = {"bf16": ("avx512_bf16",), "fp16": ("avx512_fp16",)}
# AMX: a core's tile unit does 1024 16-bit multiply-adds a cycle (Intel's figure for Sapphire Rapids):
# with twice AVX-512's peak assumed, a bf16 run on an AMX host logged mfu 112%.
_AMX_FLOP_PER_CYCLE = 2048


def cpu_has_amx(dtype: str) -> bool:
    """Whether this CPU has AMX tiles for `dtype` (bf16 or fp16), which make its 16-bit matmuls
    faster than fp32's (a bf16 run 1.4-1.5x an fp32 one on a Sapphire Rapids VM)."""
    return f"amx_{dtype}" in _cpu_flags()


def cpu_flop_per_cycle() -> int:
    """fp32 FLOP a core may do a cycle, by its vector width: an AVX-512 host's fp32 MFU read ~2x high
    against AVX2's 32 (a 20-step tiny run logged 97%). AMD before Zen 5 (family 26) runs AVX-512 on
    256-bit units, so Zen 4 keeps 32; hosts without x86 flags (ARM) too."""
    if "avx512f" not in _cpu_flags():
        return AVX2_FLOP_PER_CYCLE
    vendor, family = _cpu_vendor_family()
    return AVX2_FLOP_PER_CYCLE if vendor == "AuthenticAMD" and family < 26 else _AVX512_FLOP_PER_CYCLE


def cpu_peak_tflops(dtype: str = "fp32", shared: bool = True) -> float:
    """The assumed peak of this process over the threads torch uses (CPU_PEAK_ASSUMED), at most its
    share of the host's cores where a job's ranks share them (torchrun's LOCAL_WORLD_SIZE): 8 ranks
    of a thread each on 2 cores had 4x the host's peak between them, and their MFU read a quarter.
    `shared=False`: one process's, alone (the planner's profile, which shares the cores itself)."""
    threads = torch.get_num_threads() or os.cpu_count() or 1
    cores = cpu_cores()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if shared else 1
    except ValueError:
        local = 1
    launcher = _launcher_cores() if local > 1 else cores
    if cores < launcher:  # pinned (numactl, a cpu-bind, a NUMA node's cores): the ranks sharing this mask
        local = max(1, math.ceil(local * cores / launcher))
    units = min(threads, cores / local) * _CPU_HZ / 1e12
    if dtype in ("bf16", "fp16") and cpu_has_amx(dtype):
        return units * _AMX_FLOP_PER_CYCLE
    peak = units * cpu_flop_per_cycle()
    return 2 * peak if set(_CPU_HALF_FLAGS.get(dtype, ())) & _cpu_flags() else peak


def cpu_cores(pid: int = 0) -> int:
    """Cores process `pid` (0: this one) may run on: its affinity mask, else this process's (a pid
    not ours to read), else the machine's count."""
    try:
        return len(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return cpu_cores() if pid else os.cpu_count() or 1


def _launcher_cores() -> int:
    """The cores the process that started this one may use (torchrun's agent): a rank with fewer was
    pinned to its own; one with as many shares them with its peers (a job's cpuset, which every rank
    inherits, is no pinning). Unknown: this rank's own, so it shares."""
    return cpu_cores(os.getppid())


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; none elsewhere)."""
    return set(_cpuinfo().get("flags", "").split())


def _cpu_vendor_family() -> tuple[str, int]:
    """This CPU's vendor_id and cpu family ("", 0 where /proc/cpuinfo does not say)."""
    info = _cpuinfo()
    family = info.get("cpu family", "").strip()
    return info.get("vendor_id", "").strip(), int(family) if family.isdigit() else 0


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def local_datasheet(name: str) -> Datasheet | None:
    """The table entry whose marker `name` (a CUDA device name) contains; the longest marker wins."""
    for sheet in sorted(DATASHEETS.values(), key=lambda s: -len(s.marker)):
        if sheet.marker and sheet.marker in name:
            return sheet
    return None


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """Peak TFLOP/s of one device for the compute dtype, or None if unknown."""
    if device.type == "cpu":
        return cpu_peak_tflops(mfu_peak_dtype(precision))
    if device.type != "cuda":
        return None
    sheet = local_datasheet(torch.cuda.get_device_name(device))
    return sheet.peak_tflops.get(mfu_peak_dtype(precision)) if sheet else None


def mfu_peak_dtype(precision: str) -> str:
    """The datasheet peak MFU divides by, for the trainer's log and the planner's report alike.

    fp8 is measured against the bf16 dense peak (as torchtitan reports it): only the Linear
    GEMMs run in float8 (attention, the output projection and the rest stay bf16), and one
    denominator for both makes the MFU ratio of an fp8 and a bf16 run their throughput ratio.
    """
    return {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}[precision]


def cpu_load() -> float:
    """The host's 1-minute load average (0 where the system keeps none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # (no getloadavg here, or the system keeps no load)
        return 0.0


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Whether the CUDA card (`device`, else the current one) computes in bf16 itself (Ampere and newer,
    compute capability 8.0): torch's is_bf16_supported() also says yes for a V100 or T4, which emulate it,
    slower than fp32."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_memory_bytes() -> int | None:
    """This host's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# fp32 weights, their gradients and AdamW's two moments: what a CPU run holds at the least, a parameter
MODEL_STATE_BYTES = 16


def host_memory_problem(params: int, local_ranks: int, world: int) -> str | None:
    """A CPU run whose model states alone (MODEL_STATE_BYTES a parameter, this host's ranks' share of a
    fully sharded run: a lower bound) pass the host's memory: the kernel ends it without a line (exit
    137), minutes in, other processes at risk. None where it may fit (or the size is unknown)."""
    host = host_memory_bytes()
    need = MODEL_STATE_BYTES * params * local_ranks / world
    if host is None or need <= host:
        return None
    here = f"; {local_ranks} of its {world} ranks here" if world > 1 else ""
    return (f"the model's weights, gradients and AdamW states alone take {need / 2**30:.1f} GiB on this host "
            f"({MODEL_STATE_BYTES} bytes a parameter of {params / 1e9:.2f} B{here}), past its "
            f"{host / 2**30:.1f} GiB of memory: the run would be killed without a word; train a smaller "
            "model.preset, on more hosts, or on a GPU (`shardline train --dry-run --run.device=cpu` estimates "
            "the whole of it)")

