"""Tensor parallelism for the GPT (`tp`), and FSDP2 x TP on a 2-D mesh (`fsdp_tp`).

The ranks form a mesh (dp, tp): `tp` uses one tensor-parallel group of every rank (dp = 1);
`fsdp_tp` shards each tensor-parallel shard again with FSDP2 over the dp dimension. The ranks of
one tensor-parallel group see the same samples; the batch is dealt over dp only.

The plan (Megatron-style, with sequence parallelism; DTensor's parallel styles), per block:
- ln_1, ln_2 (SequenceParallel): weights replicated; each rank normalises its 1/tp of the sequence
  (and dropout acts on those sequence shards only).
- attention: the input is all-gathered along the sequence; q, k, v are column-parallel (each rank
  computes n_head/tp heads); out_proj is row-parallel, its partial sums reduce-scattered back into
  sequence shards.
- MLP: the same: all-gather, fc column-parallel (4C/tp), proj row-parallel, reduce-scatter.
Embeddings: wte and wpe are row-parallel (each rank holds 1/tp of the rows), their partial sums
reduce-scattered into sequence shards. Output: ln_f sequence-parallel; lm_head column-parallel
(vocabulary-sharded logits, kept as a DTensor) and the cross-entropy computed under
`loss_parallel`, so the logits are never gathered.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from dtlab.config import Config, model_parallel_size
from dtlab.distributed import DistContext
from dtlab.strategies.base import LossHook, Strategy, full_value
from dtlab.strategies.fsdp import shard, without_gradient_sync


def gpt_plan() -> dict[str, Any]:
    """The parallel style of each GPT module (FQN patterns, as parallelize_module takes them)."""
    to_full_sequence = PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (T, C)
        "h.*.ln_1": SequenceParallel(),
        "h.*.attn": to_full_sequence,
        "h.*.attn.q_proj": ColwiseParallel(),
        "h.*.attn.k_proj": ColwiseParallel(),
        "h.*.attn.v_proj": ColwiseParallel(),
        "h.*.attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        "h.*.ln_2": SequenceParallel(),
        "h.*.mlp": to_full_sequence,
        "h.*.mlp.fc": ColwiseParallel(),
        "h.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),
    }


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
        model = parallelize_module(self.prepare(model), self.mesh["tp"], gpt_plan())
        # DTensor's embedding backward returns a replicated (full-size) gradient for the
        # row-sharded tables; keep only this rank's rows (a local slice, no communication), so
        # that gradients and optimizer state are split like the parameters.
        for table in (model.wte.weight, model.wpe.weight):
            table.register_post_accumulate_grad_hook(_shard_grad_like_param)
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
