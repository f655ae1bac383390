"""The sweep history database and `clusterops health history`."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from clusterops.cli.history import history as history_cmd
from clusterops.errors import InputError
from clusterops.history import History, parse_since, sparkline
from clusterops.sweep import NodeResult, SweepReport


def report(sweep_id, t, statuses, tflops=None):
    results = {}
    for node, st in statuses.items():
        r = NodeResult(node, st, detail="" if st == "pass" else "broken", duration_s=0.5,
                       probe="" if st == "pass" else "host.paths")
        r.probes = [{"name": "host.paths", "status": "pass" if st == "pass" else "fail", "value": None,
                     "unit": None, "detail": r.detail}]
        if tflops and node in tflops:
            r.metrics["matmul_tflops"] = tflops[node]
            r.probes.append({"name": "matmul", "status": "pass", "value": tflops[node], "unit": "TFLOPS",
                             "detail": ""})
        results[node] = r
    return SweepReport(sweep_id, t - 5, t, {"via": "slurm", "profile": "fast"}, list(statuses), results, {}, None)


def test_record_query_flapping_and_prune(history_target):
    db = history_target
    now = time.time()
    with History.open(db) as h:
        seq = ["pass", "fail", "skipped", "fail", "pass", "unreachable"]
        for i, st in enumerate(seq):
            h.record(report(f"s{i}", now - 3600 * (len(seq) - i), {"node1": st, "node2": "pass"},
                            tflops={"node1": 100.0 + i, "node2": 99.0}))
        fh = h.fail_history(["node1", "node2", "node9"], 4)
        # newest first, skipped sweeps do not count: unreachable, pass, fail, fail
        assert fh == {"node1": [True, False, True, True], "node2": [False] * 4, "node9": []}
        rows = h.rows(node="node1", probe="matmul")
        assert [r.value for r in rows] == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
        assert [r.value for r in h.rows(node="node1", probe="matmul", limit=2)] == [104.0, 105.0]
        latest = {r.node: r.status for r in h.latest()}
        assert latest == {"node1": "unreachable", "node2": "pass"}
        assert len(h.rows(node="node1", probe="check", since=now - 2.5 * 3600)) == 2
        gone = h.prune(retention_days=3.5 / 24, now=now)
        assert gone > 0
        assert [r.sweep_id for r in h.rows(node="node1", probe="check")] == ["s3", "s4", "s5"]
        assert [s["id"] for s in h.sweeps()] == ["s5", "s4", "s3"]


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("30m", now) == now - 1800
    assert parse_since("7d", now) == now - 7 * 86400
    assert parse_since("2026-01-01T00:00:00") > 0
    with pytest.raises(InputError):
        parse_since("yesterday-ish", now)


def test_sparkline():
    assert sparkline([1, 2, 3]) == "▁▄█"
    assert sparkline([]) == ""


def test_history_cli(history_target, tmp_path):
    db = history_target
    now = time.time()
    with History.open(db) as h:
        for i in range(5):
            h.record(report(f"s{i}", now - 60 * (5 - i), {"node1": "pass", "node3": "fail" if i % 2 else "pass"},
                            tflops={"node1": 90.0 + i}))
    runner = CliRunner()
    out = runner.invoke(history_cmd, ["node1", "--probe", "matmul", "--db", str(db), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert [r["value"] for r in doc["rows"]] == [90.0, 91.0, 92.0, 93.0, 94.0]
    assert doc["trend"]["median"] == 92.0 and doc["trend"]["last"] == 94.0
    out = runner.invoke(history_cmd, ["node1", "--probe", "matmul", "--db", str(db)])
    assert "trend (5 values)" in out.output and "median 92" in out.output
    out = runner.invoke(history_cmd, ["--db", str(db)])
    assert "node3" in out.output and "fail" not in out.output    # node3 passed its latest sweep (i=4)
    out = runner.invoke(history_cmd, ["node3", "--probe", "check", "--db", str(db), "--json"])
    assert [r["status"] for r in json.loads(out.output)["rows"]] == ["pass", "fail", "pass", "fail", "pass"]
    out = runner.invoke(history_cmd, ["--db", str(tmp_path / "none.db")])
    assert out.exit_code != 0
    out = runner.invoke(history_cmd, ["--db", str(db), "--since", "bogus"])
    assert out.exit_code != 0


def test_sqlite_text_that_is_not_utf8_is_read_not_crashed_on(tmp_path):
    """A damaged file can hold bytes that are not UTF-8 in its text, even in a column name
    (found by the property test): reading replaces them instead of raising."""
    import sqlite3

    db = tmp_path / "sweep.db"
    now = time.time()
    with History.open(db) as h:
        h.record(report("s0", now, {"node1": "fail"}))
    conn = sqlite3.connect(db)
    conn.execute("UPDATE results SET detail = CAST(x'80ff62726f6b656e' AS TEXT)")
    conn.commit()
    conn.close()
    out = CliRunner().invoke(history_cmd, ["node1", "--probe", "check", "--db", str(db), "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["rows"]
    assert rows and rows[0]["status"] == "fail"


def test_a_schema_with_bytes_that_are_not_utf8_is_a_clear_input_error(tmp_path, capsys):
    # SQLite quotes the damaged schema in its error message; Python's strict decoding of
    # that message must not escape as a traceback.
    import sqlite3

    path = tmp_path / "sweep.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE sweeps (sweep_id TEXT, a TEXT)")
    conn.commit()
    conn.close()
    data = bytearray(path.read_bytes())
    at = data.find(b"CREATE TABLE sweeps")
    data[at + 7] = 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="not a usable sweep history database: damaged text"):
        History.open(path, create=False)
    from clusterops.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["health", "history", "--db", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "not a usable sweep history database" in err and "Traceback" not in err


def test_pair_results_recorded_per_node_and_never_counted_as_node_failures(history_target):
    """--pairs: the all-reduce and ib_write_bw of each pair are rows for both nodes, with
    their figures; a failing pair does not enter the flapping rule (node verdicts only)."""
    from clusterops.history import PAIR_ALLREDUCE, PAIR_IB_WRITE_BW

    now = time.time()
    rep = report("p1", now, {"node1": "pass", "node2": "pass", "node3": "pass", "node4": "pass"})
    rep.pairs = [
        {"nodes": ["node1", "node2"], "status": "fail", "busbw_gbps": 1.5, "job_id": 1,
         "detail": "ib_write_bw: mlx5_0: 196.1 Gb/s < floor 380",
         "ib_write_bw": {"status": "fail", "gbps": 196.1, "detail": "mlx5_0: 196.1 Gb/s < floor 380",
                         "rails": [{"rail": "mlx5_0/1", "status": "fail", "gbps": 196.1,
                                    "detail": "mlx5_0: 196.1 Gb/s < floor 380"},
                                   {"rail": "mlx5_1/1", "status": "pass", "gbps": 393.9, "detail": "mlx5_1: 393.9 Gb/s"}]}},
        {"nodes": ["node3", "node4"], "status": "unreachable", "busbw_gbps": None, "job_id": 2,
         "detail": "no result within 5s", "ib_write_bw": None},
    ]
    with History.open(history_target) as h:
        h.record(rep)
        ib = h.rows(node="node2", probe=PAIR_IB_WRITE_BW)
        assert [(r.status, r.value, r.unit) for r in ib] == [("fail", 196.1, "Gb/s")]
        assert ib[0].detail.startswith("pair node1,node2: ")
        rails = {r.probe: (r.status, r.value) for n in ("node1", "node2") for r in h.rows(node=n)
                 if r.probe.startswith(PAIR_IB_WRITE_BW + ":")}
        assert rails == {f"{PAIR_IB_WRITE_BW}:mlx5_0/1": ("fail", 196.1), f"{PAIR_IB_WRITE_BW}:mlx5_1/1": ("pass", 393.9)}
        assert len(h.rows(node="node1", probe=f"{PAIR_IB_WRITE_BW}:mlx5_1/1")) == 1
        assert [(r.status, r.value) for r in h.rows(node="node1", probe=PAIR_ALLREDUCE)] == [("fail", 1.5)]
        assert [(r.status, r.value) for r in h.rows(node="node4", probe=PAIR_ALLREDUCE)] == [("unreachable", None)]
        assert h.rows(node="node4", probe=PAIR_IB_WRITE_BW) == []
        assert h.fail_history(["node1", "node2"], 3) == {"node1": [False], "node2": [False]}
        assert {r.node: r.status for r in h.latest()} == {n: "pass" for n in ("node1", "node2", "node3", "node4")}
