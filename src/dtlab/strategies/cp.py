"""Context parallelism (`cp`: the layouts fsdp@cpN, single@cpN, and with tensor parallelism
fsdp@tpT.cpN) for dtlab's GPT: each sequence is split into N contiguous chunks, one per rank of
a context-parallel group, and attention runs as a ring over the group (ring_attention.py), so
activations per rank shrink with N.

The ranks form a mesh (dp, cp) or (dp, cp, tp). The ranks of one context-parallel group (and
their tensor-parallel ranks) see the same samples: the batch is dealt over dp. Each takes its
chunk of every sequence: tokens, targets and their positions (the GPT numbers its positions from
`position_offset`). With tensor parallelism, the GPT's plan (tp_plans.py) splits each chunk's
heads and MLP over tp, and the sequence again for the norms. Each rank's loss is the mean over
its tokens; FSDP2 shards the model over dp x cp flattened (as torchtitan does, also without
replicas) and averages the gradients over them: the gradient of the mean over every token (the
chunks are equal). The logged loss is that mean too. Evaluation runs whole sequences (no ring):
the ranks of a group compute the same sums, reduced over dp only.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from dtlab.config import Config
from dtlab.config.strategies.cp_spec import degree as cp_degree
from dtlab.distributed import DistContext
from dtlab.models import loss_fn
from dtlab.strategies.base import LossHook, Strategy, full_value
from dtlab.strategies.fsdp import shard, without_gradient_sync
from dtlab.strategies.ring_attention import ring
from dtlab.strategies.tp import _shard_grad_like_param
from dtlab.strategies.tp_plans import plan_for


class CP(Strategy):
    wrapper_casts = True  # FSDP2's MixedPrecisionPolicy
    sharded_grads = True

    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        super().__init__(cfg, ctx)
        self.degree, self.tp = cp_degree(cfg, ctx.world_size), cfg.strategy.cp.tp
        dp = ctx.world_size // (self.degree * self.tp)
        shape, names = ((dp, self.degree), ("dp", "cp")) if self.tp == 1 else \
            ((dp, self.degree, self.tp), ("dp", "cp", "tp"))
        self.mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        self.dp_mesh, self.cp_mesh = self.mesh["dp"], self.mesh["cp"]
        self.cp_group = self.mesh.get_group("cp")
        self.dp_cp = self.mesh["dp", "cp"]._flatten("dp_cp")

    def wrap(self, model: nn.Module) -> nn.Module:
        model = self.prepare(model)
        if self.tp > 1:
            plan = plan_for(model)
            model = parallelize_module(model, self.mesh["tp"], plan.styles)
            for table in plan.tables:
                model.get_parameter(table).register_post_accumulate_grad_hook(
                    _shard_grad_like_param)
        return shard(model, self.dp_cp, self.cfg.strategy.fsdp, self.precision, self.ctx.device)

    def no_sync(self, model: nn.Module) -> Any:
        return without_gradient_sync(model)

    def forward_backward(self, forward: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         loss_hook: LossHook) -> torch.Tensor:
        rank, chunk = self.cp_mesh.get_local_rank(), x.shape[1] // self.degree
        mine = slice(rank * chunk, (rank + 1) * chunk)
        forward.position_offset = rank * chunk
        vocab_sharded = loss_parallel() if self.tp > 1 else nullcontext()
        try:
            with ring(self.cp_group), vocab_sharded:
                with self.autocast():
                    report, root = loss_hook(loss_fn(forward(x[:, mine]), y[:, mine]))
                root.backward()
        finally:
            forward.position_offset = 0
        return full_value(report).detach()

    def mean_loss(self, step_loss: torch.Tensor) -> float:
        """The mean over every token: each rank's mean over its chunk, averaged over dp x cp."""
        total = step_loss.clone()
        dist.all_reduce(total, group=self.dp_cp.get_group())
        return total.item() / self.dp_cp.size()

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Over dp only: the ranks of a context-parallel group evaluate the same sequences."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.mesh.get_group("dp"))
        return tensor

    def describe(self) -> dict[str, Any]:
        mesh = {"dp": self.dp_size, "cp": self.degree, **({"tp": self.tp} if self.tp > 1 else {})}
        return {"mesh": mesh, "attention": "ring",
                "dp": self.cfg.strategy.cp.dp if self.dp_size > 1 else "none"}
