#!/usr/bin/env bash
# Build and install pyslurm into the repository's .venv against a Slurm prefix, once.
#
#   scripts/build-pyslurm.sh [PREFIX] [VERSION]
#
# Defaults: /opt/slurm-25.11 (built by scripts/build-slurm.sh) and pyslurm 25.11.2 from PyPI
# (an sdist: pyslurm X.Y.* builds only against Slurm X.Y's headers and libslurmfull). Needs
# cython first. About 4 minutes on 2 cores. A .venv that already imports that pyslurm version
# is left alone, so a second run returns at once. Afterwards the Slurm layer's `auto` backend
# uses pyslurm on a 25.11 controller (docs/foundation.md, "The pyslurm backend").
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
prefix="${1:-/opt/slurm-25.11}"
version="${2:-25.11.2}"
py="$repo/.venv/bin/python"

die() { echo "build-pyslurm: $*" >&2; exit 2; }
[ -x "$py" ] || die "no $py: run scripts/setup.sh first"
[ -d "$prefix/include/slurm" ] || die "no Slurm headers in $prefix/include/slurm: run scripts/build-slurm.sh"
[ -e "$prefix/lib/slurm/libslurmfull.so" ] || die "no $prefix/lib/slurm/libslurmfull.so"

have="$("$py" -c 'from importlib import metadata; print(metadata.version("pyslurm"))' 2>/dev/null || true)"
if [ "$have" = "$version" ] && PYSLURM_DISABLE_AUTO_INIT=1 "$py" -c 'import pyslurm' 2>/dev/null; then
    echo "build-pyslurm: .venv already has pyslurm $version; nothing to do"
    exit 0
fi
start=$SECONDS
echo "build-pyslurm: building pyslurm $version against $prefix"
"$py" -m pip install -q cython
SLURM_INCLUDE_DIR="$prefix/include" SLURM_LIB_DIR="$prefix/lib/slurm" \
    "$py" -m pip install -q --no-cache-dir "pyslurm==$version"
PYSLURM_DISABLE_AUTO_INIT=1 "$py" -c 'import pyslurm' || die "pyslurm $version built but does not import"
echo "build-pyslurm: done in $((SECONDS - start)) s"
