"""The training step in-process, against a tiny fake strategy (no process group).

Accumulation gives the full batch's gradient, gradients stay local (no_sync) on every micro batch
but the last, the loss is divided by the accumulation steps, clipping bounds the update, and a
non-finite gradient stops the run (or is skipped) without touching the parameters.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.config import load_config
from dtlab.distributed import DistContext, DistEnv
from dtlab.errors import RunError
from dtlab.levers.optim import build_scheduler
from dtlab.models import loss_fn
from dtlab.run.faults import Fault
from dtlab.run.step import Stepper
from dtlab.strategies.base import Strategy

LR = 0.5


class Recorder(Strategy):
    """One process, no wrapper; records which micro batches ran under no_sync."""

    name = "recorder"

    def __init__(self, *overrides: str) -> None:
        cfg = load_config(None, [f"train.lr={LR}", "train.momentum=0", "train.schedule=constant",
                                 *overrides])
        ctx = DistContext(DistEnv(), torch.device("cpu"), None, 1)
        super().__init__(cfg, ctx)
        self.local: list[bool] = []
        self._in_no_sync = False

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    @contextmanager
    def _no_sync(self) -> Any:
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def no_sync(self, model: nn.Module) -> Any:
        return self._no_sync()

    def forward_backward(self, forward: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         loss_hook: Any) -> torch.Tensor:
        self.local.append(self._in_no_sync)
        return super().forward_backward(forward, x, y, loss_hook)


def make(*overrides: str, fault: Fault | None = None) -> tuple[Recorder, nn.Module, Stepper]:
    strategy = Recorder(*overrides)
    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(4, 3))
    engine = strategy.step_engine(model, model, optimizer)
    scheduler = build_scheduler(optimizer, strategy.cfg.train, 10)
    return strategy, model, Stepper(strategy.cfg, engine, scheduler, fault)


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def split(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(x.chunk(k), y.chunk(k), strict=True))


def full_batch_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Parameters after one plain SGD step on the whole batch (the reference)."""
    ref = nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    loss_fn(ref(x), y).backward()
    return [(p - LR * p.grad).detach() for p in ref.parameters()]


def test_accumulation_gives_the_full_batch_gradient() -> None:
    strategy, model, step = make("train.grad_accum_steps=4")
    x, y = data(16)
    expected = full_batch_update(model, x, y)
    step(split(x, y, 4))
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    # gradients stay local on the first three micro batches, synchronised on the last
    assert strategy.local == [True, True, True, False]


def test_the_step_loss_is_the_mean_of_the_micro_batches() -> None:
    _, model, step = make("train.grad_accum_steps=4")
    x, y = data(16)
    with torch.no_grad():
        micro = [loss_fn(model(a), b).item() for a, b in split(x, y, 4)]
    assert step(split(x, y, 4)).item() == pytest.approx(sum(micro) / 4, rel=1e-6)


def test_without_loss_division_the_gradient_is_k_times_larger() -> None:
    _, model, step = make("train.grad_accum_steps=4", "lab.no_loss_division=true")
    x, y = data(16)
    before = [p.detach().clone() for p in model.parameters()]
    expected = full_batch_update(model, x, y)
    step(split(x, y, 4))
    for p, b, e in zip(model.parameters(), before, expected, strict=True):
        torch.testing.assert_close(p.detach() - b, 4 * (e - b), rtol=1e-5, atol=1e-6)


def test_sync_every_micro_step_never_enters_no_sync() -> None:
    strategy, _, step = make("train.grad_accum_steps=3", "lab.sync_every_micro_step=true")
    x, y = data(12)
    step(split(x, y, 3))
    assert strategy.local == [False, False, False]


def test_clipping_bounds_the_update_by_lr_times_the_limit() -> None:
    clip = 0.01
    _, model, step = make(f"train.grad_clip={clip}")
    x, y = data(8)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    step([(x, y)])
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    # the unclipped gradient norm is far above the limit, so the step is lr x the limit long
    assert (after - before).norm().item() == pytest.approx(LR * clip, rel=1e-4)


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_non_finite_gradient_is_never_applied(policy: str) -> None:
    cfg = load_config(None, ["run.fault.kind=nan", "run.fault.step=2"])
    _, model, step = make(f"train.nan_policy={policy}", fault=Fault(cfg.run.fault, 0))
    x, y = data(8)
    step([(x, y)])  # step 1: finite
    before = [p.detach().clone() for p in model.parameters()]
    if policy == "error":
        with pytest.raises(RunError, match="non-finite gradient .* at step 2"):
            step([(x, y)])
    else:
        step([(x, y)])
        assert step.skipped == 1
        assert all(p.grad is None for p in model.parameters())  # the bad gradients are dropped
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def test_probes_observe_the_step_in_order() -> None:
    _, _, step = make("train.grad_accum_steps=3")
    seen: list[tuple[str, int]] = []
    step.engine.probes.append(lambda event, n: seen.append((event, n)))
    x, y = data(12)
    step(split(x, y, 3))
    assert seen == [("micro", 1), ("micro", 1), ("before_step", 1), ("after_step", 1)]
