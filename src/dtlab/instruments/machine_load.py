"""Can a run's timings be trusted? The machine's load and the run's own oversubscription.

Timings measure the machine as much as the strategy: with another process on the cores, or more
busy threads than cores, a step waits for a core and throughput drops by a factor that has
nothing to do with the strategy. A run records, in summary.json `timing`:

- `cores`: the cores its ranks may run on (the union of their CPU affinity, per node);
  `ranks_on_node` x `threads_per_rank` against them: `oversubscribed` when more busy threads
  than cores.
- `loadavg_before` / `loadavg_after`: the system's 1/5/15-minute load averages when training
  began and ended (os.getloadavg; the 1-minute figure lags by about a minute and includes the
  run's own ranks).
- `others_cores`: the cores kept busy by other processes on those cores while it trained: the
  busy time of those cores (/proc/stat) minus the CPU time of the run's own ranks, per second.
  Where /proc/stat cannot be read, the load average before the run stands in.
- `step_time_spread`: (p90 - p10) / median of the timed steps.
- `unreliable`: one reason per problem (empty when the timings can be trusted).

compare, sweep and report print one WARN line per unreliable run, and the report's findings do
not compare the throughput of unreliable runs.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

# Other processes may take up to half a core beyond the cores a run leaves free: a shell, an
# editor or a monitor costs a few percent of a core; a competing job costs whole cores.
OTHERS_MARGIN_CORES = 0.5
# (p90 - p10) / median of the step time. Steps of a fixed workload on a quiet machine vary by
# 5-8% (quick CNN, 40 steps, measured here); a rank that loses its core to another process for
# part of its steps makes those several times slower: 1.6-3.8 with one busy process here.
MAX_STEP_TIME_SPREAD = 0.5
MIN_STEPS_FOR_SPREAD = 5  # below this p10 and p90 are two of a handful of values: not judged
_MASK_WORDS, _BITS = 20, 52  # CPU ids below 1040, exact in float64


def cpu_set() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def busy_ticks() -> dict[int, int]:
    """Per CPU, the clock ticks spent not idle since boot ({} where /proc/stat is missing)."""
    ticks = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit():
                    v = [int(x) for x in values] + [0] * 8
                    # user nice system (idle iowait) irq softirq steal; guest is inside user
                    ticks[int(name[3:])] = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    except (OSError, ValueError, IndexError):
        return {}
    return ticks


def cpu_peak_tflops() -> float | None:
    """This rank's float32 matmul TFLOP/s with its threads, the CPU's peak for MFU (flops.py),
    measured before the first step, as the steps will find the cores; None on a CUDA run."""
    import torch

    if torch.cuda.is_initialized():  # the model is on a GPU: its peak is the datasheet's
        return None
    from dtlab.instruments.flops import cpu_matmul_tflops

    return cpu_matmul_tflops(torch.get_num_threads())


@dataclass
class LoadProbe:
    """The machine's state when training began; `finish` measures what happened since."""

    cpu_tflops: float | None = None  # the CPU peak for MFU, when measured (with_cpu_peak)
    loadavg: list[float] | None = field(default_factory=load_average)
    ticks: dict[int, int] = field(default_factory=busy_ticks)
    cpu_s: float = field(default_factory=time.process_time)  # this process, all its threads
    wall: float = field(default_factory=time.perf_counter)

    @classmethod
    def with_cpu_peak(cls) -> LoadProbe:
        """A training run's probe: the CPU peak is measured first, so that its matmuls are not
        counted as the run's own CPU time (a benchmark that reports no MFU skips it)."""
        return cls(cpu_tflops=cpu_peak_tflops())

    def finish(self) -> dict[str, Any]:
        """This rank's view, in numbers every rank can exchange (see `node_view`)."""
        wall = max(time.perf_counter() - self.wall, 1e-9)
        ticks = busy_ticks()
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = {c: (ticks[c] - self.ticks[c]) / hz for c in ticks.keys() & self.ticks.keys()}
        return {"wall_s": wall, "own_cpu_s": time.process_time() - self.cpu_s, "busy_s": busy,
                "loadavg_before": self.loadavg, "loadavg_after": load_average()}


def host_id() -> float:
    """The host name as a number below 2^48 (ranks on one node share it)."""
    return float(int(hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12], 16))


