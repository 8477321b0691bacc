"""Nothing left running: a dtlab process's children die with it, whatever kills it (SIGKILL of its
process group, as an OOM kill or a scheduler's hard kill does), and write nothing after; a signal
to `dtlab comm` stops it like `train` (one line, 128 + the signal, the results so far written).

The commands run as a user runs them (`python -m dtlab`, torch elastic for 2 ranks), each in a
session of its own; the ranks are in sessions of their own too, so the kill reaches only the
command's own process, and what follows it is the guard's doing (dtlab/process/launcher_guard.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CONFIGS, unpinned

from dtlab.process.launcher_guard import PID_VAR, START_VAR, launcher_env, start_time

COMM = ["comm", "--nproc-per-node", "2", "--min-bytes", "8", "--max-bytes", "1G", "--iters", "20"]
LONG = ("train.max_steps=100000", "run.log_every=1", "run.progress=false")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = {p for p, pp in parents.items() if pp == parent}
        found |= kids
        todo += kids
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if start_time(p) is not None}  # None: gone, or a zombie


def step(progress: Path) -> int:
    """The last step a run completed, from its progress file (0 before the first)."""
    try:
        return int(progress.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def measured(printed: str) -> list[str]:
    """The rows of sizes measured, in what `dtlab comm` printed."""
    return [x for x in printed.splitlines() if x.strip() and not x.startswith("#")]


def start(args: list[str], cwd: Path, stdout: object = subprocess.PIPE,
          preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[str]:
    """`dtlab ARGS` in a session of its own (its process group is its pid)."""
    return subprocess.Popen([sys.executable, "-m", "dtlab", *args], cwd=cwd, text=True,
                            stdout=stdout, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=preexec_fn)


def kill_when(proc: subprocess.Popen[str], ready: Callable[[], bool], workers: int,
              group: bool = True) -> set[int]:
    """Once `ready()` and `workers` processes run below `proc`: SIGKILL its process group (or,
    group=False, the process alone, as the kernel's OOM killer picks one). Returns the processes
    that ran below it."""
    deadline, below = time.monotonic() + 120, set()
    while time.monotonic() < deadline and proc.poll() is None:
        below |= descendants(proc.pid)
        if ready() and len(below) >= workers:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the command ended before the kill:\n{proc.stderr.read()[-3000:]}"
    below = alive(below | descendants(proc.pid))
    assert len(below) >= workers, below
    (os.killpg if group else os.kill)(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)  # not its pipes: processes left below it would hold them open
    return below


def assert_gone_at_once(pids: set[int], within_s: float = 5.0) -> float:
    """Every process of `pids` ends within `within_s` of its launcher's kill; how long it took."""
    t0 = time.monotonic()
    while alive(pids) and time.monotonic() - t0 < within_s:
        time.sleep(0.02)
    left = alive(pids)
    for pid in left:  # no orphan outlives a failed test either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived their launcher: {sorted(left)}"
    return time.monotonic() - t0


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in root.rglob("*") if p.is_file()}


SWEEP = """
base: {base}
overrides: {{strategy.name: ddp, train.max_steps: 100000, train.checkpoint_every: 2}}
matrix: {{nproc_per_node: [2]}}
timeout_s: 240
"""
# What runs below each command: train: torch elastic's 2 workers; compare (strategy single): its
# `dtlab train`, which trains in its own process; sweep: its `dtlab train` and that one's 2 workers.
KILLED = {"train": 2, "compare": 1, "sweep": 3}


