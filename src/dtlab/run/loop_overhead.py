"""dtlab's own cost per step: the training loop's time outside the model's compute and
collectives, measured in every run, for `dtlab predict` to add to a predicted step (it reads it
from a short run: predict/truth.measure_run).

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
