"""Processor sharing: the ranks of a CPU host share its cores, and each rank's compute runs at
the share it gets while the others compute too (simulate.py's compute streams).

A rank computing with `threads` threads while k ranks of its node compute runs
max(1, threads x k / cores) times slower than alone. Ranks waiting for a collective or a
pipeline's message use no core, so the others run faster meanwhile: a 4-stage pipeline on 2
cores is slowed where its stages overlap, not in its bubble. A node's ranks that were not traced
do what the traced ones do (data and tensor parallel ranks are symmetric). When they do it is
the cluster's `phase_correlation` rho: with rho = 1 they compute exactly when the traced ones do
(lockstep), so k counts each computing traced rank for the untraced ones it stands for; with
rho = 0 their phase is independent of the traced ranks' (the OS time-slices 4 ranks on 2 cores,
and a rank that waits for a collective hands its core to one that computes), and each computes
a `duty` fraction of the time, the traced ranks' own (host.simulate_shared iterates the
simulation to that fixed point). In between, an untraced rank computes with weight
rho x (share of the traced ranks computing) + (1 - rho) x duty. rho is the Pearson correlation
of two ranks' "computing" over time (benchmarks/sync_cost.py measures it); a cluster file may
give it per length of the compute between two meetings of the ranks, as measured, since it
grows with that length (correlation_at).

Not modelled: the cores that communication itself takes (gloo's threads copy and reduce on the
CPU, 1-3 ms of CPU per call on 4 ranks here, benchmarks/comm_cpu.py; the overlap slowdown of the
cluster file covers the rank's own). Measured instead of modelled: the memory bandwidth and caches
the ranks share, and what time-slicing costs a rank's compute where they outnumber the cores
(compute is timed with the node's other ranks beside the traced one, on its thread's CPU clock
where they outnumber the cores: predict/corun.py).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable


def correlation_at(rho: float | dict[float, float], compute_ms: float) -> float:
    """The phase correlation of ranks that compute `compute_ms` between two meetings: `rho`
    itself, or from a table {compute ms: rho} of measurements, linear in log(ms) between two
    points and the nearest point's value beyond them (never extrapolated)."""
    if not isinstance(rho, dict):
        return float(rho)
    points = sorted(rho.items())
    if compute_ms <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if compute_ms <= x1:
            return y0 + (y1 - y0) * math.log(compute_ms / x0) / math.log(x1 / x0)
    return points[-1][1]


class CoreShare:
    """Which traced rank is on which node, and how many of each node's ranks compute now."""

    def __init__(self, cores: int, threads: int, ranks_per_node: int, world: int,
                 traced: Iterable[int], correlation: float = 1.0, duty: float = 1.0) -> None:
        if cores < 1 or ranks_per_node < 1:
            raise ValueError(f"cores ({cores}) and ranks per node ({ranks_per_node}) must be >= 1")
        self.cores, self.threads = cores, max(1, threads)
        self.node_of = {r: r // ranks_per_node for r in traced}
        on_node = Counter(r // ranks_per_node for r in range(max(world, 1 + max(self.node_of))))
        if not 0.0 <= correlation <= 1.0 or not 0.0 <= duty <= 1.0:
            raise ValueError(f"correlation ({correlation}) and duty ({duty}) must be in [0, 1]")
        self.traced_on = Counter(self.node_of.values())
        self.untraced = {n: on_node[n] - self.traced_on[n] for n in self.traced_on}
        self.correlation, self.duty = correlation, duty
        self.computing: Counter[int] = Counter()

    @property
    def phased(self) -> bool:
        """Whether the untraced ranks' phase matters: some are untraced, and not in lockstep."""
        return self.correlation < 1.0 and any(self.untraced.values())

    def factor(self, rank: int) -> float:
        """How many times slower than alone `rank` computes now."""
        node = self.node_of[rank]
        computing = self.computing[node]
        weight = (self.correlation * computing / self.traced_on[node]
                  + (1.0 - self.correlation) * self.duty)
        return max(1.0, self.threads * (computing + self.untraced[node] * weight) / self.cores)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]
