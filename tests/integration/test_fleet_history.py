"""The fleet history on both backends (SQLite and a real PostgreSQL server): schema
migrations from the first release's schema, node checks recorded through the spool,
concurrent writers, a database that is down, and a dev-cluster sweep into PostgreSQL."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clusterops import spool
from clusterops.errors import ClusteropsError, InputError
from clusterops.history import (MIGRATIONS, SCHEMA, SCHEMA_VERSION, History, parse_target, redact)
from clusterops.sweep import NodeResult, SweepReport

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")


def sweep_report(sweep_id, t, statuses):
    results = {}
    for node, st in statuses.items():
        r = NodeResult(node, st, detail="" if st == "pass" else "broken", duration_s=0.5)
        r.probes = [{"name": "host.paths", "status": "pass" if st == "pass" else "fail", "value": 1.5,
                     "unit": "GB", "detail": ""}]
        results[node] = r
    return SweepReport(sweep_id, t - 5, t, {"via": "slurm", "profile": "fast"}, list(statuses), results, {}, None)


def check_report(node, status="pass", t=None, value=12.5):
    return {"node": node, "profile": "fast", "status": status, "exit_code": 0 if status == "pass" else 1,
            "duration_s": 0.2, "time": t or time.time(),
            "results": [{"name": "host.memory", "status": status, "value": value, "unit": "GB",
                         "detail": "" if status == "pass" else "too little memory"},
                        {"name": "nvml", "status": "skip", "value": None, "unit": None, "detail": "no GPU"}]}


def run_check(*args, env=None, timeout=60):
    e = dict(os.environ)
    e.pop("CLUSTEROPS_HISTORY_DB", None)
    e.update(env or {})
    return subprocess.run([CLUSTEROPS, "health", "check", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


# -- targets ----------------------------------------------------------------------------

def test_targets_parse_and_passwords_never_shown(tmp_path):
    assert parse_target(str(tmp_path / "a.db")).kind == "sqlite"
    assert parse_target("sqlite:///var/x.db").path == Path("/var/x.db")
    t = parse_target("postgres://u:pw@db1:5432/fleet")
    assert t.kind == "postgresql" and t.url.startswith("postgresql://")
    assert t.display == "postgresql://u:***@db1:5432/fleet"
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    for bad in ("mysql://u@h/db", "sqlite://relative.db", "postgresql://u@h", ""):
        with pytest.raises(InputError):
            parse_target(bad)


def test_unreachable_server_is_one_line_without_password():
    with pytest.raises(ClusteropsError) as e:
        History.open("postgresql://u:topsecret@127.0.0.1:1/fleet", timeout_s=2)
    assert "\n" not in e.value.message and "topsecret" not in e.value.message
    assert "127.0.0.1" in e.value.message


# -- migrations -------------------------------------------------------------------------

def _first_release_db(target: str) -> None:
    """A database as the first release left it (schema version 1) with a few sweeps."""
    t = parse_target(target)
    rows = [(1000.0 + i, f"s{i}", "node1", "check", st, 0.5, "s", "") for i, st in
            enumerate(["fail", "pass", "fail"])]
    if t.kind == "sqlite":
        conn = sqlite3.connect(str(t.path))
        conn.executescript(SCHEMA)
        conn.executemany("INSERT INTO results (time, sweep_id, node, probe, status, value, unit, detail) "
                         "VALUES (?,?,?,?,?,?,?,?)", rows)
        conn.execute("INSERT INTO sweeps VALUES ('s2', 995, 1002, 'slurm', 'fast', 1, 1, 0, 1)")
        conn.commit()
        conn.close()
    else:
        import psycopg

        with psycopg.connect(t.url, autocommit=True) as conn:
            for stmt in MIGRATIONS[1][1]["postgresql"].split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO results (time, sweep_id, node, probe, status, value, unit, detail) "
                                "VALUES (%s,%s,%s,%s,%s,%s,%s,%s)", rows)
            conn.execute("INSERT INTO sweeps VALUES ('s2', 995, 1002, 'slurm', 'fast', 1, 1, 0, 1)")


def test_migrates_from_the_first_release_schema(history_target):
    _first_release_db(history_target)
    # A reader reads the old database as it is, and changes nothing.
    with History.open(history_target, create=False) as h:
        assert h.schema_version() == 1 and not h.has_source
        assert [r.status for r in h.rows(node="node1")] == ["fail", "pass", "fail"]
        assert [r.source for r in h.rows(node="node1")] == ["sweep"] * 3
        assert h.checks() == [] and h.rows(source="check") == []
    # A writer migrates it: old rows kept, new features work.
    with History.open(history_target) as h:
        assert h.schema_version() == SCHEMA_VERSION == 3 and h.has_source and h.has_blames
        assert h.fail_history(["node1"], 5) == {"node1": [True, False, True]}
        assert h.record_check(dict(check_report("node1", "fail", t=2000.0), id="c1", host="h")) == 3
        h.record(sweep_report("s3", 3000.0, {"node1": "pass"}))
        # Flapping counts sweeps only; the node's own failing check is not one.
        assert h.fail_history(["node1"], 5) == {"node1": [False, True, False, True]}
        assert [r.source for r in h.rows(node="node1", probe="check")] == ["sweep"] * 3 + ["check", "sweep"]
        assert [s["id"] for s in h.sweeps()] == ["s3", "s2"]
        # The failed check is a blame (schema 3); the old sweeps' rows are not replayed as blames.
        assert [(b["node"], b["source"]) for b in h.blames()] == [("node1", "check")]
    # Opening again applies nothing more.
    with History.open(history_target) as h:
        assert h.migrate() == []


def test_fresh_database_gets_every_migration_and_a_newer_one_is_refused(history_target):
    with History.open(history_target) as h:
        assert h.schema_version() == SCHEMA_VERSION
        if h.kind == "postgresql":
            got = h.db.query("SELECT version FROM clusterops_schema ORDER BY version")
            assert [v for (v,) in got] == list(range(1, SCHEMA_VERSION + 1))
            h.db.execute("INSERT INTO clusterops_schema VALUES (99, 0, 'from the future')")
        else:
            h.db.set_version(99)
    with pytest.raises(ClusteropsError, match="newer than this clusterops knows"):
        History.open(history_target)


def test_record_check_is_idempotent_and_read_back(history_target):
    with History.open(history_target) as h:
        doc = dict(check_report("node2", t=1500.0), id="abc", host="node2-host")
        assert h.record_check(doc) == 3
        assert h.record_check(doc) == 0          # the same spooled file flushed twice
        assert [c["id"] for c in h.checks()] == ["abc"]
        rows = h.rows(node="node2", probe="host.memory")
        assert [(r.value, r.source, r.sweep_id) for r in rows] == [(12.5, "check", "abc")]
        assert {r.node: r.status for r in h.latest(source="check")} == {"node2": "pass"}
        assert h.latest(source="sweep") == []


# -- health check --db ------------------------------------------------------------------

def test_bad_db_is_exit_2_before_the_check(tmp_path):
    o = run_check("--db", "mysql://u@h/x", "--node", "n1")
    assert o.returncode == 2 and o.stderr.count("\n") == 1 and "unknown database scheme" in o.stderr
    site = tmp_path / "site.yaml"
    site.write_text("history:\n  db: postgresql://u@127.0.0.1:1/x\n  spool_max_files: 0\n")
    o = run_check("--site-config", str(site), "--node", "n1")
    assert o.returncode == 2 and "history.spool_max_files" in o.stderr


def test_spool_is_bounded_and_drops_the_oldest(tmp_path):
    s = spool.RecordSettings("postgresql://u@127.0.0.1:1/x", tmp_path / "spool", max_files=3, timeout_s=1)
    results = [spool.record(check_report("n1", t=1000.0 + i), s) for i in range(5)]
    assert all(r["error"] and r["recorded"] == 0 for r in results)
    assert [r["pending"] for r in results] == [1, 2, 3, 3, 3]
    assert [r["dropped"] for r in results] == [0, 0, 0, 1, 1]
    kept = [json.loads(p.read_text())["time"] for p in sorted((tmp_path / "spool").glob("*.json"))]
    assert kept == [1002.0, 1003.0, 1004.0]
    s2 = spool.RecordSettings(s.target, tmp_path / "spool2", max_bytes=4096, timeout_s=1)
    for i in range(40):
        spool.record(check_report("n1", t=1000.0 + i), s2)
    assert sum(p.stat().st_size for p in (tmp_path / "spool2").glob("*.json")) <= 4096


def test_checks_record_to_both_backends_through_the_cli(history_target, tmp_path):
    env = {"CLUSTEROPS_HEALTH_SPOOL": str(tmp_path / "spool")}
    o = run_check("--node", "nodeA", "--db", history_target, "--json", env=env)
    assert o.returncode == 0, o.stderr
    doc = json.loads(o.stdout)
    assert doc["history"]["recorded"] == 1 and doc["history"]["pending"] == 0 and doc["history"]["error"] is None
    assert "s3cret" not in o.stdout
    # The environment selects the database too; `health history` reads it back.
    o = run_check("--node", "nodeA", env=dict(env, CLUSTEROPS_HISTORY_DB=history_target))
    assert o.returncode == 0
    h = subprocess.run([CLUSTEROPS, "health", "history", "nodeA", "--probe", "check", "--source", "check",
                        "--db", history_target, "--json"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0, h.stderr
    rows = json.loads(h.stdout)["rows"]
    assert [r["status"] for r in rows] == ["pass", "pass"] and {r["source"] for r in rows} == {"check"}


def test_four_nodes_check_concurrently_without_losing_a_row(postgres_server, tmp_path):
    url = postgres_server.create_db("conc")
    rounds = 3

    def node_loop(i):
        codes = []
        for _ in range(rounds):
            # Each node has its own local spool, as on real nodes.
            o = run_check("--node", f"node{i}", "--db", url, "--json",
                          env={"CLUSTEROPS_HEALTH_SPOOL": str(tmp_path / f"spool{i}")})
            codes.append((o.returncode, json.loads(o.stdout)["history"]))
        return codes

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(node_loop, range(1, 5)))
    assert all(code == 0 and hist["error"] is None and hist["pending"] == 0 for per in got for code, hist in per)
    with History.open(url, create=False) as h:
        checks = h.checks()
        assert len(checks) == 4 * rounds
        assert sorted({c["node"] for c in checks}) == ["node1", "node2", "node3", "node4"]
        assert all(len(h.rows(node=f"node{i}", probe="check")) == rounds for i in range(1, 5))
        assert len({c["id"] for c in checks}) == 4 * rounds


def test_database_down_checks_pass_and_arrive_after_restart(postgres_server, tmp_path):
    url = postgres_server.create_db("down")
    env = {"CLUSTEROPS_HEALTH_SPOOL": str(tmp_path / "spool")}
    assert run_check("--node", "node1", "--db", url, env=env).returncode == 0
    postgres_server.stop()
    try:
        t0 = time.monotonic()
        outs = [run_check("--node", "node1", "--db", url, "--json", env=env) for _ in range(2)]
        assert time.monotonic() - t0 < 30
        for o in outs:
            assert o.returncode == 0                     # the check passes; only its recording waits
            assert "history not recorded now" in o.stderr and "s3cret" not in o.stderr
        assert [json.loads(o.stdout)["history"]["pending"] for o in outs] == [1, 2]
    finally:
        postgres_server.start()
    o = run_check("--node", "node1", "--db", url, "--json", env=env)
    assert o.returncode == 0 and json.loads(o.stdout)["history"] == {
        **json.loads(o.stdout)["history"], "recorded": 3, "pending": 0, "error": None}
    with History.open(url, create=False) as h:
        assert len(h.checks(node="node1")) == 4


# -- a dev-cluster sweep into PostgreSQL ---------------------------------------------------

@pytest.mark.integration
def test_dev_cluster_sweep_writes_to_postgresql(cluster, postgres_server, tmp_path):
    url = postgres_server.create_db("sweep")
    o = subprocess.run([CLUSTEROPS, "sweep", "--db", url, "--timeout", "90", "--json", "--quiet"],
                       capture_output=True, text=True, timeout=180)
    assert o.returncode == 0, o.stderr
    doc = json.loads(o.stdout)
    with History.open(url, create=False) as h:
        assert [s["id"] for s in h.sweeps()] == [doc["sweep_id"]]
        latest = {r.node: (r.status in ("pass", "warn"), r.source) for r in h.latest()}   # healthy (a busy
        assert latest == {f"node{i}": (True, "sweep") for i in range(1, 5)}               # machine may warn)
        assert len(h.rows(probe="check")) == 4


@pytest.mark.integration
def test_four_srun_tasks_record_their_checks(cluster, postgres_server, tmp_path):
    """As HealthCheckProgram would on four nodes: one check per node at once, each under
    its own node name ($SLURMD_NODENAME), sharing one spool directory (one host here)."""
    url = postgres_server.create_db("srun")
    env = dict(os.environ, CLUSTEROPS_HEALTH_SPOOL=str(tmp_path / "spool"), CLUSTEROPS_HISTORY_DB=url)
    o = subprocess.run(["srun", "-N4", "--ntasks-per-node=1", "--time=2", f"--output={tmp_path}/out-%t.json",
                        CLUSTEROPS, "health", "check", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert o.returncode == 0, o.stderr
    docs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("out-*.json"))]
    assert sorted(d["node"] for d in docs) == ["node1", "node2", "node3", "node4"]
    # A check that found another flushing leaves its report for a later run: flush now.
    spool.flush(spool.RecordSettings(url, tmp_path / "spool"))
    with History.open(url, create=False) as h:
        assert sorted(c["node"] for c in h.checks()) == ["node1", "node2", "node3", "node4"]
