"""Compute vs communication in a training step (`run.comm_breakdown=true`).

After training, three short phases on the next batches of the data stream:
1. normal steps, timed: the step time;
2. the same steps under torch.profiler: every collective the backend ran, its payload and the
   time the backend spent in it (gloo: `gloo:<op>` events on gloo's threads, whose durations
   include waiting for the peer; NCCL: `nccl*` kernels on the GPU);
3. compute-only steps of the same local work, timed: DDP under `no_sync()` (no all-reduce), FSDP
   as a plain replica of the model on this rank (no all-gather, no reduce-scatter).
communication time = per step the smallest time any rank spent in collectives (the others also
waited for it), median over steps; exposed communication = the step's slowdown over the
compute-only step, at most the communication time; overlapped = communication time - exposed;
other overhead = the rest of the slowdown (see split_step). Call counts are per step, whole.
Bytes: the measured payloads, the ring traffic they imply, and the analytic volume (DDP
2(n-1)/n G; FSDP FULL_SHARD (n-1)/n (2P + G); without resharding (n-1)/n (P + G)).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "Half": 2,
               "BFloat16": 2, "long int": 8, "int": 4, "unsigned char": 1, "signed char": 1,
               "bool": 1, "short int": 2}


def ring_factor(op: str, n: int) -> float:
    if "all_reduce" in op or "allreduce" in op:
        return 2 * (n - 1) / n
    if any(k in op for k in ("all_gather", "allgather", "reduce_scatter", "alltoall", "all_to_all")):
        return (n - 1) / n
    return 1.0


def comm_calls(events: Any, n: int) -> tuple[list[dict[str, Any]], float]:
    """The backend's collectives (op, payload bytes, seconds) and the GPU time of NCCL kernels,
    from the profiler's raw events (`_KinetoEvent`: times in ns).

    gloo and NCCL both record `<backend>:<op>` events with the input shapes. gloo's run on its
    own threads for the whole collective; NCCL's only enqueue, its time is in the kernels.
    """
    calls, kernel_s = [], 0.0
    for e in events:
        name = e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA and name.lower().startswith("nccl"):
            kernel_s += e.duration_ns() * 1e-9
            continue
        if not name.startswith(("gloo:", "nccl:")):
            continue
        op = name.split(":", 1)[1]
        shapes, dtypes = e.shapes(), e.dtypes()
        elem = DTYPE_BYTES.get(dtypes[0] if dtypes else "float", 4)
        gathered = "all_gather" in op or "allgather" in op  # the shape is this rank's part
        # a 0-dim tensor (shape []) is one element; an op without a tensor (a barrier) moves none
        payload = math.prod(shapes[0]) * elem * (n if gathered else 1) if shapes and dtypes else 0
        calls.append({"op": op, "payload_bytes": payload, "seconds": e.duration_ns() * 1e-9,
                      "start": e.start_ns()})
    return calls, kernel_s


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ code writes there directly) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def timed_steps(step: Callable[[Any], Any], batches: list[Any], sync: Callable[[], None],
                warmup: int = 1) -> float:
    times = []
    for i, b in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        step(b)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(step: Callable[[Any], Any], compute_only: Callable[[Any], Any], batches: list[Any],
            sync: Callable[[], None], gather: Callable[[list[float]], list[list[float]]], n: int,
            analytic: float | None, trace: Path | None = None) -> dict[str, Any]:
    step_s = timed_steps(step, batches, sync)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, record_shapes=True)
    with quiet_stderr():  # kineto prints "profiler_start" lines on every rank
        prof.start()
    for b in batches:
        with record_function("dtlab.step"):
            step(b)
            sync()
    with quiet_stderr():
        prof.stop()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    # The raw events: FunctionEvents (prof.events()) would build a tree of every op first, which
    # took longer than the steps measured here (~1.2 s a rank for 3 small GPT steps on a CPU).
    events = prof.profiler.kineto_results.events()
    calls, kernel_s = comm_calls(events, n)
    windows = [(e.start_ns(), e.end_ns()) for e in events if e.name() == "dtlab.step"
               and e.device_type() == torch.autograd.DeviceType.CPU]

    def in_collectives(op: str | None) -> tuple[float, float]:
        """Seconds per step in collectives (one op or all): least and most over ranks, medians.

        A rank that reached a collective first also waited for the others: per step, the rank
        that waited least shows the transfer itself; the median over steps drops spikes."""
        mine = [sum(c["seconds"] for c in calls if a <= c["start"] < b and op in (None, c["op"]))
                for a, b in windows]
        ranks = gather(mine)  # every rank calls this for the same ops in the same order
        return (statistics.median(min(r[i] for r in ranks) for i in range(len(mine))),
                statistics.median(max(r[i] for r in ranks) for i in range(len(mine))))

    comm_s, comm_max_s = in_collectives(None)
    if kernel_s:  # NCCL: the kernels' GPU time is the communication time
        comm_s = comm_max_s = kernel_s / len(batches)
    compute_s = timed_steps(compute_only, batches, sync)
    per_step = len(batches)
    payload = sum(c["payload_bytes"] for c in calls) / per_step
    traffic = sum(c["payload_bytes"] * ring_factor(c["op"], n) for c in calls) / per_step
    split = split_step(step_s, compute_s, comm_s)

    def calls_per_step(op: str | None) -> int:
        """Collectives per step (the median step's count: steps may differ, a count is whole)."""
        return statistics.median_low(
            sum(1 for c in calls if a <= c["start"] < b and op in (None, c["op"]))
            for a, b in windows) if windows else 0

    ops: dict[str, dict[str, Any]] = {}
    for c in calls:
        entry = ops.setdefault(c["op"], {"payload_bytes": 0, "seconds": 0.0, "sizes": set()})
        entry["payload_bytes"] += c["payload_bytes"] / per_step
        entry["seconds"] += c["seconds"] / per_step
        entry["sizes"].add(c["payload_bytes"])
    for op in sorted(ops):
        ops[op]["calls"] = calls_per_step(op)
        ops[op]["sizes"] = sorted(ops[op]["sizes"])
        ops[op]["seconds_per_step"] = in_collectives(op)[0]
    return {
        "steps": per_step, "step_time_s": step_s, "compute_time_s": compute_s, **split,
        "comm_share": split["exposed_comm_s"] / step_s if step_s else 0.0,
        "comm_time_with_wait_s": comm_max_s,
        "payload_bytes_per_step": payload, "traffic_bytes_per_step": traffic,
        "analytic_traffic_bytes_per_step": analytic,
        "calls_per_step": calls_per_step(None), "by_op": ops,
    }


def split_step(step_s: float, compute_s: float, comm_s: float) -> dict[str, float]:
    """Communication time split into exposed + overlapped (their sum is comm_time_s, exactly).

    The step's slowdown over its compute-only twin is what communication cost the step; the part
    of it that the profiler saw in collectives (at most the collectives' time) is exposed
    communication. The rest of the slowdown is other overhead of the distributed step (gradient
    bucket copies, hooks, cores shared with the backend's threads), not communication."""
    slowdown = max(0.0, step_s - compute_s)
    exposed = min(slowdown, comm_s)
    overlapped = comm_s - exposed
    return {"exposed_comm_s": exposed, "overlapped_comm_s": overlapped,
            "comm_time_s": exposed + overlapped, "other_overhead_s": slowdown - exposed}
