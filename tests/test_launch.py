"""Launch paths: `dtlab train` against srun-style SLURM variables, and timeouts. (torchrun by hand
gives the run `dtlab train` gives: guide chapter 02, tests/test_guide.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, dtlab, free_port, in_process, step_losses

from dtlab.process.launch import launch

STEPS = "train.max_steps=8"


@pytest.fixture(scope="module")
def via_dtlab(session_dir: Path) -> Path:
    run = session_dir / "launch-dtlab"  # the real command (its torch elastic agent in this process)
    proc = dtlab("train", "--nproc-per-node", "2", "strategy.name=ddp", STEPS, f"run.dir={run}",
                 "run.log_every=1", "run.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_", "WORLD_", "MASTER_", "TORCHELASTIC"))}
    return {**env, **extra}


def test_srun_style_variables_give_the_same_losses(via_dtlab: Path, session_dir: Path) -> None:
    run = session_dir / "launch-slurm"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dtlab.train", "strategy.name=ddp", STEPS, f"run.dir={run}",
             "run.log_every=1", "run.progress=false"],
            env=worker_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                           SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
                           SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="4242", MASTER_PORT=port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert step_losses(run) == step_losses(via_dtlab)
    assert json.loads((run / "summary.json").read_text())["launcher"] == "slurm"


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
