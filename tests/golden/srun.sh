#!/bin/bash
# srun-ranks: srun on 2 node(s) x 4 = 8 rank(s).
# Rendered by clusterops VERSION. Edit the job spec and render again rather than this file.
#SBATCH --job-name=srun-ranks
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=4
#SBATCH --time=90
#SBATCH --chdir=/REPO/tests/golden
#SBATCH --output=/shared/logs/srun/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --no-requeue

set -eo pipefail

# ---- environment ---------------------------------------------------------------
# srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05): hand it on.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# NCCL errors and timeouts raise in the training processes instead of hanging them.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export CLUSTEROPS_LOG_DIR=/shared/logs/srun
mkdir -p "$CLUSTEROPS_LOG_DIR"  # `launch submit` creates it; a hand-run sbatch may not have

# ---- rendezvous: one address and port, the same on every node ----------------------
# The first node of the allocation runs node rank 0, which hosts the rendezvous.
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) || true
if [ -z "$MASTER_NODE" ]; then
    echo "clusterops: cannot expand SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}" >&2
    exit 1
fi
MASTER_ADDR=$MASTER_NODE
# A Slurm node name need not resolve; then use the address Slurm itself reaches it at.
if ! getent hosts "$MASTER_ADDR" >/dev/null 2>&1; then
    _addr=$(scontrol show node "$MASTER_NODE" --oneliner | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p') || true
    MASTER_ADDR=${_addr:-$MASTER_NODE}
fi
# Derived from the job id, below the ephemeral port range, so jobs sharing a node
# differ; a port that something already listens on is skipped.
MASTER_PORT=$(( 10000 + SLURM_JOB_ID % 20000 ))
for _ in 1 2 3 4 5 6 7 8 9 10; do
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null || break
    MASTER_PORT=$(( 10000 + (MASTER_PORT - 10000 + 1) % 20000 ))
done
export MASTER_ADDR MASTER_PORT
echo "clusterops: job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST}: rendezvous at ${MASTER_ADDR}:${MASTER_PORT}" >&2

# ---- the lead-time signal -----------------------------------------------------------
# Slurm sends SIGUSR1 to this shell 600 s before the time limit. Bash runs a trap
# only between commands, so the step runs in the background while this shell waits
# on it; the trap hands the signal to srun, which delivers it to the processes of the
# step. Launchers run with SIGUSR1 ignored (see below), so only the training
# processes act on it (checkpoint, then stop).
step_pid=
_forward() {
    echo "clusterops: SIG$1 received; forwarding it to the job step" >&2
    if [ -n "$step_pid" ]; then kill -s "$1" "$step_pid" 2>/dev/null || true; fi
}
trap '_forward USR1' USR1
# Preemption, scancel and the time limit send SIGTERM to every process of the job;
# this shell stays to collect the step's exit status while it shuts down.
trap 'echo "clusterops: SIGTERM received; waiting for the job step to stop" >&2' TERM

# ---- the training step: 4 task(s) per node, log files per node ------------------
srun --kill-on-bad-exit=1 --wait=60 \
    --nodes=2 --ntasks-per-node=4 \
    --output=/shared/logs/srun/%x-%j-%N-%n.out --open-mode=append \
    --gpu-bind=closest \
    bash -c '
        export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID" \
            LOCAL_WORLD_SIZE=4 NODE_RANK="$SLURM_NODEID"
        exec "$@"
    ' srun-task \
    /shared/envs/llm/bin/python /REPO/tests/golden/train.py --steps 1000 &
step_pid=$!
# A trapped signal ends `wait` early (status > 128); wait again while srun runs.
while kill -0 "$step_pid" 2>/dev/null; do
    wait "$step_pid" || true
done
rc=0
wait "$step_pid" || rc=$?
echo "clusterops: job step exited with status $rc" >&2
exit "$rc"
