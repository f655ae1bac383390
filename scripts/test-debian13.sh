#!/usr/bin/env bash
# The Slurm 24.11 tier: run the README's test command on Debian 13 (trixie), whose
# slurm-wlm is 24.11, inside a debootstrapped root on this machine.
#
#   scripts/test-debian13.sh [--root DIR] [--setup-only] [--keep-mounts] [PYTEST_ARGS...]
#
# Default root: /var/tmp/clusterops-debian13. What it does (each step skipped when done):
#  1. apt-get install debootstrap on the host; `debootstrap --variant=minbase trixie ROOT`
#     (under a minute here), then apt-get install slurm-wlm munge openssh-server git in it.
#  2. Mounts: /proc, /dev and /sys recursively (`mount --rbind`: slurmd 24.11 refuses to
#     start without /sys/fs/cgroup), the host's Python installation (the directory of
#     `python3`'s real prefix, at the same path) and the folders pip reads wheels from,
#     read-only; copies the pip configuration, the CA bundle (pip reaches the registry
#     with it) and /etc/hosts (the hostname must resolve, or `torchrun --standalone` hangs).
#  3. Clones this repository's HEAD into ROOT/opt/clusterops (committed work only).
#  4. Runs `bash scripts/test.sh PYTEST_ARGS...` there with chroot: the README's test
#     command, which installs what it needs and starts its own dev cluster (Slurm 24.11).
# --setup-only stops after step 3 and prints `slurmctld -V` from the root. Mounts are
# undone on exit unless --keep-mounts.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
root=/var/tmp/clusterops-debian13
setup_only=0
keep_mounts=0
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="$2"; shift 2 ;;
        --setup-only) setup_only=1; shift ;;
        --keep-mounts) keep_mounts=1; shift ;;
        --) shift; break ;;
        *) break ;;
    esac
done
pytest_args=("$@")
die() { echo "test-debian13: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, mount, chroot)"
case "$root" in /*) ;; *) die "--root must be an absolute path: $root" ;; esac
log() { echo "test-debian13: $*"; }

# -- 1. the root ----------------------------------------------------------------------
if ! command -v debootstrap >/dev/null; then
    log "apt-get install debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq debootstrap >/dev/null
fi
if [ ! -f "$root/.clusterops-debootstrap-done" ]; then
    log "debootstrap trixie into $root"
    # Never delete through a bind mount (/dev, /sys, the host's Python) left by --keep-mounts.
    if awk -v r="$root" '$2 == r || index($2, r "/") == 1 {found=1} END {exit !found}' /proc/mounts; then
        die "something is still mounted under $root: umount -R it first"
    fi
    rm -rf "$root"
    mkdir -p "$root"
    start=$SECONDS
    debootstrap --variant=minbase trixie "$root" http://deb.debian.org/debian >"$root.debootstrap.log" 2>&1 \
        || { tail -n 20 "$root.debootstrap.log" >&2; die "debootstrap failed (log: $root.debootstrap.log)"; }
    touch "$root/.clusterops-debootstrap-done"
    log "debootstrap took $((SECONDS - start)) s"
fi

# -- 2. mounts and copied files ---------------------------------------------------------
mounted=()
cleanup() {
    [ "$keep_mounts" = 1 ] && return
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -R "${mounted[$i]}" 2>/dev/null || umount -R -l "${mounted[$i]}" 2>/dev/null || true
    done
}
trap cleanup EXIT
bind() {   # bind SRC [ro]: SRC at the same path inside the root
    local src="$1" dst="$root$1"
    [ -e "$src" ] || return 0
    mountpoint -q "$dst" 2>/dev/null && return 0
    if [ -d "$src" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")"; touch "$dst"; fi
    mount --rbind "$src" "$dst"
    mount --make-rslave "$dst"
    if [ "${2:-}" = ro ]; then mount -o remount,bind,ro "$dst" 2>/dev/null || true; fi
    mounted+=("$dst")
}
for d in /proc /dev /sys; do bind "$d"; done
# The host's Python (this project pins the interpreter its wheels are built for).
py_prefix="$(python3 -c 'import sys; print(sys.base_prefix)')"
py_home="$py_prefix"
case "$py_prefix" in */.pyenv/versions/*) py_home="${py_prefix%%/versions/*}" ;; esac
bind "$py_home" ro
# pip: its configuration, the on-disk wheel folders and indexes it names, the CA bundle.
for f in /etc/pip.conf /etc/xdg/pip "$HOME/.config/pip" "$HOME/.pip"; do
    if [ -e "$f" ]; then mkdir -p "$root$(dirname "$f")"; cp -a "$f" "$root$(dirname "$f")/"; fi
done
for d in $(python3 -m pip config list 2>/dev/null | grep -Eo "(file://)?/[^' ]+" | sed 's|^file://||' | sort -u); do
    case "$d" in /etc/*|"$HOME"/.config/*) continue ;; esac
    base="$d"
    [ -d "$base" ] || base="$(dirname "$base")"
    [ -d "$base" ] || continue
    case "$base" in */simple) base="$(dirname "$base")" ;; esac
    bind "$base" ro
done
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt" 2>/dev/null \
    || { mkdir -p "$root/etc/ssl/certs"; cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"; }
cp /etc/hosts "$root/etc/hosts"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true

in_root() {
    chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH="$py_prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        $(env | grep -E '^PIP_[A-Z_]+=' | tr '\n' ' ') "$@"
}
if [ ! -f "$root/.clusterops-packages-done" ]; then
    log "apt-get install slurm-wlm munge openssh-server git inside the root"
    in_root bash -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq &&
        apt-get install -y -qq slurm-wlm munge openssh-server git ca-certificates >/dev/null'
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    touch "$root/.clusterops-packages-done"
fi

# -- 3. the repository --------------------------------------------------------------------
rm -rf "$root/opt/clusterops"
git clone -q --no-hardlinks "$repo" "$root/opt/clusterops"
log "cloned $(git -C "$repo" rev-parse --short HEAD) into $root/opt/clusterops"
log "Debian $(cat "$root/etc/debian_version"), $(in_root slurmctld -V)"
if [ "$setup_only" = 1 ]; then
    exit 0
fi

# -- 4. the README's test command ----------------------------------------------------------
log "bash scripts/test.sh ${pytest_args[*]}"
in_root bash -c 'cd /opt/clusterops && exec bash scripts/test.sh "$@"' test.sh "${pytest_args[@]}"
