#!/bin/bash
# dtlab on SLURM, one task per rank (srun). Defaults: 1 node, 4 tasks; override on the command line:
#   sbatch scripts/slurm/run.sh --config configs/ddp_resnet_cifar10.yaml
#   sbatch --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 scripts/slurm/run.sh strategy.name=fsdp
#   PYTHON=$PWD/.venv/bin/python sbatch --ntasks-per-node=1 scripts/slurm/run.sh   # one rank
# Arguments are those of `python -m dtlab.train` (--config FILE and key=value overrides).
#SBATCH --job-name=dtlab
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --time=01:00:00
#SBATCH --output=dtlab-%j.out
##SBATCH --gpus-per-node=4            # enable on GPU nodes (one rank per GPU)
##SBATCH --environment=./edf.toml     # CSCS-style container, see scripts/slurm/edf.toml
set -euo pipefail

# The rendezvous every task can compute alone: the allocation's first node and a port derived
# from the job id (two jobs on one node get different ports).
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
PYTHON=${PYTHON:-python}

echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
# Map SLURM's variables to the ones torch.distributed reads (dtlab also reads SLURM's directly;
# other scripts may not).
srun --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS \
  LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; exec "$@"' \
  rank "$PYTHON" -m dtlab.train "$@"
