#!/bin/bash
# dtlab on SLURM, one torchrun per node (torch elastic, c10d rendezvous on the first node).
# Use this when you want torchrun's restarts (--max-restarts) or one process per node in SLURM.
#   NPROC_PER_NODE=4 sbatch --nodes=2 --gpus-per-node=4 scripts/slurm/run_torchrun.sh --config configs/fsdp_gpt.yaml
# Arguments are those of `python -m dtlab.train`.
#SBATCH --job-name=dtlab-torchrun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
#SBATCH --output=dtlab-torchrun-%j.out
##SBATCH --gpus-per-node=4
set -euo pipefail

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
NPROC=${NPROC_PER_NODE:-4}
export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-$NPROC} / NPROC > 0 ? ${SLURM_CPUS_PER_TASK:-$NPROC} / NPROC : 1 ))
PYTHON=${PYTHON:-python}

echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $NPROC rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \
  --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
  -m dtlab.train "$@"
