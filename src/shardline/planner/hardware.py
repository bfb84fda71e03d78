"""Accelerators and interconnects: the one table of datasheet figures in shardline.

Every number the planner uses about a machine lives in `Hardware`; the trainer's MFU
denominator (`shardline.hardware.peak_tflops`) reads `peak_tflops` from the same
table. Figures are dense (not 2:4 sparse) per device, from the vendors' datasheets:

* compute: H100/H200 SXM 989 TFLOP/s bf16, 1979 fp8, 67 fp32 (non-tensor); A100 312 /
  19.5; B200 2250 / 4500 / 80; MI300X 1307 / 2615 / 163.4.
* memory: capacity as torch reports it (GiB), HBM bandwidth (GB/s).
* network, per device and per direction: NVLink 4 (H100/H200) 450 GB/s, NVLink 3
  (A100) 300, NVLink 5 (B200) 900; MI300X xGMI 7 x 64 GB/s peer links, of which a
  collective realises ~300; one 400 Gb/s NIC per GPU (50 GB/s; A100 systems 200 Gb/s).

Efficiencies (what fraction of a peak real kernels reach) are not datasheet numbers:
`matmul_eff_max` and `matmul_half_dim` are set so an 8192^3 bf16 GEMM on H100/H200
reaches the 80.9% measured in REFERENCE.md; `attn_eff` is a flash-attention fwd+bwd
figure. `shardline calibrate` measures all of them for the machine it runs on.

Overrides: a TOML file whose top-level keys are field names of `Hardware`, with
`[network]` for `Network` fields and tables for the per-dtype dicts; a `base` key
names the table entry it applies to (calibrated profiles carry one). Unknown keys are
errors, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.config import read_toml
from shardline.errors import ConfigError

DTYPES = ("bf16", "fp16", "fp8", "fp32")


@dataclass(frozen=True)
class Network:
    """Links of one device. Bandwidths are per device, per direction, in GB/s (1e9 B/s)."""

    gpus_per_node: int = 8
    intra_bw_gbs: float = 450.0  # NVLink / NVSwitch (or PCIe, or loopback for CPU processes)
    intra_latency_us: float = 3.0
    inter_bw_gbs: float = 50.0  # IB / RoCE NIC share of one device
    inter_latency_us: float = 8.0
    oversubscription: float = 1.0  # >1: the fabric above the leaf switches carries less than full bisection
    bw_efficiency: float = 0.8  # share of link bandwidth a collective library realises
    host_bw_gbs: float = 50.0  # device <-> host (PCIe) for CPU offload
    host_mem_gib: float = 2048.0  # host memory of one node (DGX H100: 2 TB), which CPU offload fills
    # Calibrated intra-node alpha and B per group size ("2", "4", ...; gloo between CPU
    # processes, where both depend on how many processes share the cores). Empty: the
    # scalar intra_* fields for every size.
    latency_by_world_us: dict[str, float] = field(default_factory=dict)
    bw_by_world_gbs: dict[str, float] = field(default_factory=dict)
    # Calibrated time of each intra-node collective ("all_reduce", "all_gather",
    # "reduce_scatter") over the shared alpha-beta fit: gloo's reduce-scatter, for one,
    # runs well behind the ring model of its volume. Empty: 1 for every op.
    op_factor: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Hardware:
    name: str
    marker: str  # substring of torch.cuda.get_device_name() that identifies it ("" = none)
    peak_tflops: dict[str, float]  # dense, per dtype
    mem_gib: float  # capacity one process can use
    mem_bw_gbs: float  # device memory bandwidth, GB/s
    network: Network = field(default_factory=Network)
    reserved_gib: float = 2.0  # CUDA context, NCCL and cuBLAS workspaces (outside the allocator's count)
    fragmentation: float = 0.08  # allocator slack as a share of allocated bytes
    matmul_eff_max: dict[str, float] = field(default_factory=lambda: {d: 0.838 for d in DTYPES})
    matmul_half_dim: float = 96.0  # a GEMM dimension of this size halves that dimension's efficiency
    attn_eff: dict[str, float] = field(default_factory=lambda: {d: 0.45 for d in DTYPES})
    attn_half_len: float = 256.0  # a query or key block of this length halves attention's efficiency
    elementwise_eff: dict[str, float] = field(default_factory=lambda: {d: 0.7 for d in DTYPES})  # share of
    # mem_bw_gbs that norms, casts and adds reach when the compute dtype is this one
    loss_eff: float = 1.0  # share of that rate softmax + cross-entropy reach (exp/log: slower on CPUs)
    op_overhead_us: float = 3.0  # per launched op: launch gap on GPU, dispatcher time on CPU
    optimizer_bytes_per_param: float = 40.0  # fused AdamW (28 B) + grad-norm clip (12 B), memory traffic
    shared_compute: bool = False  # True: processes on one node share its compute (CPU ranks)
    cores: int = 0  # shared_compute: cores the ranks of one node share (0: the device is split evenly)
    threads: int = 1  # shared_compute: threads of one rank, which the peak and efficiencies describe
    process_baseline_gib: float = 0.0  # CPU: resident memory before the model (torch, data)
    # shared_compute: one core's throughput while every core of the node is busy, relative to
    # it running alone (shared caches, memory bandwidth, SMT siblings; calibrate_corun.py),
    # for GEMMs, streaming element-wise work and per-op dispatch. 1: no interference.
    corun_matmul_eff: float = 1.0
    corun_memory_eff: float = 1.0
    corun_dispatch_eff: float = 1.0
    # Host CPU time of the distributed wrappers (calibrate_dist.py), per micro-batch: one TP+SP
    # block's DTensor dispatch, one FSDP2 block's hooks and copies, and per parameter tensor
    # of the optimizer step on DTensors. 0 on GPUs, where the host runs ahead of the kernels.
    tp_layer_overhead_us: float = 0.0
    fsdp_layer_overhead_us: float = 0.0
    # ... and FSDP's part that grows with size, per MB of a block's fp32 parameters (copies into
    # and out of the gather and reduce-scatter buffers); the model's ends pay it for their weights.
    fsdp_layer_overhead_us_per_mb: float = 0.0
    # CPU ranks: a TP block's whole extra wall time (host work, collectives, waits on the peer)
    # per micro-batch, fixed + per MB of its fp32 activations; when set it replaces
    # tp_layer_overhead_us and the alpha-beta cost of the block's TP collectives. 0: not calibrated.
    tp_layer_wall_us: float = 0.0
    tp_layer_wall_us_per_mb: float = 0.0
    # ... and of TP's ends (embedding, output, loss-parallel cross-entropy), fixed + per MB of a
    # rank's fp32 logits; they replace tp_head_overhead_us and the ends' alpha-beta costs.
    tp_head_wall_us: float = 0.0
    tp_head_wall_us_per_mb: float = 0.0
    tp_head_overhead_us: float = 0.0  # the model's ends (embedding, output, loss) under TP
    fsdp_root_overhead_us: float = 0.0  # FSDP2's root module (embedding, norm, output)
    dtensor_param_overhead_us: float = 0.0

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s (not TFLOP/s) for a dtype; ConfigError if the device lacks it."""
        if dtype not in self.peak_tflops:
            raise ConfigError(f"{self.name} has no {dtype} peak in the hardware table; "
                              f"it has {', '.join(self.peak_tflops)}")
        return self.peak_tflops[dtype] * 1e12


