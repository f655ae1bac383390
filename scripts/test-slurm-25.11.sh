#!/usr/bin/env bash
# The 25.11 tier: Slurm 25.11 built from the vendored source, pyslurm built against it, a
# dev cluster from that prefix, and on it: the Slurm layer's contract tests over both
# backends (CLI and pyslurm), and the supervisor's fault cases (a) kill -9 and (d) lost node
# without a spare, each with the CLI and with the pyslurm backend; and the expedited requeue
# (tests/integration/test_expedited_requeue.py).
#
#   scripts/test-slurm-25.11.sh [PYTEST_ARGS...]
#
# Both builds are cached (a second run skips them). CLUSTEROPS_TEST_REQUIRE_PYSLURM=1 turns
# a skipped pyslurm half into a failure: on this tier pyslurm must really run.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${CLUSTEROPS_SLURM_25_11_PREFIX:-/opt/slurm-25.11}"
tarball="${CLUSTEROPS_SLURM_25_11_TARBALL:-../shared/vendor/slurm-25.11.7.tar.gz}"
bash scripts/setup.sh
bash scripts/build-slurm.sh "$tarball" "$prefix"
bash scripts/build-pyslurm.sh "$prefix"
export CLUSTEROPS_SLURM_PREFIX="$prefix" CLUSTEROPS_TEST_REQUIRE_PYSLURM=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 -rs \
    tests/integration/test_slurm_contract.py \
    tests/integration/test_fault_matrix.py::test_a_kill9_rank_restarts_in_allocation \
    tests/integration/test_fault_matrix.py::test_d_lost_node_without_spare_requeues_excluding_it \
    tests/integration/test_expedited_requeue.py \
    "$@"
