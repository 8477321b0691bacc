"""FSDP1 (`FullyShardedDataParallel`): blocks flattened into FlatParameters, sharded per unit.

Sharding strategies by their PyTorch names: FULL_SHARD (params, grads, optimizer state sharded;
params re-gathered for backward), SHARD_GRAD_OP (params kept gathered between forward and
backward), NO_SHARD (DDP-like), HYBRID_SHARD (FULL_SHARD inside a group, replicated across groups).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1Wrapper
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from dtlab.errors import ConfigError
from dtlab.strategies.base import DTYPES, Strategy


class FSDP1(Strategy):
    wrapper_casts = True  # MixedPrecision casts parameters and inputs itself
    sharded_grads = True

    def wrap(self, model: nn.Module) -> nn.Module:
        o = self.cfg.strategy.fsdp1
        dev = self.ctx.device
        if o.cpu_offload and dev.type != "cuda":
            raise ConfigError(
                "strategy.fsdp1.cpu_offload pins host memory, which needs an accelerator; "
                "fix: on CPU use strategy.name=fsdp with strategy.fsdp.cpu_offload=true"
            )
        model = self.prepare(model)
        policy = None
        if o.auto_wrap == "block":
            policy = ModuleWrapPolicy({type(b) for b in model.blocks()})
        elif o.auto_wrap == "size":
            policy = functools.partial(size_based_auto_wrap_policy, min_num_params=o.min_num_params)
        mixed = None
        if self.precision != "fp32":
            dtype = DTYPES[self.precision]
            mixed = MixedPrecision(
                param_dtype=dtype, reduce_dtype=torch.float32 if o.reduce_fp32 else dtype
            )
        mesh = None
        if o.sharding_strategy == "HYBRID_SHARD":
            shard = o.shard_group_size or self.ctx.env.local_world_size
            mesh = init_device_mesh(
                dev.type, (self.ctx.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
            )
        return FSDP1Wrapper(
            model,
            sharding_strategy=ShardingStrategy[o.sharding_strategy],
            auto_wrap_policy=policy,
            mixed_precision=mixed,
            cpu_offload=CPUOffload(offload_params=True) if o.cpu_offload else None,
            backward_prefetch=None
            if o.backward_prefetch == "none"
            else BackwardPrefetch[o.backward_prefetch],
            forward_prefetch=o.forward_prefetch,
            limit_all_gathers=o.limit_all_gathers,
            device_id=dev,  # FSDP1 refuses CPU modules unless told the device explicitly
            device_mesh=mesh,
            use_orig_params=True,  # optimizer and clipping see the original parameters
        )

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return model.no_sync()

    @property
    def no_sync_is_local(self) -> bool:  # type: ignore[override]
        return self.cfg.strategy.fsdp1.sharding_strategy == "NO_SHARD"

    def grad_norm(self, model: nn.Module, clip: float = 0.0) -> torch.Tensor:
        # FSDP1 reduces the norm over the shards; clipping at infinity leaves the gradients as they are
        return model.clip_grad_norm_(clip or float("inf"))

    def describe(self) -> dict[str, Any]:
        return self.cfg.strategy.fsdp1.model_dump()
