"""State bytes per rank, exact: the bytes of the storages behind the parameters, gradients and
optimizer state this rank holds (local shards only, each storage counted once). Each strategy
reports its own through `Strategy.state_bytes`; summary.json's `memory_per_rank` holds them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        # a storage without memory (meta, or fake tensors: dtlab predict) has no address
        seen[s._cdata if s.device.type == "meta" else s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    opt_tensors = [
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    ]
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes(p.grad for p in params if p.grad is not None),
        "optim_bytes": storage_bytes(opt_tensors),
    }
