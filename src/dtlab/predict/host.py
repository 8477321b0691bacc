"""The CPU host a prediction measures on: how busy other processes kept it while compute was
timed, and how its cores are shared among the ranks of a node (cores.py)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from dtlab.predict.cluster import first_clause
from dtlab.predict.cores import CoreShare, correlation_at
from dtlab.predict.events import Compute, Trace
from dtlab.predict.timeline import Timeline

# The duty cycle's fixed point (cores.py): it moves by less than this between two simulations,
# or the iterations run out (each is one simulation of the step, linear in its events).
DUTY_TOLERANCE = 1e-3
DUTY_ITERATIONS = 30


def core_share(cluster: Any, threads: int, ranks_per_node: int, world: int,
               traces: dict[int, Trace], notes: list[str],
               compute_s: Callable[[Compute], float]) -> CoreShare | None:
    """The simulator's sharing of a CPU host's cores among its ranks (None: a device per rank).
    The ranks' phase correlation is the cluster's at the traced ranks' compute per step: the
    ranks all meet at least once a step, at the optimizer's (cores.correlation_at)."""
    cores = cluster.cores
    if not cores:
        return None
    per_step = max(sum(compute_s(e) for e in t.events if isinstance(e, Compute))
                   for t in traces.values())
    rho = correlation_at(cluster.phase_correlation, per_step * 1e3)
    share = CoreShare(cores, threads, ranks_per_node, world, traces, correlation=rho)
    if ranks_per_node * threads > cores:
        source = textwrap.shorten(first_clause(cluster.phase_correlation_source), 120,
                                  placeholder=" [...]")
        notes.append(f"{ranks_per_node} rank(s) x {threads} thread(s) share {cores} cores: "
                     "each rank computes at its share of them while the others compute "
                     f"(up to {ranks_per_node * threads / cores:.2g}x slower than alone)"
                     + (f"; phase correlation {rho:.2f} at {per_step * 1e3:.3g} ms of compute "
                        f"a step ({source})" if share.phased else ""))
    return share


def duty_cycle(timeline: Timeline) -> float:
    """The fraction of the step the slowest traced rank spends computing."""
    if timeline.step_s <= 0:
        return 0.0
    computing = sum(s for k, s in timeline.split.items() if k != "bubble")
    return min(1.0, computing / timeline.step_s)


def simulate_shared(run: Callable[[CoreShare | None], Timeline],
                    cores: CoreShare | None) -> Timeline:
    """run(cores), the step simulated with the node's cores shared. Where the untraced ranks'
    phase matters (CoreShare.phased) their duty cycle is the traced ranks': starting from 1 (every
    rank computes all the time, the most sharing), each simulation's duty cycle is the next one's,
    down to the fixed point (the duty cycle falls with the sharing, monotonically)."""
    timeline = run(cores)
    if cores is None or not cores.phased:
        return timeline
    for _ in range(DUTY_ITERATIONS):
        duty = duty_cycle(timeline)
        if abs(duty - cores.duty) < DUTY_TOLERANCE:
            break
        cores.duty = duty
        timeline = run(cores)
    return timeline


def load_probe(device: str) -> Any:
    """A CPU measurement watches the machine (instruments/machine_load.py): None elsewhere."""
    from dtlab.instruments.machine_load import LoadProbe

    return LoadProbe() if device == "cpu" else None


def machine_loaded(probe: Any, threads: int, helpers_cpu_s: float = 0.0) -> str | None:
    """Why the compute just measured is not this machine's (other processes busy), or None:
    the cores other processes kept busy meanwhile, as a run's timing record counts them; the
    processes that ran beside the traced rank on purpose (`helpers_cpu_s`) are not others."""
    from dtlab.instruments.machine_load import OTHERS_MARGIN_CORES, node_view

    mine = probe.finish()
    mine["own_cpu_s"] += helpers_cpu_s
    node = node_view(mine, threads, lambda me: [me])[0]
    others = node["others_cores"]
    if others is not None and others > OTHERS_MARGIN_CORES:
        return f"other processes kept {others:.1f} of {node['cores']} core(s) busy"
    return None
