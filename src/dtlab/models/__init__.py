"""Model zoo. Every model has `blocks()`: the modules that FSDP wraps (shards) one by one.

Under the strategies: may import data, levers (LoRA), config and the ground; never strategies,
instruments, the run or anything above."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dtlab.config import Config, ModelConfig
from dtlab.data import DataSpec, spec_for
from dtlab.errors import ConfigError
from dtlab.files import meminfo
from dtlab.levers import lora as adapters
from dtlab.models.cnn import SimpleCNN
from dtlab.models.gpt import GPT
from dtlab.models.resnet import ResNet

__all__ = [
    "GPT", "ResNet", "SimpleCNN", "build_model", "check_model", "check_model_size", "count_params",
    "has_batchnorm", "loss_fn",
]


def build_model(cfg: ModelConfig, spec: DataSpec, lora: Any = None) -> nn.Module:
    """The model of `cfg` for data `spec`, with `lora`'s adapters (train.lora) when on."""
    model = _build(cfg, spec)
    return model if lora is None else adapters.apply(model, lora)  # rank 0: unchanged


def _build(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    if cfg.name == "cnn":
        return SimpleCNN(
            spec.in_channels, spec.image_size, spec.num_classes, cfg.channels, cfg.hidden,
            cfg.batch_norm, cfg.activation, cfg.pool,
        )
    if cfg.name == "resnet":
        return ResNet(cfg.depth, cfg.width, spec.in_channels, spec.num_classes)
    if cfg.name == "hf":
        from dtlab.models import hf  # transformers only where it is used

        return hf.build(cfg)
    return GPT(
        cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.dropout, cfg.bias,
        cfg.tie_weights,
    )


def check_model(cfg: ModelConfig) -> None:
    """Before any rank starts: what can be checked of the model without building it (a Hugging
    Face model's config loads and fits the sequence)."""
    if cfg.name == "hf":
        from dtlab.models import hf

        hf.check(cfg)


def check_model_size(cfg: Config) -> None:
    """Before any rank starts: dtlab's own model of `cfg` can be built (on the meta device, which
    allocates nothing) and its fp32 parameters fit in this machine's memory, as each rank builds
    the whole model before a strategy shards it. (A Hugging Face model: hf.check.)"""
    if cfg.model.name == "hf":
        return
    try:
        with torch.device("meta"), _NoInit():
            n = count_params(_build(cfg.model, spec_for(cfg)))
    except (RuntimeError, ValueError, OverflowError) as e:
        raise ConfigError(f"model.name={cfg.model.name} cannot be built with these sizes "
                          f"({str(e).splitlines()[0][:200]}); fix: smaller model.* sizes") from None
    memory = meminfo().get("MemTotal")
    if memory and 4 * n > memory:
        raise ConfigError(f"model.name={cfg.model.name} has {n:,} parameters, {4 * n / 1e9:,.1f} GB "
                          f"in fp32, more than this machine's {memory / 1e9:.1f} GB of memory; "
                          "fix: smaller model.* sizes")


class _NoInit(TorchFunctionMode):
    """Parameters left uninitialised: on the meta device there is nothing to fill, and torch's
    meta kernels for the random fills import torch._dynamo (about 2 s of CPU in a launcher that
    would never use it)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init" or \
                getattr(func, "__name__", "") in _FILLS:
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


_FILLS = {"normal_", "uniform_", "trunc_normal_", "zero_", "fill_", "bernoulli_", "exponential_"}


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy for class labels (B,) and for next tokens (B, T) alike, computed in fp32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction
    )
