"""FLOPs and bytes of every op of a traced step, and the functional collectives on fake tensors:
a dispatch mode over the step (trace.py) that adds to the recorder's current Compute."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from dtlab.predict.functional import tell_group
from dtlab.predict.recorder import RECORDER

_DEVICE = torch.ops.prim.device.default
_SHAPE_ONLY = {_DEVICE, torch.ops.aten.detach.default}
# Ops that make a tensor without reading or writing device memory: a view of another tensor's
# storage (DeepSpeed narrows one 2-GB gradient bucket per parameter: counted as reads, a CNN's
# backward "moved" 20 GB), or storage left uninitialised
_ALLOCATE = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
             torch.ops.aten.empty_like.default}
_WRAP = "_wrap_tensor_autograd"  # registered by torch.distributed._functional_collectives


def _tensor_bytes(values: Any) -> int:
    """The bytes of the tensors among `values`, in lists and tuples too (an op's arguments;
    cheaper than a pytree walk, on every op)."""
    n = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            n += v.numel() * v.element_size()
        elif isinstance(v, (list, tuple)):
            n += _tensor_bytes(v)
    return n


class CountingMode(TorchDispatchMode):
    """Adds each op's FLOPs (torch's flop formulas, as FlopCounterMode counts them) and the bytes
    of its tensor inputs and outputs (a rough roofline figure) to the recorder's stretch.
    DTensors are let through to their own dispatch, whose local ops come back here (so the
    counts are per rank); FakeTensors (DTensor's shape propagation) are not counted, unless the
    step itself runs on them (`fake`: a model too big for this machine, trace.host_mode), and
    then the functional collectives are handed to their group here (`_functional`)."""

    def __init__(self, fake: bool = False) -> None:
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        self.dtensor, self.fake = DTensor, (() if fake else FakeTensor)
        self.on_fake = fake
        self.propagating = 0  # inside DTensor's sharding propagation (global shapes: uncounted)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE:
            return func(*args)
        kwargs = kwargs or {}
        if any(issubclass(t, self.dtensor) for t in types):
            return NotImplemented
        if not RECORDER.on or self.propagating or (
                self.fake and any(issubclass(t, self.fake) for t in types)):
            return func(*args, **kwargs)
        if func.namespace == "_c10d_functional":
            return self._functional(func, args, kwargs)
        packet = func._overloadpacket
        if packet not in flop_registry and func not in _SHAPE_ONLY:
            r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        if func.is_view or func in _ALLOCATE:
            return out
        if packet in flop_registry:
            RECORDER.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        RECORDER.bytes += _tensor_bytes(args) + _tensor_bytes(kwargs.values()) + _tensor_bytes(
            (out,))
        return out

    def __enter__(self) -> CountingMode:
        """DTensor's sharding propagation runs each op on fake tensors of the global shapes, to
        learn the output's: on a meta trace those are the step's own kind of tensor, so the
        propagation is marked (`propagating`) and its ops are not counted."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        propagate, mode = self._propagate, self

        def marked(prop: Any, op_schema: Any) -> Any:
            mode.propagating += 1
            try:
                return propagate(prop, op_schema)
            finally:
                mode.propagating -= 1
        ShardingPropagator._propagate_tensor_meta_non_cached = marked
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
        super().__exit__(*exc)

    def _functional(self, func: Any, args: Any, kwargs: Any) -> Any:
        """On real tensors torch's kernel calls the group (recorded) and `wait_tensor` waits the
        group's work (recorded). On fake tensors the fake mode answers both: the group is called
        here (functional.py), and the output's wait is the fake mode's `wait_tensor` of a tensor
        on its storage (fake_host.HostFake)."""
        if not self.on_fake or func._overloadpacket.__name__ == "wait_tensor":
            RECORDER.functional = True
            try:
                return func(*args, **kwargs)
            finally:
                RECORDER.functional = False
        if func._overloadpacket.__name__ == _WRAP:  # its fake kernel: a plain tensor, never waited
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            return AsyncCollectiveTensor(args[0])  # what its real kernel returns
        out = func(*args, **kwargs)
        before = RECORDER.next_id
        RECORDER.functional = True
        try:
            told = tell_group(func, args, kwargs, out)
        finally:
            RECORDER.functional = False
        if told and RECORDER.next_id > before:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    RECORDER.awaits(t, RECORDER.next_id)
        return out
