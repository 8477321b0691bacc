"""Activation checkpointing: a block drops the activations of its forward and recomputes them in
its backward (torch.utils.checkpoint, non-reentrant), trading compute for memory.

`train.activation_checkpointing`: `full` checkpoints every block of `model.blocks()` (the units
the sharding strategies wrap), `selective` every k-th (`train.ac_every`, as torchtitan's
layer-selective option). It is applied before any strategy wraps the model: the blocks keep their
parameters and names (torch's checkpoint_wrapper would prefix them, which checkpoints and tensor
parallel plans would see), and a wrapper's hooks run around the checkpointed forward, so FSDP has
gathered a block's parameters again before its backward recomputes it. The recomputation runs
the same kernels on the same inputs (the RNG state restored for dropout): fp32 losses equal
those of the same run without checkpointing (tests/test_activation_checkpoint.py).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint


def chosen_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks to checkpoint: none, all, or every `every`-th (the last of each
    group of `every`, counting from the first block)."""
    if mode == "none":
        return []
    return [i for i in range(n_blocks) if mode == "full" or (i + 1) % every == 0]


def apply(model: nn.Module, mode: str, every: int = 2) -> list[int]:
    """Checkpoint the chosen blocks of `model` in place; returns their indices."""
    blocks = model.blocks()
    chosen = chosen_blocks(len(blocks), mode, every)
    for i in chosen:
        blocks[i].forward = partial(checkpoint, blocks[i].forward, use_reentrant=False)
    return chosen
