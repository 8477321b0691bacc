"""One training step, shared by every strategy.

Stepper: micro batches with gradient synchronisation on the last one only, the loss divided by
the accumulation steps, a check that the loss and the gradient are finite (error or skip), the
optimizer and schedule steps. What each of those does for a parallelism is the strategy's
`StepEngine` (dtlab/strategies/base.py): the default one runs the strategy's forward/backward,
no_sync, clipping and the torch optimizer (with fp16 loss scaling); pipeline schedules and
DeepSpeed bring their own.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from dtlab.config import Config
from dtlab.errors import RunError
from dtlab.strategies.base import StepEngine


class Stepper:
    def __init__(self, cfg: Config, engine: StepEngine, scheduler: Any, fault: Any = None) -> None:
        self.t, self.lab, self.engine, self.scheduler = cfg.train, cfg.lab, engine, scheduler
        self.fault, self.step_number, self.skipped = fault, 0, 0
        # Time in engine.micro_step and engine.step in the last step (the model's compute and
        # its collectives): the rest of a step is the loop's own cost (RunState.record_loop)
        self.engine_s = 0.0

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        engine, step = self.engine, self.step_number + 1
        self.step_number = step
        if not self.lab.no_zero_grad:
            engine.zero_grad()
        step_loss, engine_s = None, 0.0
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            t0 = time.perf_counter()
            loss = engine.micro_step(x, y, self.loss_hook,
                                     sync=last or self.lab.sync_every_micro_step)
            engine_s += time.perf_counter() - t0
            step_loss = loss if step_loss is None else step_loss + loss
            if not last:
                self.observe("micro", step)
        assert step_loss is not None, "a step needs at least one micro batch"
        self.observe("before_step", step)
        norm = engine.grad_norm(self.t.grad_clip)
        if norm is not None and not self.finite(norm, step_loss):
            engine.skip()  # nan_policy=skip
        else:
            t0 = time.perf_counter()
            engine.step()
            engine_s += time.perf_counter() - t0
        self.engine_s = engine_s
        self.observe("after_step", step)
        self.scheduler.step()
        return step_loss

    def observe(self, event: str, step: int) -> None:
        for probe in self.engine.probes:
            probe(event, step)

    def loss_hook(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro batch's mean loss -> (its share of the step's loss, what to backpropagate)."""
        if not self.lab.no_loss_division:
            loss = loss / self.t.grad_accum_steps
        if self.fault is not None:
            loss = self.fault.loss(self.step_number, loss)
        return loss, self.engine.scale(loss)

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