def _gpu(name: str, marker: str, peaks: tuple[float, float, float | None, float], mem_gib: float,
         mem_bw: float, net: Network) -> Hardware:
    bf16, fp16, fp8, fp32 = peaks
    table = {"bf16": bf16, "fp16": fp16, "fp32": fp32}
    if fp8 is not None:
        table["fp8"] = fp8
    return Hardware(name=name, marker=marker, peak_tflops=table, mem_gib=mem_gib, mem_bw_gbs=mem_bw, network=net)


_NVLINK4 = Network(intra_bw_gbs=450.0, inter_bw_gbs=50.0)
GPUS: dict[str, Hardware] = {
    "h100-sxm": _gpu("h100-sxm", "H100", (989.0, 989.0, 1979.0, 67.0), 79.6, 3350.0, _NVLINK4),
    "h200": _gpu("h200", "H200", (989.0, 989.0, 1979.0, 67.0), 139.8, 4800.0, _NVLINK4),
    "a100-80gb": _gpu("a100-80gb", "A100", (312.0, 312.0, None, 19.5), 79.2, 2039.0,
                      Network(intra_bw_gbs=300.0, inter_bw_gbs=25.0, host_bw_gbs=25.0)),
    "b200": _gpu("b200", "B200", (2250.0, 2250.0, 4500.0, 80.0), 179.0, 8000.0,
                 Network(intra_bw_gbs=900.0, inter_bw_gbs=50.0, host_mem_gib=4096.0)),
    "mi300x": _gpu("mi300x", "MI300X", (1307.4, 1307.4, 2614.9, 163.4), 191.5, 5300.0,
                   Network(intra_bw_gbs=300.0, intra_latency_us=5.0, inter_bw_gbs=50.0)),
}
DEVICE_NAMES = (*GPUS, "cpu")

# A CPU has no datasheet peak we can read; assume 3 GHz x 32 fp32 FLOP/cycle per core
# (two AVX2 FMA units) over the threads torch uses. It makes CPU MFU comparable
# between runs on one machine, not with GPUs.
_CPU_FLOP_PER_CYCLE, _CPU_HZ = 32, 3.0e9


