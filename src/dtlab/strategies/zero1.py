"""ZeRO stage 1 with PyTorch's own parts: DDP + `ZeroRedundancyOptimizer`.

Every rank keeps the full parameters and, after DDP's all-reduce, the full gradients; the optimizer
state is split: each rank's local optimizer (dtlab's SGD/AdamW) updates only the parameters
assigned to it, then every rank broadcasts the parameters it updated. PyTorch assigns *whole
tensors* to ranks (largest first, each to the least-loaded rank), so the split is only as even as
the tensor sizes allow: summary.json reports each rank's real optimizer bytes, not 1/N.

Checkpoints: each rank saves the optimizer state of the parameters it owns under the parameters'
names, the same layout a DDP checkpoint has, so one loads into the other, and into zero1 at
another world size (each rank reads back what it owns under the new assignment).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from dtlab.levers.optim import optimizer_spec
from dtlab.strategies.base import StepEngine
from dtlab.strategies.ddp import DDP
from dtlab.strategies.state_bytes import state_bytes


class HookStepped(StepEngine):
    """overlap_with_ddp: each bucket's part of the optimizer step runs inside DDP's backward hook,
    as soon as the bucket is reduced; by the time the loop would step, the step is done."""

    def step(self) -> None:
        """Nothing left to apply (fp16 loss scaling is refused with overlap_with_ddp)."""


class Zero1(DDP):
    no_sync_is_local = False  # the step broadcasts the updated parameters

    def setup(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = self.wrap(model)
        o = self.cfg.strategy.zero1
        cls, kwargs = optimizer_spec(self.cfg.train, model.parameters())
        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=cls,
            parameters_as_bucket_view=o.parameters_as_bucket_view,
            overlap_with_ddp=o.overlap_with_ddp, **kwargs,
        )
        if o.overlap_with_ddp:  # NCCL only (config check): the local step runs in DDP's hook
            from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
                hook_with_zero_step,
            )
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
        return model, zero

    def step_engine(self, model: nn.Module, forward: nn.Module,
                    optimizer: torch.optim.Optimizer) -> StepEngine:
        if self.cfg.strategy.zero1.overlap_with_ddp:
            return HookStepped(self, model, forward, optimizer)
        return super().step_engine(model, forward, optimizer)

    def owned(self, model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, torch.Tensor]:
        """Name -> parameter, for the parameters this rank's local optimizer updates."""
        mine = {id(p) for group in zero.optim.param_groups for p in group["params"]}
        return {name: p for name, p in _named_parameters(model) if id(p) in mine}

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        # This rank's state lives in the local optimizer (overlap_with_ddp builds it only once
        # DDP's buckets are known, after the first steps).
        local = getattr(optimizer, "optim", None)
        return state_bytes(model, optimizer if local is None else local)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   full: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd, _ = super().state_dict(model, None, full)
        if optimizer is None:
            return model_sd, {}
        if full:
            raise NotImplementedError("zero1 gives the optimizer state as local shards only")
        self._init_state(optimizer)
        local = optimizer.optim
        owned = self.owned(model, optimizer)
        state = {name: dict(local.state[p]) for name, p in owned.items()}
        names = [name for name, _ in _named_parameters(model)]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                  for g in optimizer.param_groups]
        return model_sd, {"state": state, "param_groups": groups}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=False))
        local = optimizer.optim
        for name, p in self.owned(model, optimizer).items():
            local.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v
                              for k, v in optim_sd["state"][name].items()}
        for groups in (optimizer.param_groups, local.param_groups):
            for group, old in zip(groups, optim_sd["param_groups"], strict=True):
                group.update({k: v for k, v in old.items() if k != "params"})

    @staticmethod
    def _init_state(optimizer: ZeroRedundancyOptimizer) -> None:
        """Create the local optimizer's state before the first step (the shapes a resume fills):
        one step with zero gradients and lr 0, as torch's get_state_dict does for plain optimizers."""
        local = optimizer.optim
        params = [p for g in local.param_groups for p in g["params"]]
        if local.state or not params or any(p.grad is not None for p in params):
            return
        lrs = [g["lr"] for g in local.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in local.param_groups:
            g["lr"] = 0.0
        local.step()
        for g, lr in zip(local.param_groups, lrs, strict=True):
            g["lr"] = lr
        local.zero_grad(set_to_none=True)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.cfg.strategy.zero1.model_dump()}


def _named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameter names as in `single` (without DDP's `module.` prefix)."""
    return list(getattr(model, "module", model).named_parameters())