@pytest.mark.parametrize("command", list(KILLED))
def test_sigkill_of_the_launcher_kills_every_rank_and_nothing_more_is_written(
        tmp_path: Path, command: str) -> None:
    """SIGKILL of `dtlab train` on 2 ranks, `dtlab compare` or `dtlab sweep` (its process group): every process below it ends within seconds and writes nothing after; no checkpoint newer than the step in flight at the kill."""
    (tmp_path / "spec.yaml").write_text(SWEEP.format(base=CONFIGS / "quick.yaml"))
    args = {"train": ["train", "--nproc-per-node", "2", "strategy.name=ddp", f"run.dir={tmp_path}/r"],
            "compare": ["compare", "--strategies", "single", "--out", str(tmp_path / "r")],
            "sweep": ["sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "r")]}[command]
    extra = [*LONG, "train.checkpoint_every=2"] if command != "sweep" else []
    proc = start([*args, *extra], tmp_path)
    seen: list[int] = []  # the steps read; the last one right after the kill

    def ready() -> bool:
        steps = [step(p) for p in (tmp_path / "r").rglob("progress")]
        seen.append(max(steps, default=0))
        return seen[-1] >= 3

    below = kill_when(proc, ready, workers=KILLED[command])
    ready()  # the step reached at the kill (a loaded machine may run steps between read and kill)
    assert_gone_at_once(below)
    run = next((tmp_path / "r").rglob("progress")).parent
    before = listing(run)
    time.sleep(1.0)
    assert listing(run) == before, "files of the run changed after its ranks were gone"
    saved = [int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*")]
    assert max(saved, default=0) <= seen[-1] + 1  # at most the step in flight at the kill
    assert step(run / "progress") <= seen[-1] + 1


def test_sigkill_of_dtlab_comm_kills_its_ranks(tmp_path: Path) -> None:
    """SIGKILL of a 2-rank `dtlab comm`'s process group mid-sweep: both ranks end within seconds, no --json is written."""
    printed, out = tmp_path / "printed", tmp_path / "out"
    out.mkdir()
    with open(printed, "w") as stdout:
        proc = start([*COMM, "--json", str(out / "comm.json")], tmp_path, stdout=stdout)
        below = kill_when(proc, lambda: len(measured(printed.read_text())) >= 2, workers=2)
    assert_gone_at_once(below)
    assert not list(out.iterdir())  # neither comm.json nor its temporary file


def test_sigkill_of_dtlab_predict_measuring_kills_the_ranks_stepping_beside_it(tmp_path: Path) -> None:
    """SIGKILL of `dtlab predict --measure` alone (its helpers share its process group) while a
    process steps the node's other rank beside the measured one (predict/corun.py): that process
    ends within seconds instead of stepping on."""
    # on every core: a node of 2 ranks with 1 core has no core for a second rank to step on
    proc = start(["predict", "--config", str(CONFIGS / "quick.yaml"), "--world-size", "2",
                  "--cluster", "cpu_gloo", "--measure", "--strategies", "ddp"], tmp_path,
                 preexec_fn=unpinned)

    def stepping_beside() -> bool:
        return any("spawn_main" in cmdline(p) for p in descendants(proc.pid))

    assert_gone_at_once(kill_when(proc, stepping_beside, workers=1, group=False))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_dtlab_comm_stops_it_with_one_line_and_the_results_so_far(
        tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or Ctrl-C on a 2-rank `dtlab comm`: exit 143/130, one line naming where and the file, no traceback, a valid --json (and --csv) of the sizes measured so far, no rank left."""
    proc = start([*COMM, "--json", "comm.json", "--csv", "comm.csv"], tmp_path)
    assert proc.stdout is not None
    printed, below = "", set()
    for line in proc.stdout:  # 3 sizes measured: the stop comes in the middle of the sweep
        below |= descendants(proc.pid)
        printed += line
        if len(measured(printed)) == 3:
            break
    os.killpg(proc.pid, sig)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        assert_gone_at_once(below)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"dtlab: interrupted by {sig.name} during all_reduce of "), lines
    rows = json.loads((tmp_path / "comm.json").read_text())
    sized = [r for r in rows if "size_bytes" in r]
    assert len(sized) >= 3 and all(r["op"] == "all_reduce" for r in sized)
    assert rows[-1] == {"op": "interrupted", "signal": sig.name,
                        "during": lines[0].split(" during ")[1].split(";")[0]}
    assert (f"; wrote the {len(rows) - 1} results measured so far to {tmp_path / 'comm.json'} "
            f"and {tmp_path / 'comm.csv'}") in lines[0]
    csv_rows = (tmp_path / "comm.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + len(sized)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["comm.csv", "comm.json"]  # no .tmp
    assert len(below) == 2


# ---- the guard itself, on small processes without torch ---------------------------------------
GUARDED = ("from dtlab.process.launcher_guard import die_with_launcher; die_with_launcher(); "
           "import time; print('started', flush=True); time.sleep(60)")


def guarded_child(launcher: int, start: str | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in (PID_VAR, START_VAR, "RANK")}
    env.update({PID_VAR: str(launcher), START_VAR: start or "1"})
    return subprocess.Popen([sys.executable, "-c", GUARDED], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_child_started_through_another_program_dies_when_the_launcher_does() -> None:
    """A rank whose launcher is not its parent (a wrapper in between): the watch ends it within a second of the launcher's SIGKILL, with one line."""
    launcher = subprocess.Popen(["sleep", "60"])
    child = guarded_child(launcher.pid, start_time(launcher.pid))
    try:
        assert child.stdout is not None and child.stdout.readline() == "started\n"
        launcher.kill()
        launcher.wait()
        out, err = child.communicate(timeout=5)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL
    assert err == (f"dtlab: stopped: the dtlab process that started this one (pid {launcher.pid}) "
                   "is gone\n")


def test_a_child_whose_launcher_is_already_gone_stops_before_doing_anything() -> None:
    """A rank started after its launcher died (or with a reused pid): it stops at once, before its first line of work."""
    launcher = subprocess.Popen(["true"])
    launcher.wait()
    child = guarded_child(launcher.pid, "12345")
    out, err = child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL and out == "" and err.startswith("dtlab: stopped")


def test_a_launcher_names_itself_only_to_its_children() -> None:
    """launcher_env() names this process (pid and start time) for the children it starts; a process started otherwise (srun, torchrun) has no launcher named and no guard."""
    env = launcher_env({"A": "1"})
    assert env == {"A": "1", PID_VAR: str(os.getpid()), START_VAR: start_time(os.getpid())}
    assert PID_VAR not in os.environ
    clean = {k: v for k, v in os.environ.items() if k not in (PID_VAR, START_VAR)}
    proc = subprocess.run([sys.executable, "-c", "from dtlab.process.launcher_guard import "
                           "die_with_launcher; die_with_launcher(); import threading; "
                           "print(threading.active_count())"], env=clean, text=True,
                          capture_output=True, timeout=30)
    assert proc.stdout == "1\n" and proc.returncode == 0  # no watch thread
