"""A CPU trace as a GPU runs it: the side streams of the wrappers' own collectives.

A trace is taken on a CPU (or fake tensors), where a wrapper waits for a collective where its
thread needs the result: FSDP's all-gather of unit k+1 right before unit k+1's forward, its
reduce-scatter of unit k's gradients right after unit k's backward. On a GPU the same wrappers
run those calls on side streams and order them with events, so the compute stream goes on:

  - all-gathers of parameters are *prefetched*: FSDP2 issues unit k+1's all-gather while unit
    k computes (implicitly in forward, as the CPU runs ahead; explicitly in backward), FSDP1
    likewise with its default BACKWARD_PRE; one unit ahead, the depth both use by default;
  - reduce-scatters (and HSDP's all-reduces after them) run behind the backward: the compute
    waits for one only when the next is issued (FSDP bounds the reduce buffers in flight to
    one) or when the optimizer needs the gradients.

`with_streams` moves the Issue and Wait events of the wrappers' own collectives (Issue.
functional false) accordingly, on traces priced for a device with streams (a cluster without
`cores`); tensor parallelism's functional collectives stay where they are, on the critical
path, and so do DDP's and ZeRO's calls, which the CPU trace already shows asynchronous. Applied
only where the CPU trace waits at once (an Issue directly followed by its Wait).
"""

from __future__ import annotations

from dataclasses import replace

from dtlab.predict.events import Compute, Event, Issue, Trace, Wait

PREFETCHED = ("all_gather",)
BEHIND = ("reduce_scatter", "all_reduce")


def _waited_at_once(events: list[Event], i: int) -> bool:
    e = events[i]
    return (isinstance(e, Issue) and not e.functional and i + 1 < len(events)
            and isinstance(events[i + 1], Wait) and events[i + 1].id == e.id)


def _prefetch(events: list[Event]) -> list[Event]:
    """Each all-gather waited at once is issued right after the previous one's Wait (same group,
    phase and micro step), when compute lies between them."""
    out: list[Event] = []
    last_wait: dict[tuple, int] = {}  # (group, phase, micro) -> index in out after that Wait
    i = 0
    while i < len(events):
        e = events[i]
        if _waited_at_once(events, i) and e.op in PREFETCHED:
            key = (e.group, e.phase, e.micro)
            at = last_wait.get(key)
            if at is not None and any(isinstance(x, Compute) for x in out[at:]):
                out.insert(at, e)
                for k, v in last_wait.items():
                    last_wait[k] = v + 1 if v >= at else v
            else:
                out.append(e)
            out.append(events[i + 1])
            last_wait[key] = len(out)
            i += 2
            continue
        out.append(e)
        i += 1
    return out


def _behind(events: list[Event]) -> list[Event]:
    """Each reduce waited at once is waited when the next one on its group is issued, or before
    the optimizer's first compute, or at the end of the step."""
    out: list[Event] = []
    pending: dict[tuple[int, ...], Wait] = {}
    for i, e in enumerate(events):
        if isinstance(e, Wait) and i > 0 and _waited_at_once(events, i - 1) \
                and events[i - 1].op in BEHIND:
            pending[events[i - 1].group] = e
            continue
        if isinstance(e, Issue) and not e.functional and e.op in BEHIND and e.group in pending:
            out.append(pending.pop(e.group))
        if isinstance(e, Compute) and e.phase == "optimizer" and pending:
            out.extend(pending.values())
            pending.clear()
        out.append(e)
    out.extend(pending.values())
    return out


def with_streams(trace: Trace) -> Trace:
    """`trace` with the wrappers' collectives on side streams (module docstring)."""
    return replace(trace, events=_behind(_prefetch(list(trace.events))),
                   meta={**trace.meta, "streams": True})
