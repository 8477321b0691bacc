"""dtlab's own cost per step: the training loop's time outside the model's compute and
collectives, measured in every run, for `dtlab predict` to add to a predicted step.

A step of the loop (train.py), boundary to boundary, is the engine's work (`engine.micro_step`
per micro batch: forward, backward and the strategy's collectives; `engine.step`: the optimizer)
plus the loop's own: reading the batch, zero_grad, the finiteness check of the gradient norm,
the learning-rate schedule, the step's bookkeeping and logging, the progress file, the run
directory's check and the ranks' stop vote (run/stop.py). Evaluations and checkpoint saves are
not part of it (they are counted where they happen, not per step).

On CPU the engine's host time is its compute time (kernels run in the calling thread), so the
difference is the loop's overhead. On a GPU the engine returns before its kernels finish and the
loop waits for them in its synchronisation: host times do not separate the two, and no number
is reported (`loop_overhead_s` is null).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def loop_record(loop_times: list[float], engine_times: list[float], warmup: int,
                device: torch.device) -> dict[str, float | None]:
    """summary.json's `median_loop_time_s` (step boundary to step boundary, evaluations and
    saves left out) and `loop_overhead_s` (the median over the timed steps of that interval
    minus the engine's time in it; CPU only)."""
    loops, engines = loop_times[warmup:] or loop_times, engine_times[warmup:] or engine_times
    if not loops:
        return {"median_loop_time_s": None, "loop_overhead_s": None}
    overhead = statistics.median(a - b for a, b in zip(loops, engines, strict=True))
    return {"median_loop_time_s": statistics.median(loops),
            "loop_overhead_s": overhead if device.type == "cpu" else None}


def loop_overhead(summary: dict[str, Any] | Path) -> float | None:
    """Seconds per step of dtlab's loop beyond `engine.micro_step`/`engine.step`, from a run's
    summary (a dict, or the path of summary.json or of its run directory); None where the run
    could not measure it (GPU, or a summary written before it was measured)."""
    if isinstance(summary, Path):
        path = summary / "summary.json" if summary.is_dir() else summary
        summary = json.loads(path.read_text())
    value = summary.get("loop_overhead_s")
    return float(value) if value is not None else None


def measure_loop_overhead(nproc: int = 1, overrides: tuple[str, ...] = (), config: str | None = None,
                          steps: int = 60, timeout_s: float = 300.0) -> float | None:
    """Run `dtlab train` for `steps` steps on `nproc` local ranks in a temporary run directory
    and return its `loop_overhead_s` (this device, this config: the loop's cost grows with the
    gradients' size, which the finiteness check reads once per step)."""
    with tempfile.TemporaryDirectory(prefix="dtlab-overhead-") as tmp:
        cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc),
               *(["--config", config] if config else []), *overrides,
               f"train.max_steps={steps}", f"run.log_every={steps}", "run.progress=false",
               "train.checkpoint_every=0", f"run.dir={tmp}/run"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout_s)
        return loop_overhead(Path(tmp) / "run")