def mask(cpus: set[int]) -> list[float]:
    words = [0] * _MASK_WORDS
    for c in cpus:
        if c < _MASK_WORDS * _BITS:
            words[c // _BITS] |= 1 << (c % _BITS)
    return [float(w) for w in words]


def unmask(words: list[float]) -> set[int]:
    return {i * _BITS + b for i, w in enumerate(words) for b in range(_BITS) if int(w) >> b & 1}


def node_view(mine: dict[str, Any], threads: int, gather: Any) -> list[dict[str, Any]]:
    """Every node's cores, busy threads and load from other processes; this rank's node first.

    `gather(list of floats)` returns every rank's list (every rank must call this, twice). Cores:
    the union of the affinities of a node's ranks; their busy time minus the CPU time of the
    node's ranks is what other processes used."""
    me = [host_id(), float(threads), mine["own_cpu_s"] / mine["wall_s"], *mask(cpu_set())]
    ranks = [r for r in gather(me) if r[0] == me[0]]
    cores = set().union(*(unmask(r[3:]) for r in ranks))
    others = -1.0  # unknown
    if cores and cores <= set(mine["busy_s"]):
        busy = sum(mine["busy_s"][c] for c in cores) / mine["wall_s"]
        others = round(max(0.0, busy - sum(r[2] for r in ranks)), 3)
    node = [me[0], float(len(cores)), float(len(ranks)), float(sum(int(r[1]) for r in ranks)), others]
    nodes = {r[0]: r for r in gather(node)}
    nodes.pop(me[0])
    return [{"cores": int(n[1]), "ranks_on_node": int(n[2]), "busy_threads": int(n[3]),
             "others_cores": n[4] if n[4] >= 0 else None} for n in (node, *nodes.values())]


def judge(record: dict[str, Any], spread: float | None, timed_steps: int) -> list[str]:
    """Why this run's timings cannot be trusted (one short reason each; empty when they can)."""
    reasons = []
    for node in record["nodes"]:
        cores, demand, others = node["cores"], node["busy_threads"], node["others_cores"]
        where = " on one of its nodes" if len(record["nodes"]) > 1 else ""
        if demand > cores:
            reasons.append(f"oversubscribed: {node['ranks_on_node']} rank(s) x "
                           f"{record['threads_per_rank']} thread(s) on {cores} core(s){where}")
        if others is not None and others > max(0, cores - demand) + OTHERS_MARGIN_CORES:
            reasons.append(f"machine loaded: other processes kept {others:.1f} of {cores} "
                           f"core(s) busy{where}")
    before = record.get("loadavg_before")
    if record["others_cores"] is None and before and before[0] > record["cores"]:
        reasons.append(f"machine loaded: load average {before[0]:.1f} above {record['cores']} "
                       "core(s)")
    if spread is not None and timed_steps >= MIN_STEPS_FOR_SPREAD and spread > MAX_STEP_TIME_SPREAD:
        reasons.append(f"step times spread by {100 * spread:.0f}% of the median (p10 to p90, "
                       f"limit {100 * MAX_STEP_TIME_SPREAD:.0f}%)")
    return list(dict.fromkeys(reasons))


def timing_record(probe: LoadProbe, threads: int, gather: Any, step_stats: dict[str, float],
                  timed_steps: int) -> dict[str, Any]:
    """summary.json `timing` (see the module docstring): this node's numbers, every node's in
    `nodes`. Every rank calls it."""
    mine = probe.finish()
    nodes = node_view(mine, threads, gather)
    here = nodes[0]
    median = step_stats.get("median")
    spread = (step_stats["p90"] - step_stats["p10"]) / median if median else None
    record: dict[str, Any] = {
        **here, "threads_per_rank": threads, "oversubscribed": any(
            n["busy_threads"] > n["cores"] for n in nodes),
        "loadavg_before": mine["loadavg_before"], "loadavg_after": mine["loadavg_after"],
        "step_time_spread": round(spread, 3) if spread is not None else None, "nodes": nodes}
    record["unreliable"] = judge(record, spread, timed_steps)
    return record


def warning(label: str, summary: dict[str, Any]) -> str | None:
    """The WARN line for a run whose timings are unreliable (None when they are fine)."""
    reasons = (summary.get("timing") or {}).get("unreliable")
    if not reasons:
        return None
    return f"WARN: {label}: timings unreliable ({'; '.join(reasons)}); rerun on an idle machine " \
           "with ranks x threads <= cores"


def mfu_line(summary: dict[str, Any]) -> str:
    """`MFU: 23.1% of 0.231 TFLOP/s per rank (where that peak comes from)`, or `MFU: n/a (why)`
    (flops.py withholds an MFU that cannot be true, e.g. from a CPU peak measured under load)."""
    mfu, top, note = summary.get("mfu"), summary.get("peak_tflops"), summary["mfu_note"]
    if mfu is None or not top:
        return f"MFU: n/a ({note})"
    return f"MFU: {100 * mfu:.1f}% of {top:.3g} TFLOP/s per rank ({note})"
