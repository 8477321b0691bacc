"""One training step, shared by every strategy.

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
from dtlab.errors import RunError
from dtlab.strategies import Strategy


class Stepper:
    """`sync=False` keeps every micro batch local (the compute-only step of DDP)."""

    def __init__(self, cfg: Config, strategy: Strategy, model: nn.Module, forward: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, device: torch.device,
                 fault: Any = None) -> None:
        self.t, self.strategy, self.model, self.forward = cfg.train, strategy, model, forward
        self.lab = cfg.lab
        self.optimizer, self.scheduler, self.device = optimizer, scheduler, device
        self.scaler = strategy.grad_scaler()
        self.fault, self.step_number, self.skipped = fault, 0, 0

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], sync: bool = True) -> torch.Tensor:
        t, strategy, scaler = self.t, self.strategy, self.scaler
        self.step_number += 1
        if not self.lab.no_zero_grad:
            strategy.zero_grad(self.optimizer)
        step_loss = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            local = not sync or (i < len(batches) - 1 and not self.lab.sync_every_micro_step)
            with strategy.no_sync(self.model) if local else contextlib.nullcontext():
                step_loss += strategy.forward_backward(self.forward, x, y, self.loss_hook)
        if scaler:  # fp16: the scaler skips steps with inf/NaN gradients by itself
            if t.grad_clip:
                scaler.unscale_(self.optimizer)
                strategy.clip_grad_norm_(self.model, t.grad_clip)
            scaler.step(self.optimizer)
            scaler.update()
        elif sync and not self.finite(self.grad_norm(), step_loss):
            strategy.skip_step(self.optimizer)  # nan_policy=skip
        else:
            strategy.optimizer_step(self.optimizer)
        self.scheduler.step()
        return step_loss

    def loss_hook(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro batch's mean loss -> (its share of the step's loss, what to backpropagate)."""
        if not self.lab.no_loss_division:
            loss = loss / self.t.grad_accum_steps
        if self.fault is not None:
            loss = self.fault.loss(self.step_number, loss)
        return loss, (self.scaler.scale(loss) if self.scaler else loss)

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
