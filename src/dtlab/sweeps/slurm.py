"""Run a sweep on SLURM: one sbatch script per run, submitted at once, polled until done.

Two layouts inside the allocation:
- `srun`: one task per rank; each task gets RANK/WORLD_SIZE/LOCAL_RANK from SLURM's variables and
  MASTER_ADDR/MASTER_PORT from the first node and the job id;
- `torchrun`: one task per node running torch elastic with c10d rendezvous on the first node.
Accounting (`sacct`) is often absent: jobs are followed with `squeue`, and `scontrol show job`
gives the final state and exit code while the controller still remembers the job.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from dtlab.errors import DtlabError
from dtlab.sweeps.spec import PlannedRun, SlurmOptions

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}

TEMPLATE = """#!/bin/bash
#SBATCH --job-name=dtlab-{key}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node={tasks_per_node}
#SBATCH --cpus-per-task={cpus_per_task}
#SBATCH --time={time_min}
#SBATCH --output={log}
{extra}
# dtlab sweep run: {label}
set -euo pipefail
cd {workdir}
# Every rank must agree on the rendezvous without talking: the allocation's first node, and a
# port derived from the job id (two jobs sharing a node get different ports).
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
export OMP_NUM_THREADS={threads_per_rank}
export DTLAB_SWEEP_RUN={run_dir}
{setup}
{launch}
"""

SRUN = (
    "srun --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS "
    "LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; exec \"$@\"' rank {cmd}"
)
# dtlab's own launcher (torch elastic): it passes stop signals on to its workers and stops quietly.
TORCHRUN = (
    "srun --kill-on-bad-exit=1 {python} -m dtlab train --nnodes $SLURM_NNODES "
    "--nproc-per-node {nproc} --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT "
    "--rdzv-id $SLURM_JOB_ID --config {config}"
)


REQUEUE = """code=0
{launch} || code=$?
# Stopped by SIGTERM or the checkpoint signal after saving a checkpoint: requeue this job (same
# job id and run directory; resume=auto continues from the checkpoint). Preemption and
# `scontrol requeue` stop this script too, and SLURM requeues the job by itself.
if (( code == 143 || code == {checkpoint_code} )); then
  echo "dtlab: job $SLURM_JOB_ID stopped with exit code $code after a checkpoint: requeued" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $code"""


def render(run: PlannedRun, opts: SlurmOptions, timeout_s: float, workdir: Path,
           requeue: bool = False) -> str:
    config = run.run_dir / "config.yaml"
    srun_mode = run.slurm_mode == "srun"
    named = run.config.run.checkpoint_signal if run.config is not None else None
    extra = ["#SBATCH --requeue", "#SBATCH --open-mode=append"] if requeue else []
    if requeue and named:  # SLURM signals the tasks 90 s before the time limit
        extra += [f"#SBATCH --signal={named}@90"]
    extra += [f"#SBATCH --partition={opts.partition}"] if opts.partition else []
    extra += [f"#SBATCH --account={opts.account}"] if opts.account else []
    extra += [f"#SBATCH --gpus-per-node={opts.gpus_per_node}"] if opts.gpus_per_node else []
    extra += [f"#SBATCH {x}" for x in opts.extra]
    worker = f"{shlex.quote(sys.executable)} -m dtlab.train --config {shlex.quote(str(config))}"
    launch = (SRUN.format(cmd=worker) if srun_mode else TORCHRUN.format(
        python=shlex.quote(sys.executable), nproc=run.nproc_per_node,
        config=shlex.quote(str(config))))
    if requeue:
        code = 128 + signal.Signals[f"SIG{named}"] if named else 143
        launch = REQUEUE.format(launch=launch, checkpoint_code=code)
    return TEMPLATE.format(
        key=run.key,
        nnodes=run.nnodes,
        tasks_per_node=run.nproc_per_node if srun_mode else 1,
        cpus_per_task=opts.cpus_per_task * (1 if srun_mode else run.nproc_per_node),
        threads_per_rank=opts.cpus_per_task,
        time_min=opts.time_min or math.ceil(timeout_s / 60),
        log=run.run_dir / "slurm-%j.log",
        extra="\n".join(extra),
        label=run.label,
        workdir=shlex.quote(str(workdir)),
        run_dir=shlex.quote(os.path.realpath(run.run_dir)),  # SWEEP_RUN_VAR: the sweep's own run
        setup="\n".join(opts.setup),
        launch=launch,
    )


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    except FileNotFoundError:
        raise DtlabError(f"'{cmd[0]}' not found: the slurm launcher needs SLURM's client "
                         "commands; fix: run on a login node, or use --launcher local") from None
    except subprocess.CalledProcessError as e:
        raise DtlabError(f"{' '.join(cmd[:2])} failed: {e.stderr.strip()[:300]}") from None


def submit(script: Path) -> str:
    return _run(["sbatch", "--parsable", str(script)]).strip().split(";")[0]


def active_jobs(job_ids: list[str]) -> dict[str, tuple[str, int]]:
    """(state, times requeued) of the listed jobs that squeue still shows (pending, running...).
    The count comes from SLURM: a poll can miss a short run between two requeues."""
    if not job_ids:
        return {}
    out = _run(["squeue", "-h", "-O", "JobID:|,State:|,RestartCnt:", "-j", ",".join(job_ids)])
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return {j.strip(): (s.strip(), int(n)) for j, s, n in rows if s.strip() in ACTIVE}


def final_state(job_id: str) -> tuple[str, int | None]:
    """(JobState, exit code) from scontrol, or ("UNKNOWN", None) once the job is forgotten."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "UNKNOWN", None
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    code = fields.get("ExitCode", "").split(":")[0]
    return fields.get("JobState", "UNKNOWN"), int(code) if code.isdigit() else None


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
