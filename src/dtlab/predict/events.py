"""One step of one rank as a list of events, in the order the rank's Python thread met them.

The tracer (trace.py) records them from the real strategy wrappers under a recording fake
process group; the simulator (simulate.py) turns the events of every rank into a timeline.

    Compute  a stretch of work on the rank's compute stream between two other events: measured
             seconds (a trace on a real device) and/or counted FLOPs and bytes (any trace)
    Issue    a collective or point-to-point call leaving the rank (asynchronous: the compute
             stream goes on)
    Wait     the rank needs the result of an earlier Issue: its compute stream stops until the
             call has finished (the wrappers' own wait, where they put it)

Sizes follow nccl-tests: all_reduce, broadcast, reduce: the buffer; all_gather: the gathered
output; reduce_scatter: the whole input; all_to_all: the whole buffer; send/recv: the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

PHASES = ("forward", "backward", "recompute", "optimizer", "other")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
               "barrier")
POINT_TO_POINT = ("send", "recv")
# Trace.meta["clock"] (and a profile's) where compute was read on the thread's CPU clock, not the
# wall's: ranks that outnumbered their host's cores (corun.cpu_clock)
CPU_CLOCK = "thread cpu"


@dataclass(frozen=True)
class Compute:
    phase: str  # one of PHASES
    block: int | None = None  # the model block it belongs to (None: embeddings, head, loss, ...)
    seconds: float | None = None  # measured on the tracing device; None on a meta-device trace
    flops: float = 0.0  # FLOPs counted in this stretch
    bytes: float = 0.0  # bytes read and written from device memory (for a roofline), 0: unknown
    micro: int = 0  # micro step (gradient accumulation) or pipeline microbatch it belongs to


@dataclass(frozen=True)
class Issue:
    id: int  # unique within the trace of one rank
    op: str  # one of COLLECTIVES or POINT_TO_POINT
    bytes: int  # nccl-tests size (module docstring)
    group: tuple[int, ...]  # global ranks of the group, sorted; send/recv: (src, dst)
    phase: str = "other"  # where it was issued (PHASES)
    block: int | None = None
    micro: int = 0
    dtype: str = ""  # element type, e.g. "float32"
    # A functional collective (DTensor: tensor parallelism) works on this step's activations and
    # sits on the compute's critical path; the others (DDP, FSDP, ZeRO) on the wrappers' own
    # buffers, which a GPU's side streams run ahead or behind the compute (streams.py)
    functional: bool = False
    # The rank computed on its own since its last Issue or Wait (mark_arrivals): the ranks
    # come to this call out of step, as to the first of a run of calls issued back to back
    after_compute: bool = False
    # One of a run of two or more collectives issued back to back (no compute of the rank's own,
    # no wait between): such calls queue behind each other in the process group (ZeRO-1's
    # parameter broadcasts; a cluster's link prices them with its `burst` factors)
    in_burst: bool = False


@dataclass(frozen=True)
class Wait:
    id: int  # the Issue waited for


Event = Compute | Issue | Wait


@dataclass
class Trace:
    """One rank's step. `events` in program order; `meta` says how it was taken (device, dtype,
    threads, world, strategy spec, torch version), for the profile file and for refusals."""

    rank: int
    world: int
    events: list[Event] = field(default_factory=list)
    meta: dict[str, object] = field(default_factory=dict)

    def issues(self) -> list[Issue]:
        return [e for e in self.events if isinstance(e, Issue)]

    def computes(self) -> list[Compute]:
        return [e for e in self.events if isinstance(e, Compute)]


ON_ITS_OWN_S = 50e-6  # compute shorter than this between two calls cannot put ranks out of step


def mark_arrivals(events: list[Event]) -> list[Event]:
    """How each collective arrives: the events with `after_compute` set on each Issue that follows
    compute of the rank's own since its last Issue or Wait (at least ON_ITS_OWN_S measured, or
    FLOPs counted where the trace has no seconds: price.py adds a link's sync cost to those), and
    `in_burst` on the collectives of each run of two or more issued back to back."""
    out: list[Event] = []
    seconds, flops = 0.0, 0.0
    run: list[int] = []  # positions in `out` of the current run's collectives

    def close() -> None:
        if len(run) >= 2:
            for i in run:
                out[i] = replace(out[i], in_burst=True)
        run.clear()

    for e in events:
        if isinstance(e, Compute):
            seconds += e.seconds or 0.0
            flops += e.flops
        elif isinstance(e, Issue | Wait):
            if isinstance(e, Issue):
                e = replace(e, after_compute=seconds >= ON_ITS_OWN_S if seconds else flops > 0)
                if e.after_compute or e.op in POINT_TO_POINT:
                    close()
                if e.op not in POINT_TO_POINT:
                    run.append(len(out))
            else:
                close()
            seconds, flops = 0.0, 0.0
        out.append(e)
    close()
    return out
