"""FSDP2 (`fully_shard`): every parameter becomes a DTensor sharded on dim 0 across the ranks.

Each block is its own communication unit: its parameters are all-gathered just before its forward
(and again before its backward when `reshard_after_forward`), and its gradients reduce-scattered
right after its backward. The root module holds what remains (embeddings, heads).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from dtlab.strategies.base import DTYPES, Strategy


class FSDP(Strategy):
    name = "fsdp"
    wrapper_casts = True  # MixedPrecisionPolicy runs the forward in the low precision
    sharded_grads = True

    def wrap(self, model: nn.Module) -> nn.Module:
        o = self.cfg.strategy.fsdp
        model = self.prepare(model)
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": o.reshard_after_forward}
        if self.precision != "fp32":
            dtype = DTYPES[self.precision]
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32 if o.reduce_fp32 else dtype
            )
        if o.cpu_offload:
            # Pinned host memory needs an accelerator; on a CPU-only run pinning would fail.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
        for block in model.blocks():
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    @contextmanager
    def _without_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model: nn.Module) -> Any:
        return self._without_sync(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # The gradients are DTensors: the norm is computed over all shards (a DTensor result).
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        norm = super().grad_norm(model)  # a DTensor: its full value reduces over the shards
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def describe(self) -> dict[str, Any]:
        return self.cfg.strategy.fsdp.model_dump()
