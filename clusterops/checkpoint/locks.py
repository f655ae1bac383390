"""Writer locks: which hidden entries of a checkpoint root belong to a live writer.

A save holds ``flock(2)`` on ``.lock.<suffix>`` (the suffix of its temporary) from
before its temporary exists until its cleanup is done; the kernel drops the lock when
the writer dies, however it dies. Retention asks :func:`lock_state` instead of trusting
the pid in a name, which means nothing across PID namespaces or hosts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

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

