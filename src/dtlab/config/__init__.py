"""Typed configuration: the schema (`schema.py`) and how files and overrides become one (`load.py`)."""

from dtlab.config.load import (
    apply_override,
    format_validation_error,
    load_config,
    parse_value,
    read_yaml,
    to_yaml,
    valid_keys,
)
from dtlab.config.schema import (
    PP_SCHEDULES,
    SHARDING_STRATEGIES,
    STRATEGIES,
    CNNConfig,
    Config,
    DataConfig,
    FaultConfig,
    GPTConfig,
    ModelConfig,
    ResNetConfig,
    RunConfig,
    StrategyConfig,
    SyntheticConfig,
    TrainConfig,
    check_environment,
    check_world,
    data_parallel_size,
    model_parallel_size,
)
from dtlab.errors import ConfigError

__all__ = [
    "PP_SCHEDULES", "SHARDING_STRATEGIES", "STRATEGIES", "CNNConfig", "Config", "ConfigError", "DataConfig", "FaultConfig",
    "GPTConfig", "ModelConfig", "ResNetConfig", "RunConfig", "StrategyConfig", "SyntheticConfig",
    "TrainConfig", "apply_override", "check_environment", "check_world", "data_parallel_size",
    "format_validation_error", "model_parallel_size",
    "load_config", "parse_value", "read_yaml", "to_yaml", "valid_keys",
]
