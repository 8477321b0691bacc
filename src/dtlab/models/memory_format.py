"""`model.channels_last` for the convolutional models: weights and inputs in NHWC order.

On a GPU, cuDNN's bf16/fp16 tensor-core convolutions work in NHWC: an NCHW model pays layout
transposes around its convolutions (measured on an H100 for issue 15: a hand-written CIFAR
ResNet-18 loop ran 51.2k samples/s in channels_last, 23.4k without; dtlab, NCHW, 22.1k).
`auto` turns it on for CUDA. The input is converted by a forward
pre-hook on the model, so every strategy's wrapper passes NHWC batches without knowing; a
sharding strategy that re-lays out parameters (FSDP1's flat parameters) gathers them in NCHW,
FSDP2 takes them only in NCHW, and each convolution then follows its input's format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def wanted(cfg: Any, device: torch.device) -> bool:
    """channels_last for this model config on this device (`auto`: on CUDA)."""
    choice = getattr(cfg, "channels_last", False)
    return device.type == "cuda" if choice == "auto" else bool(choice)


def _to_nhwc(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x, *rest = args
    return (x.contiguous(memory_format=torch.channels_last), *rest) if x.dim() == 4 else args


def apply(model: nn.Module, cfg: Any, device: torch.device, weights: bool = True) -> bool:
    """Put the model in channels_last (before any wrapper) when `wanted`; returns whether.
    weights=False (FSDP2's fully_shard takes contiguous parameters only): the inputs alone, and
    each convolution runs in NHWC, the layout of its input."""
    if not wanted(cfg, device):
        return False
    if weights:
        model.to(memory_format=torch.channels_last)
    model.register_forward_pre_hook(_to_nhwc)
    return True
