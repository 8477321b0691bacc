"""ZeRO-Infinity's swap files and swap buffers, modelled for `dtlab estimate` (deepspeed 0.19.8:
runtime/swap_tensor/, the names are theirs). tests/test_nvme_offload.py checks the disk bytes
against the swap files of real runs, to the byte.

- Parameters (offload_param.device=nvme): each partition of a tensor ZeRO 3 partitions (not a
  persistent one) is a file of its elements in the working dtype, when it is 1 MiB or more
  (MIN_AIO_BYTES, or aio.block_size if larger); smaller ones stay in host memory. Host memory
  also holds buffer_count swap buffers of buffer_size elements.
- Optimizer (offload_optimizer.device=nvme): per sub group, the fp32 master partition and each
  optimizer state tensor (AdamW: exp_avg, exp_avg_sq; SGD with momentum: its buffer) are one file
  each, and the fp32 gradient of each tensor's partition another, under the same 1 MiB rule. Host
  memory holds buffer_count buffers of the largest sub group, in fp32.
File sizes are rounded up to whole 1 KiB blocks (AIO_ALIGNED_BYTES x intra_op_parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_AIO_BYTES = 1024**2
ALIGNED_BYTES = 1024
FP32 = 4


@dataclass(frozen=True)
class SwapOptions:
    """The nvme settings the files depend on (DeepSpeed's defaults, dtlab's for the buffers)."""

    params: bool = False
    optimizer: bool = False
    param_buffer_count: int = 16
    param_buffer_size: int = 2_000_000
    optimizer_buffer_count: int = 4
    block_size: int = MIN_AIO_BYTES
    intra_op_parallelism: int = 1


def aligned(numel: int, elem: int, o: SwapOptions) -> int:
    """Bytes of a swap file (or buffer) of `numel` elements."""
    step = ALIGNED_BYTES * o.intra_op_parallelism // elem
    return math.ceil(numel / step) * step * elem


def swapped(numel: int, elem: int, o: SwapOptions) -> bool:
    return numel * elem >= max(MIN_AIO_BYTES, o.block_size)


def swap_bytes(parts: list[int], keep: list[bool], groups: list[list[int]], elem: int,
               states: int, o: SwapOptions) -> dict[str, int]:
    """One rank's bytes: `disk` (its swap files), `moved` (what CPU offload would keep in host
    memory and NVMe offload writes to disk instead) and `buffers` (host swap buffers).
    parts: each tensor's partition; keep: persistent (not partitioned, never swapped); groups:
    the tensors' indices in each optimizer sub group; states: fp32 state tensors per element."""
    disk = moved = buffers = 0
    if o.params:
        for p, k in zip(parts, keep, strict=True):
            if not k and swapped(p, elem, o):
                disk, moved = disk + aligned(p, elem, o), moved + p * elem
        buffers += o.param_buffer_count * aligned(o.param_buffer_size, elem, o)
    if o.optimizer:
        for group in groups:
            numel = sum(parts[i] for i in group)
            if swapped(numel, FP32, o):  # master weights and each state tensor
                disk += (1 + states) * aligned(numel, FP32, o)
                moved += (1 + states) * numel * FP32
            for i in group:  # the fp32 gradient of each partition
                if swapped(parts[i], FP32, o):
                    disk, moved = disk + aligned(parts[i], FP32, o), moved + parts[i] * FP32
        largest = max((sum(parts[i] for i in g) for g in groups), default=0)
        buffers += o.optimizer_buffer_count * aligned(largest, FP32, o)
    return {"disk": disk, "moved": moved, "buffers": buffers}
