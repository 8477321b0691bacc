"""The seconds one collective or message takes on a cluster, and the tier of links it uses.

Tier: "intra" when every rank of the group is on one node (node of a rank = rank //
ranks_per_node), else "inter".

On one tier, nccl-tests' bus-bandwidth convention (its doc/PERFORMANCE.md): busbw = algbw x a
factor that makes the number comparable to a link's speed, so a collective of S bytes (the
nccl-tests size, events.py) on n ranks takes

    t = latency + S x factor / busbw
    factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
            broadcast, reduce 1; send/recv 1; barrier: latency only

`latency` is the time of a small collective on that tier as nccl-tests reports it, taken as not
growing with n (NCCL uses trees and low-latency protocols for small messages): an assumption.
A link given as a `dtlab comm` fit instead takes that fit's ring prediction (comm/model.py), from
the fit measured on the most ranks up to n where the file gives several (cluster.Link.fit_for).

Across nodes with g > 1 ranks of the group on a node and m nodes, the hierarchical form NCCL's
and most frameworks' multi-node collectives follow: the fast intra-node links carry the full
size, the inter-node links (one NIC per GPU, so the g-th ranks of each node form g independent
groups working in parallel) carry 1/g of it, each at the slower tier's busbw per GPU:

    all_reduce      intra reduce_scatter(S, g) + inter all_reduce(S/g, m) + intra all_gather(S, g)
    all_gather      inter all_gather(S/g, m) + intra all_gather(S, g)
    reduce_scatter  intra reduce_scatter(S, g) + inter reduce_scatter(S/g, m)
    broadcast,      inter op(S, m) + the intra hop's latency: chunks are pipelined, so the intra
    reduce          hop's bytes hide behind the slower inter hop's
    all_to_all      the larger of the bytes leaving the node, S (n-g)/n over the inter link, and
                    those staying, S (g-1)/n over the intra link (both move at once)
    send/recv       one message over the inter link

With one rank of the group per node (g = 1: HSDP's replicas, a pipeline across nodes) the
collective runs flat on the inter tier.

A link may also give `sync_us`: what a collective costs inside a step beyond what it costs back
to back, as `dtlab comm` measures it (the ranks arriving from their own compute at different
times, waiting threads woken by the OS, caches the compute turned over), measured by
benchmarks/sync_cost.py per number of ranks. It is added to a collective that follows the rank's
own compute (Issue.after_compute: the first of a run of calls issued back to back, as ZeRO-1's
broadcasts are, pays it for the run), not to a pipeline's messages, whose waits the simulator
already counts as bubble.

And `burst`: per op and number of ranks, what a call issued back to back with others
(Issue.in_burst: ZeRO-1's parameter broadcasts) costs over its price, measured by
benchmarks/burst_cost.py. On a CPU gloo's calls queue behind each other in ways one call alone
does not show: on 2 ranks a burst costs more per call than the fit, on 4 oversubscribed ranks far
less than the fit's latency, which a lone call pays in full waiting for its peers to be scheduled.
"""

from __future__ import annotations

from collections import Counter

from dtlab.comm.model import predict
from dtlab.predict.cluster import Cluster, Link
from dtlab.predict.events import Issue

_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
            "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
            "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0,
            "recv": lambda n: 1.0, "barrier": lambda n: 0.0}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` on n ranks (the bytes per rank on the busiest link per
    byte of S)."""
    if op not in _FACTORS:
        raise ValueError(f"no bus-bandwidth factor for '{op}' (known: {', '.join(_FACTORS)})")
    return _FACTORS[op](n) if n > 1 else 0.0


def link_seconds(link: Link, op: str, size: float, n: int) -> float:
    """Seconds of `op` on `size` bytes among n ranks over one tier of links (flat)."""
    if n <= 1 and op not in ("send", "recv"):
        return 0.0
    fit = link.fit_for(n)
    if fit is not None:
        if op == "barrier":
            op, size = "all_reduce", 0.0
        name = "send_recv" if op in ("send", "recv") else op
        return predict(fit, name, size, max(n, 2))["ring_s"]
    assert link.bus_bytes_per_s is not None and link.latency_s is not None
    return link.latency_s + size * bus_factor(op, max(n, 2)) / link.bus_bytes_per_s


def tier(group: tuple[int, ...], ranks_per_node: int) -> str:
    return "intra" if len({r // ranks_per_node for r in group}) <= 1 else "inter"


def comm_seconds(issue: Issue, cluster: Cluster, ranks_per_node: int) -> tuple[float, str]:
    """(seconds, tier) of one Issue: its price on the links, times the tier's burst factor for
    a collective issued back to back with others, plus the tier's sync cost for one that follows
    compute (module docstring). Group of one rank: 0 s. PoorFitError (a DtlabError) where a fit
    refuses to predict."""
    t, tier = _on_links(issue, cluster, ranks_per_node)
    if issue.op in ("send", "recv") or len(issue.group) <= 1:
        return t, tier
    link, n = cluster.intra if tier == "intra" else cluster.inter, len(issue.group)
    if issue.in_burst:
        t *= link.burst_for(issue.op, n)
    return t + (link.sync_for(n) if issue.after_compute else 0.0), tier


def _on_links(issue: Issue, cluster: Cluster, ranks_per_node: int) -> tuple[float, str]:
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    op, size, group = issue.op, float(issue.bytes), issue.group
    per_node = Counter(r // ranks_per_node for r in group)
    m, g, n = len(per_node), max(per_node.values(), default=1), len(group)
    if m <= 1:
        return link_seconds(cluster.intra, op, size, n), "intra"
    intra, inter = cluster.intra, cluster.inter
    if g == 1 or op in ("send", "recv"):
        return link_seconds(inter, op, size, m), "inter"
    if op in ("all_reduce", "barrier"):
        if op == "barrier":
            size = 0.0
        t = (link_seconds(intra, "reduce_scatter", size, g)
             + link_seconds(inter, "all_reduce", size / g, m)
             + link_seconds(intra, "all_gather", size, g))
    elif op == "all_gather":
        t = link_seconds(inter, "all_gather", size / g, m) + link_seconds(intra, op, size, g)
    elif op == "reduce_scatter":
        t = link_seconds(intra, op, size, g) + link_seconds(inter, op, size / g, m)
    elif op in ("broadcast", "reduce"):
        t = link_seconds(inter, op, size, m) + link_seconds(intra, op, 0.0, g)
    elif op == "all_to_all":
        t = max(link_seconds(inter, "send", size * (n - g) / n, 2),
                link_seconds(intra, "send", size * (g - 1) / n, 2))
    else:
        raise ValueError(f"no price for op '{op}'")
    return t, "inter"
