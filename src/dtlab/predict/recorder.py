"""The events of one rank's step as the recording group (record.py) and the counting mode
(counting.py) see them: Compute stretches, Issue and Wait, and where the step is."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dtlab.predict.events import Compute, Event, Issue, Wait


class Recorder:
    """The events of one rank's step, and where the step is (phase, block, micro step), which
    the tracer moves with hooks. A Compute closes at every change of place and every Issue or
    Wait: its FLOPs and bytes from the counting mode, its seconds from the clock (`timed`)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.on = False  # recording (set-up and untraced steps are not)
        self.timed = False  # seconds per Compute (a real device; `sync` first)
        self.sync: Callable[[], None] = lambda: None
        self.clock: Callable[[], float] = time.perf_counter  # what a Compute's seconds are read on
        self.phase, self.block, self.micro = "other", None, 0
        self.flops = self.bytes = 0.0
        self.started = self.clock()
        self.next_id = 0
        self.issued: set[int] = set()
        self.waited: set[int] = set()
        self.futures: set[int] = set()  # issues whose result was taken as a future (DDP)
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # see `awaits`
        self.alone = 0  # collectives in a group of one rank (not recorded)
        self.functional = False  # inside a functional collective's kernel (counting.py)

    def start(self, timed: bool, sync: Callable[[], None],
              clock: Callable[[], float] = time.perf_counter) -> None:
        """Record a step from here; `clock`: the wall clock, or the thread's CPU clock where the
        node's ranks outnumber its cores (corun.cpu_clock)."""
        self.events, self.next_id, self.alone = [], 0, 0
        self.issued, self.waited, self.futures, self.pending = set(), set(), set(), {}
        self.on, self.timed, self.sync, self.clock = True, timed, sync, clock
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
        self.started = self.clock()

    def close(self) -> None:
        """End the current Compute stretch (every one: the counted and the timed step must have
        the same structure; `trace.py` drops the empty ones after merging them)."""
        if not self.on:
            return
        seconds = None
        if self.timed:
            self.sync()
            seconds = self.clock() - self.started
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
                                     self.micro, dtype, self.functional))
        return self.next_id

    def outside(self, fn: Callable[[], object]) -> None:
        """`fn` counted in no Compute, its seconds taken out of the current stretch: the fake
        backend's work, which a real backend does inside the collective."""
        on, began = self.on, self.clock()
        self.on = False
        try:
            fn()
        finally:
            self.on = on
            self.started += self.clock() - began

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
