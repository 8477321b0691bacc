"""Launch paths: timeouts. (torchrun by hand gives the run `dtlab train` gives: guide chapter 02;
srun's tasks, with SLURM's variables, the same losses: chapter 06, which runs them under a real
SLURM, and tests/test_slurm.py; tests/test_guide.py checks both.)"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from conftest import in_process

from dtlab.process.launch import launch


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_", "WORLD_", "MASTER_", "TORCHELASTIC"))}
    return {**env, **extra}


HANG_WORKER = """
import sys, time, torch, torch.distributed as dist
from dtlab.distributed import distributed
with distributed(timeout_s=3) as ctx:
    if ctx.rank == 1:
        time.sleep(120)  # a rank that stops taking part
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:
        print(f"rank 0 gave up after {time.perf_counter() - t0:.1f}s: {str(e).splitlines()[0]}",
              flush=True)
        sys.exit(3)
"""


def test_a_stuck_rank_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    (tmp_path / "hang_worker.py").write_text(HANG_WORKER)
    t0 = time.perf_counter()  # dtlab's launcher (torch elastic's agent) in this process
    proc = in_process(lambda: launch([], 2, module="hang_worker"), cwd=tmp_path,
                      env=worker_env(PYTHONPATH=str(tmp_path)))
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "rank 0 gave up after" in proc.stdout and "timed out" in proc.stdout.lower()
    assert "worker rank 0 failed with exit code 3" in proc.stderr
    assert elapsed < 60  # the sleeping rank was stopped, not waited for
    leftover = subprocess.run(["pgrep", "-f", "hang_worker"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
