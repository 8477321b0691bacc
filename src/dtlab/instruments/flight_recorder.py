"""The flight recorder: every rank keeps its last `run.flight_recorder` collectives (PyTorch's own
ring buffer, for gloo and NCCL) and writes them to RUN_DIR/flight_recorder/rank<r>.json when the
run fails, a collective times out, or a signal stops it. `dtlab doctor hang RUN_DIR`
(dtlab/doctor/hang.py) reads them back and says which rank stopped at which collective.

The buffer is on by default for distributed runs: about 16 us per collective, under 1% of the
quick config's step (docs/benchmarks.md#flight-recorder). On NCCL the watchdog that aborts a
timed-out collective also dumps (TORCH_NCCL_DUMP_ON_TIMEOUT): Python may never see that timeout.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtlab import files

DIR = "flight_recorder"
NCCL_PREFIX = "nccl_rank"  # PyTorch appends the rank to TORCH_FR_DUMP_TEMP_FILE


def enable(entries: int, run_dir: Path, device: str) -> None:
    """Before the process group is made (PyTorch reads these when it makes the recorder)."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)
    if entries and device != "cpu" and torch.cuda.is_available():
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(run_dir.absolute() / DIR / NCCL_PREFIX)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        (run_dir / DIR).mkdir(parents=True, exist_ok=True)


def group_config() -> dict[str, dict[str, str]]:
    """The process groups this rank belongs to, as the dumps describe them. gloo's own record
    leaves the names empty and keeps one group only, so they are taken from torch.distributed."""
    groups = dist.distributed_c10d._world.pg_group_ranks  # also holds a non-member marker
    return {pg.group_name: {"name": pg.group_name, "desc": pg.group_desc,
                            "ranks": str(sorted(ranks))}
            for pg, ranks in groups.items() if isinstance(pg, dist.ProcessGroup)}


def dump(run_dir: Path, rank: int, world_size: int, reason: str) -> Path | None:
    """This rank's recorded collectives -> RUN_DIR/flight_recorder/rank<r>.json (None when the
    recorder is off, there is no process group, or the dump cannot be written)."""
    if os.environ.get("TORCH_FR_BUFFER_SIZE", "0") == "0" or not dist.is_initialized():
        return None
    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True,
                                                              onlyActive=False)
        record: dict[str, Any] = json.loads(raw)
        if "entries" not in record:
            return None
        record["pg_config"] = group_config()
        record["dtlab"] = {"rank": rank, "world_size": world_size, "reason": reason,
                           "time": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        path = run_dir / DIR / f"rank{rank}.json"
        path.parent.mkdir(exist_ok=True)  # not run.dir: one deleted mid-run is not made again
        files.replace_whole(path, lambda tmp: tmp.write_text(json.dumps(record)))
        return path
    except Exception:  # a dump must never hide the failure it records  # noqa: BLE001
        return None
