#!/usr/bin/env bash
# Idempotent setup for a fresh Debian machine (root, no GPU) or CI:
# apt packages (Slurm, munge, sshd), a virtualenv in .venv, the package with its
# test extras, and torch==2.13.0 (the CPU build; an unpinned torch pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_pkgs=()
command -v slurmctld >/dev/null || apt_pkgs+=(slurm-wlm)
command -v munged >/dev/null || apt_pkgs+=(munge)
command -v slurmrestd >/dev/null || [ -x /usr/sbin/slurmrestd ] || apt_pkgs+=(slurmrestd)
[ -x /usr/sbin/sshd ] || apt_pkgs+=(openssh-server)
command -v ssh-keygen >/dev/null || apt_pkgs+=(openssh-client)
command -v openssl >/dev/null || apt_pkgs+=(openssl)   # the https tests' throwaway CA
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_pkgs+=(python3-venv)
# The fleet tests: a real PostgreSQL server (history), promtool (alert rules), headless
# Chromium with its WebDriver (the HTML pages). Without recommends: no daemons come along.
fleet_pkgs=()
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || fleet_pkgs+=(postgresql)
command -v promtool >/dev/null || fleet_pkgs+=(prometheus)
command -v chromium >/dev/null || fleet_pkgs+=(chromium)
command -v chromedriver >/dev/null || fleet_pkgs+=(chromium-driver)
if [ ${#apt_pkgs[@]} -gt 0 ] || [ ${#fleet_pkgs[@]} -gt 0 ]; then
    echo "setup: apt-get install ${apt_pkgs[*]} ${fleet_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    if [ ${#apt_pkgs[@]} -gt 0 ]; then
        apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
    fi
    if [ ${#fleet_pkgs[@]} -gt 0 ]; then
        apt-get install -y -qq --no-install-recommends "${fleet_pkgs[@]}" >/dev/null
    fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
fi
if [ ! -f .venv/.clusterops-setup ] || [ setup.cfg -nt .venv/.clusterops-setup ] || [ setup.py -nt .venv/.clusterops-setup ] || [ scripts/setup.sh -nt .venv/.clusterops-setup ]; then
    echo "setup: installing torch==2.13.0 and clusterops[dev,ssh,gpu,fleet] into .venv"
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v -e '^WARNING: Location' || true
    .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v -e '^WARNING: Location' || true
    .venv/bin/python -m pip install -q -e '.[dev,ssh,gpu,fleet]' 2>&1 | grep -v -e '^WARNING: Location' -e 'WheelFile' -e '^ *!!' -e '^ *$' || true
    .venv/bin/python -c 'import torch, clusterops, pytest; assert torch.__version__.startswith("2.13.0")'
    touch .venv/.clusterops-setup
fi
