"""A model too big for this machine, traced without its weights: the host device under a
FakeTensorMode (`host_mode`), so that every tensor of the set-up and the step (weights, gradients,
optimizer state, all-gather buffers) has its shape, dtype and the host device but no storage.

Why not the meta device itself: a device mesh needs a device with a handle (streams, a current
device), and on an accelerator-like device the wrappers hand their dependencies to streams
instead of waiting on their Works, so the waits a trace records would be lost. On the (fake)
host every wrapper takes its CPU path, as a cpu trace does: the same collectives, waits and
FLOPs. Four places read values or refuse fake tensors, and are given what they need here: a
device mesh's ranks (real integer ranges), DDP's parameter check (off) and bucket rebuild (real
integer buffers), `Module.to` (a cast in place). One place costs in proportion to the world:
FSDP2 cuts every parameter into one piece per rank to keep its own, and each piece of a fake
tensor is a Python object; here the pieces are made when asked (`Pieces`), which took an 8B
Llama's fsdp trace at 1,024 ranks from 55 s to 14 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial, wraps
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.predict.recorder import RECORDER


def on_host(model: nn.Module) -> nn.Module:
    """`model`'s meta parameters and buffers replaced by empty host ones (fake, under
    `host_mode`), tied ones still tied (`to_empty` cannot swap a fake tensor into a meta one)."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                module._parameters[name] = new[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                if id(b) not in new:
                    new[id(b)] = torch.empty_like(b, device="cpu")
                module._buffers[name] = new[id(b)]
    return model


@contextmanager
def host_mode(device: str) -> Iterator[torch.device]:
    """The device the strategy runs on. "meta" (a model too big for this machine): the host, under
    FakeTensorMode, so that every tensor made in set-up and step (weights, gradients, optimizer
    state, all-gather buffers) has shape, dtype and the host device but no storage, and every
    wrapper takes its CPU path (a device mesh needs a device with a handle; CPU waits on Works);
    DDP's check that parameter shapes agree across ranks reads values (`.item()`): off."""
    if device != "meta":
        yield torch.device(device)
        return
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.nn.parallel import distributed as ddp

    check, swap, mesh, chunk = (ddp._verify_param_shape_across_processes, torch.utils.swap_tensors,
                                DeviceMesh.__init__, _fsdp_param._chunk_with_empty)
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    torch.utils.swap_tensors = partial(_swap_fake, swap)
    DeviceMesh.__init__ = _real(mesh)
    _fsdp_param._chunk_with_empty = partial(_pieces, chunk)
    tracing = _eager_dtensor()
    try:
        with HostFake(allow_non_fake_inputs=True):
            yield torch.device("cpu")
    finally:
        ddp._verify_param_shape_across_processes, torch.utils.swap_tensors = check, swap
        DeviceMesh.__init__, _fsdp_param._chunk_with_empty = mesh, chunk
        for module, fn in tracing.items():
            module._are_we_tracing = fn


class Pieces(Sequence[torch.Tensor]):
    """FSDP2's `_chunk_with_empty(tensor, num_chunks, dim)`: torch.chunk's pieces, padded with
    empty tensors to `num_chunks`, each made when it is asked for (FSDP2 reads its rank's)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.count, self.dim = tensor, num_chunks, dim
        length = tensor.size(dim)
        self.step = -(-length // num_chunks)  # torch.chunk's piece: ceil(length / num_chunks)
        self.length = length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if i < 0:
            i += self.count
        if not 0 <= i < self.count:
            raise IndexError(i)
        start = i * self.step
        if start >= self.length:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, self.length - start))


def _pieces(chunk: Callable[..., list[torch.Tensor]], tensor: torch.Tensor, num_chunks: int,
            dim: int) -> Sequence[torch.Tensor]:
    return Pieces(tensor, num_chunks, dim) if tensor.size(dim) else chunk(tensor, num_chunks, dim)


_TRACING_READERS = ("torch.distributed._functional_collectives", "torch.distributed.tensor._dispatch",
                    "torch.distributed.tensor._redistribute",
                    "torch.distributed.tensor._sharding_prop",
                    "torch.distributed.tensor._collective_utils",
                    "torch.distributed.tensor._decompositions")


def _eager_dtensor() -> dict[Any, Callable[[], bool]]:
    """DTensor and the functional collectives take an active fake mode for a compiler's tracing
    (`_are_we_tracing`): they would wait on every collective at once, where an eager step waits
    when the result is used, and not cache sharding propagation. A meta trace is an eager step on
    fake tensors: "not tracing" in every module that reads it (the originals are returned)."""
    import importlib

    before = {}
    for name in _TRACING_READERS:
        module = importlib.import_module(name)
        before[module] = module._are_we_tracing
        module._are_we_tracing = _not_tracing
    return before


def _not_tracing() -> bool:
    return False


def _real(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` without the fake mode: a device mesh computes its coordinates from its ranks."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @wraps(fn)
    def real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    return real


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICE = torch.ops.prim.device.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_SCALAR = torch.ops.aten._local_scalar_dense.default


class HostFake(FakeTensorMode):
    """FakeTensorMode, but integer ranges are real (a device mesh reads its ranks), and so are
    integer buffers while DDP rebuilds its buckets (each rank writes its bucket indices and
    reads them back after a broadcast: `RebuildReal`)."""
    real_ints = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is _DEVICE:  # asked of every tensor the autograd engine meets: ~90% of the calls
            return args[0].fake_device
        if func is _WAIT:  # the fake kernel waits on nothing; the real one waits the group's work
            RECORDER.wait_tensor(args[0])
        if func is _SCALAR:  # a value read on the host (DeepSpeed's norm and overflow checks)
            return _healthy(args[0].dtype)
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        if (func._overloadpacket is torch.ops.aten.arange and dtype not in _FLOATS) or (
                HostFake.real_ints and func is torch.ops.aten.empty.memory_format
                and dtype in (torch.int32, torch.int64)):
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _healthy(dtype: torch.dtype) -> bool | int | float:
    """What a step's scalar reads see in a trace without values: a finite norm of 1, no overflow,
    no non-finite count, so that the step takes the path of a healthy step."""
    if dtype is torch.bool:
        return False
    return 1.0 if dtype.is_floating_point else 0


class RebuildReal:
    """DDP's reducer, whose bucket rebuild sees real integer buffers (`HostFake`)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        HostFake.real_ints = True
        try:
            return self._reducer._rebuild_buckets()
        finally:
            HostFake.real_ints = False


def fake_reducers(*models: Any) -> list[Any]:
    """The DDP modules in `models`, their reducers' bucket rebuild made to work on fake tensors.
    DDP's buckets follow the order gradients became ready in the first backward: one step, then
    the rebuild (which DDP does in the second step's forward, with broadcasts a steady step does
    not make), and the next step is a steady one."""
    from torch.nn.parallel import DistributedDataParallel

    found = []
    for model in models:
        for m in model.modules() if isinstance(model, nn.Module) else ():
            if isinstance(m, DistributedDataParallel) and not isinstance(m.reducer, RebuildReal):
                m.reducer = RebuildReal(m.reducer)
                found.append(m)
    return found


def _swap_fake(swap: Callable[[Any, Any], None], t1: Any, t2: Any) -> None:
    """`Module.to` swaps a fake parameter for its conversion, which a fake parameter refuses (a
    weak reference holds it): on the same device its data is replaced instead (a cast)."""
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        swap(t1, t2)
    except RuntimeError:
        if not (isinstance(t1, FakeTensor) and t1.device == t2.device):
            raise
        t1.data = t2
