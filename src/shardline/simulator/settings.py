"""Simulation settings: defaults, a TOML file, `--simulate.key=value` overrides, CLI flags.

Precedence, lowest first: the defaults below, `[simulate]` and `[failures]` tables of
`--config FILE.toml`, `--simulate.key=value` / `--failures.key=value` overrides, then the
explicit CLI flags. Every value is checked here and a mistake raises ConfigError naming
the key. The defaults and their sources are documented in docs/simulator.md.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from shardline.config import read_toml
from shardline.errors import ConfigError
from shardline.simulator.failures import FailureModel

MODES = ("sync", "async", "memory")


@dataclass(frozen=True)
class Settings:
    # Step time: given, or the planner's best layout (pinned by `fix`), else FLOPs at `mfu`
    # (see job.step_time_s).
    step_time_s: float | None = None
    fix: str = ""  # planner --fix keys, e.g. "tp=8,pp=16"
    seq_len: int | None = None  # None: min(model max_seq_len, 8192)
    global_batch_tokens: int | None = None  # None: one sequence per GPU, at most 2048 sequences
    mfu: float = 0.40  # fallback only; Llama 3 405B: 38-43% BF16 MFU (Table 4)
    # Failure handling.
    detection_s: float = 120.0  # from the fault to the job noticing it (watchdog/heartbeat)
    restart_s: float = 300.0  # reschedule onto spares, relaunch, init NCCL; excludes the load
    load_s: float | None = None  # read a persistent checkpoint; None: estimate (= save cost)
    memory_load_s: float | None = None  # restore from a peer's host memory; None: snapshot cost
    planned_downtime_s: float | None = None  # planned stop; None: restart_s + load_s
    # Checkpoint policy and costs.
    checkpoint_mode: str = "async"
    checkpoint_interval: int | str = "optimal"  # steps, or "optimal" (Daly)
    save_s: float | None = None  # write one checkpoint to storage; None: estimate
    snapshot_s: float | None = None  # device-to-host copy (async/memory stall); None: estimate
    persist_every: int | None = None  # memory mode: snapshots per persistent save
    persist_interval_s: float | None = None  # memory mode: None = as often as the write allows
    state_bytes_per_param: float = 12.0  # fp32 weights + Adam m, v (fp32 master, bf16 autocast)
    storage_gbps_per_node: float = 1.0  # GB/s one node writes/reads to the checkpoint store
    storage_gbps_total: float = 2000.0  # Llama 3 Tectonic: 2 TB/s sustained
    host_copy_gbps: float = 5.0  # GB/s device-to-host per GPU, pinned memory
    save_overhead_s: float = 10.0  # barrier, metadata, commit of a persistent save
    snapshot_overhead_s: float = 1.0  # sync of all ranks before/after a snapshot
    # Stragglers: each GPU slows a step with this probability, by this factor.
    straggler_prob: float = 5e-7
    straggler_slowdown: float = 2.0
    failures: FailureModel = field(default_factory=FailureModel)


# key: (lowest allowed, strictly greater?, integer?)
_RULES: dict[str, tuple[float, bool, bool]] = {
    "step_time_s": (0, True, False), "seq_len": (0, True, True), "global_batch_tokens": (0, True, True),
    "mfu": (0, True, False), "detection_s": (0, False, False), "restart_s": (0, False, False),
    "load_s": (0, False, False), "memory_load_s": (0, False, False), "planned_downtime_s": (0, False, False),
    "save_s": (0, False, False), "snapshot_s": (0, False, False), "persist_every": (1, False, True),
    "persist_interval_s": (0, True, False), "state_bytes_per_param": (0, True, False),
    "storage_gbps_per_node": (0, True, False), "storage_gbps_total": (0, True, False),
    "host_copy_gbps": (0, True, False), "save_overhead_s": (0, False, False),
    "snapshot_overhead_s": (0, False, False), "straggler_prob": (0, False, False),
    "straggler_slowdown": (1, False, False),
}


def _check_number(key: str, value: Any) -> float | int:
    low, strict, integer = _RULES[key]
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ConfigError(f"simulate.{key}={value!r} must be {kind}")
    if value < low or (strict and value == low):
        raise ConfigError(f"simulate.{key}={value} must be {'>' if strict else '>='} {low}")
    if key == "mfu" and value > 1:
        raise ConfigError(f"simulate.mfu={value} must be in (0, 1]")
    if key == "straggler_prob" and value > 1:
        raise ConfigError(f"simulate.straggler_prob={value} must be a probability in [0, 1]")
    return value


def check_value(key: str, value: Any) -> Any:
    """Validate one `[simulate]` value; return it as stored."""
    if key == "checkpoint_mode":
        if value not in MODES:
            raise ConfigError(f"checkpoint mode {value!r} is not one of {', '.join(MODES)}")
        return value
    if key == "checkpoint_interval":
        return parse_interval(value)
    if key == "fix":
        from shardline.planner.layout import parse_fix

        if not isinstance(value, str):
            raise ConfigError(f"simulate.fix={value!r} must be a string like \"tp=8,pp=16\"")
        parse_fix(value)  # a bad key or value fails here, naming it
        return value
    if key not in _RULES:
        valid = ", ".join(f.name for f in fields(Settings) if f.name != "failures")
        raise ConfigError(f"simulate.{key} is not a simulator setting; valid keys: {valid}")
    return _check_number(key, value)


def parse_interval(value: Any) -> int | str:
    """`optimal` or a positive number of steps."""
    if value == "optimal":
        return value
    try:
        steps = int(value)
    except (TypeError, ValueError):
        steps = 0
    if isinstance(value, bool) or steps < 1 or str(steps) != str(value).strip():
        raise ConfigError(f"checkpoint interval {value!r} must be a positive number of steps or 'optimal'")
    return steps


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _read_toml(path: str | Path) -> dict[str, Any]:
    raw = read_toml(path)
    unknown = set(raw) - {"simulate", "failures"}
    if unknown:
        raise ConfigError(f"--config {path}: unknown section(s) {', '.join(sorted(unknown))}; "
                          "valid: [simulate], [failures]")
    return raw


def apply_table(settings: Settings, section: str, table: dict[str, Any], where: str) -> Settings:
    if section == "failures":
        return replace(settings, failures=settings.failures.with_updates(table, where))
    return replace(settings, **{k: check_value(k, v) for k, v in table.items()})


def load_settings(path: str | Path | None, overrides: list[str], flags: dict[str, Any]) -> Settings:
    """Defaults < TOML file < `--section.key=value` overrides < explicit flags (not None)."""
    settings = Settings()
    if path is not None:
        for section, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"--config {path}: [{section}] must be a table")
            settings = apply_table(settings, section, table, section)
    for item in overrides:
        name, sep, text = item.removeprefix("--").partition("=")
        section, _, key = name.partition(".")
        if not sep or section not in ("simulate", "failures") or not key:
            raise ConfigError(f"override {item!r}: use --simulate.KEY=VALUE or --failures.KEY=VALUE")
        settings = apply_table(settings, section, {key: _parse_scalar(text)}, section)
    given = {k: v for k, v in flags.items() if v is not None}
    return apply_table(settings, "simulate", given, "simulate")
