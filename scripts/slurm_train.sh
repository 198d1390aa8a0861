#!/bin/bash
# Multi-node training under SLURM: one torchrun per node, meeting through a c10d rendezvous on
# the job's first node.
#
#   sbatch --nodes 4 scripts/slurm_train.sh --config configs/llama3_70b.toml [--section.key v ...]
#
# Preemption and the time limit: SLURM sends SIGTERM to every task STOP_GRACE_S seconds before
# it kills the job (--signal below); torchrun passes it to its workers, which finish the step
# they are in, save a checkpoint and exit 0. torchrun waits --shutdown-timeout seconds for them,
# so that must cover a step and a save. Requeue or resubmit the same command to resume.
#SBATCH --job-name=pipekit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=TERM@300
#SBATCH --output=slurm-%j.out

set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_PORT=${RDZV_PORT:-29500}
STOP_GRACE_S=${STOP_GRACE_S:-240}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# NCCL and the network: set what your cluster documents (e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA).

srun --kill-on-bad-exit=1 python -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$head_node:$RDZV_PORT" \
    --rdzv-id "$SLURM_JOB_ID" \
    --shutdown-timeout "$STOP_GRACE_S" \
    train.py "$@"
