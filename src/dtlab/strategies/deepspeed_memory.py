"""Exact bytes a DeepSpeed engine holds on this rank, by kind.

metrics.state_bytes sees `model.parameters()` and `optimizer.state`; DeepSpeed keeps most of its
memory elsewhere: flat fp32 master partitions, gradient partitions and accumulation buffers,
communication buckets. This walks every tensor reachable from the engine's ZeRO optimizer object
(its attributes, lists, dicts and DeepSpeed-owned objects) and counts each storage once:

- param_bytes: the module's parameters as they are held (ZeRO 3: this rank's partitions
  `ds_tensor`, plus the small parameters ZeRO 3 keeps whole, below
  stage3_param_persistence_threshold) and whatever aliases them (DeepSpeed's flat groups).
- grad_bytes: parameter gradients and DeepSpeed's gradient partitions/accumulators, including the
  `.grad` of the fp32 master partitions under offload.
- optim_bytes: the optimizer state (exp_avg, ...) plus the fp32 master weights. In fp32 training
  DeepSpeed still keeps its own fp32 copy of this rank's partition.
- buffer_bytes: everything else: reduction/all-gather buckets (sized by reduce_bucket_size and
  friends; allocated, on CPU not necessarily touched), offload staging buffers, scalars.
A storage is counted at its full size even when only a view of it is in use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

MASTER = {"single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_partitioned_groups"}
GRADS = {"averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer",
         "accumulated_grads_in_cpu", "fp32_groups_gradients", "fp32_groups_gradients_flat"}
PARAMS = {"bit16_groups", "bit16_groups_flat", "parallel_partitioned_bit16_groups", "fp16_groups",
          "fp16_partitioned_groups", "fp16_partitioned_groups_flat"}
KINDS = ("param_bytes", "grad_bytes", "optim_bytes", "buffer_bytes")


def _tensors(value: Any, seen: set[int], depth: int = 0) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, is_a_grad) for every tensor reachable from value."""
    if id(value) in seen or depth > 8:
        return
    seen.add(id(value))
    if torch.is_tensor(value):
        if value.device.type == "meta":  # shape records, no memory
            return
        yield value, False
        if value.grad is not None:
            yield value.grad, True
        if hasattr(value, "ds_tensor"):  # a ZeRO 3 parameter: its partition
            yield from _tensors(value.ds_tensor, seen, depth + 1)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _tensors(v, seen, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, seen, depth + 1)
    elif type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
        for v in vars(value).values():
            yield from _tensors(v, seen, depth + 1)


def held_storages(engine: Any) -> list[tuple[str, str, int]]:
    """(kind, where it was found, bytes) for each storage, counted once."""
    counted: set[tuple[int, int]] = set()
    out: list[tuple[str, str, int]] = []

    def add(tensor: torch.Tensor, kind: str, where: str) -> None:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key not in counted:  # the first, most specific, kind wins
            counted.add(key)
            out.append((kind, where, storage.nbytes()))

    seen: set[int] = set()
    for p in engine.module.parameters():
        for t, is_grad in _tensors(p, seen):
            add(t, "grad_bytes" if is_grad else "param_bytes", "module")
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        for t, _ in _tensors(list(inner.state.values()), seen):
            add(t, "optim_bytes", "optimizer.state")
    known = MASTER | GRADS | PARAMS  # named buffers first: an alias elsewhere is not a buffer
    for attr, value in sorted(vars(opt).items(), key=lambda item: item[0] not in known):
        for t, is_grad in _tensors(value, seen):
            kind = ("grad_bytes" if is_grad or attr in GRADS else "optim_bytes" if attr in MASTER
                    else "param_bytes" if attr in PARAMS else "buffer_bytes")
            add(t, kind, attr + (".grad" if is_grad else ""))
    return out


def held_bytes(engine: Any) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for kind, _, nbytes in held_storages(engine):
        out[kind] += nbytes
    return out
