"""`hsdp`: hybrid sharding on FSDP2, `fully_shard` over a 2-D (replicate, shard) mesh; options and
checks (implementation: hsdp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import NonNegativeInt

from dtlab.config.strategies import fsdp_spec
from dtlab.config.strategies.spec import (
    StrategySpec,
    micro_batch_of,
    ring_all_reduce,
    sharded_data_parallel,
)
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


class HSDPOptions(fsdp_spec.FSDPOptions):
    """FSDP2 inside each shard group of `shard_size` ranks (parameters, gradients and optimizer
    state split over it), replicated across the groups (gradients all-reduced between them)."""

    shard_size: NonNegativeInt = 0  # ranks per shard group; 0 = the ranks of one node


def shard_size(cfg: Config, world_size: int, local_world_size: int | None) -> int:
    return cfg.strategy.hsdp.shard_size or local_world_size or world_size


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    micro_batch_of(cfg, world_size)  # a batch that does not split is the first thing to say
    group = shard_size(cfg, world_size, local_world_size)
    if world_size % group:
        raise ConfigError(
            f"strategy.hsdp.shard_size={group} does not divide world_size={world_size} into "
            "shard groups; fix: set strategy.hsdp.shard_size to a divisor of the world size "
            "(0 = the ranks of one node)")


def comm_bytes(options: dict[str, Any], n_params: int, param_elem: int, grad_elem: int,
               n: int) -> float | None:
    """Inside a shard group of s ranks, FSDP's all-gathers and reduce-scatter; then each rank
    all-reduces its 1/s of the gradients with the r = n/s replicas of that shard."""
    s = (options.get("mesh") or {}).get("shard", n)
    gathers = 2 if options.get("reshard_after_forward", True) else 1
    g = n_params * grad_elem
    return (sharded_data_parallel(n_params * param_elem, g, s, gathers)
            + ring_all_reduce(g / s, n // s))


SPEC = StrategySpec(
    name="hsdp", impl="hsdp:HSDP",
    about="hybrid sharding: FSDP2 inside shard groups, replicated across them (2-D mesh)",
    options=HSDPOptions, mesh_key="strategy.hsdp.shard_size", validate=fsdp_spec.validate,
    check=check, textbook="zero3", comm_bytes=comm_bytes, shards_state=True,
    shard_group=lambda cfg, per_node: cfg.strategy.hsdp.shard_size or per_node,
    layout=lambda cfg: "zero3" if cfg.strategy.hsdp.reshard_after_forward else "zero2",
)
