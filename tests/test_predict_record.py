"""The recording group's own cost: what torch's fake backend does for it (filling outputs) is in
no Compute of the trace, and is skipped on fake tensors; FSDP2's per-rank pieces of a fake
parameter are made when asked (fake_host.Pieces). In this process, no ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtlab.predict.counting import CountingMode
from dtlab.predict.fake_host import HostFake, Pieces
from dtlab.predict.record import recording_group
from dtlab.predict.recorder import RECORDER


def test_the_fake_backends_copies_fill_the_outputs_but_count_no_bytes() -> None:
    """Rank 1 of 4 on a real device: the all-gather's output holds the input four times (the
    step computes with it), the reduce-scatter's output the input's chunk, and no Compute counts
    the copies, which a real backend makes inside the collective the link prices."""
    inp, out, shard, full = torch.arange(4.0), torch.zeros(16), torch.zeros(4), torch.arange(16.0)
    with recording_group(1, 4):
        RECORDER.start(timed=True, sync=lambda: None)
        try:
            with CountingMode():
                dist.all_gather_into_tensor(out, inp)
                dist.reduce_scatter_tensor(shard, full)
        finally:
            events = RECORDER.stop()
    assert torch.equal(out, inp.repeat(4))
    assert torch.equal(shard, full[4:8])
    assert [(e.op, e.bytes) for e in events if hasattr(e, "op")] == [
        ("all_gather", 64), ("reduce_scatter", 64)]
    assert sum(getattr(e, "bytes", 0) for e in events if not hasattr(e, "op")) == 0
    assert sum(getattr(e, "flops", 0) for e in events if not hasattr(e, "op")) == 0


class Refuses:
    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"the fake backend was asked for {name} on fake tensors")


def test_on_fake_tensors_the_fake_backend_is_not_asked() -> None:
    """A trace without values (1,024 ranks): the collectives are recorded with their bytes, and
    the fake backend, which would cut and copy one piece per rank, is never called."""
    with recording_group(0, 1024):
        group = dist.distributed_c10d._get_default_group()
        group.inner = Refuses()
        RECORDER.start(timed=False, sync=lambda: None)
        try:
            with HostFake(allow_non_fake_inputs=True):
                inp, out = torch.empty(4), torch.empty(4096)
                dist.all_gather_into_tensor(out, inp)
                dist.reduce_scatter_tensor(inp, out)
                dist.all_reduce(inp)
        finally:
            events = RECORDER.stop()
    assert [(e.op, e.bytes) for e in events if hasattr(e, "op")] == [
        ("all_gather", 4096 * 4), ("reduce_scatter", 4096 * 4), ("all_reduce", 16)]


@pytest.mark.parametrize("length", [1, 5, 7, 64, 100, 1000])
@pytest.mark.parametrize("count", [1, 3, 8, 64, 1024])
def test_pieces_are_the_chunks_fsdp2_cuts(length: int, count: int) -> None:
    """Each piece has the shape, strides, offset and values of FSDP2's own chunk (torch.chunk,
    padded with empty tensors to one per rank), from either end."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    t = torch.arange(length * 3.0).reshape(length, 3)
    chunks, pieces = _chunk_with_empty(t, count, 0), Pieces(t, count, 0)
    assert len(pieces) == len(chunks) == count
    for i in [*range(count), -1]:
        a, b = chunks[i], pieces[i]
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(),
                                                             b.storage_offset())
        assert torch.equal(a, b)
    with pytest.raises(IndexError):
        pieces[count]


def test_a_compute_is_timed_on_the_clock_it_is_given() -> None:
    """A Compute's seconds are its clock's (the thread's CPU clock where ranks outnumber the
    cores, corun.cpu_clock): the stretch from the last event to the next, less the time spent
    `outside` (the fake backend's work), on that same clock."""
    now = {"t": 10.0}

    def tick(to: float) -> None:
        now["t"] = to

    RECORDER.start(timed=True, sync=lambda: None, clock=lambda: now["t"])
    try:
        tick(10.25)
        RECORDER.at("forward", 0)
        tick(11.0)
        RECORDER.outside(lambda: tick(11.5))
        tick(12.0)
    finally:
        events = RECORDER.stop()
    assert [(e.phase, e.block, e.seconds) for e in events] == [
        ("other", None, 0.25), ("forward", 0, 1.25)]
