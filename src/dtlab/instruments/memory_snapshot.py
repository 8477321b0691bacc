"""Where the memory went: PyTorch's CUDA allocator history over a window of steps
(`run.memory_snapshot`), and a snapshot when a CUDA out-of-memory error stops the run.

Files in RUN_DIR/memory/: snapshot_rank<r>.pickle (drag it into https://pytorch.org/memory_viz)
and snapshot_rank<r>.html (PyTorch's own viewer, offline); oom_rank<r>.* at an OOM. Only CUDA has
an allocator history: on CPU the profiler's memory timeline (run.profile.memory) is what there is.
At an OOM the error names the largest categories of this rank's memory at that moment: the
parameters, gradients and optimizer state it holds (counted from the tensors), and the rest of
what the allocator had handed out (activations, temporaries, communication buffers).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dtlab.config import MemorySnapshotConfig
from dtlab.distributed import DistContext

DIR = "memory"
MiB = 2**20


def write(snapshot: dict[str, Any], stem: Path) -> list[Path]:
    """The snapshot as a pickle (PyTorch's format) and as PyTorch's HTML viewer."""
    from torch.cuda._memory_viz import segment_plot, trace_plot

    stem.parent.mkdir(parents=True, exist_ok=True)
    pickle_path, html_path = stem.with_suffix(".pickle"), stem.with_suffix(".html")
    with open(pickle_path, "wb") as f:
        pickle.dump(snapshot, f)
    has_history = any(t for t in snapshot.get("device_traces", []))
    html_path.write_text(trace_plot(snapshot) if has_history else segment_plot(snapshot))
    return [pickle_path, html_path]


class MemorySnapshot:
    """Records the allocator's history from step `start` to the window's last step (CUDA)."""

    def __init__(self, cfg: MemorySnapshotConfig, run_dir: Path, ctx: DistContext) -> None:
        self.cfg, self.ctx, self.dir = cfg, ctx, run_dir / DIR
        self.on = bool(cfg.steps) and ctx.device.type == "cuda"
        self.last = cfg.start + cfg.steps - 1
        self.recording = False
        self.files: list[str] = []

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.on and step == self.cfg.start:
            torch.cuda.memory._record_memory_history(max_entries=self.cfg.max_entries)
            self.recording = True
        yield
        if self.recording and step == self.last:
            self.stop(write_it=True)

    def stop(self, write_it: bool = False) -> None:
        if not self.recording:
            return
        if write_it:
            paths = write(torch.cuda.memory._snapshot(), self.dir / f"snapshot_rank{self.ctx.rank}")
            self.files = [f"{DIR}/{p.name}" for p in paths]
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False


KINDS = {"param_bytes": "parameters", "grad_bytes": "gradients", "optim_bytes": "optimizer state"}


def categories(state: dict[str, int], device: torch.device) -> dict[str, int]:
    """This rank's memory by category, in bytes, largest first: `state` is the strategy's count of
    what it holds (Strategy.state_bytes), the rest is the allocator's (CUDA)."""
    found = {name: state[key] for key, name in KINDS.items()}
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        found["activations and temporaries"] = max(0, allocated - sum(found.values()))
        found["cached by the allocator, free"] = torch.cuda.memory_reserved(device) - allocated
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def out_of_memory(error: BaseException, where: str, ctx: DistContext, run_dir: Path,
                  state: dict[str, int] | None = None,
                  snapshot: MemorySnapshot | None = None) -> str:
    """The one line for an OOM: where, what held the memory, where the snapshot is, the fixes.
    `state` (Strategy.state_bytes) is None outside the training steps (set-up: the model may not
    be built yet)."""
    first = str(error).strip().splitlines()[0][:160] if str(error).strip() else "out of memory"
    if state is not None:
        held = ", ".join(f"{k} {v / MiB:,.1f} MiB" for k, v in categories(state, ctx.device).items())
    elif ctx.device.type == "cuda":
        held = (f"{torch.cuda.memory_allocated(ctx.device) / MiB:,.1f} MiB allocated, "
                f"{torch.cuda.memory_reserved(ctx.device) / MiB:,.1f} MiB reserved")
    else:
        held = "what it had built so far (not counted on CPU)"
    if ctx.device.type == "cuda":
        if snapshot is not None:
            snapshot.stop()
        paths = write(torch.cuda.memory._snapshot(), run_dir / DIR / f"oom_rank{ctx.rank}")
        found = f"snapshot: {paths[1]} (or drag {paths[0].name} into https://pytorch.org/memory_viz)"
    else:
        found = ("no allocator snapshot on CPU: run.profile.memory=true gives the memory "
                 "timeline by category")
    return (f"out of memory {where} on rank {ctx.rank} ({first}); this rank held {held}; "
            f"{found}; fix: raise train.grad_accum_steps (smaller micro batches, the same global "
            "batch), train.activation_checkpointing=full, or a sharding strategy (dtlab "
            "estimate shows what each would hold)")
