"""Tensor parallelism (`tp`), and FSDP2 x TP on a 2-D mesh (`fsdp_tp`), of dtlab's GPT and of
Hugging Face Llama-family decoders.

The ranks form a mesh (dp, tp): `tp` uses one tensor-parallel group of every rank (dp = 1);
`fsdp_tp` shards each tensor-parallel shard again with FSDP2 over the dp dimension. The ranks of
one tensor-parallel group see the same samples; the batch is dealt over dp only.

The plan (Megatron-style, with sequence parallelism; DTensor's parallel styles) is chosen from the
model's parameter names (tp_plans.py), per block:
- the norms (SequenceParallel): weights replicated; each rank normalises its 1/tp of the sequence
  (and dropout acts on those sequence shards only).
- attention: the input is all-gathered along the sequence; q, k, v are column-parallel (each rank
  computes heads/tp heads, KV heads/tp key/value heads); the output projection is row-parallel,
  its partial sums reduce-scattered back into sequence shards.
- MLP: the same: all-gather, the first projections column-parallel (GPT's fc, Llama's gate and
  up), the last one row-parallel, reduce-scatter.
Embeddings: the token (and GPT's position) tables are row-parallel (each rank holds 1/tp of the
rows), their partial sums reduce-scattered into sequence shards. Output: the final norm
sequence-parallel; the head column-parallel (vocabulary-sharded logits, kept as a DTensor) and the
cross-entropy computed under `loss_parallel`, so the logits are never gathered.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from dtlab.config import Config, model_parallel_size
from dtlab.distributed import DistContext
from dtlab.strategies.base import LossHook, Strategy, full_value
from dtlab.strategies.fsdp import shard, without_gradient_sync
from dtlab.strategies.tp_plans import plan_for


def _shard_grad_like_param(param: torch.Tensor) -> None:
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(placements=param.placements)


class TP(Strategy):
    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        super().__init__(cfg, ctx)
        self.degree = model_parallel_size(cfg, ctx.world_size)
        self.mesh: DeviceMesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // self.degree, self.degree),
            mesh_dim_names=("dp", "tp"))
        self.dp_mesh = self.mesh["dp"]

    def wrap(self, model: nn.Module) -> nn.Module:
        model = self.prepare(model)
        plan = plan_for(model)
        if plan.prepare is not None:
            plan.prepare(model)
        model = parallelize_module(model, self.mesh["tp"], plan.styles)
        # DTensor's embedding backward returns a replicated (full-size) gradient for the
        # row-sharded tables; keep only this rank's rows (a local slice, no communication), so
        # that gradients and optimizer state are split like the parameters.
        for table in plan.tables:
            model.get_parameter(table).register_post_accumulate_grad_hook(_shard_grad_like_param)
        return model

    def forward_backward(self, forward: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         loss_hook: LossHook) -> torch.Tensor:
        # The cross-entropy of vocabulary-sharded logits, and its backward, under loss_parallel.
        with loss_parallel():
            report = super().forward_backward(forward, x, y, loss_hook)
        return full_value(report)  # a replicated DTensor: its local value

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Over the dp dimension only: the ranks of one tensor-parallel group hold the same value."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.mesh.get_group("dp"))
        return tensor

    def describe(self) -> dict[str, Any]:
        return {"mesh": {"dp": self.dp_size, "tp": self.degree}, "sequence_parallel": True,
                "loss_parallel": True}


class FSDPTP(TP):
    """2-D: tensor parallelism inside each group of `tp.degree` ranks, FSDP2 across the groups."""

    wrapper_casts = True  # FSDP's MixedPrecisionPolicy
    sharded_grads = True

    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        super().__init__(cfg, ctx)
        # Gathering the full state of 2-D parameters takes two all-gathers per tensor, and DTensor
        # warns about it on every rank for every tensor; it is done once, at the end of the run.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    def wrap(self, model: nn.Module) -> nn.Module:
        model = super().wrap(model)
        return shard(model, self.mesh["dp"], self.cfg.strategy.fsdp, self.precision,
                     self.ctx.device)

    def no_sync(self, model: nn.Module) -> Any:
        return without_gradient_sync(model)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "fsdp": self.cfg.strategy.fsdp.model_dump()}
