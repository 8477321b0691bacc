"""The SLURM launcher against a real one-node SLURM cluster started by scripts/local_slurm.sh."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import ALL_CPUS, CONFIGS, ROOT, cli, max_rel_dev, step_losses, train

from dtlab.config import load_config
from dtlab.sweeps.slurm import render
from dtlab.sweeps.spec import PlannedRun, SlurmOptions


def test_sbatch_script_maps_ranks_and_rendezvous(tmp_path: Path) -> None:
    run = PlannedRun("strategy.name=ddp", {}, nproc_per_node=4, nnodes=2, slurm_mode="srun",
                     key="abc", config=load_config(None), run_dir=tmp_path)
    opts = SlurmOptions(partition="gpu", gpus_per_node=4, cpus_per_task=8, extra=["--qos=high"],
                        setup=["module load cuda"])
    script = render(run, opts, timeout_s=600, workdir=tmp_path)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --time=10", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --qos=high", "module load cuda", "export OMP_NUM_THREADS=8",
                 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))",
                 "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID"):
        assert line in script, line
    run.slurm_mode = "torchrun"
    script = render(run, opts, timeout_s=600, workdir=tmp_path)
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --cpus-per-task=32" in script
    assert "-m dtlab train --nnodes $SLURM_NNODES --nproc-per-node 4" in script
    assert "--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id $SLURM_JOB_ID" in script


def test_local_slurm_is_safe_to_rerun(local_slurm: None) -> None:
    again = subprocess.run([ROOT / "scripts/local_slurm.sh"], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and "local SLURM is running" in again.stdout, again.stderr
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True)
    assert int(nodes.stdout.split()[0]) == len(ALL_CPUS)  # the node has every core, not a pinned share


SPEC = """
base: {base}
overrides: {{train.max_steps: 8, strategy.name: ddp}}
matrix:
  slurm_mode: [srun, torchrun]
  nproc_per_node: [2]
timeout_s: 240
slurm: {{poll_s: 1}}
"""


def test_sweep_on_slurm_with_srun_and_torchrun(local_slurm: None, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(base=CONFIGS / "quick.yaml"))
    proc = cli("sweep", str(spec), "--launcher", "slurm", "--out", str(tmp_path / "o"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 of 2 runs done, 0 failed" in proc.stdout
    launchers = {}
    for run_json in (tmp_path / "o").glob("runs/*/run.json"):
        record = json.loads(run_json.read_text())
        summary = json.loads((run_json.parent / "summary.json").read_text())
        assert record["status"] == "done" and record["job_id"].isdigit()
        assert summary["world_size"] == 2 and summary["backend"] == "gloo"
        launchers[record["slurm_mode"]] = summary["launcher"]
        assert list(run_json.parent.glob("slurm-*.log"))
    # srun: one task per rank (SLURM's variables); torchrun: elastic inside the allocation.
    assert launchers == {"srun": "slurm", "torchrun": "torchrun"}
    rows = list(csv.DictReader((tmp_path / "o" / "results.csv").read_text().splitlines()))
    assert sorted(r["series"] for r in rows) == ["ddp, slurm_mode=srun", "ddp, slurm_mode=torchrun"]
    assert all(r["status"] == "done" and float(r["samples_per_s"]) > 0 for r in rows)


REQUEUE_SPEC = """
base: {base}
overrides: {{train.max_steps: {steps}, strategy.name: ddp, train.checkpoint_every: 1000,
            run.log_every: 1}}
matrix:
  nproc_per_node: [2]
timeout_s: 240
slurm: {{poll_s: 0.5}}
"""


def _job_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-o", "%T", "-j", job], capture_output=True, text=True)
    return out.stdout.strip()


def test_a_preempted_job_checkpoints_is_requeued_and_resumes_exactly(
        local_slurm: None, tmp_path: Path) -> None:
    """`scontrol requeue` stops a running job as preemption does (SIGTERM to every task, SIGKILL
    after KillWait) and puts it back in the queue with the same id; the ranks save a checkpoint
    at the step they agree on, and the job, run again, resumes there."""
    steps = 240  # ~15 ms each: the requeue must land while steps run (60 ended before it once)
    spec = tmp_path / "spec.yaml"
    spec.write_text(REQUEUE_SPEC.format(base=CONFIGS / "quick.yaml", steps=steps))
    sweep = subprocess.Popen([sys.executable, "-m", "dtlab", "sweep", str(spec), "--launcher",
                              "slurm", "--requeue", "--out", str(tmp_path / "o")], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and sweep.poll() is None:
        progress = list((tmp_path / "o").glob("runs/*/progress"))
        if progress and progress[0].read_text().strip() and \
                int(progress[0].read_text().split()[0]) >= 3:
            break
        time.sleep(0.05)
    run_dir = progress[0].parent
    job = json.loads((run_dir / "run.json").read_text())["job_id"]
    subprocess.run(["scontrol", "requeue", job], check=True)
    while time.monotonic() < deadline and _job_state(job) not in ("PENDING", ""):
        time.sleep(0.2)
    # SLURM holds a requeued job for 2 minutes (BeginTime); a test does not wait that long.
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    # The same run without the stop, trained while the job starts again and the sweep polls
    # (this worker's core idles then; the job's tasks run unpinned): started only now, so that
    # it cannot slow the steps the requeue had to land in.
    ref = tmp_path / "ref"
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(train, ref, f"train.max_steps={steps}", "strategy.name=ddp",
                                "train.checkpoint_every=1000", nproc=2)
        out, _ = sweep.communicate(timeout=max(1, deadline - time.monotonic()))
        reference.result()
    assert sweep.returncode == 0, out[-3000:]
    assert f"job {job} was stopped and requeued (1)" in out and "1 of 1 runs done" in out
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "done" and record["requeues"] == 1
    log = (run_dir / f"slurm-{job}.log").read_text()  # both attempts (--open-mode=append)
    said = re.search(r"dtlab: interrupted by SIGTERM at step (\d+); saved checkpoint step \1", log)
    assert said and "Traceback" not in log, log[-3000:]
    step = int(said[1])
    assert f"step_{step:06d} at step {step}; steps lost since that checkpoint: 0" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == step and summary["steps"] == steps - step
    # The same per-step losses as the same run without the stop (measured: identical).
    assert max_rel_dev(step_losses(run_dir), step_losses(ref)) < 1e-6
