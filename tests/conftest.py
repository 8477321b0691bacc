"""Shared helpers: run the real CLI (in a subprocess, or in this process where no process group is
needed), start runs on real ranks (tests/ranks.py), read what a run wrote; the xdist set-up."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ranks

from dtlab.cli.compare import loss_deviation, read_run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# The suite asserts CPU/gloo behaviour (2-4 ranks on one machine). On a GPU machine run.device=auto
# would pick CUDA, and 2 ranks on 1 GPU are refused: hide the GPUs from every test and its children.
# benchmarks/gpu_node.sh checks the CUDA/NCCL paths.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


ALL_CPUS = frozenset(os.sched_getaffinity(0))  # before pinning: what daemons the suite starts get


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip where the optional `extra` that brings `module` is not installed: found, not imported
    (pytest.importorskip would import deepspeed, peft and transformers in every worker while it
    collects, ~3 s each)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} not installed: pip install 'dtlab[{extra}]' "
                                     "(make test installs it)")


def unpinned() -> None:
    """preexec_fn for a process that must see every core (the SLURM daemons size the node by it)."""
    os.sched_setaffinity(0, ALL_CPUS)


def _pin_xdist_worker() -> None:
    """Give each pytest-xdist worker its own share of the cores (inherited by every process it
    starts). A dtlab rank sets its threads to the cores it may use / ranks per node; unpinned,
    a 1-rank run on a 2-core machine starts 2 OpenMP threads while the other worker keeps the
    second core busy, and OpenMP's barrier then waits on a descheduled thread (the quick CNN's
    step measured here on a busy machine: 0.36 s with 2 threads, 0.075 s with 1). Pinned, every
    rank runs 1 thread per core it owns; with more workers than cores, workers share a core
    round-robin. make test runs 3 workers on the 2-core CI host: the suite waits on launchers,
    timeouts and SLURM's polls, so 2 workers kept the cores 64% busy (2026-11-28); 3 ran the
    whole suite in 7:43 with both cores 95% busy (885 CPU-seconds), where 2 took 12:42 and 13:38
    in that day's fresh clones.
    DTLAB_TEST_NO_PIN=1 turns this off."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or os.environ.get("DTLAB_TEST_NO_PIN") == "1":
        return
    cpus = sorted(ALL_CPUS)
    index = int(worker[2:])
    share = cpus[index % count::count] if len(cpus) >= count else [cpus[index % len(cpus)]]
    os.sched_setaffinity(0, share)
    import torch

    torch.set_num_threads(len(share))


_pin_xdist_worker()
ranks.memoize_synthetic_images()  # for the runs made in this process too


# ------------------------------------------------------------------------------ local SLURM
LOCAL_SLURM = ROOT / "scripts" / "local_slurm.sh"


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[None]:
    """A running one-node SLURM cluster (tests/test_slurm.py, guide chapter 06). Started unpinned,
    so that the node has every core; stopped at the end when this test run started it, left alone
    when it was running before. Skips when SLURM is missing and cannot be installed or started."""
    import shutil

    running_before = subprocess.run([LOCAL_SLURM, "--status"]).returncode == 0
    if not running_before:
        have = all(shutil.which(c) for c in ("slurmctld", "slurmd", "munged"))
        if not have and (os.geteuid() != 0 or not shutil.which("apt-get")):
            pytest.skip("SLURM is not installed and cannot be installed here (needs root and apt)")
        if os.geteuid() != 0:
            pytest.skip("the local SLURM cluster is not running and starting it needs root")
        proc = subprocess.run([LOCAL_SLURM], capture_output=True, text=True, timeout=600,
                              preexec_fn=unpinned)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    yield
    if not running_before:
        subprocess.run([LOCAL_SLURM, "--stop"], capture_output=True, timeout=60)


