"""The strategy interface: everything the training loop needs to know about a parallelism.

A strategy wraps the model, builds the optimizer over what the wrapped model holds (its shards),
controls gradient synchronisation for accumulation micro steps, clips gradients correctly for its
layout, picks the autocast/grad-scaler pair for the precision, and produces state dicts.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.optim import build_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """bf16/fp16 autocast on the device, nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class Strategy:
    name = "base"
    wrapper_casts = False  # the wrapper applies mixed precision itself (no autocast on top)
    sharded_grads = False  # gradients are shards: fp16 loss scaling needs ShardedGradScaler

    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.precision = cfg.train.precision

    # --- model and optimizer -------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        """Steps common to all strategies: SyncBatchNorm if asked, move to the device."""
        if self.cfg.strategy.sync_batchnorm:
            from dtlab.strategies.syncbn import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.ctx.device)
        return model.to(self.ctx.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # Built after wrapping, over the wrapped model's (possibly sharded) parameters.
        return build_optimizer(model.parameters(), self.cfg.train)

    # --- the step ------------------------------------------------------------------------
    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context for accumulation micro steps whose gradients must not be synchronised yet."""
        return nullcontext()

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext() if self.wrapper_casts else autocast(self.precision, self.ctx.device)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 needs loss scaling; bf16 and fp32 do not."""
        if self.precision != "fp16":
            return None
        if self.sharded_grads:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.ctx.device.type)
        return torch.amp.GradScaler(self.ctx.device.type)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm, without clipping. Replicated gradients: a local computation."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    # --- state ---------------------------------------------------------------------------
    def state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, full: bool = True
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state with the wrapper's prefixes removed.

        full=True gathers unsharded tensors (every rank takes part; on CPU nothing is offloaded
        because FSDP1's offload path pins memory); full=False returns the local shards.
        """
        options = StateDictOptions(full_state_dict=full, cpu_offload=False)
        if optimizer is None:
            return get_model_state_dict(model, options=options), {}
        return get_state_dict(model, optimizer, options=options)

    def describe(self) -> dict[str, Any]:
        """The options that define this strategy's behaviour, for summary.json."""
        return {}
