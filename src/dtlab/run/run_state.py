"""What a training run is made of (`Training`) and what happened in it (`RunState`).

train() builds the first and fills the second step by step; summary.py turns both into
summary.json, every field in one place.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab.data import DataSpec, SampleUsage
from dtlab.instruments.machine_load import LoadProbe
from dtlab.run.dir_watch import DirectoryWatch
from dtlab.run.step import Stepper
from dtlab.strategies.base import StepEngine, Strategy


@dataclass
class Training:
    strategy: Strategy
    model: nn.Module  # the wrapped model (its state)
    forward: nn.Module  # what the loop calls: the model, or its compiled form
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: StepEngine
    stepper: Stepper
    spec: DataSpec
    n_params: int
    micro_batch: int


@dataclass
class RunState:
    total_steps: int
    steps_per_epoch: int
    start: int = 0  # the step the run began at (> 0 when resumed)
    resumed_from: Path | None = None
    lost_steps: int = 0  # steps done after that checkpoint by the run that stopped: run again
    step: int = 0
    epoch: int = 0
    last_loss: float = math.nan  # the loss at the last logged step
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    # Per step: boundary to boundary without evaluations and saves, and the part of it spent in
    # the engine's micro steps and optimizer step (the rest is the loop's own cost)
    loop_times: list[float] = field(default_factory=list)
    engine_times: list[float] = field(default_factory=list)
    epoch_times: list[float] = field(default_factory=list)  # training time of each full epoch
    evals: dict[str, Any] = field(default_factory=dict)  # the latest evaluation
    usage: SampleUsage | None = None
    started: float = field(default_factory=time.perf_counter)
    load: LoadProbe = field(default_factory=LoadProbe.with_cpu_peak)  # the machine when it began
    peaks: dict[str, int] = field(default_factory=dict)  # the set-up's and warm-up's peak memory
    run_id: str = ""  # which run this is: new when it starts over, kept when it resumes (run/owner.py)
    watch: DirectoryWatch | None = None  # the run directory, to stop when it disappears

    def begin_step(self, epoch: int) -> int:
        self.step, self.epoch = self.step + 1, epoch
        return self.step

    def record_step(self, step_time: float, data_time: float) -> None:
        self.step_times.append(step_time)
        self.data_times.append(data_time)
        if self.end_of_epoch and len(self.step_times) >= self.steps_per_epoch:
            self.epoch_times.append(sum(self.step_times[-self.steps_per_epoch:]))

    def record_loop(self, loop_time: float, engine_time: float) -> None:
        self.loop_times.append(loop_time)
        self.engine_times.append(engine_time)

    @property
    def end_of_epoch(self) -> bool:
        return self.step % self.steps_per_epoch == 0

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def epoch_time(self, median_step_time: float | None) -> tuple[float, bool]:
        """The median epoch's training time, measured when one completed, else the median step
        time x steps per epoch; and whether it was measured."""
        if self.epoch_times:
            return statistics.median(self.epoch_times), True
        return (median_step_time or 0) * self.steps_per_epoch, False

    @property
    def wall_time(self) -> float:
        return time.perf_counter() - self.started
