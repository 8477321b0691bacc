"""HSDP on FSDP2: `fully_shard` over a 2-D device mesh (replicate, shard).

Inside each shard group (`strategy.hsdp.shard_size` ranks, by default one node) it is FSDP2:
every parameter a DTensor sharded on dim 0, all-gathered per block for forward and backward,
gradients reduce-scattered. Across the groups the shards are replicated: after the
reduce-scatter, each rank all-reduces its gradient shard with the ranks that hold the same shard
in the other groups. So the fast links (inside a node) carry the all-gathers, the slow ones (between
nodes) only 1/shard_size of the gradients. Every rank is a data-parallel replica.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dtlab.config.strategies.hsdp_spec import shard_size
from dtlab.strategies.fsdp import FSDP, shard


class HSDP(FSDP):
    def wrap(self, model: nn.Module) -> nn.Module:
        ctx = self.ctx
        self.shard_size = shard_size(self.cfg, ctx.world_size, ctx.env.local_world_size)
        self.replicas = ctx.world_size // self.shard_size
        mesh = init_device_mesh(ctx.device.type, (self.replicas, self.shard_size),
                                mesh_dim_names=("replicate", "shard"))
        return shard(self.prepare(model), mesh, self.cfg.strategy.hsdp, self.precision, ctx.device)

    def describe(self) -> dict[str, Any]:
        return {**self.cfg.strategy.hsdp.model_dump(),
                "mesh": {"replicate": self.replicas, "shard": self.shard_size}}
