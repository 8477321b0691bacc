"""Checks that need the number of ranks, run before any process starts (and again in each
worker): the generic ones here, each strategy's own from its description (dtlab/strategies)."""

from __future__ import annotations

import importlib.util

from dtlab.config.limits import check_fits_machine
from dtlab.config.schema import TRACKER_PACKAGES, Config
from dtlab.config.strategies import registry
from dtlab.config.strategies.spec import micro_batch_of
from dtlab.errors import ConfigError


def model_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks that hold one copy of the model between them (1 for data-parallel strategies)."""
    return registry.of(cfg).model_parallel_size(cfg, world_size)


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Replicas the global batch is split over: the ranks not spent on model parallelism."""
    return max(1, world_size // model_parallel_size(cfg, world_size))


def micro_batch(cfg: Config, world_size: int) -> int:
    """Samples per replica per forward, or a ConfigError when the global batch does not split."""
    return micro_batch_of(cfg, world_size, model_parallel_size(cfg, world_size))


def check_world(cfg: Config, world_size: int, local_world_size: int | None = None) -> int:
    """Checks that need the number of ranks; returns the micro batch size per rank."""
    spec = registry.of(cfg)
    if spec.one_process and world_size > 1:
        raise ConfigError(
            f"strategy.name={spec.name} runs one process but {world_size} ranks were started; "
            "fix: use --nproc-per-node 1, or strategy.name=ddp|fsdp|fsdp1"
        )
    if spec.check is not None:
        spec.check(cfg, world_size, local_world_size)
    return micro_batch(cfg, world_size)


def check_environment(cfg: Config) -> None:
    """Options that need an optional package, and data this machine can hold."""
    check_fits_machine(cfg)
    extra = registry.of(cfg).extra
    if extra is not None and importlib.util.find_spec(extra[0]) is None:
        raise ConfigError(
            f"strategy.name={cfg.strategy.name} needs the {extra[0]} package; "
            f"fix: pip install 'dtlab[{extra[1]}]' (after the pinned torch), or choose another strategy")
    if registry.of(cfg).environment is not None:
        registry.of(cfg).environment(cfg)
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "run.tensorboard=true needs the tensorboard package; "
            "fix: pip install 'dtlab[tensorboard]', or set run.tensorboard=false"
        )
    for name in cfg.run.trackers:
        package, extra_name = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"run.trackers includes {name}, which needs the {package} package; fix: pip "
                f"install 'dtlab[{extra_name}]' (after the pinned torch), or remove {name} from "
                "run.trackers")
