"""The flight recorder: every rank keeps its last `run.flight_recorder` collectives (PyTorch's own
ring buffer, for gloo and NCCL) and writes them to RUN_DIR/flight_recorder/rank<r>.json when the
run fails, a collective times out, or a signal stops it. `dtlab doctor hang RUN_DIR`
(dtlab/doctor/hang.py) reads them back and says which rank stopped at which collective. For `dtlab predict`'s checks, a
run may also write the collectives of one chosen step (DTLAB_RECORD_STEP, step_window below).

The buffer is on by default for distributed runs: about 16 us per collective, under 1% of the
quick config's step (docs/benchmarks.md#flight-recorder). On NCCL the watchdog that aborts a
timed-out collective also dumps (TORCH_NCCL_DUMP_ON_TIMEOUT): Python may never see that timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Iterator
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


# ------------------------------------------------------------------ one step, for dtlab predict
# `DTLAB_RECORD_STEP=K` (set by dtlab.predict.truth for its measured runs, never by a user):
# every rank writes the collectives of step K (the Stepper's call: its micro steps and the
# optimizer step, not the loop's own agreements, logging or evaluation around it) to
# RUN_DIR/flight_recorder/step<K>_rank<r>.json. Sources: the flight recorder's entries created
# during the step (everything a process group runs, whoever calls it from Python or C++), and a
# recording of our own for what gloo's record leaves out or names by its implementation:
# point-to-point (absent) and reduce-scatter (gloo runs it as an all-reduce of the whole input,
# and records it so). dtlab.predict.truth turns both into one list of (op, bytes, group size).
RECORD_STEP_ENV = "DTLAB_RECORD_STEP"
# (module, function, op, the argument holding its tensor(s)). Deprecated names call the ones
# listed (reduce_scatter_tensor -> reduce_scatter_single); a call inside another is not noted
# again. DTensor's reduce-scatters come through the functional collectives.
C10D, FUNCOL = "torch.distributed.distributed_c10d", "torch.distributed._functional_collectives"
OWN_CALLS = [(C10D, "send", "send", "tensor"), (C10D, "isend", "send", "tensor"),
             (C10D, "recv", "recv", "tensor"), (C10D, "irecv", "recv", "tensor"),
             (C10D, "reduce_scatter_single", "reduce_scatter", "input"),
             (C10D, "reduce_scatter", "reduce_scatter", "input_list"),
             *((FUNCOL, f"reduce_scatter_{kind}", "reduce_scatter", "self")
               for kind in ("single", "single_autograd", "tensor", "tensor_autograd")),
             *((FUNCOL, f"reduce_scatter_{kind}_coalesced", "reduce_scatter", "inputs")
               for kind in ("single", "tensor"))]
_own: list[dict[str, Any]] | None = None  # the records of the step being recorded, else None
_inside = [0]  # wrapped calls in progress: only the outermost is recorded


def record_step() -> int:
    """The step to record (0: none)."""
    value = os.environ.get(RECORD_STEP_ENV, "")
    return int(value) if value.isdigit() else 0


def _peer(bound: dict[str, Any]) -> int | None:
    """A point-to-point call's peer as a global rank (None: recv from any source)."""
    peer = bound.get("dst", bound.get("src"))
    local = bound.get("group_dst", bound.get("group_src"))
    if peer is None and local is not None:
        group = bound.get("group") or dist.distributed_c10d._get_default_group()
        peer = dist.get_global_rank(group, local)
    return peer


def _record_own_calls() -> None:
    """Wrap the functions of OWN_CALLS (in their module, and torch.distributed's name for it:
    batch_isend_irecv and P2POp compare against those) so that each call made while a step is
    recorded is noted: op, bytes, peer, wall-clock start and end (the flight recorder's clock)."""
    import functools
    import importlib
    import inspect
    import time

    for module_name, name, op, arg in OWN_CALLS:
        module = importlib.import_module(module_name)
        real = getattr(module, name, None)
        if real is None or getattr(real, "dtlab_recorded", False):
            continue
        signature = inspect.signature(real)

        def wrapper(*args: Any, _real: Any = real, _op: str = op, _sig: Any = signature,
                    _arg: str = arg, **kwargs: Any) -> Any:
            if _own is None or _inside[0]:
                return _real(*args, **kwargs)
            bound = _sig.bind(*args, **kwargs).arguments
            tensors = bound[_arg] if isinstance(bound[_arg], list | tuple) else [bound[_arg]]
            peer = _peer(bound) if _op in ("send", "recv") else None
            start = time.time_ns()
            _inside[0] += 1
            try:
                result = _real(*args, **kwargs)
            finally:
                _inside[0] -= 1
            if _op == "recv" and peer is None:  # from any source: recv says which
                peer = result
            _own.append({"op": _op, "bytes": sum(t.numel() * t.element_size() for t in tensors),
                         "peer": peer, "start_ns": start, "end_ns": time.time_ns()})
            return result

        wrapper = functools.wraps(real)(wrapper)
        wrapper.dtlab_recorded = True  # type: ignore[attr-defined]
        setattr(module, name, wrapper)
        if getattr(dist, name, None) is real:
            setattr(dist, name, wrapper)


@contextlib.contextmanager
def step_window(run_dir: Path, step: int, rank: int) -> Iterator[None]:
    """Around the Stepper's call: records step `record_step()` when the recorder is on."""
    global _own
    if step != record_step() or os.environ.get("TORCH_FR_BUFFER_SIZE", "0") == "0" \
            or not dist.is_initialized():
        yield
        return
    import time

    _record_own_calls()
    _own, start = [], time.time_ns()
    try:
        yield
    finally:
        end, own, _own = time.time_ns(), _own, None
    raw = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True,
                                                                    onlyActive=False))
    kept = raw.get("entries", [])
    entries = [e for e in kept if start <= e["time_created_ns"] <= end]
    # the ring buffer was full and its oldest entry is from this step: earlier ones were lost
    lost = len(kept) >= int(os.environ["TORCH_FR_BUFFER_SIZE"]) and bool(entries) and \
        entries[0] is kept[0]
    record = {"step": step, "rank": rank, "start_ns": start, "end_ns": end, "entries": entries,
              "pg_config": group_config(), "own": own, "entries_lost": lost}
    path = run_dir / DIR / f"step{step}_rank{rank}.json"
    path.parent.mkdir(exist_ok=True)
    files.replace_whole(path, lambda tmp: tmp.write_text(json.dumps(record)))
