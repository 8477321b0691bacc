"""Run a sweep's runs one after another on this machine, through `dtlab train` (torch elastic)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtlab.process import interrupt
from dtlab.process.launcher_guard import launcher_env
from dtlab.run.sweep_record import SWEEP_RUN_VAR, failure_reason


def command(config_path: Path, nproc_per_node: int) -> list[str]:
    return [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc_per_node),
            "--config", str(config_path)]


def run_local(cmd: list[str], run_dir: Path, timeout_s: float) -> tuple[str, str, int | None]:
    """(status, reason, exit code) of one run; its output goes to run_dir/train.log. Status
    "interrupted" when this process got a stop signal: it was passed on to the run, which stopped
    (after a checkpoint on SIGTERM) and said where in its log."""
    log_path = run_dir / "train.log"
    since = log_path.stat().st_size if log_path.is_file() else 0
    with open(log_path, "a") as log:  # a continued run's log keeps its earlier attempts
        # A process group of its own: the launcher and its workers are stopped by signals to it. It
        # dies with this process, however this process ends (dtlab/process/launcher_guard.py).
        env = {**launcher_env(), SWEEP_RUN_VAR: os.path.realpath(run_dir)}  # the sweep's own run
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        with interrupt.forwarding():
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                return "timeout", f"exceeded the {timeout_s:g} s timeout and was stopped", None
    if code == 0 and (run_dir / "summary.json").is_file():
        return "done", "", 0
    if interrupt.requested():
        return "interrupted", failure_reason(log_path, code, since), code
    return "failed", failure_reason(log_path, code, since), code


def stop_group(proc: subprocess.Popen, grace_s: float = 45.0) -> None:
    """SIGTERM to the run's process group: torch elastic passes it on to its workers (each in a
    process group of its own) and waits 30 s for them; after grace_s every group of the run that
    is left is SIGKILLed."""
    groups = {proc.pid} | interrupt.descendant_groups(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    interrupt.stop_groups(groups | interrupt.descendant_groups(proc.pid), None, 0)
    proc.wait()
