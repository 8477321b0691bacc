"""Communication per step of each data-parallel layout: the collectives, their volume and time.

Ring traffic per rank of a collective of S bytes on n ranks (dtlab/comm/model.py): all-reduce
2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S. Per step (P, G: parameters and gradients in
the bytes they travel in): ddp 2(n-1)/n G; zero1/2 (n-1)/n (G + P); zero3 per unit (n-1)/n (2P
+ G), one all-gather fewer without resharding after forward; hybrid zero3 inside groups of s and
an all-reduce of G/s across them; torch's ZeroRedundancyOptimizer DDP's all-reduce + P of
broadcasts. Offload's host-device copies are listed apart (PCIe, not the network). Times: traffic
/ bandwidth, or the alpha-beta fit of a `dtlab comm` result (with per-call latency); overlap with
compute is not modelled. Why, and the measurements: docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.cli_args import input_file
from dtlab.comm.model import fit_file, predict, ring_terms
from dtlab.errors import DtlabError
from dtlab.estimate.memory import Kind, Plan, Precision

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first (smallest) bucket


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | all_gather | reduce_scatter | broadcast
    size_bytes: float  # S: the full (gathered / reduced) size of one call
    ranks: int
    calls: float = 1
    inter_node: bool = False  # crosses nodes (the slower links)

    @property
    def traffic(self) -> float:
        """Bytes each rank sends (= receives) over all calls, as the ring algorithm moves them."""
        return self.calls * ring_terms(self.op, self.ranks)[1] * self.size_bytes


def buckets(total: float, first: float = DDP_FIRST_BUCKET_BYTES,
            cap: float = DDP_BUCKET_BYTES) -> list[tuple[float, int]]:
    """DDP-style buckets covering `total` bytes, as (size, how many of that size): the first
    bucket is small (it starts early), the rest equal. Counted, not listed: a trillion-parameter
    model has ~10^5 buckets."""
    if total <= first:
        return [(total, 1)]
    n = math.ceil((total - first) / cap)
    return [(first, 1), ((total - first) / n, n)]


def collectives(plan: Plan, units: list[float], precision: Precision, world: int,
                ranks_per_node: int, reshard_after_forward: bool = True,
                torch_zero1: bool = False, backend: str = "nccl", root: float = 0.0,
                root_reshards: bool = True) -> list[Collective]:
    """The collectives of one step. `units`: parameter counts of the blocks (sharding units);
    `root`: the parameters of the root unit, which FSDP1 keeps gathered from forward to backward
    (`root_reshards=False`) and FSDP2 gathers again for backward. gloo has no reduce-scatter: it
    runs an all-reduce of the whole buffer (the profiler of a dtlab run shows `gloo:all_reduce`
    of each unit's unsharded gradients), at an all-reduce's traffic."""
    if world == 1:
        return []
    rs = "all_reduce" if backend == "gloo" else "reduce_scatter"
    n_params = sum(units) + root
    g_bytes = n_params * precision.reduce
    p_bytes = n_params * precision.weight  # zero1/2 all-gather the updated (stored) weights
    multi_node = world > ranks_per_node
    if plan.kind == Kind.REPLICATED or (plan.kind == Kind.ZERO1 and torch_zero1):
        out = [Collective("all_reduce", s, world, n, multi_node) for s, n in buckets(g_bytes)]
        if plan.kind == Kind.ZERO1:  # each rank broadcasts its updated parameters to the others
            out.append(Collective("broadcast", p_bytes / world, world, world, multi_node))
        return out
    if plan.kind in (Kind.ZERO1, Kind.ZERO2):
        return ([Collective(rs, s, world, n, multi_node) for s, n in buckets(g_bytes)]
                + [Collective("all_gather", s, world, n, multi_node) for s, n in buckets(p_bytes)])
    shards, out = plan.shards(world), []
    for i, unit in enumerate([*units, root] if root else units):
        gathers = 2 if reshard_after_forward and (root_reshards or i < len(units)) else 1
        out += [Collective("all_gather", unit * precision.compute, shards, gathers,
                           shards > ranks_per_node),
                Collective(rs, unit * precision.reduce, shards, 1, shards > ranks_per_node)]
        if shards < world:  # HYBRID: replicas average their shards
            out.append(Collective("all_reduce", unit * precision.reduce / shards, world // shards,
                                  1, True))
    return out


def offload_bytes(plan: Plan, n_params: float, precision: Precision, world: int) -> float:
    """Host<->device bytes per step of offloading: gradient shard out, updated parameters back."""
    return n_params * (precision.grad + precision.weight) / plan.shards(world) if plan.offload else 0.0


# ------------------------------------------------------------------------------------ time
@dataclass(frozen=True)
class Links:
    """What to predict times with: bandwidths in bytes/s, or an alpha-beta fit."""

    bandwidth: float | None = None  # within a node (or everywhere)
    inter_node_bandwidth: float | None = None
    fitted: dict[str, dict[str, float]] | None = None
    source: str = ""

    def seconds(self, c: Collective) -> float | None:
        if self.fitted is not None:
            return c.calls * predict(self.fitted, c.op, c.size_bytes, c.ranks)["ring_s"]
        bw = self.inter_node_bandwidth if c.inter_node and self.inter_node_bandwidth else self.bandwidth
        return c.traffic / bw if bw else None


def load_comm_results(path: Path) -> Links:
    """A `dtlab comm --json` or `--csv` file -> its alpha-beta fit (dtlab.comm.model.fit)."""
    input_file("--comm-results", path, f"measure with dtlab comm --op all --json {path}")
    try:
        fitted = fit_file(path)
    except (ValueError, KeyError, TypeError, ArithmeticError):
        raise DtlabError(f"--comm-results '{path}' is not a dtlab comm --json/--csv file; fix: "
                         "pass what dtlab comm --json FILE or --csv FILE wrote") from None
    if not fitted:
        raise DtlabError(f"--comm-results '{path}' has no collective measured at two sizes or "
                         "more; fix: run dtlab comm with --min-bytes below --max-bytes")
    if "all_reduce" not in fitted:  # what every op without its own fit is predicted from
        raise DtlabError(f"--comm-results '{path}' has no all_reduce measured ({', '.join(fitted)} "
                         "only); fix: measure with dtlab comm --op all --json FILE")
    ops = ", ".join(f"{op} ({m['world_size']} ranks)" for op, m in fitted.items())
    return Links(fitted=fitted, source=f"alpha-beta fit of {path}: {ops}")


def summarize(calls: list[Collective], links: Links | None) -> dict[str, Any]:
    by_op: dict[str, dict[str, float]] = {}
    for c in calls:
        e = by_op.setdefault(c.op, {"calls": 0, "traffic_bytes": 0.0})
        e["calls"] += c.calls
        e["traffic_bytes"] += c.traffic
    times = [links.seconds(c) for c in calls] if links else []
    return {"traffic_bytes": sum(c.traffic for c in calls), "calls": sum(c.calls for c in calls),
            "by_op": by_op, "time_s": sum(times) if times and None not in times else None}
