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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from dtlab.config.strategies.fsdp_spec import FSDPOptions
from dtlab.strategies.base import DTYPES, Strategy


def shard(model: nn.Module, mesh: DeviceMesh, o: FSDPOptions, precision: str,
          device: torch.device) -> nn.Module:
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": o.reshard_after_forward}
    if precision != "fp32":
        dtype = DTYPES[precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32 if o.reduce_fp32 else dtype
        )
    if o.cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only run pinning would fail.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextmanager
def without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulation micro steps: gradients stay unreduced until the last one."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class FSDP(Strategy):
    wrapper_casts = True  # MixedPrecisionPolicy runs the forward in the low precision
    sharded_grads = True
    contiguous_params = True  # fully_shard refuses channels_last weights (non-contiguous)

    def wrap(self, model: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        return shard(self.prepare(model), mesh, self.cfg.strategy.fsdp, self.precision,
                     self.ctx.device)

    def no_sync(self, model: nn.Module) -> Any:
        return without_gradient_sync(model)

    def describe(self) -> dict[str, Any]:
        return self.cfg.strategy.fsdp.model_dump()
