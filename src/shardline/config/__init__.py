"""Typed configuration: dataclass sections, TOML files, `--section.key=value` overrides.

`reader` is the typed TOML reader every settings file of shardline goes through;
`sections`, `data_section` and `resilience` hold the sections of the training config; `job` puts
them together as `Config`. The config imports no feature: features read it.
"""

from shardline.config.job import (LAUNCH_ONLY, Config, apply_override, config_changes, expand_home, from_dict,
                                  load_config, load_relaunch_config, override_list, save_config, to_toml)
from shardline.config.given import GivenConfig, refuse_changed_since
from shardline.config.data_section import DataConfig, MixSource, saved_formats
from shardline.config.reader import read_toml
from shardline.config.resilience import AnomalyConfig, FaultsConfig, WatchdogConfig
from shardline.config.sections import (
    AC_MODES,
    CP_BALANCES,
    CP_MODES,
    DTYPE_NAMES,
    PP_SCHEDULES,
    PRECISIONS,
    SCHEDULES,
    CheckpointConfig,
    MemoryConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "AC_MODES", "CP_BALANCES", "LAUNCH_ONLY", "CP_MODES", "DTYPE_NAMES", "PP_SCHEDULES", "PRECISIONS", "SCHEDULES",
    "AnomalyConfig", "CheckpointConfig", "Config", "DataConfig", "FaultsConfig", "GivenConfig", "MemoryConfig",
    "MetricsConfig", "MixSource", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig", "RunConfig",
    "TrainConfig", "WatchdogConfig", "apply_override", "config_changes", "expand_home", "from_dict", "load_config",
    "load_relaunch_config", "override_list", "read_toml", "refuse_changed_since", "save_config",
    "saved_formats", "to_toml",
]
