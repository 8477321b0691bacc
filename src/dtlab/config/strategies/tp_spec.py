"""`tp` (tensor parallelism over every rank) and `fsdp_tp` (FSDP2 x TP on a 2-D mesh): options and
checks (implementation: tp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import NonNegativeInt

from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec, check_mesh
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

KEY = "strategy.tp.degree"


class TPOptions(Section):
    degree: NonNegativeInt = 0  # ranks per tensor-parallel group; 0 = every rank


def degree(cfg: Config, world_size: int) -> int:
    return cfg.strategy.tp.degree or world_size


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    d = degree(cfg, world_size)
    check_mesh(cfg, world_size, d, KEY)
    if cfg.strategy.name == "tp" and d != world_size:
        raise ConfigError(
            f"strategy.name=tp puts every rank in one tensor-parallel group, but "
            f"strategy.tp.degree={d} < world_size={world_size}; fix: strategy.tp.degree=0, "
            "or strategy.name=fsdp_tp for a data-parallel dimension"
        )
    m = cfg.model
    for what, value in (("model.n_head", m.n_head), ("model.vocab_size", m.vocab_size),
                        ("model.block_size", m.block_size)):
        if value % d:
            raise ConfigError(
                f"{what}={value} is not divisible by the tensor-parallel degree {d} "
                f"(heads, vocabulary and sequence are split over it); fix: choose {what} as "
                f"a multiple of {d}, or a smaller strategy.tp.degree"
            )


SPEC = StrategySpec(
    name="tp", impl="tp:TP", about="tensor parallelism (Megatron-style, sequence parallel)",
    options=TPOptions, mesh_key=KEY, check=check, model_parallel=degree,
)
FSDP_TP = StrategySpec(
    name="fsdp_tp", impl="tp:FSDPTP", about="FSDP2 across tensor-parallel groups (2-D mesh)",
    mesh_key=KEY, check=check, model_parallel=degree, shards_state=True,
)
