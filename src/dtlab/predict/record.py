"""A fake process group that records: every collective and point-to-point call a wrapper makes,
and where the wrapper waits for it, as `events` (Issue, Wait, Compute between them).

`RecordingGroup` is a Python `ProcessGroup` registered as the backend "dtlab_record": torch
returns such a group itself from `init_process_group`/`new_group`, so DeviceMesh, DDP's reducer,
FSDP1/2, ZeRO, DTensor's functional collectives and the pipeline schedules call its methods. Each
method records an Issue, delegates to torch's own fake backend (`FakeProcessGroup`: nothing
moves, outputs keep their shapes, the work is complete) and returns a `RecordingWork`, whose
`wait` records a Wait. Functional collectives (DTensor, TP) are waited with
`_c10d_functional.wait_tensor`; the counting mode below records those Waits.

Why CPU or meta, not CUDA: NCCL wrappers hand their dependencies to CUDA streams (events,
`wait_stream`) and never call `Work.wait`, so a recording would lose where a rank needs a
result; on a CPU device the same wrappers wait on the work itself, at the point the data is
needed, which is what the simulator takes as the dependency.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by dist
from torch.futures import Future
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from dtlab.predict.events import Compute, Event, Issue, Wait
from dtlab.predict.functional import tell_group

BACKEND = "dtlab_record"


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Recorder:
    """The events of one rank's step, and where the step is (phase, block, micro step), which
    the tracer moves with hooks. A Compute closes at every change of place and every Issue or
    Wait: its FLOPs and bytes from the counting mode, its seconds from the clock (`timed`)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.on = False  # recording (set-up and untraced steps are not)
        self.timed = False  # seconds per Compute (a real device; `sync` first)
        self.sync: Callable[[], None] = lambda: None
        self.phase, self.block, self.micro = "other", None, 0
        self.flops = self.bytes = 0.0
        self.started = time.perf_counter()
        self.next_id = 0
        self.issued: set[int] = set()
        self.waited: set[int] = set()
        self.futures: set[int] = set()  # issues whose result was taken as a future (DDP)
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # see `awaits`
        self.alone = 0  # collectives in a group of one rank (not recorded)

    def start(self, timed: bool, sync: Callable[[], None]) -> None:
        self.events, self.next_id, self.alone = [], 0, 0
        self.issued, self.waited, self.futures, self.pending = set(), set(), set(), {}
        self.on, self.timed, self.sync = True, timed, sync
        self.phase, self.block, self.micro = "other", None, 0
        self._reset_stretch()

    def stop(self) -> list[Event]:
        self.close()
        self.on = False
        return self.events

    def _reset_stretch(self) -> None:
        self.flops = self.bytes = 0.0
        if self.timed:
            self.sync()
        self.started = time.perf_counter()

    def close(self) -> None:
        """End the current Compute stretch (every one: the counted and the timed step must have
        the same structure; `trace.py` drops the empty ones after merging them)."""
        if not self.on:
            return
        seconds = None
        if self.timed:
            self.sync()
            seconds = time.perf_counter() - self.started
        self.events.append(Compute(self.phase, self.block, seconds, self.flops, self.bytes,
                                   self.micro))
        self._reset_stretch()

    def at(self, phase: str, block: int | None = None, micro: int | None = None) -> None:
        """The step moved to another place: the stretch so far belongs to the previous one."""
        micro = self.micro if micro is None else micro
        if (phase, block, micro) != (self.phase, self.block, self.micro):
            self.close()
            self.phase, self.block, self.micro = phase, block, micro

    def issue(self, op: str, size: int, group: tuple[int, ...], dtype: str) -> int:
        """A collective or send/recv; one in a group of one rank moves nothing and costs no
        time: it is counted in `alone`, not recorded (HSDP's replica all-reduce at one replica)."""
        self.next_id += 1
        if self.on and len(group) == 1:
            self.alone += 1
        elif self.on:
            self.close()
            self.issued.add(self.next_id)
            self.events.append(Issue(self.next_id, op, size, group, self.phase, self.block,
                                     self.micro, dtype))
        return self.next_id

    def wait(self, issue_id: int) -> None:
        """A wait on an Issue of this trace, the first time only (later ones cost nothing)."""
        if self.on and issue_id in self.issued and issue_id not in self.waited:
            self.close()
            self.waited.add(issue_id)
            self.events.append(Wait(issue_id))

    def awaits(self, t: torch.Tensor, issue_id: int) -> None:
        """`t`, the output of a functional collective on fake tensors, is waited with
        `wait_tensor` of it or of a view of it (its storage), as torch's kernel waits its work."""
        self.pending[t.untyped_storage()._cdata] = (issue_id, t)

    def wait_tensor(self, t: torch.Tensor) -> None:
        """`_c10d_functional.wait_tensor(t)` on fake tensors (`awaits`)."""
        issue_id, _ = self.pending.pop(t.untyped_storage()._cdata, (None, None))
        if issue_id is not None:
            self.wait(issue_id)

    def wait_futures(self) -> None:
        """Results handed over as futures (DDP's buckets) are needed when the backward ends."""
        for i in sorted(self.futures - self.waited):
            self.wait(i)
        self.futures.clear()

    def wait_all(self) -> None:
        """The step ends when its communication has: anything never waited is waited here."""
        for i in sorted(self.issued - self.waited):
            self.wait(i)


