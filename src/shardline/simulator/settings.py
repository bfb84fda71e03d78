"""Simulation settings: defaults, a TOML file, `--simulate.key=value` overrides, CLI flags.

Precedence, lowest first: the defaults below, `[simulate]` and `[failures]` tables of
`--config FILE.toml`, `--simulate.key=value` / `--failures.key=value` overrides, then the
explicit CLI flags. Names and types are the dataclass's, read by `shardline.config.reader`
like every settings file; ranges and choices are checked here. A mistake raises
ConfigError naming the key. The defaults and their sources are documented in docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from shardline.config import reader
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
    global_batch: int | None = None  # sequences a step; None: one per GPU, at most 2048
    global_batch_tokens: int | None = None  # or the step's tokens (global_batch x seq_len): one of the two
    mfu: float | None = None  # a step time from FLOPs at this MFU where the planner has no plan (job.step_time_s)
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


_KEYS = [f.name for f in fields(Settings) if f.name != "failures"]  # of [simulate]; [failures] is its own table

# key: (lowest allowed, strictly greater?); the type (integer, number or None) is the field's
_RULES: dict[str, tuple[float, bool]] = {
    "step_time_s": (0, True), "seq_len": (0, True), "global_batch": (0, True), "global_batch_tokens": (0, True),
    "mfu": (0, True),
    "detection_s": (0, False), "restart_s": (0, False), "load_s": (0, False), "memory_load_s": (0, False),
    "planned_downtime_s": (0, False), "save_s": (0, False), "snapshot_s": (0, False), "persist_every": (1, False),
    "persist_interval_s": (0, True), "state_bytes_per_param": (0, True), "storage_gbps_per_node": (0, True),
    "storage_gbps_total": (0, True), "host_copy_gbps": (0, True), "save_overhead_s": (0, False),
    "snapshot_overhead_s": (0, False), "straggler_prob": (0, False), "straggler_slowdown": (1, False),
}


def _check_range(key: str, value: Any) -> None:
    """A number within its rule (the reader has checked its type); named as the user wrote it."""
    low, strict = _RULES[key]
    if value < low or (strict and value == low):
        raise ConfigError(f"simulate.{key}={value} must be {'>' if strict else '>='} {low}")
    if key == "mfu" and value > 1:
        raise ConfigError(f"simulate.mfu={value} must be in (0, 1]")
    if key == "straggler_prob" and value > 1:
        raise ConfigError(f"simulate.straggler_prob={value} must be a probability in [0, 1]")


def _check_value(key: str, value: Any, given: Any) -> None:
    """What a type does not say about one `[simulate]` value: its choices, or its range (shown `given`)."""
    if key == "checkpoint_mode":
        if value not in MODES:
            raise ConfigError(f"checkpoint mode {value!r} is not one of {', '.join(MODES)}")
    elif key == "fix":
        from shardline.planner.layout import parse_fix

        parse_fix(value)  # a bad key or value fails here, naming it
    elif key in _RULES and value is not None:
        _check_range(key, given)


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


def _read_toml(path: str | Path) -> dict[str, Any]:
    raw = reader.read_toml(path)
    unknown = set(raw) - {"simulate", "failures"}
    if unknown:
        training = unknown & {"parallel", "train", "model"}  # a training config, given as simulate's own
        raise ConfigError(f"--config {path}: unknown section(s) {', '.join(sorted(unknown))}; "
                          "valid: [simulate], [failures]" + (
                              " (a training config: simulate takes its model as --model and its layout as --fix "
                              "tp=...,pp=..., as plan does)" if training else ""))
    return raw


_BATCH_KEYS = ("global_batch", "global_batch_tokens")


def apply_table(settings: Settings, section: str, table: dict[str, Any], where: str) -> Settings:
    """`settings` with one table set: names and types by the config reader, ranges checked here."""
    if section == "failures":
        return replace(settings, failures=settings.failures.with_updates(table, where))
    for key in table:
        if key not in _KEYS:
            raise ConfigError(f"simulate.{key} is not a simulator setting; valid keys: {', '.join(_KEYS)}")
    batch = [key for key in _BATCH_KEYS if key in table]
    if len(batch) == 2:
        raise ConfigError("simulate.global_batch (sequences) and simulate.global_batch_tokens both set the "
                          "step's batch; give one or the other")
    if batch:  # a later source's batch replaces an earlier one's, in either unit
        settings = replace(settings, **{key: None for key in _BATCH_KEYS})
    if "checkpoint_interval" in table:  # "optimal" or steps, as a number or a string (a CLI flag)
        table = {**table, "checkpoint_interval": parse_interval(table["checkpoint_interval"])}
    typed = reader.updated(settings, table, "simulate", kind="simulator setting")
    for key, given in table.items():
        _check_value(key, getattr(typed, key), given)  # an error shows the value as the user wrote it
    return typed


def load_settings(path: str | Path | None, overrides: list[str], flags: dict[str, Any]) -> Settings:
    """Defaults < TOML file < `--section.key=value` overrides < explicit flags (not None)."""
    settings = Settings()
    if path is not None:
        for section, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"--config {path}: [{section}] must be a table")
            settings = apply_table(settings, section, table, section)
    given_overrides: dict[str, dict[str, Any]] = {"simulate": {}, "failures": {}}
    for item in overrides:  # (one table a section: the batch in both units on one command line is refused)
        section, key, value = reader.split_override(item)
        if section not in given_overrides:
            raise ConfigError(f"override {item!r}: use --simulate.KEY=VALUE or --failures.KEY=VALUE")
        given_overrides[section][key] = value
    for section, table in given_overrides.items():
        if table:
            settings = apply_table(settings, section, table, section)
    given = {k: v for k, v in flags.items() if v is not None}
    settings = apply_table(settings, "simulate", given, "simulate")
    _check_step_time(settings)
    return settings


def _check_step_time(settings: Settings) -> None:
    """A given step time replaces the estimate; keys that only shape the estimate would be
    ignored (from any source: file, override or flag)."""
    if settings.step_time_s is None:
        return
    unused = [f"simulate.{key}" for key in ("fix", "seq_len", "global_batch", "global_batch_tokens")
              if getattr(settings, key)]
    unused += ["simulate.mfu"] if settings.mfu is not None else []
    if unused:
        raise ConfigError(f"{', '.join(unused)} {'shapes' if len(unused) == 1 else 'shape'} the step-time "
                          "estimate, which simulate.step_time_s replaces; give one or the other")


# [simulate] keys only some checkpoint modes read: a persistent save every k snapshots and the
# restore from a peer's memory are memory mode's; the device-to-host snapshot (its time, or
# the figures that estimate it) is the stall of async and memory, never of sync.
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "persist_every": ("memory",), "persist_interval_s": ("memory",), "memory_load_s": ("memory",),
    "snapshot_s": ("async", "memory"), "snapshot_overhead_s": ("async", "memory"),
    "host_copy_gbps": ("async", "memory"),
}


def check_mode_keys(settings: Settings, modes: tuple[str, ...]) -> None:
    """Refuse keys set away from their defaults that none of the simulated `modes` reads (from any
    source: file, override or flag): they would be ignored, and the user believe them priced."""
    unused = [key for key, users in MODE_KEYS.items()
              if getattr(settings, key) != getattr(Settings, key) and not set(users) & set(modes)]
    if unused:
        named = ", ".join(f"simulate.{key} (used by {' and '.join(MODE_KEYS[key])})" for key in unused)
        them = "it" if len(unused) == 1 else "them"
        raise ConfigError(f"{named} would be ignored under checkpoint mode {' and '.join(modes)}; remove {them} "
                          f"or choose a mode that uses {them} (valid: {', '.join(MODES)})")
