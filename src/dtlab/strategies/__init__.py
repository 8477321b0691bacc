"""Strategies by name. Each is a small module behind the interface in `base.py`."""

from __future__ import annotations

from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.strategies.base import Strategy
from dtlab.strategies.ddp import DDP
from dtlab.strategies.deepspeed import DeepSpeed
from dtlab.strategies.fsdp import FSDP
from dtlab.strategies.fsdp1 import FSDP1
from dtlab.strategies.pp import PP
from dtlab.strategies.single import Single
from dtlab.strategies.tp import FSDPTP, TP
from dtlab.strategies.zero1 import Zero1

REGISTRY: dict[str, type[Strategy]] = {
    s.name: s for s in (Single, DDP, FSDP, FSDP1, Zero1, DeepSpeed, TP, FSDPTP, PP)
}

__all__ = ["REGISTRY", "Strategy", "build_strategy"]


def build_strategy(cfg: Config, ctx: DistContext) -> Strategy:
    return REGISTRY[cfg.strategy.name](cfg, ctx)
