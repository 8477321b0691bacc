"""`zero1`: DDP + ZeroRedundancyOptimizer; its options and checks (implementation: zero1.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlab.config.device import backend_type
from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


class Zero1Options(Section):
    """DDP + torch's ZeroRedundancyOptimizer (strategy.ddp.* options apply to the DDP part)."""

    parameters_as_bucket_view: bool = False  # broadcast updated parameters as flat buckets
    overlap_with_ddp: bool = False  # the step inside DDP's backward hook; NCCL only


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    z, hook = cfg.strategy.zero1, cfg.strategy.ddp.comm_hook
    if hook == "local_sgd":
        raise ConfigError(
            "strategy.ddp.comm_hook=local_sgd does not combine with strategy zero1 (post-local SGD "
            "wraps the optimizer and averages parameters itself); fix: use strategy ddp, or "
            "another comm_hook")
    if not z.overlap_with_ddp:
        return
    if backend_type(cfg) == "gloo":
        raise ConfigError(
            "strategy.zero1.overlap_with_ddp=true needs the NCCL backend (PyTorch's "
            "hook_with_zero_step refuses gloo, which may hang); fix: set it false on CPU/gloo")
    clash = [k for k, on in (("strategy.ddp.comm_hook", hook != "none"),
                             ("train.grad_clip", cfg.train.grad_clip > 0),
                             ("train.checkpoint_every", cfg.train.checkpoint_every > 0),
                             ("train.precision=fp16", cfg.train.precision == "fp16")) if on]
    if clash:
        raise ConfigError(
            f"strategy.zero1.overlap_with_ddp=true runs the optimizer step inside DDP's backward "
            f"hook, so {', '.join(clash)} cannot apply; fix: turn those off or set "
            "overlap_with_ddp=false")


SPEC = StrategySpec(
    name="zero1", impl="zero1:Zero1",
    about="DDP with the optimizer state split over the ranks (ZeroRedundancyOptimizer)",
    options=Zero1Options, check=check, textbook="zero1", layout=lambda cfg: "zero1",
    broadcasts_updates=True,
)
