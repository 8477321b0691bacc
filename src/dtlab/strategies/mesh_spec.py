"""Checks shared by the strategies that split the GPT itself over a mesh (tp, fsdp_tp, pp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


def check_mesh(cfg: Config, world_size: int, degree: int, key: str) -> None:
    """What every model-parallel strategy needs: a GPT, a degree that divides the world, and
    none of the features these strategies do not support."""
    name, m, t = cfg.strategy.name, cfg.model, cfg.train
    if m.name != "gpt":
        raise ConfigError(
            f"strategy.name={name} splits a GPT's layers, not model.name={m.name}; "
            "fix: use model.name=gpt, or a data-parallel strategy (ddp, fsdp, fsdp1)"
        )
    if degree > world_size or world_size % degree:
        raise ConfigError(
            f"{key}={degree} does not divide world_size={world_size} into a mesh; "
            f"fix: set {key} to a divisor of {world_size} (0 = every rank)"
        )
    if m.tie_weights:
        raise ConfigError(
            f"model.tie_weights with strategy.name={name} is not supported (the embedding and "
            "the head are split differently); fix: set model.tie_weights=false"
        )
    if t.compile or t.precision == "fp16" or cfg.run.comm_breakdown:
        what = ("train.compile" if t.compile else
                "train.precision=fp16" if t.precision == "fp16" else "run.comm_breakdown")
        raise ConfigError(
            f"{what} is not supported with strategy.name={name}; fix: turn it off "
            "(bf16 works for precision)"
        )
