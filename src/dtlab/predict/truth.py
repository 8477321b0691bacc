"""What really happens: real runs of `dtlab train` on local gloo ranks, for checking predictions.

    measure_run(cfg_path, overrides, nproc, steps, record=True)
        -> {"step_s": median step seconds (summary.json), "data_s": the median batch's loading
            in it, "loop_overhead_s": dtlab's own loop per step, "collectives": {rank: [(op,
            bytes, group size), ...]} of one step after the warm-up}

The collectives of a step come from the ranks themselves (DTLAB_RECORD_STEP, see
dtlab/instruments/flight_recorder.py): PyTorch's flight recorder for everything a process group
runs, DDP's buckets, FSDP's and DeepSpeed's all-gathers, DTensor's collectives, coalesced calls
included, whoever issued them; a recording of our own around torch.distributed's functions where
gloo's record is incomplete or names gloo's implementation rather than the call:

    send, recv        absent from gloo's record: ours (the peer, the message's bytes)
    reduce_scatter    gloo runs it as an all-reduce of the whole input and records that: the
                      record made during our reduce_scatter call is renamed (the bytes, the whole
                      input, are the same in both). On gloo its time is an all-reduce's.

Sizes follow nccl-tests (dtlab/predict/events.py): all_reduce, broadcast, reduce: the buffer;
all_gather: the gathered output; reduce_scatter, all_to_all: the whole input; send/recv: the
message. A coalesced call is one collective of the summed size, as the recorder keeps it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dtlab.errors import RunError
from dtlab.instruments.flight_recorder import DIR, RECORD_STEP_ENV
from dtlab.run.loop_overhead import loop_overhead

Collective = tuple[str, int, int]  # (op, nccl-tests bytes, group size)

# The flight recorder's names for dtypes (c10's ScalarType names) -> bytes per element
DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
               "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8,
               "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1}
# gloo's profiling names (without the "gloo:" prefix) -> events.py's ops
FR_OPS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
          "allgather": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
          "reduce_scatter": "reduce_scatter", "broadcast": "broadcast", "reduce": "reduce",
          "all_to_all": "all_to_all", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
          "barrier": "barrier", "gather": "gather", "scatter": "scatter"}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fr_bytes(op: str, entry: dict[str, Any], group_size: int) -> int:
    """nccl-tests' size from the recorded input: an all-gather's output is its input from every
    rank (gloo's record of a functional all-gather gives the output the input's shape)."""
    sizes, dtypes = entry["input_sizes"], entry["input_dtypes"]
    size = sum(_numel(s) * DTYPE_BYTES[d] for s, d in zip(sizes, dtypes, strict=True))
    return size * group_size if op == "all_gather" else size


def _fr_op(entry: dict[str, Any]) -> str:
    name = entry["profiling_name"].split(":", 1)[-1]
    return FR_OPS.get(name, name)


def step_collectives(record: dict[str, Any]) -> list[Collective]:
    """One rank's step record (flight_recorder.step_window) -> (op, bytes, group size) of every
    collective and point-to-point call, in the order the rank issued them."""
    if record.get("entries_lost"):
        raise RunError(f"rank {record['rank']}'s step {record['step']} issued more collectives "
                       "than the flight recorder keeps; fix: a larger run.flight_recorder")
    groups = {name: len(json.loads(g["ranks"])) for name, g in record["pg_config"].items()}
    own = record["own"]
    # (time, tie-break, item): the recorder's entries, renamed where a call of ours made them
    timeline: list[tuple[int, int, Collective]] = []
    renamed: set[int] = set()
    for call in (c for c in own if c["op"] == "reduce_scatter"):
        inside = {i for i, e in enumerate(record["entries"])
                  if call["start_ns"] <= e["time_created_ns"] <= call["end_ns"]}
        if not inside:
            raise RunError(f"no flight-recorder entry for a reduce_scatter at "
                           f"{call['start_ns']} ns on rank {record['rank']}")
        renamed |= inside
    for i, entry in enumerate(record["entries"]):
        op = "reduce_scatter" if i in renamed else _fr_op(entry)
        size = groups.get(entry["process_group"][0], 0)
        timeline.append((entry["time_created_ns"], i, (op, _fr_bytes(op, entry, size), size)))
    for call in (c for c in own if c["op"] in ("send", "recv")):
        timeline.append((call["start_ns"], -1, (call["op"], call["bytes"], 2)))
    return [c for _, _, c in sorted(timeline)]


def split_alone(collectives: list[Collective]) -> tuple[list[Collective], int]:
    """(those over a group of more than one rank, how many over a group of one): the trace
    leaves the latter out, as they move nothing (HSDP's replica all-reduce at one replica)."""
    moving = [c for c in collectives if c[2] > 1]
    return moving, len(collectives) - len(moving)


def recorded_collectives(run_dir: Path, step: int, nproc: int) -> dict[int, list[Collective]]:
    """The step records every rank of a finished run wrote -> {rank: collectives}."""
    out = {}
    for rank in range(nproc):
        path = run_dir / DIR / f"step{step}_rank{rank}.json"
        if not path.exists():
            raise RunError(f"{path} is missing: rank {rank} did not record step {step} (a run "
                           "of fewer steps, or run.flight_recorder=0)")
        out[rank] = step_collectives(json.loads(path.read_text()))
    return out


def run_args(cfg_path: str | None, overrides: list[str], steps: int, run_dir: Path,
             warmup: int) -> list[str]:
    """`dtlab train`'s arguments for a measured run: `steps` steps, the first `warmup` untimed, no
    evaluation, checkpoint or model saved in between (only the step is measured)."""
    return [*(["--config", cfg_path] if cfg_path else []), *overrides,
            f"train.max_steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
            f"run.timing_warmup_steps={warmup}", f"run.dir={run_dir}", "run.progress=false",
            "run.save_model=false", "resume=none", "run.overwrite=true"]


def warmup_of(steps: int) -> int:
    """The untimed steps of a measured run of `steps`: the first third, at least one."""
    return max(1, steps // 3)


def measure_run(cfg_path: str | None, overrides: list[str], nproc: int, steps: int,
                record: bool = False, timeout_s: float = 600) -> dict[str, Any]:
    """Run `python -m dtlab train --nproc-per-node NPROC` for `steps` steps (the first third, at
    least one, is warm-up) and return the median step time from its summary.json, the batch's
    loading in it (`data_s`) and dtlab's own loop per step (`loop_overhead_s`,
    run/loop_overhead.py; None on a GPU); with `record`, also the collectives each rank issued in
    the last step (one step after the warm-up; its record, a few milliseconds, is inside that
    step's time: one of the medianed steps)."""
    warmup = warmup_of(steps)
    if steps <= warmup:
        raise ValueError(f"steps={steps}: at least 2 (one warm-up step, one timed)")
    with tempfile.TemporaryDirectory(prefix="dtlab-truth-") as tmp:
        run_dir = Path(tmp) / "run"
        env = dict(os.environ)
        if record:
            env[RECORD_STEP_ENV] = str(steps)
        cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc),
               *run_args(cfg_path, overrides, steps, run_dir, warmup)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RunError(f"measured run failed (exit {proc.returncode}): {tail}")
        summary = json.loads((run_dir / "summary.json").read_text())
        out: dict[str, Any] = {"step_s": summary["median_step_time_s"],
                               "data_s": summary["median_data_time_s"],
                               "loop_overhead_s": loop_overhead(summary)}
        if record:  # one rank has no process group: nothing to record
            out["collectives"] = recorded_collectives(run_dir, steps, nproc) if nproc > 1 \
                else {0: []}
    return out