# ------------------------------------------------------------------------------ the CLI
def cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`dtlab ARGS` as a user runs it (python -m dtlab), capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "dtlab", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, cwd=cwd or ROOT,
    )


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _with_fds_captured(fn: Callable[[], int]) -> tuple[int, str, str]:
    """fn()'s result and what was written to fds 1 and 2 meanwhile, by this process (through
    sys.stdout/err) and by the processes it started (which inherit the fds)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds, saved_streams = (os.dup(1), os.dup(2)), (sys.stdout, sys.stderr)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            with open(1, "w", closefd=False, buffering=1, errors="replace") as sys.stdout, \
                    open(2, "w", closefd=False, buffering=1, errors="replace") as sys.stderr:
                result = fn()
        finally:
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
        out.seek(0)
        err.seek(0)
        return result, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def in_process(fn: Callable[[], int], cwd: Path | None = None, env: dict[str, str] | None = None,
               args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """fn() in this process as if it were a command: its result as exit code and its output (fds
    1 and 2, so the output of worker processes it starts is included). The working directory,
    environment and signal handlers are restored afterwards (a launch sets OMP_NUM_THREADS,
    torch elastic installs handlers)."""
    environ, cwd_before = dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    os.environ.update(env or {})
    os.chdir(cwd or ROOT)
    try:
        code, stdout, stderr = _with_fds_captured(fn)
    finally:
        os.chdir(cwd_before)
        os.environ.clear()
        os.environ.update(environ)
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess(args or [], code, stdout, stderr)


def dtlab(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
          real_launches: bool = False) -> subprocess.CompletedProcess[str]:
    """`dtlab ARGS` inside this process: dtlab.cli.main.main(ARGS), its exit code and output.

    What the console script does besides main() is distributed.leave(), which only matters after
    a process group: use it for commands that start none here (1-rank `single` runs, validation
    errors, launches, compare/sweep, which start their runs as processes, estimate, advise, ...).
    Their ranks start through fast_launches (a fresh interpreter per run or rank costs 4-5 s of
    CPU in imports alone); real_launches=True keeps dtlab's own processes (python -m dtlab train
    for each run of a compare or sweep, torch elastic's agent for a train)."""
    from dtlab.cli.main import main

    def run() -> int:
        try:
            with contextlib.nullcontext() if real_launches else fast_launches():
                return main(list(args))
        except SystemExit as e:  # argparse: bad usage (2) or --help (0)
            return e.code if isinstance(e.code, int) else 1

    return in_process(run, cwd, env, ["dtlab", *args])


def runs_in_process(overrides: tuple[str, ...] | list[str], config: str | None = None) -> bool:
    """A 1-rank run trains in this process when it starts no process group (strategy single)."""
    from dtlab.config import load_config

    return load_config(config, list(overrides)).strategy.name == "single"


