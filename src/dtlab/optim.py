"""Optimizer and learning-rate schedule, shared by every strategy."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from dtlab.config import TrainConfig


def peak_lr(cfg: TrainConfig) -> float:
    """`train.lr`, scaled linearly by global batch / `lr_scale_base_batch` when that is set."""
    if cfg.lr_scale_base_batch:
        return cfg.lr * cfg.global_batch_size / cfg.lr_scale_base_batch
    return cfg.lr


def optimizer_spec(cfg: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its hyper-parameters (wrappers such as ZeRO build it themselves)."""
    lr = peak_lr(cfg)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov,
                                 "weight_decay": cfg.weight_decay}
    return torch.optim.AdamW, {"lr": lr, "betas": cfg.betas, "weight_decay": cfg.weight_decay}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_spec(cfg)
    return cls(params, **kwargs)


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> LambdaLR:
    """Linear warmup over `warmup_steps`, then constant or cosine decay to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(opt, factor)
