"""A fake process group that records: every collective and point-to-point call a wrapper makes,
and where the wrapper waits for it, as `events` (Issue, Wait, Compute between them).

`RecordingGroup` is a Python `ProcessGroup` registered as the backend "dtlab_record": torch
returns such a group itself from `init_process_group`/`new_group`, so DeviceMesh, DDP's reducer,
FSDP1/2, ZeRO, DTensor's functional collectives and the pipeline schedules call its methods. Each
method records an Issue, delegates to torch's own fake backend (`FakeProcessGroup`: nothing
moves, outputs keep their shapes; on fake tensors it is not called at all: `_record`) and
returns a `RecordingWork`, whose
`wait` records a Wait, into the recorder (recorder.py). Functional collectives (DTensor, TP)
call the same methods from torch's kernels (on fake tensors: counting.py).

Why CPU or meta, not CUDA: NCCL wrappers hand their dependencies to CUDA streams (events,
`wait_stream`) and never call `Work.wait`, so a recording would lose where a rank needs a
result; on a CPU device the same wrappers wait on the work itself, at the point the data is
needed, which is what the simulator takes as the dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # not re-exported by dist
from torch.futures import Future

from dtlab.predict.recorder import RECORDER

BACKEND = "dtlab_record"


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class RecordingWork(dist._Work):
    """The fake backend's work, whose wait is recorded; its future holds the outputs (DDP's
    reducer reads its bucket from it)."""

    def __init__(self, issue_id: int, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.issue_id, self.outputs = issue_id, outputs

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


def _values(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` hold values (not fake tensors, not on the meta device)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors)


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

    def _record(self, op: str, size: int, tensors: Sequence[torch.Tensor],
                outputs: list[torch.Tensor], backend: Callable[[], Any] | None = None,
                group: tuple[int, ...] | None = None) -> RecordingWork:
        """The Issue, then the fake backend's part (`backend`: writing the outputs a real one
        would have written) outside the step's counts and clock: a real backend writes them
        inside the collective, whose time the link prices. On fake tensors, which hold no
        values, it is skipped (one chunk and copy per rank: seconds at 1,024 ranks)."""
        i = RECORDER.issue(op, size, group or self.ranks(), _dtype(tensors))
        if backend is not None:
            RECORDER.outside(lambda: _values([*tensors, *outputs]) and backend())
        return RecordingWork(i, outputs)

    # --- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> RecordingWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self._record("all_reduce", nbytes(tensors), tensors, tensors, lambda: self.inner
                            .allreduce(tensors, _opts(opts, dist.AllreduceOptions)))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> RecordingWork:
        return self._record("all_reduce", nbytes(tensors), tensors, list(tensors), lambda: self
                            .inner.allreduce_coalesced(tensors, _opts(
                                opts, dist.AllreduceCoalescedOptions)))

    def reduce(self, tensors: Any, opts: Any = None) -> RecordingWork:
        return self._record("reduce", nbytes(tensors), tensors, list(tensors), lambda: self.inner
                            .reduce(tensors, opts or dist.ReduceOptions()))

    def broadcast(self, tensors: Any, opts: Any = None) -> RecordingWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self._record("broadcast", nbytes(tensors), tensors, tensors, lambda: self.inner
                            .broadcast(tensors, opts or dist.BroadcastOptions()))

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        flat = [t for out in outputs for t in out]
        return self._record("all_gather", nbytes(flat), inputs, flat, lambda: self.inner
                            .allgather(outputs, inputs, opts or AllgatherOptions()))

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        flat = [t for out in outputs for t in out]
        return self._record("all_gather", nbytes(flat), inputs, flat, lambda: self.inner
                            .allgather_coalesced(outputs, inputs, opts or AllgatherOptions()))

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> RecordingWork:
        return self._record("all_gather", nbytes([output]), [input], [output], lambda: self.inner
                            ._allgather_base(output, input, opts or AllgatherOptions()))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any,
                                    opts: Any = None) -> RecordingWork:
        def backend() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                self.inner._allgather_base(out, inp, opts or AllgatherOptions())
        return self._record("all_gather", nbytes(outputs), inputs, list(outputs), backend)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        flat = [t for inp in inputs for t in inp]
        return self._record("reduce_scatter", nbytes(flat), outputs, list(outputs), lambda: self
                            .inner.reduce_scatter(outputs, inputs, _opts(
                                opts, dist.ReduceScatterOptions)))

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> RecordingWork:
        return self._record("reduce_scatter", nbytes([input]), [input], [output], lambda: self
                            .inner._reduce_scatter_base(output, input, _opts(
                                opts, dist.ReduceScatterOptions)))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> RecordingWork:
        def backend() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                self.inner._reduce_scatter_base(out, inp, _opts(opts, dist.ReduceScatterOptions))
        return self._record("reduce_scatter", nbytes(inputs), inputs, list(outputs), backend)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                          opts: Any = None) -> RecordingWork:
        return self._record("all_to_all", nbytes([input]), [input], [output], lambda: self.inner
                            .alltoall_base(output, input, output_splits, input_splits,
                                           opts or dist.AllToAllOptions()))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        return self._record("all_to_all", nbytes(inputs), inputs, list(outputs), lambda: self
                            .inner.alltoall(outputs, inputs, opts or dist.AllToAllOptions()))

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        flat = [t for out in outputs for t in out] or list(inputs)
        return self._record("gather", nbytes(flat), inputs, flat, lambda: self.inner
                            .gather(outputs, inputs, opts or dist.GatherOptions()))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> RecordingWork:
        return self._record("scatter", nbytes(outputs) * self.size(), outputs, list(outputs),
                            lambda: self.inner.scatter(outputs, inputs,
                                                       opts or dist.ScatterOptions()))

    def barrier(self, opts: Any = None) -> RecordingWork:
        return self._record("barrier", 0, [], [])

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        RECORDER.wait(self._record("barrier", 0, [], []).issue_id)

    # --- point to point: group (source, destination) in global ranks -----------------------
    def send(self, tensors: Any, dst: int, tag: int = 0) -> RecordingWork:
        me, peer = self.ranks()[self.rank()], self.ranks()[dst]
        return self._record("send", nbytes(tensors), tensors, list(tensors), group=(me, peer))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> RecordingWork:
        """Nothing arrives: a received tensor holds ones (finite activations and gradients;
        the pipelines' warm-up vote then reads "static shapes", as every dtlab stage votes)."""
        me, peer = self.ranks()[self.rank()], self.ranks()[src]
        return self._record("recv", nbytes(tensors), tensors, list(tensors), partial(
            _ones, tensors), (peer, me))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> RecordingWork:
        me = self.ranks()[self.rank()]
        return self._record("recv", nbytes(tensors), tensors, list(tensors), partial(
            _ones, tensors), (-1, me))


def _ones(tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            t.fill_(1)


def _create(store: Any, rank: int, size: int, timeout: Any = None) -> RecordingGroup:
    return RecordingGroup(rank, size)


def register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda", "meta"])


@contextmanager
def recording_group(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of `world` on the recording group; destroyed on every exit path."""
    from dtlab.estimate.measure import one_process_group

    register()
    try:
        with one_process_group(BACKEND, rank, world, "predict"):
            yield
    finally:
        RECORDER.on = False
