"""One training step and one evaluation pass, shared by every strategy.

Stepper: micro batches with gradient synchronisation on the last one only, the loss divided by
the accumulation steps, loss scaling for fp16, clipping over all shards, a check that the loss and
the gradient are finite (error or skip), the optimizer and schedule steps.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from dtlab.config import Config
from dtlab.data import EvalLoader
from dtlab.distributed import DistContext
from dtlab.errors import RunError
from dtlab.models import loss_fn
from dtlab.strategies import Strategy


class Stepper:
    """`sync=False` keeps every micro batch local (the compute-only step of DDP)."""

    def __init__(self, cfg: Config, strategy: Strategy, model: nn.Module, forward: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, device: torch.device,
                 fault: Any = None) -> None:
        self.t, self.strategy, self.model, self.forward = cfg.train, strategy, model, forward
        self.optimizer, self.scheduler, self.device = optimizer, scheduler, device
        self.scaler = strategy.grad_scaler()
        self.fault, self.step_number, self.skipped = fault, 0, 0

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], sync: bool = True) -> torch.Tensor:
        t, strategy, scaler = self.t, self.strategy, self.scaler
        self.step_number += 1
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            local = not sync or i < len(batches) - 1
            with strategy.no_sync(self.model) if local else contextlib.nullcontext():
                with strategy.autocast():
                    loss = loss_fn(self.forward(x), y) / t.grad_accum_steps
                if self.fault is not None:
                    loss = self.fault.loss(self.step_number, loss)
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if scaler:  # fp16: the scaler skips steps with inf/NaN gradients by itself
            if t.grad_clip:
                scaler.unscale_(self.optimizer)
                strategy.clip_grad_norm_(self.model, t.grad_clip)
            scaler.step(self.optimizer)
            scaler.update()
        elif sync and not self.finite(self.grad_norm(), step_loss):
            self.optimizer.zero_grad(set_to_none=True)  # skip this step (nan_policy=skip)
        else:
            self.optimizer.step()
        self.scheduler.step()
        return step_loss

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (clipping, when on, computes it anyway). The same on every
        rank: DDP's gradients are identical after the all-reduce; FSDP reduces over shards."""
        if self.t.grad_clip:
            return self.strategy.clip_grad_norm_(self.model, self.t.grad_clip)
        return self.strategy.grad_norm(self.model)

    def finite(self, norm: torch.Tensor, step_loss: torch.Tensor) -> bool:
        value = float(norm)
        if math.isfinite(value):
            return True
        if self.t.nan_policy == "skip":
            self.skipped += 1
            return False
        raise RunError(
            f"non-finite gradient (norm {value}) at step {self.step_number}, this rank's loss "
            f"{float(step_loss):.6g}; the run stopped before applying it, so the last checkpoint "
            "is still good; fix: lower train.lr, use train.grad_clip, or train.nan_policy=skip")


@torch.no_grad()
def evaluate(model: nn.Module, loader: EvalLoader, strategy: Strategy, ctx: DistContext) -> dict:
    """Validation loss and accuracy over every sample once, reduced across ranks as sums."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    for x, y, mask in loader:
        with strategy.autocast():
            logits = model(x)
        weight = mask.view(-1, *[1] * (y.dim() - 1)).expand_as(y).double()
        per_item = loss_fn(logits, y, reduction="none").view(y.shape)
        totals += torch.stack([
            (per_item.double() * weight).sum(),
            ((logits.argmax(-1) == y).double() * weight).sum(),
            weight.sum(),
        ])
    ctx.all_reduce_sum(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count)}
