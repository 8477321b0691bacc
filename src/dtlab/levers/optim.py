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


# How the update runs over the parameters: one kernel per parameter and operation (for_loop),
# one per operation over all of them (foreach), or one for the whole update (fused). The same
# arithmetic: foreach equals for_loop to the bit here; fused AdamW's losses differ by ~1e-7
# relative (tests/test_optimizer_impl.py). docs/benchmarks.md has what each costs.
IMPL_KWARGS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def fused_devices() -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


FUSED_OPS = {"sgd": "_fused_sgd_", "adamw": "_fused_adamw_"}


def dtensor_has_fused(optimizer: str) -> bool:
    """Whether DTensor parameters (FSDP2, TP) can take the fused kernel: DTensor must know how
    to shard the fused op (torch 2.13: AdamW's yes, SGD's not)."""
    try:
        from torch.distributed.tensor import DTensor

        op = getattr(torch.ops.aten, FUSED_OPS[optimizer]).default
        prop = DTensor._op_dispatcher.sharding_propagator
        return any(op in getattr(prop, table, {}) for table in
                   ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs"))
    except (ImportError, AttributeError):
        return False


def resolve_impl(impl: str, optimizer: str, params: list[torch.Tensor]) -> str:
    """`train.optimizer_impl` for these parameters: auto = fused where their device has fused
    kernels for this optimizer and their type can take them (floating point; DTensors only where
    DTensor shards the fused op), else foreach."""
    from torch.distributed.tensor import DTensor

    why = ""
    if not params or any(p.device.type not in fused_devices() or not p.is_floating_point()
                         for p in params):
        kinds = sorted({f"{p.device.type} {str(p.dtype).removeprefix('torch.')}" for p in params})
        why = (f"floating-point parameters on a device with fused kernels "
               f"({', '.join(fused_devices())}), these are {', '.join(kinds)}")
    elif any(isinstance(p, DTensor) for p in params) and not dtensor_has_fused(optimizer):
        why = f"a fused {optimizer} for DTensor parameters (FSDP2, TP), which this torch lacks"
    if impl == "auto":
        return "foreach" if why else "fused"
    if impl == "fused" and why:
        from dtlab.errors import ConfigError

        raise ConfigError(f"train.optimizer_impl=fused needs {why}; fix: set "
                          "train.optimizer_impl=auto or foreach")
    return impl


def optimizer_spec(cfg: TrainConfig, params: Iterable[torch.Tensor]
                   ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its keyword arguments for these parameters (wrappers such as ZeRO
    build it themselves)."""
    lr = peak_lr(cfg)
    impl = IMPL_KWARGS[resolve_impl(cfg.optimizer_impl, cfg.optimizer, list(params))]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov,
                                 "weight_decay": cfg.weight_decay, **impl}
    return torch.optim.AdamW, {"lr": lr, "betas": cfg.betas, "weight_decay": cfg.weight_decay,
                               **impl}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]  # LoRA: the adapters only
    cls, kwargs = optimizer_spec(cfg, params)
    optimizer = cls(params, **kwargs)
    impl = {k: optimizer.defaults[k] for k in ("fused", "foreach")}

    def keep_impl(opt: torch.optim.Optimizer) -> None:
        # A checkpoint's param groups carry the implementation of the run that saved it (a fused
        # SGD from a pipeline run would fail on tensor-parallel DTensors): keep this run's.
        for group in opt.param_groups:
            group.update(impl)

    optimizer.register_load_state_dict_post_hook(keep_impl)
    return optimizer


def impl_of(optimizer: torch.optim.Optimizer) -> str:
    """The implementation an optimizer runs (a wrapper's inner optimizer: ZeRO's `optim`)."""
    defaults = (getattr(optimizer, "optim", None) or optimizer).defaults
    return "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for_loop"


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
