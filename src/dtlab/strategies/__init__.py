"""Strategies by name. Each is a small module behind the interface in `base.py`.

Modules are imported when a strategy is built: a DDP worker does not pay for importing DTensor,
pipelining (which pulls in torch._dynamo) or DeepSpeed, about 1.5 s per process on our CI machine.
"""

from __future__ import annotations

import importlib

from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.strategies.base import Strategy

MODULES = {  # name -> (module, class)
    "single": ("single", "Single"), "ddp": ("ddp", "DDP"), "fsdp": ("fsdp", "FSDP"),
    "fsdp1": ("fsdp1", "FSDP1"), "zero1": ("zero1", "Zero1"), "deepspeed": ("deepspeed", "DeepSpeed"),
    "tp": ("tp", "TP"), "fsdp_tp": ("tp", "FSDPTP"), "pp": ("pp", "PP"),
}

__all__ = ["MODULES", "Strategy", "build_strategy", "strategy_class"]


def strategy_class(name: str) -> type[Strategy]:
    module, cls = MODULES[name]
    return getattr(importlib.import_module(f"dtlab.strategies.{module}"), cls)


def build_strategy(cfg: Config, ctx: DistContext) -> Strategy:
    return strategy_class(cfg.strategy.name)(cfg, ctx)
