"""A real PostgreSQL server for the tests (Debian's ``postgresql`` package).

``postgres_server`` (session scope) runs ``initdb`` and ``pg_ctl`` from
/usr/lib/postgresql/*/bin in a temporary data directory, listening on 127.0.0.1 only
(no Unix socket) on a free port, with password authentication. PostgreSQL refuses to
run as root, so as root the server runs as the unprivileged user ``clusterops-pg``
(created with ``useradd`` when missing). ``history_target`` gives each test a fresh
history database on each backend: a SQLite path, or a new PostgreSQL database.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest
from clusterops.runner import free_port
from support.users import ensure_user

PG_USER = "clusterops-pg"   # the OS user the server runs as when the tests run as root
DB_USER = "clusterops"
DB_PASSWORD = "s3cret-pw"


def pg_bindir() -> Optional[Path]:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return Path(found[-1]).parent if found else None


class PgServer:
    def __init__(self, bindir: Path, base: Path):
        self.bindir = bindir
        self.base = base
        self.data = base / "data"
        self.log = base / "server.log"
        self.port = free_port("127.0.0.1")
        self._names = itertools.count(1)
        self.os_user = PG_USER if os.geteuid() == 0 else None

    def _as_user(self, argv: List[str]) -> List[str]:
        return ["runuser", "-u", self.os_user, "--", *argv] if self.os_user else argv

    def _run(self, argv: List[str], timeout: float = 60) -> subprocess.CompletedProcess:
        p = subprocess.run(self._as_user(argv), capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
        return p

    def init(self) -> None:
        if self.os_user:
            pw = ensure_user(self.os_user, system=True)
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        os.chmod(self.base, 0o700)
        pwfile = self.base / "pwfile"
        pwfile.write_text(DB_PASSWORD + "\n")
        if self.os_user:
            pw = pwd.getpwnam(self.os_user)
            os.chown(pwfile, pw.pw_uid, pw.pw_gid)
        self._run([str(self.bindir / "initdb"), "-D", str(self.data), "-U", DB_USER, f"--pwfile={pwfile}",
                   "--auth=scram-sha-256", "-E", "UTF8", "--no-sync", "--no-instructions"], timeout=120)
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = ''\n"
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 60\n"
                    "shared_buffers = 16MB\n")
        if self.os_user:
            pw = pwd.getpwnam(self.os_user)
            os.chown(self.data / "postgresql.conf", pw.pw_uid, pw.pw_gid)

    def start(self) -> None:
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                   "start"], timeout=90)
        deadline = time.time() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop"],
                  timeout=90)

    def running(self) -> bool:
        p = subprocess.run(self._as_user([str(self.bindir / "pg_ctl"), "-D", str(self.data), "status"]),
                           capture_output=True, text=True)
        return p.returncode == 0

    def url(self, dbname: str = "postgres", password: bool = True) -> str:
        auth = f"{DB_USER}:{DB_PASSWORD}" if password else DB_USER
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def create_db(self, prefix: str = "t") -> str:
        import psycopg

        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@pytest.fixture(scope="session")
def postgres_server():
    bindir = pg_bindir()
    if bindir is None:
        pytest.fail("PostgreSQL is not installed (scripts/setup.sh installs Debian's postgresql)")
    base = Path(tempfile.mkdtemp(prefix="clusterops-test-pg-"))
    server = PgServer(bindir, base)
    try:
        server.init()
        server.start()
        yield server
    finally:
        try:
            if server.running():
                server.stop("immediate")
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def history_target(request, tmp_path) -> str:
    """A fresh, empty history database on each backend: a SQLite path or a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "history.db")
    server = request.getfixturevalue("postgres_server")
    return server.create_db()
