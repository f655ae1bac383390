#!/usr/bin/env bash
# README command 2: set everything up, then run the whole test suite. The tests start
# (and stop) their own dev cluster. pytest's exit code passes through, so "no tests
# collected" (5) fails like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 "$@"