RECORDER = Recorder()  # the recording groups of this process record here (one trace at a time)


class RecordingWork(dist._Work):
    """The fake backend's work, whose wait is recorded; its future holds the outputs (DDP's
    reducer reads its bucket from it)."""

    def __init__(self, issue_id: int, inner: Any, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.issue_id, self.inner, self.outputs = issue_id, inner, outputs

    def wait(self, timeout: Any = None) -> bool:
        RECORDER.wait(self.issue_id)
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Future:
        RECORDER.futures.add(self.issue_id)
        future: Future = Future()
        future.set_result(self.outputs)
        return future

    def result(self) -> list[torch.Tensor]:
        return self.outputs


def _dtype(tensors: Sequence[torch.Tensor]) -> str:
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else ""


def _opts(opts: Any, cls: Any) -> Any:
    """torch passes options objects; an older spelling passes a ReduceOp (or nothing)."""
    if opts is None or isinstance(opts, cls):
        return opts if opts is not None else cls()
    out = cls()
    out.reduceOp = opts
    return out


class RecordingGroup(dist.ProcessGroup):
    """See the module docstring. Sizes follow nccl-tests (events.py)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        from torch._C._distributed_c10d import FakeProcessGroup

        self.inner = FakeProcessGroup._create_internal(rank, size)
        for device in ("cpu", "cuda", "meta"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM,
                                   self.inner)
        self._ranks: tuple[int, ...] | None = None

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def ranks(self) -> tuple[int, ...]:
        if self._ranks is None:
            self._ranks = tuple(sorted(dist.get_process_group_ranks(self)))
        return self._ranks

    def _record(self, op: str, size: int, tensors: Sequence[torch.Tensor], work: Any,
                outputs: list[torch.Tensor], group: tuple[int, ...] | None = None) -> RecordingWork:
        i = RECORDER.issue(op, size, group or self.ranks(), _dtype(tensors))
        return RecordingWork(i, work, outputs)

    # --- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> RecordingWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        work = self.inner.allreduce(tensors, _opts(opts, dist.AllreduceOptions))
        return self._record("all_reduce", nbytes(tensors), tensors, work, tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.allreduce_coalesced(tensors, _opts(opts, dist.AllreduceCoalescedOptions))
        return self._record("all_reduce", nbytes(tensors), tensors, work, list(tensors))

    def reduce(self, tensors: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.reduce(tensors, opts or dist.ReduceOptions())
        return self._record("reduce", nbytes(tensors), tensors, work, list(tensors))

    def broadcast(self, tensors: Any, opts: Any = None) -> RecordingWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        work = self.inner.broadcast(tensors, opts or dist.BroadcastOptions())
        return self._record("broadcast", nbytes(tensors), tensors, work, tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.allgather(outputs, inputs, opts or AllgatherOptions())
        flat = [t for out in outputs for t in out]
        return self._record("all_gather", nbytes(flat), inputs, work, flat)

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.allgather_coalesced(outputs, inputs, opts or AllgatherOptions())
        flat = [t for out in outputs for t in out]
        return self._record("all_gather", nbytes(flat), inputs, work, flat)

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> RecordingWork:
        work = self.inner._allgather_base(output, input, opts or AllgatherOptions())
        return self._record("all_gather", nbytes([output]), [input], work, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any,
                                    opts: Any = None) -> RecordingWork:
        for out, inp in zip(outputs, inputs, strict=True):
            self.inner._allgather_base(out, inp, opts or AllgatherOptions())
        return self._record("all_gather", nbytes(outputs), inputs, None, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.reduce_scatter(outputs, inputs, _opts(opts, dist.ReduceScatterOptions))
        flat = [t for inp in inputs for t in inp]
        return self._record("reduce_scatter", nbytes(flat), outputs, work, list(outputs))

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> RecordingWork:
        work = self.inner._reduce_scatter_base(output, input,
                                               _opts(opts, dist.ReduceScatterOptions))
        return self._record("reduce_scatter", nbytes([input]), [input], work, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> RecordingWork:
        for out, inp in zip(outputs, inputs, strict=True):
            self.inner._reduce_scatter_base(out, inp, _opts(opts, dist.ReduceScatterOptions))
        return self._record("reduce_scatter", nbytes(inputs), inputs, None, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                          opts: Any = None) -> RecordingWork:
        work = self.inner.alltoall_base(output, input, output_splits, input_splits,
                                        opts or dist.AllToAllOptions())
        return self._record("all_to_all", nbytes([input]), [input], work, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.alltoall(outputs, inputs, opts or dist.AllToAllOptions())
        return self._record("all_to_all", nbytes(inputs), inputs, work, list(outputs))

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.gather(outputs, inputs, opts or dist.GatherOptions())
        flat = [t for out in outputs for t in out] or list(inputs)
        return self._record("gather", nbytes(flat), inputs, work, flat)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        work = self.inner.scatter(outputs, inputs, opts or dist.ScatterOptions())
        return self._record("scatter", nbytes(outputs) * self.size(), outputs, work, list(outputs))

    def barrier(self, opts: Any = None) -> RecordingWork:
        return self._record("barrier", 0, [], None, [])

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        RECORDER.wait(self._record("barrier", 0, [], None, []).issue_id)

    # --- point to point: group (source, destination) in global ranks -----------------------
    def send(self, tensors: Any, dst: int, tag: int = 0) -> RecordingWork:
        me, peer = self.ranks()[self.rank()], self.ranks()[dst]
        return self._record("send", nbytes(tensors), tensors, None, list(tensors), (me, peer))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> RecordingWork:
        """Nothing arrives: a received tensor holds ones (finite activations and gradients;
        the pipelines' warm-up vote then reads "static shapes", as every dtlab stage votes)."""
        with torch.no_grad():
            for t in tensors:
                if t.device.type != "meta":
                    t.fill_(1)
        me, peer = self.ranks()[self.rank()], self.ranks()[src]
        return self._record("recv", nbytes(tensors), tensors, None, list(tensors), (peer, me))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> RecordingWork:
        me = self.ranks()[self.rank()]
        return self._record("recv", nbytes(tensors), tensors, None, list(tensors), (-1, me))


def _create(store: Any, rank: int, size: int, timeout: Any = None) -> RecordingGroup:
    return RecordingGroup(rank, size)


def register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda", "meta"])


# --- FLOPs, bytes and the functional collectives' waits -------------------------------------
_DEVICE = torch.ops.prim.device.default
_SHAPE_ONLY = {_DEVICE, torch.ops.aten.detach.default}
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
            return func(*args, **kwargs)
        if func._overloadpacket.__name__ == _WRAP:  # its fake kernel: a plain tensor, never waited
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            return AsyncCollectiveTensor(args[0])  # what its real kernel returns
        out = func(*args, **kwargs)
        before = RECORDER.next_id
        if tell_group(func, args, kwargs, out) and RECORDER.next_id > before:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    RECORDER.awaits(t, RECORDER.next_id)
        return out


@contextmanager
def recording_group(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of `world` on the recording group; destroyed on every exit path."""
    import sys
    import warnings

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.errors import DtlabError

    if dist.is_initialized():
        raise DtlabError("a process group is already initialised in this process; fix: run "
                         "dtlab predict in a process of its own")
    register()
    hook = sys.excepthook
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        RECORDER.on = False
        dist.destroy_process_group()
        sys.excepthook = hook
        if "torch.distributed.tensor" in sys.modules:  # see estimate/measure.fake_group
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache
            _clear_sharding_prop_cache()
