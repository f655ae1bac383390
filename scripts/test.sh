#!/usr/bin/env bash
# README command 2: set everything up, then run the whole test suite. The tests start
# (and stop) their own dev cluster. pytest's exit code passes through, so "no tests
# collected" (5) fails like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests run in CLUSTEROPS_TEST_WORKERS processes at once (pytest-xdist; 3 by default, 0
# for one process), each with its own dev cluster and PostgreSQL server: most dev-cluster
# tests wait on Slurm, not on the CPU. Arguments after the defaults win (e.g. -n 0).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 \
    -n "${CLUSTEROPS_TEST_WORKERS:-3}" --dist loadgroup "$@"
