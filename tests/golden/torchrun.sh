#!/bin/bash
# llama-70b-pretrain: torchrun on 16 node(s) x 8 = 128 rank(s).
# Rendered by clusterops VERSION. Edit the job spec and render again rather than this file.
#SBATCH --job-name=llama-70b-pretrain
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=96
#SBATCH --gpus-per-node=8
#SBATCH --mem=0
#SBATCH --time=2-00:00:00
#SBATCH --partition=gpu
#SBATCH --account=proj-llm
#SBATCH --qos=high
#SBATCH --exclusive
#SBATCH --exclude=gpu[007,100-103]
#SBATCH --constraint=h100
#SBATCH --chdir=/REPO/tests/golden
#SBATCH --output=/shared/logs/llm/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@900
#SBATCH --requeue

set -eo pipefail

# ---- environment ---------------------------------------------------------------
# srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05): hand it on.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# NCCL errors and timeouts raise in the training processes instead of hanging them.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export CLUSTEROPS_LOG_DIR=/shared/logs/llm
mkdir -p "$CLUSTEROPS_LOG_DIR"  # `launch submit` creates it; a hand-run sbatch may not have
export NCCL_DEBUG=WARN
export HF_HOME=/shared/cache/hf

# ---- setup (from the job spec, verbatim) -----------------------------------------
module load cuda/12.4 nccl
source /shared/envs/llm/bin/activate

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
# Slurm sends SIGUSR1 to this shell 900 s before the time limit. Bash runs a trap
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

# ---- the training step: 1 task(s) per node, log files per node ------------------
srun --kill-on-bad-exit=1 --wait=60 \
    --nodes=16 --ntasks-per-node=1 \
    --output=/shared/logs/llm/%x-%j-%N-%n.out --open-mode=append \
    bash -c '
        trap "" USR1  # torchrun ignores the lead-time signal; its workers handle it
        exec torchrun --nnodes=16 --nproc-per-node=8 \
            --node-rank="$SLURM_NODEID" \
            --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
            "$@"
    ' torchrun \
    --max-restarts=0 \
    /REPO/tests/golden/train.py --config configs/70b.yaml --lr 3e-4 --run-name 'first try; really' &
step_pid=$!
# A trapped signal ends `wait` early (status > 128); wait again while srun runs.
while kill -0 "$step_pid" 2>/dev/null; do
    wait "$step_pid" || true
done
rc=0
wait "$step_pid" || rc=$?
echo "clusterops: job step exited with status $rc" >&2
exit "$rc"
