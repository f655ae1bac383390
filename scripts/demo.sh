#!/usr/bin/env bash
# README command 1: set everything up, then run the main job on a 4-node dev cluster:
#   1. a real 4-node torchrun (gloo) all-reduce through clusterops' Slurm layer;
#   2. the self-healing demo: the example training submitted through `clusterops launch`
#      under the supervisor, one rank killed mid-run, the job healing itself, its
#      timeline printed, and the final weights checked against an uninterrupted run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
state=${CLUSTEROPS_DEVCLUSTER_DIR:-/tmp/clusterops-devcluster}
.venv/bin/python examples/demo_allreduce.py --state-dir "$state" --keep
rc=0
.venv/bin/python examples/demo.py --state-dir "$state" --port-base 17000 "$@" || rc=$?
# CLUSTEROPS_KEEP_CLUSTER=1 leaves the dev cluster up to play with (export SLURM_CONF=$state/slurm.conf).
if [ "${CLUSTEROPS_KEEP_CLUSTER:-0}" != 1 ]; then
    .venv/bin/clusterops devcluster down --state-dir "$state"
fi
exit "$rc"
