"""The whole training config: every section, loaded from defaults, a TOML file and overrides."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import socket
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.config import reader
from shardline.config.data_section import DataConfig, MixSource
from shardline.config.resilience import DRILL_STEPS, AnomalyConfig, FaultsConfig, WatchdogConfig
from shardline.config.sections import (
    CheckpointConfig,
    Float8Config,
    MemoryConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from shardline.errors import ConfigError, did_you_mean


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: Float8Config = field(default_factory=Float8Config)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def check_sections(self) -> None:
        """Each section's own rules, and those between sections that need nothing else; those involving
        the layout are shardline.layout's, the data's (an evaluation with something to evaluate on) preflight's."""
        sections = typing.get_type_hints(Config)
        unknown = [name for name in vars(self) if name not in sections and not name.startswith("_")]
        if unknown:  # (set in code: a file's unknown section is the reader's error)
            raise ConfigError(f"unknown config section {unknown[0]!r}{did_you_mean(unknown[0], sections)}; valid: "
                              f"{', '.join(sections)}")
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if not isinstance(value, sections[section.name]):
                raise ConfigError(f"config section {section.name} is a {type(value).__name__}, not a "
                                  f"{sections[section.name].__name__} (set its keys one by one, or use load_config)")
            reader.check_types(value, section.name)  # (values set in code)
            self._named_where_set(value.check)
        self._named_where_set(self.check_drills)

    def _named_where_set(self, check) -> None:
        """check(); its error names the file that set the key it opens with, where the value is still the file's
        (`_file`: load_config's record; not an override's value, nor one set in code since)."""
        try:
            check()
        except ConfigError as e:
            path, values = getattr(self, "_file", ("", {}))
            key = reader.key_of(e)
            if key not in values or getattr(getattr(self, key.split(".")[0]), key.split(".")[1]) != values[key]:
                raise
            raise ConfigError(f"{e} ({key} from {path})") from None  # (maybe beside another's value: not blamed)

    def check_drills(self, steps_known: bool = False) -> None:
        """A drill that can never fire passed as if it had: one at a step past train.steps, or a loss
        spike before the detector judges any (it needs anomaly.min_history healthy steps first).
        Under train.epochs the steps are known once the data is read (`steps_known`)."""
        f, steps = self.faults, self.train.steps
        for key in DRILL_STEPS if steps_known or not self.train.epochs else ():
            if getattr(f, key) > steps:
                raise ConfigError(f"faults.{key}={getattr(f, key)} is past train.steps={steps}: the drill would "
                                  f"never fire; give a step in 1..{steps}")
        every, ends = self.checkpoint.interval, {steps, self.train.stop_at_step}
        for key in ("fail_save_step", "refuse_save_step", "corrupt_checkpoint_step"):  # (a disk save's drills)
            step = getattr(f, key)
            if step and not every:
                raise ConfigError(f"faults.{key}={step} would never fire: checkpoint.interval=0 saves no checkpoint")
            if step and step % every and step not in ends and (steps_known or not self.train.epochs):
                raise ConfigError(f"faults.{key}={step} is no step a checkpoint is saved at: the drill would never "
                                  f"fire; give a multiple of checkpoint.interval={every} or the run's last step")
        phases = {"eval": ("train.eval_interval", self.train.eval_interval), "save": ("checkpoint.interval", every),
                  "snapshot": ("checkpoint.memory_interval", self.checkpoint.memory_interval),
                  "halt": ("faults.nan_step or faults.spike_step (an anomaly to halt on)",
                           f.nan_step or f.spike_step or (f.overflow_step and self.train.precision != "fp16"))}
        if f.hang_rank >= 0 and f.hang_phase in phases and not phases[f.hang_phase][1]:
            raise ConfigError(f"faults.hang_phase={f.hang_phase} would never fire: this run has no {f.hang_phase} "
                              f"phase; set {phases[f.hang_phase][0]}")
        if f.hang_rank >= 0 and not self.watchdog.timeout_s:  # (a hung process ignores SIGTERM: only a kill ends it)
            raise ConfigError(f"faults.hang_rank={f.hang_rank} needs watchdog.timeout_s > 0: nothing would end the "
                              "hang (the drill tests the watchdog; e.g. watchdog.timeout_s=30)")
        # an earlier anomaly drill skipped is a step the detector's history lacks (a rollback restores it)
        drills = {f.nan_step, f.overflow_step * (self.train.precision != "fp16")}
        earlier = sum(0 < at < f.spike_step for at in drills) if self.anomaly.action == "skip" else 0
        if f.spike_step and f.spike_step <= self.anomaly.min_history + earlier:
            lacks = f" (and faults' earlier anomalous step{'s' * (earlier > 1)}, which it leaves out)" * bool(earlier)
            raise ConfigError(f"faults.spike_step={f.spike_step} comes before the spike detector judges any step: it "
                              f"needs anomaly.min_history={self.anomaly.min_history} healthy steps first{lacks}; give "
                              "a later step, or a lower anomaly.min_history")

    def check(self, dp_world: int = 1) -> None:
        """check_sections(), and a global batch that splits over `dp_world` ranks."""
        self.check_sections()
        t = self.train
        per_step = t.micro_batch_size * dp_world
        if t.global_batch_size % per_step:
            # A resumed run keeps its global batch: say what else fits, not only a batch it cannot take.
            fits = divisors(t.global_batch_size // dp_world) if t.global_batch_size % dp_world == 0 else []
            near = sorted(sorted(fits, key=lambda m: abs(m - t.micro_batch_size))[:3])  # about the memory asked
            other = (f", or train.micro_batch_size {' or '.join(map(str, near))} (a resumed run keeps its "
                     "global batch)" if fits else f"; no micro batch fits {t.global_batch_size} sequences on "
                     f"{dp_world} data-parallel ranks: a resumed run keeps its global batch, so it needs a number of "
                     f"ranks whose data-parallel degree divides {t.global_batch_size}")
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={t.micro_batch_size} x {dp_world} data-parallel rank(s) = {per_step}; "
                f"use a multiple of {per_step}{other}"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def divisors(n: int) -> list[int]:
    """n's divisors in order, in O(sqrt n) (a global batch given in tokens by mistake is large; the
    planner's degrees use it too)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def load_config(path: str | Path | None = None, overrides: list[str] | str = ()) -> Config:
    """Defaults, then the TOML file, then `section.key=value` overrides (a list of them, or one
    string). Keys and types are checked here, values by check_sections() when a Trainer is made (call
    it to check them sooner): a relaunch reads its overrides before the run's saved config they
    complete, whose train.steps a drill's step is checked against. A file's unknown keys and wrong
    types name the file, and so does a value refused while it is still the file's."""
    if path is None:
        return _overridden({}, overrides)
    if not isinstance(path, (str, os.PathLike)):  # (a dict of sections is from_dict's)
        raise ConfigError(f"load_config takes a TOML file's path, not a {type(path).__name__}: a dict of sections "
                          "is from_dict's (from shardline.config import from_dict)")
    try:
        raw = reader.read_toml(path)
        cfg = from_dict(raw)
    except ConfigError as e:
        if str(path) in str(e):  # (the reader's own line, its cause kept: a read one rank's storage refused)
            raise
        raise ConfigError(f"{path}: {e}") from None
    cfg._file = (os.fspath(path), _file_values(cfg, raw))
    return _overridden(cfg, overrides)


def _file_values(cfg: Config, raw: dict) -> dict[str, Any]:
    """Each "section.key" a file set, with its value as read (copied: a list set in place is a change)."""
    return {f"{s}.{k}": copy.deepcopy(getattr(getattr(cfg, s), k)) for s, table in raw.items()
            if isinstance(table, dict) and hasattr(cfg, s) for k in table if hasattr(getattr(cfg, s), k)}


# What the config of one launch says about that launch alone, not the run: a relaunch from the
# run's saved config starts them afresh (an early stop, the checkpoint a launch resumed, drills).
LAUNCH_ONLY = {"run": ("resume",), "train": ("stop_at_step",), "faults": None}


def changed_keys(before: Config, now: Config) -> list[str]:
    """The "section.key"s whose values differ between two configs, each read as a file's values are
    (a Path and its string, numpy's numbers and Python's, are alike; check_types on copies)."""
    plain = []
    for cfg in (before, now):
        read = copy.deepcopy(cfg)
        read.check_sections()  # (a value set wrong since: its one-line error)
        plain.append(read.to_dict())
    return [f"{section}.{key}" for section, table in plain[1].items() for key, value in table.items()
            if plain[0][section][key] != value]


def config_changes(saved: dict, now: dict) -> dict[str, list]:
    """{"section.key": [saved, now]} of the settings a resumed launch changed (a precision, a
    micro-batch, the data), so that a resume says them: beside what one launch sets for itself
    (LAUNCH_ONLY) and run.dir (a run dir may move). A key the saved config lacks is no change."""
    out = {}
    for section, table in now.items():
        launch_only = LAUNCH_ONLY.get(section, ())
        if launch_only is None or not isinstance(saved.get(section), dict):
            continue
        for key, value in table.items():
            if key in launch_only or (section, key) == ("run", "dir") or key not in saved[section]:
                continue
            if _filled(section, key, saved[section][key]) != _filled(section, key, value):
                out[f"{section}.{key}"] = [saved[section][key], value]
    return out


# The settings whose change makes a launch another run, not the same one trained again: what it trains
# (the model, the data) and on which batches (their size, length and order).
WHAT_IS_TRAINED = ("model.", "moe.", "data.", "train.seq_len", "train.global_batch_size", "train.seed",
                   "train.data_seed")


def trained_settings(cfg: Config) -> dict[str, Any]:
    """{"section.key": value} of WHAT_IS_TRAINED, paths made absolute (a relaunch from another folder, or by
    another spelling of the same path, trains the same run): the goodput account keeps it, so a launch from
    nothing over one that saved nothing knows whether it trains that run again or another."""
    out = {}
    for section, table in cfg.to_dict().items():
        for key, value in table.items():
            name = f"{section}.{key}"
            if name.startswith(WHAT_IS_TRAINED):
                out[name] = os.path.realpath(value) if (section, key) in _PATH_KEYS and value else value
    for i, source in enumerate(out.pop("data.mix", [])):  # each source's keys apart: one a later version adds to
        for key, value in source.items():                 # a source is no difference in an older account
            out[f"data.mix.{i}.{key}"] = os.path.realpath(value) if key == "path" and value else value
    out["data.mix.sources"] = len(cfg.data.mix)
    return out


def _filled(section: str, key: str, value):
    """data.mix's entries with the keys a config saved before them lacks at their defaults (format)."""
    if (section, key) != ("data", "mix") or not isinstance(value, list):
        return value
    return [{**dataclasses.asdict(MixSource()), **entry} if isinstance(entry, dict) else entry for entry in value]


def load_relaunch_config(saved: str | Path, run_dir: str | Path, overrides: list[str] | str = ()) -> Config:
    """A run's saved config.toml as a relaunch reads it: its LAUNCH_ONLY settings back to their
    defaults, run.dir the folder it was found in (a run dir may move), then the overrides."""
    try:
        raw = reader.read_toml(saved)
    except ConfigError as e:  # (a truncated or hand-broken file: where it came from, and the ways past it)
        raise ConfigError(f"{e} (the run's saved config: fix it there, or give --config FILE)") from None
    if not reader.whole_config(raw):
        raise ConfigError(f"{saved}, the run's saved config, holds no [model] table (emptied by a crash or by "
                          "hand?): the defaults would resume this run's checkpoints; give --config FILE with the run's "
                          "settings")
    for section, keys in LAUNCH_ONLY.items():
        table = raw.get(section)
        if keys is None:  # the whole section
            raw.pop(section, None)
        elif isinstance(table, dict):
            for key in keys:
                table.pop(key, None)
    raw.setdefault("run", {})["dir"] = os.fspath(run_dir)
    if isinstance(raw.get("data"), dict):  # saved before data.add_bos existed: its run had no BOS
        raw["data"].setdefault("add_bos", False)
    given = override_list(overrides)
    for item in given:  # what an override sets replaces the file's value: a broken one there is mended so
        section, _, key = item.removeprefix("--").split("=", 1)[0].partition(".")
        if isinstance(raw.get(section), dict):
            raw[section].pop(key, None)
    try:
        cfg = from_dict(raw)
    except ConfigError as e:  # (a hand-edited file: the line named the key, not where it came from)
        key = reader.key_of(e)
        raise ConfigError(f"{e} (in {saved}, the run's saved config: fix it there"
                          + (f", or give --{key}=VALUE)" if key else ")")) from None
    cfg._file = (f"{saved}, the run's saved config", _file_values(cfg, raw))  # (its values check() refuses)
    return _overridden(cfg, given)


def save_config(cfg: Config, path: Path | str) -> None:
    """The resolved config as TOML at `path`, written whole or not at all: every rank of a
    relaunch may read it while this launch's ranks write it. Each writer has its own temporary
    file (host and process: ranks on two nodes of a shared run dir may share a process id)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(to_toml(cfg))
            f.flush()
            os.fsync(f.fileno())  # (else a power loss after the rename can leave an empty file)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # (a full disk: nothing of this launch's left behind)
        raise


def _overridden(raw: dict[str, Any] | Config, overrides: list[str] | str) -> Config:
    cfg = raw if isinstance(raw, Config) else from_dict(raw)
    for item in override_list(overrides):
        apply_override(cfg, item)
    expand_home(cfg)
    return cfg


# The path keys: a leading ~ is the user's home, as a shell would expand it (a TOML value, or
# a quoted or `--key=~/x` argument, reaches us unexpanded; a folder named "~" is never meant).
_PATH_KEYS = (("run", "dir"), ("run", "resume"), ("model", "hf_path"), ("model", "init_from"),
              ("data", "path"), ("data", "val_path"), ("data", "tokenizer"), ("checkpoint", "memory_dir"))


def expand_home(cfg: Config) -> None:
    """A leading ~ of every path key as the user's home (load_config does it; a Trainer does it
    again for paths set in code)."""
    for section, key in _PATH_KEYS:
        holder = getattr(cfg, section)
        setattr(holder, key, _home(getattr(holder, key)))
    for source in cfg.data.mix:
        source.path = _home(source.path)


def _home(path: str) -> str:
    if not path.startswith("~"):
        return path
    try:
        return str(Path(path).expanduser())
    except RuntimeError:  # ~name of no known user
        raise ConfigError(f"{path!r}: the home folder of {path.split('/')[0]!r} is not known; "
                          "give the full path") from None


def override_list(overrides: list[str] | str | None) -> list[str]:
    """`section.key=value` overrides as a list: one string is one override (not its characters), None
    none; anything else but strings is a one-line ConfigError (a Python caller's, where the CLI's are text)."""
    items = [] if overrides is None else [overrides] if isinstance(overrides, str) else overrides
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"overrides are 'section.key=value' strings, a list of them or one, not {overrides!r:.80}")
    return list(items)


def from_dict(raw: dict[str, Any]) -> Config:
    """A config from a dict of sections ({"train": {"steps": 5}}), read as a TOML file's tables are."""
    if not isinstance(raw, dict) or not all(isinstance(name, str) for name in raw):
        raise ConfigError(f"from_dict takes a dict of sections ({{'train': {{'steps': 5}}}}), not {raw!r:.80}")
    cfg = Config()
    for section_name, values in raw.items():
        _set_section(cfg, section_name, values)
    return cfg


