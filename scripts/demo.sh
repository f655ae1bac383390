#!/usr/bin/env bash
# README command 1: set everything up, then run the main job on a 4-node dev cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m clusterops.demo "$@"
