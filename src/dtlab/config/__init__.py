"""Typed configuration: the schema (`schema.py`), how files and overrides become one (`load.py`),
the checks that need the world size (`world.py`), the device and backend a run will use
(`device.py`), a `model.name=hf` config (`transformers_config.py`), and each strategy's description
with the registry (`strategies/`).

Above process control and the ground only, and may import only those (it uses `dtlab.errors`);
never models, data, levers, strategies or anything above.
"""

from dtlab.config.load import (
    apply_override,
    check_value,
    format_validation_error,
    load_config,
    parse_value,
    read_yaml,
    to_yaml,
    valid_keys,
)
from dtlab.config.schema import (
    LANGUAGE_MODELS,
    STRATEGIES,
    CNNConfig,
    Config,
    DataConfig,
    FaultConfig,
    GPTConfig,
    HFConfig,
    MemorySnapshotConfig,
    ModelConfig,
    ProfileConfig,
    ResNetConfig,
    RunConfig,
    StrategyConfig,
    SyntheticConfig,
    TrainConfig,
)
from dtlab.config.world import (
    check_environment,
    check_world,
    data_parallel_size,
    micro_batch,
    model_parallel_size,
)
from dtlab.errors import ConfigError

__all__ = [
    "STRATEGIES", "CNNConfig", "Config", "ConfigError", "DataConfig", "FaultConfig",
    "GPTConfig", "HFConfig", "LANGUAGE_MODELS", "MemorySnapshotConfig", "ModelConfig",
    "ProfileConfig", "ResNetConfig", "RunConfig", "StrategyConfig", "SyntheticConfig",
    "TrainConfig", "apply_override", "check_value", "check_environment", "check_world", "data_parallel_size",
    "format_validation_error", "micro_batch", "model_parallel_size",
    "load_config", "parse_value", "read_yaml", "to_yaml", "valid_keys",
]
