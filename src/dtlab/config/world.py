"""Checks that need the number of ranks, run before any process starts (and again in each
worker): the generic ones here, each strategy's own from its description (dtlab/strategies)."""

from __future__ import annotations

import importlib.util

from dtlab.config.schema import Config
from dtlab.config.strategies import registry
from dtlab.errors import ConfigError


def model_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks that hold one copy of the model between them (1 for data-parallel strategies)."""
    return registry.of(cfg).model_parallel_size(cfg, world_size)


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Replicas the global batch is split over: the ranks not spent on model parallelism."""
    return max(1, world_size // model_parallel_size(cfg, world_size))


def micro_batch(cfg: Config, world_size: int) -> int:
    """Samples per replica per forward, or a ConfigError when the global batch does not split."""
    t = cfg.train
    dp = data_parallel_size(cfg, world_size)
    per_step = dp * t.grad_accum_steps
    if t.global_batch_size < per_step or t.global_batch_size % per_step:
        what = f"world_size({world_size})" if dp == world_size else f"data-parallel size({dp})"
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
            f"{what} x train.grad_accum_steps({t.grad_accum_steps}) = {per_step}; "
            f"fix: set train.global_batch_size to a multiple of {per_step}"
        )
    return t.global_batch_size // per_step


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


def device_type(cfg: Config) -> str:
    """The device type a run will use (imports torch only when run.device=auto)."""
    if cfg.run.device != "auto":
        return cfg.run.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_type(cfg: Config) -> str:
    """The process-group backend a run will use (dtlab/distributed.py's choice)."""
    if cfg.run.backend != "auto":
        return cfg.run.backend
    return "nccl" if device_type(cfg) == "cuda" else "gloo"


def check_environment(cfg: Config) -> None:
    """Options that need an optional package."""
    extra = registry.of(cfg).extra
    if extra is not None and importlib.util.find_spec(extra[0]) is None:
        raise ConfigError(
            f"strategy.name={cfg.strategy.name} needs the {extra[0]} package; "
            f"fix: pip install 'dtlab[{extra[1]}]' (after the pinned torch), or choose another strategy")
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "run.tensorboard=true needs the tensorboard package; "
            "fix: pip install 'dtlab[tensorboard]', or set run.tensorboard=false"
        )