def cpu_peak_tflops() -> float:
    import torch

    threads = torch.get_num_threads() or os.cpu_count() or 1
    return threads * _CPU_FLOP_PER_CYCLE * _CPU_HZ / 1e12


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_hardware() -> Hardware:
    """This host as a device: uncalibrated guesses, replaced by `shardline calibrate`."""
    import torch

    peak = cpu_peak_tflops()
    return Hardware(
        name="cpu", marker="", peak_tflops={"fp32": peak, "bf16": peak, "fp16": peak},
        mem_gib=_host_memory_gib(), mem_bw_gbs=20.0, reserved_gib=0.0, fragmentation=0.15,
        network=Network(gpus_per_node=1024, intra_bw_gbs=2.0, intra_latency_us=60.0, inter_bw_gbs=1.25,
                        inter_latency_us=60.0, bw_efficiency=1.0, host_bw_gbs=20.0, host_mem_gib=_host_memory_gib(),
                        op_factor={"all_reduce": 0.9, "all_gather": 1.1, "reduce_scatter": 2.0}),
        matmul_eff_max={"fp32": 0.5, "bf16": 0.1, "fp16": 0.05}, matmul_half_dim=64.0,
        attn_eff={"fp32": 0.25, "bf16": 0.05, "fp16": 0.03}, elementwise_eff={"fp32": 1.0, "bf16": 0.8, "fp16": 0.5},
        loss_eff=0.2, op_overhead_us=10.0,
        optimizer_bytes_per_param=120.0, shared_compute=True, cores=cpu_cores(),
        threads=torch.get_num_threads() or 1, process_baseline_gib=0.45,
        # As `shardline calibrate` measured them on a 2-core VM (one thread per rank), rounded.
        tp_layer_overhead_us=15000.0, fsdp_layer_overhead_us=2000.0, fsdp_layer_overhead_us_per_mb=1500.0,
        tp_head_overhead_us=5000.0, fsdp_root_overhead_us=2000.0, dtensor_param_overhead_us=60.0,
        tp_layer_wall_us=25000.0, tp_layer_wall_us_per_mb=15000.0, tp_head_wall_us=10000.0,
        tp_head_wall_us_per_mb=10000.0)


def get_hardware(name: str, profile: str | Path | None = None) -> Hardware:
    """The table entry for `name`, with the fields of a profile/override TOML applied."""
    if name == "cpu":
        hw = cpu_hardware()
    elif name in GPUS:
        hw = GPUS[name]
    else:
        raise ConfigError(f"unknown device type {name!r}; valid: {', '.join(DEVICE_NAMES)}")
    if profile is not None:
        hw = apply_overrides(hw, read_profile(profile), str(profile))
    return hw


def read_profile(path: str | Path) -> dict[str, Any]:
    return read_toml(path, "hardware profile")


def apply_overrides(hw: Hardware, raw: dict[str, Any], where: str) -> Hardware:
    """Return `hw` with the fields of `raw` replaced; raw["measured"] is kept for the record only."""
    raw = dict(raw)
    base = raw.pop("base", None)
    raw.pop("measured", None)
    if base is not None and base != hw.name:
        raise ConfigError(f"{where} describes {base!r} but the device is {hw.name!r}; "
                          f"use --gpu {base} with this profile, or remove its base key")
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "network":
            changes["network"] = _replace_fields(hw.network, value, f"{where} [network]")
        else:
            changes.update(_field_values(hw, {key: value}, where))
    return dataclasses.replace(hw, **changes)


def _replace_fields(obj: Any, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table of keys, got {raw!r}")
    return dataclasses.replace(obj, **_field_values(obj, raw, where))


def _field_values(obj: Any, raw: dict[str, Any], where: str) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(obj) if f.name not in ("name", "network")}
    out = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{where}: unknown hardware key {key!r}; valid: {', '.join(fields)}, network")
        current = getattr(obj, key)
        if isinstance(current, dict):
            if not isinstance(value, dict) or not all(_is_number(v) for v in value.values()):
                raise ConfigError(f"{where}: {key} must be a table of numbers per dtype, got {value!r}")
            out[key] = {**current, **{k: float(v) for k, v in value.items()}}
        elif isinstance(current, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {key}={value!r} must be true or false")
            out[key] = value
        elif isinstance(current, (int, float)):
            if not _is_number(value) or value < 0:
                raise ConfigError(f"{where}: {key}={value!r} must be a number >= 0")
            out[key] = type(current)(value)
        else:
            out[key] = str(value)
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def to_toml(values: dict[str, Any], comment: str = "") -> str:
    """A flat-or-one-level-nested dict of numbers/strings/bools as TOML (for profiles)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    tables = {k: v for k, v in values.items() if isinstance(v, dict)}
    for key, value in values.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(round(v, 6))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
