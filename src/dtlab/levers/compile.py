"""torch.compile, per `train.compile`: `model` compiles the wrapped model as one callable;
`blocks` compiles each block of `model.blocks()` before any strategy wraps it, the way torchtitan
compiles transformer blocks before `fully_shard`.

Per block, a wrapper's hooks (FSDP's all-gather before a block and reduce-scatter after it, DDP's
bucketed all-reduce) stay outside the compiled graphs instead of being traced or breaking them,
and identical blocks share one graph: dynamo compiles the block's code once and feeds each block
its own parameters (measured: 1 graph for a 4-block GPT; the whole model costs a graph per
distinct piece). Only `forward` is replaced, so parameter names, checkpoints and tensor-parallel
plans see the same module tree as an eager run. Activation checkpointing is applied first: the
compiled forward then contains the checkpointed region, as in torchtitan.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def use_cache() -> None:
    """A persistent inductor cache: the first compile of a model costs tens of seconds on a CPU,
    later runs reuse it."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache/dtlab/inductor"))


def compile_blocks(model: nn.Module, mode: str, backend: str = "inductor") -> int:
    """For mode `blocks`, compile each block's forward in place (before wrapping); returns the
    number of blocks compiled."""
    if mode != "blocks":
        return 0
    use_cache()
    blocks = model.blocks()
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


def compiled_forward(model: nn.Module, mode: str, backend: str = "inductor") -> nn.Module:
    """What the step calls: for mode `model`, the wrapped model compiled as a whole."""
    if mode != "model":
        return model
    use_cache()
    return torch.compile(model, backend=backend)
