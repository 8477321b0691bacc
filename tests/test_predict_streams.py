"""A CPU trace priced for a GPU: the wrappers' collectives on side streams (predict/streams.py)."""

from __future__ import annotations

from collections import Counter

from dtlab.predict.events import Compute, Issue, Trace, Wait
from dtlab.predict.simulate import simulate
from dtlab.predict.streams import with_streams


def unit_trace(units: int, functional: bool = False) -> Trace:
    """FSDP as a CPU runs it: gather unit k, wait, compute k; then backward: compute k, reduce,
    wait; the optimizer."""
    events: list = []
    n = 0
    for k in range(units):
        n += 1
        events += [Issue(n, "all_gather", 1000, (0, 1), "forward", k, functional=functional),
                   Wait(n), Compute("forward", k, 1.0)]
    for k in reversed(range(units)):
        n += 1
        events += [Compute("backward", k, 2.0),
                   Issue(n, "reduce_scatter", 1000, (0, 1), "backward", k, functional=functional),
                   Wait(n)]
    return Trace(0, 2, events + [Compute("optimizer", None, 0.5)])


def run(trace: Trace) -> float:
    return simulate({0: trace}, lambda c: c.seconds, lambda i: (0.8, "intra")).step_s


def test_gathers_run_one_unit_ahead_and_reduces_behind_the_backward() -> None:
    """4 units, gathers 0.8 s, forward 1 s, backward 2 s: only the first gather and the last
    reduce stay exposed on streams (14.1 s), against every call on the CPU's order (18.9 s)."""
    cpu = unit_trace(4)
    gpu = with_streams(cpu)
    assert Counter(map(repr, gpu.events)) == Counter(map(repr, cpu.events))
    issued: set[int] = set()
    for e in gpu.events:
        if isinstance(e, Issue):
            issued.add(e.id)
        elif isinstance(e, Wait):
            assert e.id in issued
    assert abs(run(cpu) - (4 * 1.0 + 4 * 2.0 + 0.5 + 8 * 0.8)) < 1e-9
    assert abs(run(gpu) - (0.8 + 4 * 1.0 + 4 * 2.0 + 0.8 + 0.5)) < 1e-9


def test_functional_collectives_stay_on_the_critical_path() -> None:
    """Tensor parallelism's collectives (functional) are not moved."""
    cpu = unit_trace(3, functional=True)
    assert with_streams(cpu).events == cpu.events
