#!/bin/bash
# Fault-tolerant replica groups on one machine: a torchft lighthouse and one torchrun per
# group, each in a folder of its own; a group that dies is restarted by its loop and rejoins.
#
#   NUM_GROUPS=2 RANKS_PER_GROUP=2 scripts/fault_tolerant_groups.sh --config configs/debug_model.toml
#
# Each group trains its share of the global batch (FSDP, TP, CP or a pipeline inside it as in
# any job); the survivors of a failure go on without a restart, and a restarted group copies the
# training state from a live one. Stop with Ctrl-C (every group and the lighthouse end).
set -euo pipefail

NUM_GROUPS=${NUM_GROUPS:-2}
RANKS_PER_GROUP=${RANKS_PER_GROUP:-2}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
OUTPUT=${OUTPUT:-outputs/fault_tolerant}
MAX_RESTARTS=${MAX_RESTARTS:-3}
export TORCHFT_LIGHTHOUSE="http://localhost:$LIGHTHOUSE_PORT"
export RUST_LOG=${RUST_LOG:-warn}  # torchft's quorum messages at every step otherwise

torchft_lighthouse --bind "[::]:$LIGHTHOUSE_PORT" --min_replicas 1 --quorum_tick_ms 100 \
    --join_timeout_ms 10000 &
pids=($!)
trap 'kill "${pids[@]}" 2>/dev/null' EXIT

for group in $(seq 0 $((NUM_GROUPS - 1))); do
    (
        for attempt in $(seq 0 "$MAX_RESTARTS"); do
            # --standalone: each group is a torchrun world of its own (its own rendezvous)
            torchrun --standalone --nproc-per-node "$RANKS_PER_GROUP" train.py "$@" \
                --job.output_dir "$OUTPUT/group-$group" \
                --fault_tolerance.enabled true --fault_tolerance.groups "$NUM_GROUPS" \
                --fault_tolerance.replica_group "$group" && exit 0
            echo "replica group $group exited (attempt $attempt); restarting" >&2
        done
        exit 1
    ) &
    pids+=($!)
done
wait "${pids[@]:1}"
