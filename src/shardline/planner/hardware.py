"""Accelerators and interconnects as the planner models them.

Every number the planner uses about a machine lives in `Hardware`: the datasheet of
`shardline.devices` (which the trainer's MFU denominator reads too) plus networks and
kernel efficiencies. Figures are dense (not 2:4 sparse) per device, from the vendors' datasheets:

* compute: H100/H200 SXM 989 TFLOP/s bf16, 1979 fp8, 67 fp32 (non-tensor); H100 PCIe 756 /
  1513 / 51; H100 NVL and H200 NVL 835 / 1671 / 60; A100 312 / 19.5; B200 2250 / 4500 / 80; MI300X
  1307 / 2615 / 163.4.
* memory: capacity as torch reports it (GiB), HBM bandwidth (GB/s).
* network, per device and per direction: NVLink 4 (H100/H200) 450 GB/s, NVLink 3
  (A100) 300, NVLink 5 (B200) 900; MI300X xGMI 7 x 64 GB/s peer links, of which a
  collective realises ~300; H100 PCIe/NVL and H200 NVL cards PCIe 5.0 (55); one 400 Gb/s NIC per GPU
  (50 GB/s; A100 systems 200 Gb/s).

Efficiencies (what fraction of a peak real kernels reach) are not datasheet numbers:
`matmul_eff_max` and `matmul_half_dim` are set so an 8192^3 bf16 GEMM on H100/H200
reaches the 80.9% we measured on one H200 (torch 2.11, CUDA 13); `attn_eff` is a flash-attention fwd+bwd
figure. `shardline calibrate` measures all of them for the machine it runs on.

What only CPU ranks need (gloo processes sharing a host's cores: how they share them,
the host time of the distributed wrappers) is `Hardware.cpu`, a `CpuRanks`, apart from
the accelerator's figures; on a GPU it stays at its defaults.

Overrides: a TOML file whose top-level keys are field names of `Hardware`, with
`[network]` for `Network` fields, `[cpu]` for `CpuRanks` fields and tables for the
per-dtype dicts; a `base` key names the table entry it applies to (calibrated profiles
carry one). Unknown keys are errors, not silently ignored: a profile written before
`[cpu]` existed, with those keys at the top level, is refused with a pointer to `[cpu]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardline.config import reader
from shardline.devices import DATASHEETS, cpu_cores, cpu_peak_tflops, host_memory_bytes, local_datasheet
from shardline.errors import ConfigError
from shardline.parallel.distributed import check_card

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
    # A node's local NVMe drives together, for memory.ssd_offload_dir (GB/s): a DGX H100 has eight
    # U.2 data drives; at a datacenter drive's ~6-7 GB/s read and ~3-4 GB/s write each, derated for
    # the file system and software RAID. Guesses, not measured: set them in a profile's [network].
    ssd_read_gbs: float = 25.0
    ssd_write_gbs: float = 12.0
    # Measured intra-node alpha and B per group size ("2", "4", ...): `shardline calibrate`'s gloo
    # between CPU processes (where both depend on how many share the cores), `shardline comm-bench`'s
    # groups inside a node. Empty: the scalar intra_* fields for every size.
    latency_by_world_us: dict[str, float] = field(default_factory=dict)
    bw_by_world_gbs: dict[str, float] = field(default_factory=dict)
    # Measured time of each intra-node collective ("all_reduce", "all_gather", "reduce_scatter")
    # over the planner's price for it under the fitted links (calibrate/comm.py op_factors): gloo's
    # reduce-scatter, for one, runs well behind the ring model of its volume. Empty: 1 for every op.
    op_factor: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CpuRanks:
    """What matters only when ranks are processes sharing one host's CPU cores (gloo on CPU).

    The planner is for GPU clusters; CPU ranks are how its method is checked on a machine
    without one. They need figures a datasheet has no place for (how the ranks share the
    cores, how busy cores slow each other, the host time of the distributed wrappers that a
    GPU's host hides behind its kernels), so they live apart from the accelerator's. The
    defaults describe a GPU: no sharing, no host overheads.
    """

    shared_compute: bool = False  # True: processes on one node share its compute (CPU ranks)
    cores: int = 0  # shared_compute: cores the ranks of one node share (0: the device is split evenly)
    threads: int = 1  # shared_compute: threads of one rank, which the peak and efficiencies describe
    process_baseline_gib: float = 0.0  # CPU: resident memory before the model (torch, data)
    # shared_compute: one core's throughput while every core of the node is busy, relative to
    # it running alone (shared caches, memory bandwidth, SMT siblings; calibrate/corun.py),
    # for GEMMs, streaming element-wise work and per-op dispatch. 1: no interference.
    corun_matmul_eff: float = 1.0
    corun_memory_eff: float = 1.0
    corun_dispatch_eff: float = 1.0
    # Host CPU time of the distributed wrappers (calibrate/dist.py), per micro-batch: one TP+SP
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
    # Memory traffic of AdamW + clipping a parameter: fused AdamW with the clip's scale in its kernel (reads
    # weight, gradient, two moments; writes them back: 32 B) + the norm's read (4 B). ZeRO-1 clips apart (+8 B).
    optimizer_bytes_per_param: float = 36.0
    cpu: CpuRanks = field(default_factory=CpuRanks)  # [cpu]: ranks sharing a host's cores (gloo on CPU)

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s (not TFLOP/s) for a dtype; ConfigError if the device lacks it."""
        if dtype not in self.peak_tflops:
            raise ConfigError(f"{self.name} has no {dtype} peak in the hardware table; "
                              f"it has {', '.join(self.peak_tflops)}")
        return self.peak_tflops[dtype] * 1e12

    def with_cpu(self, **changes: Any) -> Hardware:
        """A copy with some `CpuRanks` figures changed (one call for the two nested replaces)."""
        return dataclasses.replace(self, cpu=dataclasses.replace(self.cpu, **changes))


def _gpu(name: str, net: Network) -> Hardware:
    """The planner's device: the datasheet (shardline.devices) plus its network."""
    d = DATASHEETS[name]
    return Hardware(name=name, marker=d.marker, peak_tflops=dict(d.peak_tflops), mem_gib=d.mem_gib,
                    mem_bw_gbs=d.mem_bw_gbs, network=net)


_NVLINK4 = Network(intra_bw_gbs=450.0, inter_bw_gbs=50.0)
GPUS: dict[str, Hardware] = {
    "h100-sxm": _gpu("h100-sxm", _NVLINK4),
    "h200": _gpu("h200", _NVLINK4),
    # PCIe cards: peers over PCIe 5.0 x16 (~64 GB/s per direction; NVLink bridges join pairs only)
    "h100-pcie": _gpu("h100-pcie", Network(intra_bw_gbs=55.0, intra_latency_us=5.0)),
    "h100-nvl": _gpu("h100-nvl", Network(intra_bw_gbs=55.0, intra_latency_us=5.0)),
    "h200-nvl": _gpu("h200-nvl", Network(intra_bw_gbs=55.0, intra_latency_us=5.0)),
    "a100-80gb": _gpu("a100-80gb", Network(intra_bw_gbs=300.0, inter_bw_gbs=25.0, host_bw_gbs=25.0)),
    "b200": _gpu("b200", Network(intra_bw_gbs=900.0, inter_bw_gbs=50.0, host_mem_gib=4096.0)),
    "mi300x": _gpu("mi300x", Network(intra_bw_gbs=300.0, intra_latency_us=5.0, inter_bw_gbs=50.0)),
}
DEVICE_NAMES = (*GPUS, "cpu")

def _host_memory_gib() -> float:
    host = host_memory_bytes()
    return 16.0 if host is None else host / 2**30  # (unknown: a laptop's, guessed)


def cpu_hardware() -> Hardware:
    """This host as a device: uncalibrated guesses, replaced by `shardline calibrate`."""
    # The trainer's MFU peaks, one process's alone: the planner shares the cores between ranks itself.
    peak = {dtype: cpu_peak_tflops(dtype, shared=False) for dtype in ("fp32", "bf16", "fp16")}
    # The efficiencies below are shares of this host's fp32 peak, for every dtype (a wider unit, AVX-512's,
    # computes faster: a host with it ran a tiny model's GEMMs at 0.94 of its 64-FLOP/cycle peak, where
    # keeping AVX2's FLOP/s priced it 4.8x slow); a 16-bit peak's own units are not assumed to help.
    per = {dtype: peak["fp32"] / peak[dtype] for dtype in peak}
    return Hardware(
        name="cpu", marker="", peak_tflops=peak,
        mem_gib=_host_memory_gib(), mem_bw_gbs=20.0, reserved_gib=0.0, fragmentation=0.15,
        network=Network(gpus_per_node=1024, intra_bw_gbs=2.0, intra_latency_us=60.0, inter_bw_gbs=1.25,
                        inter_latency_us=60.0, bw_efficiency=1.0, host_bw_gbs=20.0, host_mem_gib=_host_memory_gib(),
                        # A 2-core VM's disk: dd (O_DIRECT) read 1.2-1.7 GB/s; the kernel's write-back of mapped
                        # moments under memory pressure reached ~0.5 (benchmarks/ssd_pressure.py; dd wrote 1.1)
                        ssd_read_gbs=1.5, ssd_write_gbs=0.5,
                        op_factor={"all_reduce": 0.9, "all_gather": 1.1, "reduce_scatter": 2.0}),
        matmul_eff_max={"fp32": 0.5 * per["fp32"], "bf16": 0.1 * per["bf16"], "fp16": 0.05 * per["fp16"]},
        matmul_half_dim=64.0,
        attn_eff={"fp32": 0.25 * per["fp32"], "bf16": 0.05 * per["bf16"], "fp16": 0.03 * per["fp16"]},
        elementwise_eff={"fp32": 1.0, "bf16": 0.8, "fp16": 0.5},
        # AdamW + clipping: the host's windowed AdamW (clip folded in) over 4 M parameters, one thread, at
        # the 20 GB/s above: 55-58 B a parameter on the 2-core VM one hour, 87-91 B a few hours later
        # (calibrate's measure_optimizer; the VM's memory speed moves); between them. Calibrate measures yours.
        loss_eff=0.2, op_overhead_us=10.0, optimizer_bytes_per_param=75.0,
        cpu=CpuRanks(
            shared_compute=True, cores=cpu_cores(), threads=torch.get_num_threads() or 1, process_baseline_gib=0.45,
            # As `shardline calibrate` measured them on a 2-core VM (one thread per rank), rounded.
            tp_layer_overhead_us=15000.0, fsdp_layer_overhead_us=2000.0, fsdp_layer_overhead_us_per_mb=1500.0,
            tp_head_overhead_us=5000.0, fsdp_root_overhead_us=2000.0, dtensor_param_overhead_us=60.0,
            tp_layer_wall_us=25000.0, tp_layer_wall_us_per_mb=15000.0, tp_head_wall_us=10000.0,
            tp_head_wall_us_per_mb=10000.0))


def detected_gpu(index: int = 0) -> str:
    """This machine's GPU (card `index`) as a table entry; ConfigError when the table lacks it."""
    sheet = local_datasheet(torch.cuda.get_device_name(index))
    if sheet is None:
        raise ConfigError(f"this machine's GPU ({torch.cuda.get_device_name(index)}) is not in the hardware table; "
                          f"pass --gpu with the closest entry ({', '.join(GPUS)}) and a --profile for the rest")
    return sheet.name


def cuda_index(device: str, ranks: int = 1) -> int:
    """The CUDA card run.device names on this machine (auto and cuda: the first); ConfigError
    past the cards it shows, as a launch of one process refuses it. With several ranks each takes its
    local rank's card, whatever cuda:N says: the first."""
    index = (torch.device(device).index or 0) if device.startswith("cuda") and ranks == 1 else 0
    check_card(device, index)
    return index


def with_local_memory(hw: Hardware, index: int = 0) -> Hardware:
    """`hw` (this machine's GPU's table entry) with the card's own memory where it differs: the
    table matches a card by a part of its name, so an A100-SXM4-40GB is the 80 GB "A100" entry,
    a GH200 (96 GB) the H200's; a memory estimate against the entry's would say "fits" wrongly.
    `index`: the CUDA device the run takes (run.device=cuda:N)."""
    card = torch.cuda.get_device_properties(index).total_memory / 2**30
    return hw if abs(card - hw.mem_gib) <= 0.02 * hw.mem_gib else dataclasses.replace(hw, mem_gib=card)


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
    return reader.read_toml(path, "hardware profile")


def apply_overrides(hw: Hardware, raw: dict[str, Any], where: str) -> Hardware:
    """Return `hw` with the keys of `raw` set; raw["measured"] is kept for the record only.

    The keys are checked here (names, and ranges: no figure below 0, as every one is a size, rate,
    time or share; above 0 what the planner divides by) so a profile's mistakes read as hardware
    keys, not as a division by zero in a search; the config reader types them.
    """
    raw = dict(raw)
    base = raw.pop("base", None)
    raw.pop("measured", None)
    if base is not None and base != hw.name:
        raise ConfigError(f"{where} describes {base!r} but the device is {hw.name!r}; "
                          f"use --gpu {base} with this profile, or remove its base key")
    _check_keys(hw, raw, where)
    try:
        out = reader.updated(hw, raw, "hardware", kind="hardware key")
    except ConfigError as e:  # a wrong type: name the file too
        raise ConfigError(f"{where}: {e}") from None
    _check_world_pairs(out.network, where)
    return out


_CPU_KEYS = reader.field_names(CpuRanks)  # top-level keys of profiles written before [cpu]


# Figures the planner divides by or scales a rate with: 0 would divide by zero or price work as
# free. Latencies, overheads, reserves and half-sizes may be 0 (none); a CPU's cores 0 means "split evenly".
POSITIVE = frozenset({"mem_gib", "mem_bw_gbs", "peak_tflops", "matmul_eff_max", "attn_eff", "elementwise_eff",
                      "loss_eff", "intra_bw_gbs", "inter_bw_gbs", "bw_efficiency", "host_bw_gbs", "bw_by_world_gbs",
                      "corun_matmul_eff", "corun_memory_eff", "corun_dispatch_eff", "op_factor"})
# Counts and ratios whose least meaningful value is 1: a node holds a device; a fabric carries at
# most full bisection (oversubscription 1); a rank runs a thread.
AT_LEAST_ONE = frozenset({"gpus_per_node", "oversubscription", "threads"})
# The names a table's entries may have ("alreduce" was kept and the base's factor priced instead).
ENTRY_NAMES = {"peak_tflops": DTYPES, "matmul_eff_max": DTYPES, "attn_eff": DTYPES, "elementwise_eff": DTYPES,
               "op_factor": ("all_reduce", "all_gather", "reduce_scatter")}
# Upper bounds: a link realises at most its bandwidth. The measured shares have none: calibrate
# measures them against an assumed peak or another measured rate (bf16 GEMMs on AMX run several
# times the CPU peak assumed for them; the loss's rate over the element-wise one passes 4 on GPUs).
AT_MOST = {"bw_efficiency": 1.0}
BY_WORLD = ("latency_by_world_us", "bw_by_world_gbs")  # keyed by intra-node group size


def _check_keys(obj: Any, raw: Any, where: str) -> None:
    """Known keys (`name` is the table's, not a profile's) with values in range, in nested tables too:
    >= 0 for every figure (a size, rate, time or share), > 0 or >= 1 where the planner needs it."""
    if not isinstance(raw, dict):
        return  # the reader says what it should be
    valid = [n for n in reader.field_names(obj) if n != "name"]
    for key, value in raw.items():
        if key not in valid:
            moved = " (it belongs in the [cpu] table)" if isinstance(obj, Hardware) and key in _CPU_KEYS else ""
            raise ConfigError(f"{where}: unknown hardware key {key!r}{moved}; valid: {', '.join(valid)}")
        if dataclasses.is_dataclass(getattr(obj, key)):
            _check_keys(getattr(obj, key), value, f"{where} [{key}]")
            continue
        if key in BY_WORLD and isinstance(value, dict):
            _check_world_sizes(key, value, where)
        unknown = [k for k in value if k not in ENTRY_NAMES[key]] if key in ENTRY_NAMES and isinstance(value, dict) \
            else []
        if unknown:
            raise ConfigError(f"{where}: unknown {key} entry {unknown[0]!r}; valid: {', '.join(ENTRY_NAMES[key])}")
        named = {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
        for name, v in named.items():
            _check_value(key, name, v, where)


def _check_value(key: str, name: str, v: Any, where: str) -> None:
    """One figure against its range (`key`: the field, `name`: it or its dict entry)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return  # the reader says what type it should be
    least, strict = (1, False) if key in AT_LEAST_ONE else (0, key in POSITIVE)
    if v < least or (strict and v == least):
        raise ConfigError(f"{where}: {name}={v!r} must be a number {'>' if strict else '>='} {least}")
    if v > AT_MOST.get(key, float("inf")):
        raise ConfigError(f"{where}: {name}={v!r} must be at most {AT_MOST[key]:g} (a share of the link's bandwidth)")


def _check_world_sizes(key: str, table: dict, where: str) -> None:
    """Group sizes as keys: whole numbers >= 1 ("2", "4", ...), as calibrate writes them."""
    for size in table:
        if not str(size).isdigit() or int(size) < 1:
            raise ConfigError(f"{where}: {key} key {size!r} must be a group size, a whole number >= 1 (e.g. \"2\")")


def _check_world_pairs(net: Network, where: str) -> None:
    """latency_by_world_us and bw_by_world_gbs are read in pairs: with both set, some group size
    must have both figures (comm._intra_fit), else neither describes any group."""
    lat, bw = net.latency_by_world_us, net.bw_by_world_gbs
    if lat and bw and not set(map(str, lat)) & set(map(str, bw)):
        raise ConfigError(f"{where}: [network] latency_by_world_us (sizes {', '.join(map(str, lat))}) and "
                          f"bw_by_world_gbs (sizes {', '.join(map(str, bw))}) share no group size; give both "
                          "for the same sizes")


def to_toml(values: dict[str, Any], comment: str = "") -> str:
    """A profile as TOML, floats to 7 significant digits: measurements carry no more, and a slow link's
    small figures (0.0012 GB/s) keep their precision, which fixed decimals would cut."""
    return reader.to_toml(_rounded(values), comment)


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return float(f"{value:.7g}") if isinstance(value, float) else value
