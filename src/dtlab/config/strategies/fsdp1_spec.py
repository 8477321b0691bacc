"""`fsdp1`: FullyShardedDataParallel and its sharding strategies (implementation: fsdp1.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import NonNegativeInt, PositiveInt

from dtlab.config.options import Section
from dtlab.config.strategies.spec import (
    StrategySpec,
    micro_batch_of,
    ring_all_reduce,
    sharded_data_parallel,
)
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
LAYOUTS = {"FULL_SHARD": "zero3", "HYBRID_SHARD": "zero3", "SHARD_GRAD_OP": "zero2",
           "NO_SHARD": "ddp"}


class FSDP1Options(Section):
    sharding_strategy: Literal[SHARDING_STRATEGIES] = "FULL_SHARD"  # type: ignore[valid-type]
    auto_wrap: Literal["block", "size", "none"] = "block"
    min_num_params: PositiveInt = 100_000  # for auto_wrap=size
    shard_group_size: NonNegativeInt = 0  # HYBRID_SHARD only: ranks per shard group, 0 = per node
    cpu_offload: bool = False
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "none"] = "BACKWARD_PRE"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    reduce_fp32: bool = True


def validate(cfg: Config) -> None:
    if cfg.train.compile != "none":
        # Measured (torch 2.13, CPU, a GPT, 2 ranks): after the first optimizer step, dynamo traces the
        # original parameters gathered to full size while their .grad is still the shard (FSDP1's
        # use_orig_params views), and fails at the first evaluation, whether the blocks or the
        # whole model are compiled.
        raise ConfigError(
            f"train.compile={cfg.train.compile} with strategy.name=fsdp1 fails at the first "
            "evaluation (dynamo cannot trace FSDP1's sharded gradients); fix: set "
            "train.compile=none, or use strategy.name=fsdp (FSDP2, which compiles)")


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    o = cfg.strategy.fsdp1
    if o.sharding_strategy != "HYBRID_SHARD":
        return
    micro_batch_of(cfg, world_size)  # a batch that does not split is the first thing to say
    group = o.shard_group_size or local_world_size or world_size
    if group < 1 or world_size % group:
        raise ConfigError(
            f"HYBRID_SHARD cannot split world_size={world_size} into shard groups of {group}; "
            "fix: set strategy.fsdp1.shard_group_size to a divisor of the world size"
        )


def comm_bytes(options: dict[str, Any], n_params: int, param_elem: int, grad_elem: int,
               n: int) -> float | None:
    sharding = options.get("sharding_strategy", "FULL_SHARD")
    p, g = n_params * param_elem, n_params * grad_elem
    if sharding == "NO_SHARD":
        return ring_all_reduce(g, n)
    if sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return sharded_data_parallel(p, g, n, 2 if sharding == "FULL_SHARD" else 1)
    return None  # HYBRID_SHARD: two group sizes, not modelled


def label(options: dict[str, Any]) -> str:
    sharding = options.get("sharding_strategy", "FULL_SHARD")
    return "fsdp1" if sharding == "FULL_SHARD" else f"fsdp1:{sharding}"


SPEC = StrategySpec(
    name="fsdp1", impl="fsdp1:FSDP1",
    about="FSDP1: FlatParameters per block (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD)",
    options=FSDP1Options, variant=("strategy.fsdp1.sharding_strategy", SHARDING_STRATEGIES,
             f"a variant ({', '.join(SHARDING_STRATEGIES)})"),
    validate=validate, check=check, label=label, layout=lambda cfg: LAYOUTS[cfg.strategy.fsdp1.sharding_strategy],
    comm_bytes=comm_bytes, shards_state=True, root_stays_gathered=True,
    shard_group=lambda cfg, per_node: cfg.strategy.fsdp1.shard_group_size or per_node
    if cfg.strategy.fsdp1.sharding_strategy == "HYBRID_SHARD" else None,
)
