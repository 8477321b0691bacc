"""`fsdp`: FSDP2 (`fully_shard`) per block; its options and checks (implementation: fsdp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec, sharded_data_parallel
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


class FSDPOptions(Section):
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    reduce_fp32: bool = True  # with train.precision bf16/fp16: reduce gradients in fp32


def has_batch_norm(cfg: Config) -> bool:
    m = cfg.model
    return m.name == "resnet" or bool(getattr(m, "batch_norm", False))


def validate(cfg: Config) -> None:
    if cfg.train.compile != "none" and has_batch_norm(cfg):
        raise ConfigError(
            f"train.compile={cfg.train.compile} with strategy {cfg.strategy.name} fails on "
            "BatchNorm models in this torch release; fix: set train.compile=none, or use "
            "strategy ddp"
        )


def comm_bytes(options: dict[str, Any], n_params: int, param_elem: int, grad_elem: int,
               n: int) -> float | None:
    gathers = 2 if options.get("reshard_after_forward", True) else 1
    return sharded_data_parallel(n_params * param_elem, n_params * grad_elem, n, gathers)


SPEC = StrategySpec(
    name="fsdp", impl="fsdp:FSDP", about="FSDP2: every parameter sharded per block (fully_shard)",
    options=FSDPOptions, validate=validate, textbook="zero3", comm_bytes=comm_bytes,
    layout=lambda cfg: "zero3" if cfg.strategy.fsdp.reshard_after_forward else "zero2",
    shards_state=True,
)
