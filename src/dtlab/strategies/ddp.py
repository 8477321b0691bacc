"""DistributedDataParallel: a full replica per rank; gradients all-reduced in buckets during
backward, overlapping communication with the rest of the backward pass."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtlab.strategies import ddp_hooks
from dtlab.strategies.base import Strategy


class DDP(Strategy):
    no_sync_is_local = True
    bucket_norms: ddp_hooks.BucketNorms | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        o = self.cfg.strategy.ddp
        dev = self.ctx.device
        ddp = DistributedDataParallel(
            self.prepare(model),
            device_ids=[dev.index] if dev.type == "cuda" else None,
            bucket_cap_mb=o.bucket_cap_mb,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            static_graph=o.static_graph,
            find_unused_parameters=o.find_unused_parameters,
        )
        ddp_hooks.register(ddp, o)
        return ddp

    def setup(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().setup(model)
        if self.cfg.strategy.ddp.comm_hook == "none" and not self.cfg.train.grad_clip:
            # the non-finite check's norm from the all-reduce itself (BucketNorms); clipping
            # keeps the norm every strategy computes, so that clipped runs stay comparable
            self.bucket_norms = ddp_hooks.BucketNorms()
            model.register_comm_hook(None, self.bucket_norms.hook)
        return model, ddp_hooks.wrap_optimizer(optimizer, self.cfg.strategy.ddp)

    def grad_norm(self, model: nn.Module, clip: float = 0.0) -> torch.Tensor:
        norm = self.bucket_norms.take() if self.bucket_norms is not None and not clip else None
        return norm if norm is not None else super().grad_norm(model, clip)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return model.no_sync()

    def describe(self) -> dict[str, Any]:
        return self.cfg.strategy.ddp.model_dump()
