"""Two cron hosts sweeping into one PostgreSQL history never sweep at once: the lock is an
advisory lock inside the database, not a file on either host. "Two hosts" here are two
processes with different local state (their own $CLUSTEROPS_SWEEP_DB path, hence their own
lock files) against one real PostgreSQL server and the session dev cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops.sweep.lock import PgAdvisoryLock, SweepLocked, pg_lock_key

pytestmark = pytest.mark.integration

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")
# A check that takes a while, so the first sweep still holds its lock when the second starts.
SLOW_CHECK = f"sh -c 'sleep 12; exec {CLUSTEROPS} health check --json \"$@\"' check"


def host_env(tmp_path: Path, host: str) -> dict:
    home = tmp_path / host
    home.mkdir()
    env = dict(os.environ, HOME=str(home), CLUSTEROPS_SWEEP_DB=str(home / "sweep.db"),
               CLUSTEROPS_STATE_DIR=str(home / "state"))
    env.pop("CLUSTEROPS_HISTORY_DB", None)
    return env


def lock_held(url: str) -> bool:
    import psycopg

    cls, obj = pg_lock_key("sweep")
    with psycopg.connect(url, autocommit=True) as conn:
        return bool(conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                                 "AND classid = %s AND objid = %s", (cls, obj)).fetchone()[0])


@pytest.mark.timeout(240)
def test_second_host_sweeping_the_same_postgresql_history_exits_4(cluster, postgres_server, tmp_path):
    url = postgres_server.create_db("lock")
    argv = [CLUSTEROPS, "sweep", "--db", url, "--nodes", "node1", "--timeout", "90", "--json", "--quiet",
            "--check-cmd", SLOW_CHECK]
    a = subprocess.Popen(argv, env=host_env(tmp_path, "hostA"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 60
        while not lock_held(url):
            assert a.poll() is None, a.communicate()
            assert time.monotonic() < deadline, "host A never took the lock"
            time.sleep(0.2)
        t0 = time.monotonic()
        b = subprocess.run(argv, env=host_env(tmp_path, "hostB"), capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert b.returncode == 4, b.stderr + b.stdout
        line = b.stderr.strip()
        assert "\n" not in line and "another sweep is running" in line and "advisory lock" in line, line
        assert "clusterops sweep pid" in line, line        # who holds it, as the server knows
        assert took < 20 and a.poll() is None
    finally:
        out, err = a.communicate(timeout=180)
    assert a.returncode == 0, err + out
    assert json.loads(out)["counts"]["pass"] + json.loads(out)["counts"].get("warn", 0) == 1
    assert not lock_held(url)          # released with the sweep
    # And once A is done, B sweeps.
    b = subprocess.run(argv[:-2], env=host_env(tmp_path, "hostC"), capture_output=True, text=True, timeout=180)
    assert b.returncode == 0, b.stderr


@pytest.mark.timeout(60)
def test_advisory_lock_is_released_when_its_holder_dies(postgres_server, tmp_path):
    url = postgres_server.create_db("lockdie")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from clusterops.sweep.lock import PgAdvisoryLock\n"
        f"l = PgAdvisoryLock({url!r}, 'db').__enter__()\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SweepLocked):
            PgAdvisoryLock(url, "db").__enter__()
    finally:
        holder.kill()          # as a crashed sweep or a host that lost power
        holder.wait()
    deadline = time.monotonic() + 20
    while True:
        try:
            with PgAdvisoryLock(url, "db"):
                break
        except SweepLocked:
            assert time.monotonic() < deadline, "the dead holder's lock was never released"
            time.sleep(0.2)
