"""`ddp`: DistributedDataParallel; its options and checks (implementation: ddp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec, ring_all_reduce
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


class DDPOptions(Section):
    bucket_cap_mb: PositiveFloat = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    # What DDP does with each gradient bucket (src/dtlab/strategies/ddp_hooks.py); ddp only.
    comm_hook: Literal["none", "fp16", "bf16", "powersgd", "topk", "local_sgd"] = "none"
    powersgd_rank: PositiveInt = 1
    powersgd_start_iter: PositiveInt = 2  # plain all-reduce before (PowerSGD needs >= 1)
    topk_ratio: float = Field(0.01, gt=0.0, le=1.0)
    local_sgd_period: PositiveInt = 4  # average parameters every this many steps
    local_sgd_warmup: NonNegativeInt = 0  # plain DDP steps first
    local_sgd_group_size: PositiveInt = 1  # ranks that still average gradients every step


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    o = cfg.strategy.ddp
    if o.comm_hook != "local_sgd":
        return
    if cfg.train.checkpoint_every:
        raise ConfigError(
            "train.checkpoint_every with strategy.ddp.comm_hook=local_sgd is not supported (its "
            "optimizer wrapper has no distributed state dict); fix: set one of them off"
        )
    if world_size % o.local_sgd_group_size:
        raise ConfigError(
            f"strategy.ddp.local_sgd_group_size={o.local_sgd_group_size} does not divide "
            f"world_size={world_size}; fix: choose a divisor"
        )


def comm_bytes(options: dict[str, Any], n_params: int, param_elem: int, grad_elem: int,
               n: int) -> float | None:
    if options.get("comm_hook", "none") != "none":
        return None  # compression and local SGD change the volume: not modelled
    return ring_all_reduce(n_params * grad_elem, n)


SPEC = StrategySpec(
    name="ddp", impl="ddp:DDP", about="a full replica per rank, gradients all-reduced in buckets",
    options=DDPOptions, check=check, textbook="ddp", comm_bytes=comm_bytes,
)
