"""One sweep at a time per history, from any host.

``sweep_lock(target)`` gives the lock for a history target (``clusterops.history.Target``):

- a SQLite history lives on one host, and so does its lock: ``fcntl.flock`` on
  ``<db>.lock`` (``FileLock``); the kernel drops it with the process, so a crashed sweep
  never leaves a stale lock;
- a PostgreSQL history is shared by every cron host that names it, so the lock is in the
  database: ``pg_try_advisory_lock`` on a connection held for the sweep's life
  (``PgAdvisoryLock``). The server drops it when that connection ends (a crashed or killed
  sweep, a host that lost power), so it is never stale either. Two hosts sweeping with the
  same history: the second finds the lock held and exits 4, like a second sweep on one host.

A lock that is held raises ``SweepLocked`` with a one-line description of its holder.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path
from typing import Optional, Tuple

from clusterops.errors import ClusteropsError

# pg_try_advisory_lock(int4, int4): the first key names clusterops' sweep lock ("swep").
PG_LOCK_CLASS = 0x73776570


class SweepLocked(Exception):
    """Another sweep holds the lock; ``str()`` says who, when it is known."""


def _holder_text() -> str:
    return (f"pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")


class FileLock:
    """``fcntl.flock`` on ``path``: one holder at a time on this host."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: Optional[int] = None

    @property
    def where(self) -> str:
        return f"lock {self.path}"

    def __enter__(self) -> "FileLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            raise SweepLocked(holder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_holder_text() + "\n").encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)   # releases the flock
            self.fd = None


def pg_lock_key(scope: str) -> Tuple[int, int]:
    """The advisory lock's two keys for ``scope`` (a stable 31-bit hash of it)."""
    return PG_LOCK_CLASS, int.from_bytes(hashlib.sha256(scope.encode()).digest()[:4], "big") & 0x7FFFFFFF


class PgAdvisoryLock:
    """A PostgreSQL session advisory lock, held on its own connection until ``__exit__``."""

    def __init__(self, url: str, display: str, scope: str = "sweep", *, timeout_s: float = 10.0):
        self.url = url
        self.display = display
        self.key = pg_lock_key(scope)
        self.timeout_s = timeout_s
        self.conn = None

    @property
    def where(self) -> str:
        return f"advisory lock {self.key[0]}/{self.key[1]} in {self.display}"

    def __enter__(self) -> "PgAdvisoryLock":
        from clusterops.history import redact_text   # a driver's message may quote the DSN

        try:
            import psycopg
        except ImportError:
            raise ClusteropsError(f"{self.display}: PostgreSQL history needs psycopg "
                                  "(pip install 'clusterops[fleet]')") from None
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=max(2, int(self.timeout_s)),
                                   application_name=f"clusterops sweep {_holder_text()}"[:63])
        except psycopg.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ClusteropsError(f"{self.display}: cannot take the sweep lock: "
                                  f"{redact_text(first, self.url)}") from None
        try:
            got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", self.key).fetchone()[0]
            if not got:
                holder = self._holder(conn)
                conn.close()
                raise SweepLocked(holder)
        except psycopg.Error as e:
            conn.close()
            raise ClusteropsError(f"{self.display}: cannot take the sweep lock: "
                                  f"{redact_text(str(e), self.url)}") from None
        self.conn = conn
        return self

    def _holder(self, conn) -> str:
        try:
            row = conn.execute(
                "SELECT a.application_name, host(a.client_addr) FROM pg_locks l "
                "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
                "AND l.classid = %s AND l.objid = %s LIMIT 1", self.key).fetchone()
        except Exception:  # noqa: BLE001 - who holds it is a courtesy; the refusal stands
            return ""
        if not row:
            return ""
        name, addr = row
        return f"{name or 'a session'}" + (f" from {addr}" if addr else "")

    def __exit__(self, *exc) -> None:
        if self.conn is not None:
            try:
                self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", self.key)
            except Exception:  # noqa: BLE001 - closing the session releases it anyway
                pass
            self.conn.close()
            self.conn = None


def sweep_lock(target, *, no_history: bool = False):
    """The lock for a sweep recording into ``target`` (a ``history.Target``): a file next to a
    SQLite database, an advisory lock inside a PostgreSQL one. A ``--no-history`` sweep
    does not connect to a PostgreSQL history at all: it takes a file lock on this host
    named after it (as every sweep did before the advisory lock)."""
    if target.kind == "sqlite":
        db = Path(target.path)
        return FileLock(db.with_name(db.name + ".lock"))
    if no_history:
        from clusterops.history import default_db_path

        digest = hashlib.sha256(target.display.encode()).hexdigest()[:12]
        return FileLock(default_db_path().with_name(f"sweep-postgresql-{digest}.lock"))
    return PgAdvisoryLock(target.url, target.display)
