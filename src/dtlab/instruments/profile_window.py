"""`run.profile`: torch.profiler over steps [start, start + steps) of the run itself.

Each rank writes RUN_DIR/profile/trace_rank<r>.json (open it in https://ui.perfetto.dev; several
ranks together with Holistic Trace Analysis), and each step of the window is split into parts
that add up to the step (step_table): the instant-by-instant share of
  data       the batch being put together ("dtlab.data"),
  optimizer  the optimizer's step (torch's "Optimizer.step#..."; what it communicates counts here),
  compute    operators at work: aten ops on the training thread (CPU) or non-NCCL kernels (GPU),
  exposed    communication with no compute beside it: the step waits for it,
  other      none of these: Python, launches, idle.
Communication is the backend's own record: gloo's `gloo:<op>` events on its threads (their time
includes waiting for the peer), NCCL's kernels on the GPU; the part of it under compute is the
overlapped communication. With `memory=true` the profiler also records every allocation, and the
memory timeline by category (parameters, gradients, optimizer state, activations, ...) is written
beside the trace: PyTorch's only memory timeline on CPU (on CUDA see run.memory_snapshot).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import statistics
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dtlab.config import Config, ConfigError, ProfileConfig
from dtlab.distributed import DistContext
from dtlab.instruments.breakdown import quiet_stderr
from dtlab.instruments.memory_snapshot import MemorySnapshot

DIR = "profile"
PARTS = ("data_s", "compute_s", "optimizer_s", "exposed_comm_s", "other_s")
COLUMNS = ("step_s", *PARTS, "comm_s", "overlapped_comm_s")
Span = tuple[int, int]


def union(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def minus(spans: list[Span], cut: list[Span]) -> list[Span]:
    """The parts of `spans` (disjoint, sorted) outside `cut` (disjoint, sorted)."""
    out = []
    for a, b in spans:
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def intersect(spans: list[Span], other: list[Span]) -> list[Span]:
    return minus(spans, minus(spans, other))


def length(spans: list[Span]) -> float:
    return sum(b - a for a, b in spans) * 1e-9


def step_table(events: Any) -> list[dict[str, float]]:
    """Per step of the window, the parts of COLUMNS in seconds, from the profiler's raw events
    (`_KinetoEvent`, times in ns)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    steps, spans = [], {"data": [], "optimizer": [], "comm": [], "compute": []}
    ops, gloo, training, kernels = [], [], set(), False
    for e in events:
        name, span, thread = e.name(), (e.start_ns(), e.end_ns()), e.start_thread_id()
        if e.device_type() == cuda:  # kernels: NCCL's are communication, the rest compute
            kernels = True
            spans["comm" if name.lower().startswith("nccl") else "compute"].append(span)
        elif name.startswith("dtlab.step#"):
            steps.append((int(name.split("#")[1]), span))
            training.add(thread)
        elif name == "dtlab.data":
            spans["data"].append(span)
        elif name.startswith("Optimizer.step#"):
            spans["optimizer"].append(span)
        elif name.startswith("gloo:"):
            spans["comm"].append(span)
            gloo.append((thread, span))
        elif name.startswith("aten::") and e.device_type() == cpu:
            ops.append((thread, span))
    merged = {k: union(v) for k, v in spans.items()}
    if not kernels:
        # CPU: the compute is the operators of the training thread (where the steps run; the
        # backward pass runs there too), except while it is itself in a collective (gloo runs
        # point-to-point sends and receives on the calling thread, collectives on its own)
        waits = union([s for t, s in gloo if t in training])
        merged["compute"] = minus(union([s for t, s in ops if t in training]), waits)
    rows = []
    for step, window in sorted(steps):
        w = [window]
        data = intersect(merged["data"], w)
        optimizer = minus(intersect(merged["optimizer"], w), data)
        rest = minus(w, union(data + optimizer))
        compute = intersect(merged["compute"], rest)
        comm = intersect(merged["comm"], rest)
        exposed = minus(comm, compute)
        row = {"step": step, "step_s": length(w), "data_s": length(data),
               "compute_s": length(compute), "optimizer_s": length(optimizer),
               "exposed_comm_s": length(exposed), "comm_s": length(comm),
               "overlapped_comm_s": length(comm) - length(exposed)}
        row["other_s"] = max(0.0, row["step_s"] - sum(row[k] for k in PARTS[:-1]))
        rows.append(row)
    return rows