def apply_override(cfg: Config, item: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as TOML, else taken as a string."""
    section, key, value = reader.split_override(item)
    if not isinstance(value, str) and _is_text(cfg, section, key):
        # --run.dir=1.50 names the folder "1.50", --run.dir=2024-06-01 "2024-06-01" (TOML: a date)
        value = reader.split_override(item, raw=True)[2]
    _set_section(cfg, section, {key: value})


def _is_text(cfg: Config, section: str, key: str) -> bool:
    """Whether section.key is a string field (unknown names are reported by _set_section)."""
    holder = getattr(cfg, section, None)
    if holder is None or not dataclasses.is_dataclass(holder) or key not in reader.field_names(holder):
        return False
    return typing.get_type_hints(type(holder))[key] is str


def _set_section(cfg: Config, name: str, values: Any) -> None:
    names = reader.field_names(cfg)
    if name not in names:
        if not isinstance(values, dict):  # `steps = 5` above every [section] header
            owners = [n for n in names if name in reader.field_names(getattr(cfg, n))]
            hint = f"; it belongs under [{owners[0]}]" if owners else ""
            raise ConfigError(f"config key {name} = {values!r} is outside any [section]{hint}; "
                              f"valid sections: {', '.join(names)}")
        raise ConfigError(f"unknown config section [{name}]{did_you_mean(name, names)}; valid sections: "
                          f"{', '.join(names)}")
    if isinstance(values, dict):  # a key placed under another section: say where it belongs
        for key in values:
            owners = [n for n in names if n != name and key in reader.field_names(getattr(cfg, n))]
            if key not in reader.field_names(getattr(cfg, name)) and owners:
                raise ConfigError(f"unknown config key {name}.{key}; it belongs under [{owners[0]}] "
                                  f"({owners[0]}.{key}); valid keys of [{name}]: "
                                  f"{', '.join(reader.field_names(getattr(cfg, name)))}")
    section = reader.updated(getattr(cfg, name), values, name)
    setattr(cfg, name, section)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (saved in the run dir so a run can be repeated). Values a reader
    would misread say so on their line: under train.epochs, train.steps is the launch's to derive;
    a LAUNCH_ONLY setting given (an early stop, the checkpoint resumed, a drill) is that launch's."""
    remarks = {"train.steps": f"train.epochs={cfg.train.epochs:g} sets this at launch, from the data"
               } if cfg.train.epochs else {}
    settings, defaults = cfg.to_dict(), Config().to_dict()
    for section, whose in (("model", "the preset's (or the starting weights')"), ("moe", "the model's")):
        for key, value in settings[section].items():  # (an override's default, 0, -1 or "", is "not set")
            if key not in ("preset", "hf_path", "init_from") and value == defaults[section][key]:
                remarks[f"{section}.{key}"] = f"unset: keeps {whose}"
    for section, table in settings.items():
        keys = LAUNCH_ONLY.get(section, ())
        for key in table if keys is None else keys:
            if table[key] != defaults[section][key]:
                remarks[f"{section}.{key}"] = "this launch's alone: a relaunch from the run dir starts without it"
    return reader.to_toml(cfg, remarks=remarks)
