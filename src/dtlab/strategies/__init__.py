"""Strategies: the implementation of each (`<name>.py`, behind the interface in `base.py`) and
their shared pieces (`grad_norm.py`, `state_bytes.py`, `ddp_hooks.py`, DeepSpeed's checkpoint and
memory model). What dtlab knows about each without running it, its description and the registry,
is the config layer's (`dtlab/config/strategies/`).

`build` imports a run's implementation by the name its description gives (`impl`): a plugin
lookup, so that a DDP worker does not pay for importing DTensor, pipelining (which pulls in
torch._dynamo) or DeepSpeed, about 1.5 s per process on our CI machine, and reading or checking a
config imports no torch at all. May import models, data, levers, config, process control, the
run directory's layout and the ground; never instruments, the run, the loop or the commands.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dtlab.config.strategies import registry

if TYPE_CHECKING:
    from dtlab.config import Config
    from dtlab.distributed import DistContext
    from dtlab.strategies.base import Strategy


def strategy_class(name: str) -> type[Strategy]:
    """The implementation of strategy `name` (imported here, by the name its description gives)."""
    module, cls = registry.get(name).impl.split(":")
    return getattr(importlib.import_module(f"dtlab.strategies.{module}"), cls)


def build(cfg: Config, ctx: DistContext) -> Strategy:
    return strategy_class(cfg.strategy.name)(cfg, ctx)
