"""Injected faults (`run.fault`), to test that dtlab loses nothing but the steps since the last
checkpoint and never hangs. A fault fires once: on one rank, in the launcher's first attempt
(torch elastic's restarts run clean), at the first opportunity from `step` on."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from dtlab.config import ConfigError, FaultConfig


def check_fault(cfg: FaultConfig, world_size: int, total_steps: int) -> None:
    """A fault that can never fire makes a recovery test pass for the wrong reason: refuse it."""
    if cfg.kind == "none":
        return
    if cfg.rank >= world_size:
        raise ConfigError(f"run.fault.rank={cfg.rank}, but the run has {world_size} rank(s), 0 to "
                          f"{world_size - 1}; fix: run.fault.rank={world_size - 1} or lower")
    if cfg.step > total_steps:
        raise ConfigError(f"run.fault.step={cfg.step}, but the run ends at step {total_steps}; "
                          f"fix: run.fault.step={total_steps} or lower, or more train.max_steps")


class Fault:
    def __init__(self, cfg: FaultConfig, rank: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kind = cfg.kind if (cfg.kind != "none" and rank == cfg.rank and first_attempt) else "none"
        self.step = cfg.step

    def before_step(self, step: int) -> None:
        if self.kind == "none" or step < self.step:
            return
        if self.kind == "kill":  # kill -9: no cleanup, no message, like an OOM kill
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "exit":  # the process ends abruptly (no cleanup)
            print(f"dtlab: injected fault: exiting at step {step}", file=sys.stderr, flush=True)
            os._exit(17)
        if self.kind == "hang":  # stops taking part in collectives, stays alive
            print(f"dtlab: injected fault: hanging at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

        if self.kind == "oom":  # what the allocator raises when a step does not fit
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB "
                                         f"(injected by run.fault.kind=oom at step {step})")

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.kind == "nan" and step == self.step:
            return loss * float("nan")
        return loss

    def during_save(self, step: int) -> None:
        if self.kind == "kill_in_save" and step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)
