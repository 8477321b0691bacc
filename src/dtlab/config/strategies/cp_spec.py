"""`cp`: context parallelism, the sequence split over the ranks of a group and attention run as
a ring (implementation: cp.py, ring_attention.py); FSDP2 over the data-parallel and the context
ranks together (the layouts fsdp@cpN and single@cpN), and tensor parallelism inside each
context-parallel rank (fsdp@tpT.cpN)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import NonNegativeInt, PositiveInt

from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec, check_mesh
from dtlab.config.strategies.tp_spec import check_sizes
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

KEY = "strategy.cp.degree"
TP_KEY = "strategy.cp.tp"


class CPOptions(Section):
    degree: NonNegativeInt = 0  # ranks that split one sequence; 0 = every rank tp leaves
    tp: PositiveInt = 1  # tensor-parallel ranks inside each context-parallel rank
    # over the other ranks: fsdp replicas; none: world = degree x tp (the state is still
    # sharded over the context-parallel ranks)
    dp: Literal["fsdp", "none"] = "fsdp"


def degree(cfg: Config, world_size: int) -> int:
    return cfg.strategy.cp.degree or max(1, world_size // cfg.strategy.cp.tp)


def model_parallel(cfg: Config, world_size: int) -> int:
    return degree(cfg, world_size) * cfg.strategy.cp.tp


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    o, m = cfg.strategy.cp, cfg.model
    d = degree(cfg, world_size)
    check_mesh(cfg, world_size, d * o.tp, KEY if o.tp == 1 else f"{KEY} x {TP_KEY}")
    if o.tp > 1:
        check_sizes(cfg, o.tp, TP_KEY)
    if o.dp == "none" and d * o.tp != world_size:
        dims = (f"tp{o.tp}." if o.tp > 1 else "") + f"cp{d}"
        raise ConfigError(
            f"single@{dims} (strategy.cp.dp=none) runs on exactly {d * o.tp} ranks, not "
            f"{world_size}; fix: --nproc-per-node {d * o.tp}, or fsdp@{dims} for data "
            "parallelism over the other ranks")
    if m.block_size % (d * o.tp):
        raise ConfigError(
            f"model.block_size={m.block_size} does not split into {d * o.tp} sequence chunks "
            f"({d} context-parallel x {o.tp} tensor-parallel ranks); fix: a block_size that is "
            f"a multiple of {d * o.tp}, or a smaller {KEY}")
    if m.dropout:
        raise ConfigError(
            f"model.dropout={m.dropout} with context parallelism is not supported (the ring "
            "runs the attention kernel without dropout); fix: model.dropout=0")


SPEC = StrategySpec(
    name="cp", impl="cp:CP", about="context parallelism (ring attention over the sequence)",
    options=CPOptions, mesh_key=KEY, check=check, model_parallel=model_parallel,
    shards_state=True, model_dim="cp", flavours=("fsdp", "single"), flavour_key="strategy.cp.dp",
    more_dims=(("tp", TP_KEY),),
)
