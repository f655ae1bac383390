#!/bin/bash
# resilient: torchrun on 4 node(s) x 8 = 32 rank(s).
# Rendered by clusterops VERSION. Edit the job spec and render again rather than this file.
# Note: no cpus_per_task: the launcher and its 8 rank(s) per node share the CPUs of one task.
#SBATCH --job-name=resilient
#SBATCH --nodes=5
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=1-00:00:00
#SBATCH --chdir=/REPO/tests/golden
#SBATCH --output=/shared/logs/resilient/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --no-kill

set -eo pipefail

# ---- stop signals before the supervisor runs ---------------------------------------
# The lead-time SIGUSR1 (a short job, a long setup, a busy node) or a SIGTERM can come
# before the supervisor is there to act on it, and either would end this shell and the
# job with it, unsaved and not requeued. They are noted here and handed to it below.
CLUSTEROPS_EARLY_SIGNALS=
trap 'CLUSTEROPS_EARLY_SIGNALS="${CLUSTEROPS_EARLY_SIGNALS:+$CLUSTEROPS_EARLY_SIGNALS,}USR1"' USR1
trap 'CLUSTEROPS_EARLY_SIGNALS="${CLUSTEROPS_EARLY_SIGNALS:+$CLUSTEROPS_EARLY_SIGNALS,}TERM"' TERM

# ---- environment ---------------------------------------------------------------
# srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05): hand it on.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# NCCL errors and timeouts raise in the training processes instead of hanging them.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export CLUSTEROPS_LOG_DIR=/shared/logs/resilient
mkdir -p "$CLUSTEROPS_LOG_DIR"  # `launch submit` creates it; a hand-run sbatch may not have

# ---- setup (from the job spec, verbatim) -----------------------------------------
source /shared/envs/llm/bin/activate

# ---- hand over to the supervisor ---------------------------------------------------
# exec: the supervisor becomes this shell, so the lead-time signal (--signal=B:USR1)
# and SIGTERM reach it directly; it runs the training steps and heals them. Until its
# handlers are in, both are ignored (a trap ends at exec, an ignored signal stays ignored);
# one lost meanwhile is made up for by the job's end time, which the supervisor reads.
trap '' USR1 TERM
export CLUSTEROPS_EARLY_SIGNALS
exec clusterops supervise --spec-json '{"account":null,"args":["--steps","100000"],"chain":1,"constraint":null,"container_image":null,"container_mounts":null,"cpus_per_task":null,"env":{},"exclude":null,"exclusive":false,"gpus_per_node":8,"launcher":"torchrun","launcher_args":[],"log_dir":"/shared/logs/resilient","master_port":null,"mem":null,"name":"resilient","nodelist":null,"nodes":4,"notify":[],"nproc_per_node":null,"partition":null,"python":"python3","qos":null,"requeue":true,"sbatch_args":[],"script":"/REPO/tests/golden/train.py","segment":null,"setup":["source /shared/envs/llm/bin/activate"],"signal_lead_s":600,"srun_args":[],"srun_wait_s":60,"supervise":{"ckpt_dir":"/shared/ckpt/resilient","hang_timeout_s":600,"min_nodes":3,"preflight":"deep","spare_nodes":1},"time":"1-00:00:00","workdir":"/REPO/tests/golden"}'
