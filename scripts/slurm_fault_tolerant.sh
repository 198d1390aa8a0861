#!/bin/bash
# Fault-tolerant replica groups under SLURM: one job step per replica group (its own torchrun
# world over its nodes), all meeting at a torchft lighthouse. Start the lighthouse once, on a
# machine the groups reach and that outlives them:
#
#   torchft_lighthouse --bind "[::]:29510" --min_replicas 1 --join_timeout_ms 60000
#
# then one allocation per group (a lost node then ends that group's allocation only):
#
#   for g in 0 1 2 3; do TORCHFT_LIGHTHOUSE=http://LIGHTHOUSE_HOST:29510 GROUP=$g NUM_GROUPS=4 \
#       sbatch --nodes 2 scripts/slurm_fault_tolerant.sh --config configs/llama3_70b.toml; done
#
# A group whose node fails exits; --requeue puts it back in the queue, and once it runs again it
# joins the quorum at a step boundary and copies the training state from a live group.
#SBATCH --job-name=pipekit-ft
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=TERM@300
#SBATCH --output=slurm-ft-%j.out

set -euo pipefail

: "${TORCHFT_LIGHTHOUSE:?set TORCHFT_LIGHTHOUSE=http://host:port of the lighthouse}"
: "${GROUP:?set GROUP, the replica group of this allocation (0 .. NUM_GROUPS - 1)}"
: "${NUM_GROUPS:?set NUM_GROUPS, the number of replica groups}"
export RUST_LOG=${RUST_LOG:-warn}  # torchft's quorum messages at every step otherwise

# The allocation's torchrun world is launched as any multi-node job's (scripts/slurm_train.sh,
# run from the repository as sbatch was), with this group's folder and place among the groups.
exec scripts/slurm_train.sh "$@" \
    --job.output_dir "outputs/${SLURM_JOB_NAME}/group-$GROUP" \
    --fault_tolerance.enabled true --fault_tolerance.groups "$NUM_GROUPS" \
    --fault_tolerance.replica_group "$GROUP"
