"""Run a sweep's runs one after another on this machine, through `dtlab train` (torch elastic)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtlab.sweeps.record import failure_reason


def command(config_path: Path, nproc_per_node: int) -> list[str]:
    return [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc_per_node),
            "--config", str(config_path)]


def run_local(cmd: list[str], run_dir: Path, timeout_s: float) -> tuple[str, str, int | None]:
    """(status, reason, exit code) of one run; its output goes to run_dir/train.log."""
    log_path = run_dir / "train.log"
    with open(log_path, "w") as log:
        # A session of its own: on timeout the launcher and all its workers are stopped together.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return "timeout", f"exceeded the {timeout_s:g} s timeout and was stopped", None
    if code == 0 and (run_dir / "summary.json").is_file():
        return "done", "", 0
    return "failed", failure_reason(log_path, code), code


def stop_group(proc: subprocess.Popen, grace_s: float = 45.0) -> None:
    """SIGTERM first: torch elastic then stops its workers (which run in sessions of their own,
    out of reach of killpg) within its own 30 s grace; SIGKILL only if that does not happen."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            time.sleep(0.1)
