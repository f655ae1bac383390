#!/usr/bin/env bash
# Build Slurm from an upstream release tarball into a prefix, once.
#
#   scripts/build-slurm.sh [TARBALL] [PREFIX]
#
# Defaults: ../shared/vendor/slurm-25.11.7.tar.gz (relative to the repository root) and
# /opt/slurm-25.11. Installs the Debian build dependencies with apt, configures with the
# flags verified on this project's machines, runs `make -j2` and `make install`, and writes
# PREFIX/.clusterops-build-stamp holding the tarball's sha256 and the configure flags. A
# second run with the same tarball and flags finds the stamp and builds nothing, so CI can
# cache PREFIX. Afterwards:
#
#   clusterops devcluster up --slurm-prefix PREFIX
#
# --enable-multiple-slurmd is required: the dev cluster runs several `slurmd -N nodeK` on
# one host, and without it the second slurmd never registers (its node stays down*).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tarball="${1:-$repo/../shared/vendor/slurm-25.11.7.tar.gz}"
prefix="${2:-/opt/slurm-25.11}"
jobs="${CLUSTEROPS_BUILD_JOBS:-2}"

die() { echo "build-slurm: $*" >&2; exit 2; }
[ -f "$tarball" ] || die "tarball not found: $tarball"
case "$prefix" in /*) ;; *) die "prefix must be an absolute path: $prefix" ;; esac
tarball="$(cd "$(dirname "$tarball")" && pwd)/$(basename "$tarball")"

flags=(--prefix="$prefix" --sysconfdir="$prefix/etc" --enable-multiple-slurmd --disable-debug)
sha="$(sha256sum "$tarball" | cut -d' ' -f1)"
stamp="$prefix/.clusterops-build-stamp"
want="sha256=$sha flags=${flags[*]}"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$prefix/sbin/slurmctld" ]; then
    echo "build-slurm: $prefix already holds this build ($(basename "$tarball")); nothing to do"
    exit 0
fi

# One build at a time per prefix (two shells running the script would race on make install).
builds="${CLUSTEROPS_BUILD_DIR:-/var/tmp/clusterops-slurm-build}"
mkdir -p "$builds"
exec 9>"$builds/$(echo "$prefix" | tr / _).lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$prefix/sbin/slurmctld" ]; then
    echo "build-slurm: $prefix was built meanwhile; nothing to do"
    exit 0
fi

deps=(build-essential libmunge-dev libjson-c-dev libyaml-dev libhttp-parser-dev libjwt-dev libdbus-1-dev munge)
missing=()
for p in "${deps[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "build-slurm: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}" >/dev/null
fi

work="$builds/$sha"
rm -rf "$work"
mkdir -p "$work"
log="$work/build.log"
echo "build-slurm: building $(basename "$tarball") into $prefix (log: $log)"
start=$SECONDS
tar -xzf "$tarball" -C "$work"
src="$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n1)"
[ -x "$src/configure" ] || die "no configure script in $tarball"
(
    cd "$src"
    ./configure "${flags[@]}"
    make -j"$jobs"
    rm -f "$stamp"
    make install
) >"$log" 2>&1 || { tail -n 30 "$log" >&2; die "build failed; full log in $log"; }
"$prefix/sbin/slurmctld" -V >/dev/null || die "$prefix/sbin/slurmctld does not run"
echo "$want" >"$stamp"
rm -rf "$src"
echo "build-slurm: done in $((SECONDS - start)) s: $("$prefix/sbin/slurmctld" -V)"
