"""LoRA fine-tuning (`train.lora`, through PEFT: the `lora` extra): low-rank adapters on the
named linear layers; every other parameter is frozen.

The adapters are injected into the model in place (peft.inject_adapter_in_model) before any
strategy wraps it, so the blocks stay the sharding, checkpointing and compiling units, and the
strategies see an ordinary module whose frozen parameters need no gradient, no gradient
reduction and no optimizer state: the state bytes of a run show the adapters alone. An adapted
layer's weight is renamed `<layer>.base_layer.weight` beside `<layer>.lora_A.default.weight` and
`lora_B`; checkpoints hold both, so a run resumes as any other. `plain` (a `Merged` view) folds
the adapters into the weights (W + alpha / rank * B @ A) for export, under the plain model's names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dtlab.errors import ConfigError


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("train.lora needs the peft package; fix: pip install 'dtlab[lora]'"
                          ) from None
    return peft


def apply(model: nn.Module, cfg: Any) -> nn.Module:
    """Inject `cfg`'s adapters (a LoraConfig section; rank 0 = off) into `model`, in place."""
    if not cfg.rank:
        return model
    peft = require_peft()
    widths = [min(m.weight.shape) for n, m in model.named_modules()
              if n.rsplit(".", 1)[-1] in cfg.targets and getattr(m, "weight", None) is not None
              and m.weight.dim() == 2]
    if widths and cfg.rank > min(widths):  # a rank past the layer's width adds nothing, and
        # the adapters (rank x width each) alone can outgrow the memory
        raise ConfigError(f"train.lora.rank={cfg.rank} is more than the narrowest targeted layer "
                          f"({min(widths)} wide); fix: a rank well below it, e.g. "
                          f"train.lora.rank={min(8, min(widths))}")
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.targets),
                             lora_dropout=cfg.dropout, bias="none")
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as e:
        layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ConfigError(f"train.lora.targets={list(cfg.targets)} names no linear layer of this "
                          f"model ({str(e).splitlines()[0][:80]}); fix: choose among "
                          f"{', '.join(layers)}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


class Merged(Mapping[str, torch.Tensor]):
    """A LoRA model's tensors (`named`, in model order) with each adapter folded into its base
    weight, under the plain model's names; read on demand, as `named` is."""

    def __init__(self, named: Mapping[str, torch.Tensor], scale: float) -> None:
        self.named, self.scale = named, scale
        self.source = {k.replace(".base_layer.", "."): k for k in named if ".lora_" not in k}

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self.source[name]
        tensor = self.named[key]
        layer, _, leaf = key.partition(".base_layer.")
        a = f"{layer}.lora_A.default.weight"
        if leaf == "weight" and a in self.named:
            delta = self.named[f"{layer}.lora_B.default.weight"].float() @ self.named[a].float()
            # GPT-2's Conv1D stores its weight [in, out]; the adapters' product is [out, in]
            delta = delta if delta.shape == tensor.shape else delta.T
            tensor = (tensor.float() + self.scale * delta).to(tensor.dtype)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


def plain(named: Mapping[str, torch.Tensor], cfg: Any) -> Mapping[str, torch.Tensor]:
    """`named` as the model without adapters: merged when train.lora (`cfg`) is on."""
    return Merged(named, cfg.alpha / cfg.rank) if cfg.rank else named
