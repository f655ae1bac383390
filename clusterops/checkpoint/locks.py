"""Writer locks: which hidden entries of a checkpoint root belong to a live writer.

A save holds ``flock(2)`` on ``.lock.<suffix>`` (the suffix of its temporary) from
before its temporary exists until its cleanup is done; the kernel drops the lock when
the writer dies, however it dies. Retention asks :func:`lock_state` instead of trusting
the pid in a name, which means nothing across PID namespaces or hosts.
:func:`node_local_flock` tells, from /proc/self/mountinfo, when a root's filesystem
grants flock per node (Lustre ``localflock``, NFS ``local_lock=flock|all`` or ``nolock``),
where a lock held on another host looks free here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import List, Optional, Set, Tuple

from clusterops.checkpoint.format import LOCK_PREFIX, CheckpointError

log = logging.getLogger(__name__)


class WriterLock:
    """A lock file ``.lock.<suffix>`` held with flock(2) by a writer for a whole save.

    A live writer is recognised by its held lock, not by its pid: a pid recorded in a
    name means nothing across PID namespaces (containers) or hosts. The lock is
    released by the kernel when the writer dies, however it dies. Where the
    filesystem has no flock (some Lustre mounts) the file still exists and the
    temporaries are then judged by age only.
    """

    def __init__(self, root: Path, suffix: str):
        self.path = root / f"{LOCK_PREFIX}{suffix}"
        self.held = False
        self.fd: Optional[int] = None
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()
        for _ in range(50):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    # A prune probing this (random, so ours alone) name holds it for an
                    # instant; try again.
                    os.close(fd)
                    time.sleep(0.01)
                    continue
                log.warning("no flock on %s (%s): temporaries there are judged by age only", root, e.strerror)
            # A prune may have removed the file between our open and flock (it saw it
            # unlocked): then lock a fresh one.
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same or not self.held:
                os.write(fd, body)
                self.fd = fd
                return
            os.close(fd)
            self.held = False
        raise CheckpointError(f"{self.path}: could not take the writer lock")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def lock_state(root: os.PathLike, suffix: str) -> str:
    """The state of the writer lock of suffix: "live" (a running writer holds it),
    "free" (the lock file exists and nobody holds it: its writer is gone), "absent"
    (no lock file) or "unknown" (it cannot be probed: no flock on this filesystem)."""
    path = os.path.join(root, f"{LOCK_PREFIX}{suffix}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "unknown"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "unknown"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return "live" if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else "unknown"
        return "free"
    finally:
        os.close(fd)  # also drops the probe's lock



# ----------------------------------------------------------------------------- node-local flock

MOUNTINFO = "/proc/self/mountinfo"
_warned_mounts: set = set()
_checked_roots: dict = {}
_scope_cache: dict = {}     # (mountinfo file, path) -> (monotonic time, answer)
SCOPE_CACHE_S = 60.0


def _unescape_mount(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    if "\\" not in field:
        return field
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> List[Tuple[str, str, Set[str]]]:
    """[(mount point, fstype, options)] from /proc/self/mountinfo text; the options are
    the mount's and its superblock's together. Malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3 or len(fields) < 6:
            continue
        opts = set(fields[5].split(",")) | set(fields[sep + 3].split(",") if len(fields) > sep + 3 else ())
        out.append((_unescape_mount(fields[4]), fields[sep + 1], opts))
    return out


def node_local_flock(path: os.PathLike, mountinfo: Optional[str] = None) -> Optional[str]:
    """Why flock(2) on the filesystem of path is local to this node, or None.

    On Lustre mounted with ``localflock``, NFS mounted with ``local_lock=flock`` or
    ``local_lock=all``, or NFS with ``nolock``, the kernel grants flock without asking
    any other host: a lock held by a writer on another node looks free here. The mount
    is the longest mount point above path in ``mountinfo`` (default: this process's
    /proc/self/mountinfo; None when it cannot be read).
    """
    if mountinfo is None:
        # Every save asks (through the leftover scan): answer from a short-lived cache.
        key = (MOUNTINFO, os.path.abspath(os.fspath(path)))
        hit = _scope_cache.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[0] < SCOPE_CACHE_S:
            return hit[1]
        try:
            with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        except OSError:
            text = ""
        why = node_local_flock(path, text) if text else None
        if len(_scope_cache) > 256:
            _scope_cache.clear()
        _scope_cache[key] = (now, why)
        return why
    # The real path of the nearest existing ancestor, with the part not made yet appended.
    p, tail = os.path.abspath(os.fspath(path)), ""
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p, tail = os.path.dirname(p), os.path.join(os.path.basename(p), tail)
    with contextlib.suppress(OSError, ValueError):
        p = os.path.realpath(p)
    p = os.path.join(p, tail).rstrip("/") or "/"
    best = None
    for mnt, fstype, opts in parse_mountinfo(mountinfo):
        if p == mnt or p.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) >= len(best[0]):
                best = (mnt, fstype, opts)
    if best is None:
        return None
    mnt, fstype, opts = best
    if fstype == "lustre" and "localflock" in opts:
        why = "Lustre mounted with localflock"
    elif fstype.startswith("nfs") and ({"local_lock=flock", "local_lock=all"} & opts):
        why = f"NFS mounted with {sorted({'local_lock=flock', 'local_lock=all'} & opts)[0]}"
    elif fstype.startswith("nfs") and "nolock" in opts:
        why = "NFS mounted with nolock"
    else:
        return None
    return (f"{mnt} is {why}: flock is local to each node there, so a checkpoint writer on another "
            f"host looks dead here; write one checkpoint root from one node at a time, or remount")


def warn_node_local_flock(root: os.PathLike, mountinfo: Optional[str] = None) -> Optional[str]:
    """Log the node-local flock warning for root's mount once per process; returns it.
    (Each root's mount is read once per process: a save costs one dict lookup.)"""
    key = os.path.abspath(os.fspath(root))
    if mountinfo is None and key in _checked_roots:
        return _checked_roots[key]
    why = node_local_flock(root, mountinfo)
    if mountinfo is None:
        _checked_roots[key] = why
    if why is not None:
        if why not in _warned_mounts:
            _warned_mounts.add(why)
            log.warning("checkpoint root %s: %s", root, why)
    return why
