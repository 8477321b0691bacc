"""Processor sharing: the ranks of a CPU host share its cores, and each rank's compute runs at
the share it gets while the others compute too (simulate.py's compute streams).

A rank computing with `threads` threads while k ranks of its node compute runs
max(1, threads x k / cores) times slower than alone. Ranks waiting for a collective or a
pipeline's message use no core, so the others run faster meanwhile: a 4-stage pipeline on 2
cores is slowed where its stages overlap, not in its bubble. A node's ranks that were not traced
do what the traced ones do (data and tensor parallel ranks are symmetric), so k counts each
computing traced rank of the node for the untraced ones it stands for.

Not modelled: the cores that communication itself takes (gloo's threads copy and reduce on the
CPU: the overlap slowdown of the cluster file covers the rank's own), and the memory bandwidth and
caches that ranks on their own cores still share (measured instead: compute is timed with the
node's other ranks running beside the traced one, predict/corun.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class CoreShare:
    """Which traced rank is on which node, and how many of each node's ranks compute now."""

    def __init__(self, cores: int, threads: int, ranks_per_node: int, world: int,
                 traced: Iterable[int]) -> None:
        if cores < 1 or ranks_per_node < 1:
            raise ValueError(f"cores ({cores}) and ranks per node ({ranks_per_node}) must be >= 1")
        self.cores, self.threads = cores, max(1, threads)
        self.node_of = {r: r // ranks_per_node for r in traced}
        on_node = Counter(r // ranks_per_node for r in range(max(world, 1 + max(self.node_of))))
        traced_on = Counter(self.node_of.values())
        self.stands_for = {n: on_node[n] / traced_on[n] for n in traced_on}
        self.computing: Counter[int] = Counter()

    def factor(self, rank: int) -> float:
        """How many times slower than alone `rank` computes now."""
        node = self.node_of[rank]
        return max(1.0, self.threads * self.computing[node] * self.stands_for[node] / self.cores)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]