class ProfileWindow:
    """Opens the profiler before step `start`, closes it after the window's last step."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, ctx: DistContext) -> None:
        self.cfg, self.ctx, self.dir = cfg, ctx, run_dir / DIR
        self.first, self.last = cfg.start, cfg.start + cfg.steps - 1
        self.prof: Any = None
        self.result: dict[str, Any] = {}

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.cfg.steps and step == self.first:
            self._open()
        if self.prof is None:
            yield
            return
        with record_function(f"dtlab.step#{step}"):
            yield
        if step == self.last:
            self.close()

    def region(self, name: str) -> contextlib.AbstractContextManager:
        return record_function(f"dtlab.{name}") if self.prof is not None else contextlib.nullcontext()

    def _open(self) -> None:
        memory = self.cfg.memory  # the memory timeline needs shapes and stacks to categorise
        self.prof = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                                 if self.ctx.device.type == "cuda" else []),
            record_shapes=self.cfg.record_shapes or memory, with_stack=self.cfg.with_stack or memory,
            profile_memory=memory)
        with quiet_stderr():  # kineto prints "profiler_start" on every rank
            self.prof.start()

    def close(self, complete: bool = True, write: bool = True) -> None:
        """Stop and write the trace; `complete`: all ranks are here (the window's last step), so
        the table can be shared; otherwise (the run stopped inside the window) only the trace.
        `write=False`: the run directory is gone, and nothing recreates it."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        with quiet_stderr():
            prof.stop()
        if not write:
            return
        if complete:  # after a failure the device may be what failed: write what was recorded
            self.ctx.synchronize()
        self.dir.mkdir(parents=True, exist_ok=True)
        rank = self.ctx.rank
        prof.export_chrome_trace(str(self.dir / f"trace_rank{rank}.json"))
        rows = step_table(prof.profiler.kineto_results.events())
        median = {k: statistics.median(r[k] for r in rows) for k in COLUMNS} if rows else {}
        self.result = {"steps": [r["step"] for r in rows], "table": rows, "median": median,
                       "traces": [f"{DIR}/trace_rank{r}.json" for r in range(self.ctx.world_size)]}
        if self.cfg.memory:
            try:
                self.result.update(self._memory_timeline(prof))
            except Exception as e:  # noqa: BLE001 - PyTorch's analysis of the window failed
                # (seen: "version mismatch" asserted by its data-flow graph on 3 FSDP steps):
                # the trace stands, the timeline is withheld and says why.
                self.result["memory_timeline_error"] = f"{type(e).__name__}: {e}"[:300]
                if self.ctx.is_main:
                    print("dtlab: run.profile.memory: PyTorch's memory profiler failed on this "
                          f"window ({type(e).__name__}: {str(e)[:120]}); the trace is written, "
                          "the memory timeline is not", file=sys.stderr, flush=True)
        if complete and self.ctx.world_size > 1 and rows:
            per_rank = self.ctx.gather_floats([median[k] for k in COLUMNS])
            self.result["median_per_rank"] = [dict(zip(COLUMNS, v, strict=True)) for v in per_rank]

    def _memory_timeline(self, prof: Any) -> dict[str, Any]:
        """The timeline by category (PyTorch's, .json and .html) and its peak, split by category."""
        device = str(self.ctx.device if self.ctx.device.type == "cpu" else f"cuda:{self.ctx.device.index}")
        data = self.dir / f"memory_timeline_rank{self.ctx.rank}.json"
        with warnings.catch_warnings():  # deprecated for CUDA in favour of snapshots; CPU has no other
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(data), device=device)
        page = data
        if importlib.util.find_spec("matplotlib") is not None:  # PyTorch's page is a plot
            # from the analysis the export above made and kept (each export makes it anew)
            page = data.with_suffix(".html")
            prof.mem_tl.export_memory_timeline_html(str(page), device)
        return {"memory_timeline": f"{DIR}/{page.name}", **timeline_peak(data)}


def timeline_peak(data: Path) -> dict[str, Any]:
    """The peak of a memory timeline that export_memory_timeline wrote, split by category."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    _, sizes = json.loads(data.read_text())
    names = {i: (c.name.lower() if c is not None else "unknown") for c, i in _CATEGORY_TO_INDEX.items()}
    peak = max(sizes, key=lambda s: sum(s[1:]), default=None)
    return {"memory_peak_bytes": sum(peak[1:]) if peak else 0,
            "memory_peak_by_category": {names[i]: v for i, v in enumerate(peak[1:])} if peak else {}}


def check_window(key: str, start: int, steps: int, total: int) -> None:
    if steps and start + steps - 1 > total:
        raise ConfigError(f"{key} covers steps {start} to {start + steps - 1}, but the run ends "
                          f"at step {total}; fix: a smaller {key}.start, or more train.max_steps")


def windows(cfg: Config, run_dir: Path, ctx: DistContext, total: int,
            first_step: int) -> tuple[ProfileWindow, MemorySnapshot]:
    """The profiler window and the memory snapshot of this run, checked against its steps. On CPU
    a memory snapshot is the profiler's memory timeline over the same steps."""
    profile_cfg, snap = cfg.run.profile, cfg.run.memory_snapshot
    check_window("run.profile", profile_cfg.start, profile_cfg.steps, total)
    check_window("run.memory_snapshot", snap.start, snap.steps, total)
    if snap.steps and ctx.device.type != "cuda" and not profile_cfg.steps:
        profile_cfg = ProfileConfig(start=snap.start, steps=snap.steps, memory=True)
        if ctx.is_main:
            print(f"dtlab: run.memory_snapshot records CUDA's allocator; on {ctx.device.type} the "
                  f"profiler's memory timeline of steps {snap.start} to {snap.start + snap.steps - 1}"
                  f" is written instead ({run_dir / DIR})", file=sys.stderr, flush=True)
    for key, c in (("run.profile", profile_cfg), ("run.memory_snapshot", snap)):
        if c.steps and c.start <= first_step and ctx.is_main:
            print(f"dtlab: {key} starts at step {c.start}, before this resumed run's first step "
                  f"({first_step + 1}): not recorded", file=sys.stderr, flush=True)
    return ProfileWindow(profile_cfg, run_dir, ctx), MemorySnapshot(snap, run_dir, ctx)
