"""The functional collectives (DTensor's, hence tensor parallelism's) on fake tensors.

On a real tensor, torch's kernel of `_c10d_functional.all_reduce` and its kin resolves the group
by name and calls its method (`allreduce`, `_allgather_base`, ...), which the recording group
records. Under a FakeTensorMode (a meta trace, fake_host.py) the fake mode answers the op itself
with an output of the right shape and no group is called: `tell_group` makes the call the real
kernel would have made, on the fake input and output, so that the recording group records it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _group(name: Any) -> dist.ProcessGroup:
    if isinstance(name, dist.ProcessGroup):
        return name
    return dist.distributed_c10d._resolve_process_group(name)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def tell_group(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> bool:
    """Call the group named in `func`'s arguments as torch's kernel would (True: one was
    called; False: an op of no group, e.g. `_wrap_tensor_autograd`)."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    if "group_name" not in bound:
        return False
    group, op = _group(bound["group_name"]), func._overloadpacket.__name__.rstrip("_")
    out = bound.get("out", out)
    if op == "all_reduce":
        group.allreduce(_tensors(out))
    elif op == "all_reduce_coalesced":
        group.allreduce_coalesced(_tensors(out))
    elif op == "all_gather_into_tensor":
        group._allgather_base(out, bound["input"])
    elif op == "all_gather_into_tensor_coalesced":
        group.allgather_into_tensor_coalesced(_tensors(out), list(bound["inputs"]))
    elif op == "reduce_scatter_tensor":
        group._reduce_scatter_base(out, bound["input"])
    elif op == "reduce_scatter_tensor_coalesced":
        group.reduce_scatter_tensor_coalesced(_tensors(out), list(bound["inputs"]))
    elif op == "all_to_all_single":
        group.alltoall_base(out, bound["input"], list(bound["output_split_sizes"]),
                            list(bound["input_split_sizes"]))
    elif op == "broadcast":
        group.broadcast(_tensors(out))  # the root moves no bytes of its own in the record
    elif op == "isend":
        group.send([bound["tensor"]], bound["dst"])
    elif op == "irecv":
        group.recv([out], bound["src"])
    else:
        return False
    return True
