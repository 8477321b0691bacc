"""Gloo ranks for the benchmarks that measure this machine's collectives (sync_cost.py,
burst_cost.py, overlap_slowdown.py): spawned processes that meet through a file store in a
temporary directory (no port to find), each writing its result as JSON, with the load average
before and after."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_ranks(rank_main: Callable[..., None], world: int,
              args: Any) -> tuple[list[Any], tuple[float, float]]:
    """rank_main(rank, world, store, args, out) on `world` ranks, where each writes its result
    to f"{out}.{rank}": the results in rank order, and the 1-minute load average before and
    after (a loaded machine's numbers are not this machine's)."""
    import torch.multiprocessing as mp

    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank")
        mp.spawn(rank_main, args=(world, f"file://{tmp}/store", args, out), nprocs=world,
                 join=True)
        results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return results, (before, os.getloadavg()[0])


def save(path: str | None, args: Any, load: tuple[float, float], **result: Any) -> None:
    """`result` as JSON at `path` (None: nothing), with the torch version, the load average
    before and after, and the arguments, so that a result file says what measured it."""
    if not path:
        return
    import torch

    Path(path).write_text(json.dumps(
        {**result, "torch": torch.__version__, "load_average": list(load),
         "args": {k: v for k, v in vars(args).items() if k != "json"}}, indent=2) + "\n")