def train(run_dir: Path, *overrides: str, nproc: int = 1, config: str | None = None,
          timeout: float = 240) -> dict:
    """`dtlab train --nproc-per-node NPROC`, assert success, return its summary. A 1-rank
    `single` run trains in this process (no process group: only the interpreter start differs),
    others on real ranks started by tests/ranks.py (the workers' entry point and a real gloo
    group, without torch elastic's agent and the imports of fresh interpreters)."""
    args = ["--config", config] if config else []
    args += [*overrides, f"run.dir={run_dir}", "run.log_every=1", "run.progress=false"]
    if nproc == 1 and runs_in_process(overrides, config):
        proc = dtlab("train", *args)
    else:
        proc = ranks.train(nproc, *args, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def _run_command(cmd: list[str], timeout: float,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m dtlab train --nproc-per-node N ARGS`, as compare and sweeps start it, on
    ranks.start(N, ARGS), with what dtlab sets for its runs in their environment (a sweep: which
    run directory is its own)."""
    from dtlab.run.sweep_record import SWEEP_RUN_VAR

    assert cmd[1:5] == ["-m", "dtlab", "train", "--nproc-per-node"], cmd
    ours = {k: v for k, v in (env or {}).items() if k == SWEEP_RUN_VAR}
    return ranks.start(int(cmd[5]), cmd[6:], timeout=timeout, env=ours)


class _Popen:
    """What the local sweep runner uses of subprocess.Popen: the run happens in wait()."""

    def __init__(self, cmd: list[str], stdout: io.TextIOBase, env: dict[str, str] | None = None,
                 **_: object) -> None:
        self.cmd, self.log, self.returncode, self.env = cmd, stdout, None, env

    def wait(self, timeout: float | None = None) -> int:
        proc = _run_command(self.cmd, timeout or 3600, self.env)
        self.log.write(proc.stdout + proc.stderr)
        self.returncode = proc.returncode
        return proc.returncode

    def poll(self) -> int | None:
        return self.returncode


class _Subprocess:
    """Stands in for the subprocess module inside dtlab.cli.compare and dtlab.sweeps.local."""

    DEVNULL, STDOUT, TimeoutExpired, Popen = (subprocess.DEVNULL, subprocess.STDOUT,
                                              subprocess.TimeoutExpired, _Popen)

    @staticmethod
    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return _run_command(cmd, 3600)


@contextlib.contextmanager
def fast_launches() -> Iterator[None]:
    """Commands run in this process start their ranks through tests/ranks.py: `dtlab compare`
    and `dtlab sweep` (locally) their runs (their specs, tables, deviations, verdicts, records
    and reports are their own), `dtlab train` and `dtlab comm` on one node without restarts
    their workers (dtlab.process.launch.launch; restarts and several nodes still go through torch
    elastic). The ranks are real processes in real gloo groups, running the workers' entry
    points. (A sweep's timeouts are tested with its real runner: test_sweep.py.)"""
    import dtlab.cli.compare
    import dtlab.process.launch
    import dtlab.sweeps.local

    def params(fn: Callable[..., int]) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(ranks.launch) == params(dtlab.process.launch.launch), "dtlab.process.launch.launch changed"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dtlab.cli.compare, "subprocess", _Subprocess)
        mp.setattr(dtlab.sweeps.local, "subprocess", _Subprocess)
        mp.setattr(dtlab.process.launch, "launch", ranks.launch)
        yield


def step_losses(run_dir: Path) -> list[float]:
    return read_run(run_dir)[1]


def max_rel_dev(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return loss_deviation(a, b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_command(line: str) -> list[str] | None:
    """The arguments of a plain `dtlab ...` command line, None for anything needing a shell."""
    if any(c in line for c in "$|&;<>`()*?~") or not line.startswith("dtlab "):
        return None
    return shlex.split(line)[1:]


@pytest.fixture(scope="session", autouse=True)
def _forkserver() -> None:
    """Each worker's forkserver (tests/ranks.py) starts before its first test, whoever uses it
    first (ranks.start, or torch.multiprocessing with start_method="forkserver")."""
    ranks.ensure_forkserver()


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


LOCAL_SWEEP = """
base: {base}
overrides: {{train.max_steps: 12}}
matrix:
  strategy.name: [ddp, fsdp]
  nproc_per_node: [1, 2]
timeout_s: 180
"""


@pytest.fixture(scope="session")
def local_sweep(session_dir: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """2 strategies x {1, 2} ranks on the quick config, swept locally (shared by several tests;
    its runs start through fast_launches: the real runner's processes, timeouts and signals are
    tested in test_sweep.py and test_signals.py)."""
    spec = session_dir / "sweep.yaml"
    spec.write_text(LOCAL_SWEEP.format(base=CONFIGS / "quick.yaml"))
    out = session_dir / "sweep"
    with fast_launches():
        proc = dtlab("sweep", str(spec), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


# make test runs the suite on 3 pytest-xdist workers with --dist loadgroup, each worker pinned to
# one core (two of them share one). Groups keep what must stay together on one worker: a module (its module-scoped
# fixtures run once), the tests sharing the local sweep, the tests that start the local SLURM
# cluster; each guide chapter is its own group, so chapters spread over the workers.
GROUPS = {"test_report_browser": "sweep", "test_sweep": "sweep", "test_slurm": "slurm"}
# Seconds a group takes on one core, heaviest first (measured 2026-11-28 in a full -n 2 run on a
# busy machine; slurm: with installing SLURM on a fresh machine; groups of 5 s or less left at the
# default): with --no-loadscope-reorder xdist hands out groups in collection order, each to the
# worker that runs out of work first, so the long ones start first and the short ones fill both
# workers up to the end (xdist's default order, by test count, would start the one-test chapters
# last). A cost far below the truth starts a long group late: it then ends the suite alone.
COST = {"slurm": 200, "guide-11-predict.md": 60, "test_signals": 105, "guide-05-model-parallel.md": 97,
        "test_train_features": 90, "test_three_d": 110, "test_context_parallel": 30, "test_outputs_kept_apart": 35, "guide-08-failure-modes.md": 88, "guide-02-ddp.md": 77,
        "guide-03-fsdp.md": 74, "test_zero": 74, "test_orphans": 69, "test_predict_trace": 61,
        "test_reliability": 61, "test_hf": 55, "sweep": 47, "test_estimate": 46, "test_launch": 8,
        "guide-09-levers.md": 34, "test_model_parallel": 29, "test_trackers": 28,
        "guide-07-communication.md": 28, "test_activation_checkpoint": 28, "test_ddp_hooks": 28,
        "guide-10-your-own-model.md": 26, "guide-04-zero.md": 25, "test_predict_collectives": 22,
        "test_parity": 21, "test_run_dir": 13, "test_faults": 10, "test_optimizer_impl": 10,
        "test_doctor": 9, "test_channels_last": 8, "test_config": 8, "test_hsdp": 8,
        "test_bad_inputs_audit2": 8, "test_tp_hf": 8, "test_predict_cli": 28,
        "test_sample_ranks": 6, "test_deepspeed_checkpoint": 6, "guide-01-single.md": 6,
        "test_bad_inputs": 6}
# Modules whose tests are each a group of their own: where the async_io op is built (make
# test-nvme), NVMe offload's two 12-s trainings run on two workers instead of one after the other
SPLIT = {"test_nvme_offload"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        module = item.module.__name__
        group = GROUPS.get(module, module)
        if module == "test_guide" and hasattr(item, "callspec"):
            chapter = item.callspec.params["chapter"]
            group = "slurm" if chapter.startswith("06") else f"guide-{chapter}"
        elif module in SPLIT:
            group = f"{module}::{item.name}"
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group
    items.sort(key=lambda item: -COST.get(groups[item].partition("::")[0], 5))  # stable: file order within a group
