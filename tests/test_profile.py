"""Seeing inside a run: the profiler window (run.profile), the memory timeline that stands in for
CUDA's memory snapshot on CPU, and an out-of-memory stop (2 gloo ranks, DDP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import dtlab, train

from dtlab.instruments.profile_window import COLUMNS, PARTS, intersect, minus, step_table, union

pytestmark = pytest.mark.xdist_group("profile")


@pytest.fixture(scope="module")
def profiled(session_dir: Path) -> tuple[Path, dict]:
    run = session_dir / "profiled-ddp"
    summary = train(run, "strategy.name=ddp", "train.max_steps=7", "run.profile.start=4",
                    "run.profile.steps=3", "run.profile.memory=true", nproc=2)
    return run, summary


def test_the_window_holds_its_steps_and_nothing_else(profiled: tuple[Path, dict]) -> None:
    run, summary = profiled
    assert summary["profile"]["traces"] == ["profile/trace_rank0.json", "profile/trace_rank1.json"]
    for rank in (0, 1):
        events = [e for e in json.loads((run / "profile" / f"trace_rank{rank}.json").read_text())
                  ["traceEvents"] if e.get("ph") == "X"]
        steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                       if e["name"].startswith("dtlab.step#"))
        assert [name for *_, name in steps] == ["dtlab.step#4", "dtlab.step#5", "dtlab.step#6"]
        names = {e["name"] for e in events}
        assert {"gloo:all_reduce", "aten::convolution", "dtlab.data"} <= names
        assert any(n.startswith("Optimizer.step#") for n in names)
        # every operator and annotation began between the start of step 4 and the end of step 6:
        # the steps before and after were not recorded (Python frames that enclose the whole
        # window, and the profiler's own session marker, began just before it)
        first, last = steps[0][0], steps[-1][1]
        outside = [e["name"] for e in events if e.get("cat") != "python_function"
                   and not e["name"].startswith("PyTorch Profiler") and not first <= e["ts"] <= last]
        assert outside == []
        # between two steps: the logging and the all-reduce with which the ranks agree to go on
        between = [e for e in events if steps[0][1] < e["ts"] < steps[1][0]]
        assert any(e["name"] == "gloo:all_reduce" for e in between)


def test_the_step_table_adds_up(profiled: tuple[Path, dict]) -> None:
    profile = profiled[1]["profile"]
    assert profile["steps"] == [4, 5, 6] and [r["step"] for r in profile["table"]] == [4, 5, 6]
    for row in profile["table"]:
        assert sum(row[k] for k in PARTS) == pytest.approx(row["step_s"], rel=1e-9)
        assert row["comm_s"] == pytest.approx(row["exposed_comm_s"] + row["overlapped_comm_s"])
        assert row["compute_s"] > 0 and row["comm_s"] > 0 and row["data_s"] > 0
        assert row["optimizer_s"] > 0
    assert len(profile["median_per_rank"]) == 2 and set(profile["median"]) == set(COLUMNS)


def test_the_memory_timeline_has_its_categories(profiled: tuple[Path, dict]) -> None:
    run, summary = profiled
    profile = summary["profile"]
    assert (run / profile["memory_timeline"]).stat().st_size > 0
    by_category = profile["memory_peak_by_category"]
    assert sum(by_category.values()) == profile["memory_peak_bytes"]
    # PyTorch's categories match dtlab's count of the tensors, byte for byte: a DDP replica holds
    # all 136,874 fp32 parameters, their gradients and SGD's momentum
    held = summary["memory_per_rank"]
    assert by_category["parameter"] == held["param_bytes"][0] == 547_496
    assert by_category["gradient"] == held["grad_bytes"][0]
    assert by_category["optimizer_state"] == held["optim_bytes"][0]
    assert by_category["activation"] > 0  # the CNN's forward keeps its activations for backward


class Event:
    """What step_table reads of a profiler event."""

    def __init__(self, name: str, start: int, end: int, thread: int = 1) -> None:
        self._n, self._s, self._e, self._t = name, start, end, thread

    def name(self) -> str:
        return self._n

    def start_ns(self) -> int:
        return self._s

    def end_ns(self) -> int:
        return self._e

    def start_thread_id(self) -> int:
        return self._t

    def device_type(self) -> torch.autograd.DeviceType:
        return torch.autograd.DeviceType.CPU


def test_the_step_split_on_a_known_timeline() -> None:
    """A 100 ns step: data 0-10, compute 10-50 (a nested op inside), a collective on gloo's
    thread 40-80 (overlapped 40-50, exposed 50-80), nothing 80-85, the optimizer 85-95, then a
    send on the training thread 95-100 (pipeline parallelism): the copy inside it is not compute."""
    events = [Event("dtlab.step#3", 0, 100), Event("dtlab.data", 0, 10),
              Event("aten::mm", 10, 50), Event("aten::add", 20, 30), Event("gloo:all_reduce", 40, 80, 2),
              Event("Optimizer.step#SGD.step", 85, 95), Event("aten::add_", 86, 94),
              Event("gloo:send", 95, 100), Event("aten::copy_", 96, 99)]
    (row,) = step_table(events)
    ns = {k: round(v * 1e9) for k, v in row.items() if k != "step"}
    assert row["step"] == 3
    assert ns == {"step_s": 100, "data_s": 10, "compute_s": 40, "optimizer_s": 10,
                  "exposed_comm_s": 35, "comm_s": 45, "overlapped_comm_s": 10, "other_s": 5}


def test_interval_arithmetic() -> None:
    assert union([(5, 9), (0, 3), (2, 4), (9, 10)]) == [(0, 4), (5, 10)]
    assert minus([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]
    assert intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]


def test_an_out_of_memory_stop_names_what_held_the_memory(tmp_path: Path) -> None:
    proc = dtlab("train", "strategy.name=single", "train.max_steps=5", "run.fault.kind=oom",
                 "run.fault.step=3", f"run.dir={tmp_path}", "run.progress=false")
    lines = [x for x in proc.stderr.splitlines() if x.startswith("dtlab: error")]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr
    # the quick config's CNN: 136,874 fp32 parameters = 0.5 MiB, its gradients the same; SGD
    # with momentum keeps one buffer per parameter
    assert lines[0].startswith("dtlab: error: out of memory at step 3 on rank 0 (CUDA out of "
                               "memory. Tried to allocate 2.00 GiB")
    assert "this rank held parameters 0.5 MiB, gradients 0.5 MiB, optimizer state 0.5 MiB" in lines[0]
    assert "no allocator snapshot on CPU" in lines[0] and "; fix: " in lines[0]


@pytest.mark.parametrize("key", ["run.profile", "run.memory_snapshot"])
def test_a_window_past_the_end_of_the_run_is_refused(tmp_path: Path, key: str) -> None:
    proc = dtlab("train", "strategy.name=single", "train.max_steps=4", f"{key}.start=3",
                 f"{key}.steps=3", f"run.dir={tmp_path}", "run.progress=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"dtlab: error: {key} covers steps 3 to 5, but the run ends at "
                                   f"step 4; fix: a smaller {key}.start, or more train.max_steps")


def test_a_snapshot_is_written_as_pytorch_reads_it(tmp_path: Path) -> None:
    """The files a CUDA snapshot becomes (the snapshot itself needs a GPU: docs/benchmarks.md)."""
    import pickle

    from dtlab.instruments.memory_snapshot import write

    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512,
                                                    "stream": 0, "frames": []}]]}
    pickled, page = write(snapshot, tmp_path / "memory" / "oom_rank0")
    assert (pickled.name, page.name) == ("oom_rank0.pickle", "oom_rank0.html")
    assert pickle.loads(pickled.read_bytes()) == snapshot
    assert "MemoryViz.js" in page.read_text()  # PyTorch's viewer, with the snapshot inlined
