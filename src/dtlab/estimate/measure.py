"""Measuring activation memory, to check the estimates against (tests, benchmarks/).

Two measurements of one forward + backward of a real dtlab model in this process:

- `saved_bytes`: the distinct storages autograd keeps for backward (saved_tensors_hooks), without
  the parameters, buffers and the data batch: exactly what activations.py's `saved` counts.
- `peak_growth`: how much the process's resident memory grew at its peak during the step (CPU:
  Linux's VmHWM after resetting it through /proc/self/clear_refs; CUDA: max_memory_allocated).
  Gradients are allocated (zeroed) beforehand, so their bytes are not counted. On CPU run it with
  MALLOC_MMAP_THRESHOLD_ set (benchmarks/activation_memory.py sets 65536): glibc then maps every
  large block fresh and unmaps it when freed, so resident memory follows the live tensors;
  otherwise freed memory stays resident and a repeated step shows no growth at all.
"""

from __future__ import annotations

import contextlib
import gc
import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlab.models import loss_fn


def batch(model_kind: str, spec: object, micro: int, device: torch.device | str = "cpu",
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model_kind == "gpt":
        x = torch.randint(0, spec.vocab_size, (micro, spec.seq_len), generator=g)  # type: ignore[attr-defined]
        y = torch.randint(0, spec.vocab_size, (micro, spec.seq_len), generator=g)  # type: ignore[attr-defined]
    else:
        c, s = spec.in_channels, spec.image_size  # type: ignore[attr-defined]
        x = torch.randn(micro, c, s, s, generator=g)
        y = torch.randint(0, spec.num_classes, (micro,), generator=g)  # type: ignore[attr-defined]
    return x.to(device), y.to(device)


def precision_context(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    if mode == "autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def checkpoint_blocks(model: nn.Module) -> None:
    """Per-block activation checkpointing (non-reentrant), on the model's sharding units."""
    for block in model.blocks():
        forward = block.forward
        block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(forward)


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> int:
    """Bytes autograd keeps for backward after one forward (distinct storages, new memory only)."""
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    skip = {key(t) for t in (*model.parameters(), *model.buffers(), x, y)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if key(t) not in skip:
            kept[key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            precision_context(mode, x.device):
        loss = loss_fn(model(x), y)
    del loss
    return sum(kept.values())


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) * 1024  # type: ignore[union-attr]


def peak_growth(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str,
                repeats: int = 3) -> list[int]:
    """Peak memory growth (bytes) of forward + backward, `repeats` times after two warm-ups."""
    dev = x.device

    def step() -> None:
        with precision_context(mode, dev):
            loss = loss_fn(model(x), y)
        loss.backward()

    for _ in range(2):  # allocates the gradients, initialises kernels and their workspaces
        step()
    out = []
    for _ in range(repeats):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            torch.cuda.synchronize(dev)
            out.append(torch.cuda.max_memory_allocated(dev) - base)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            base = _status("VmRSS")
            step()
            out.append(_status("VmHWM") - base)
    return out
