"""Property tests: generated and damaged sweep history databases (missing tables, wrong
column types, garbage rows, truncated or overwritten files, not a database at all)
thrown at `clusterops health history` and the history library. Every case ends in exit
0, 1 or 2 with one line (or typed rows), never a traceback, and reading never changes
the file."""

from __future__ import annotations

import sqlite3

from hypothesis import given
from hypothesis import strategies as st

from support.props_harness import PROPS, run_cli

from clusterops.errors import ClusteropsError
from clusterops.history import SCHEMA, History, Row

cell = st.one_of(st.none(), st.integers(-(2 ** 63), 2 ** 63 - 1), st.floats(allow_nan=True),
                 st.sampled_from([float("inf"), -float("inf"), 1e308, 253402300800.0, -1.0, 1.7e9]),
                 st.text(max_size=12), st.binary(max_size=12), st.sampled_from(["check", "node1", "fail", "pass"]))
NODES = ["node1", "node2", "nödé", "x\ny"]


@st.composite
def rows(draw):
    return (draw(st.one_of(cell, st.floats(0, 2e9))), draw(cell), draw(st.one_of(st.sampled_from(NODES), cell)),
            draw(st.one_of(st.sampled_from(["check", "matmul", "fleet:matmul_tflops"]), cell)),
            draw(st.one_of(st.sampled_from(["pass", "fail", "unreachable", "skipped"]), cell)),
            draw(cell), draw(cell), draw(cell))


@st.composite
def databases(draw, tmp):
    """-> path of a generated database, possibly damaged."""
    path = tmp / "sweep.db"
    kind = draw(st.sampled_from(["ok", "ok", "loose", "loose", "no_results", "no_sweeps", "wrong_columns", "empty_file",
                                 "not_a_db", "truncated", "overwritten"]))
    if kind == "empty_file":
        path.write_bytes(b"")
        return path
    if kind == "not_a_db":
        path.write_bytes(draw(st.binary(min_size=1, max_size=4096)))
        return path
    conn = sqlite3.connect(str(path))
    if kind == "wrong_columns":
        conn.executescript("CREATE TABLE sweeps (id TEXT); CREATE TABLE results (time TEXT, what BLOB);")
    else:
        if kind == "loose":
            # The right columns without types or constraints: any value in any cell.
            conn.executescript("CREATE TABLE sweeps (id, started, finished, via, profile, nodes, failed, guard, "
                               "exit_code); CREATE TABLE results (id INTEGER PRIMARY KEY, time, sweep_id, node, "
                               "probe, status, value, unit, detail);")
        else:
            if draw(st.booleans()):
                conn.execute("PRAGMA journal_mode=WAL")     # as the sweep writes it
            conn.executescript(SCHEMA)
        conn.executemany("INSERT OR IGNORE INTO results (time, sweep_id, node, probe, status, value, unit, detail) "
                         "VALUES (?,?,?,?,?,?,?,?)", draw(st.lists(rows(), max_size=30)))
        conn.executemany("INSERT OR IGNORE INTO sweeps VALUES (?,?,?,?,?,?,?,?,?)",
                         [(str(i),) + tuple(draw(st.lists(cell, min_size=8, max_size=8)))
                          for i in range(draw(st.integers(0, 3)))])
        if kind == "no_results":
            conn.execute("DROP TABLE results")
        if kind == "no_sweeps":
            conn.execute("DROP TABLE sweeps")
    conn.commit()
    conn.close()
    if kind in ("truncated", "overwritten"):
        data = bytearray(path.read_bytes())
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "truncated":
            data = data[:at]
        else:
            junk = draw(st.binary(min_size=1, max_size=512))
            data[at:at + len(junk)] = junk
        path.write_bytes(bytes(data))
    return path


@st.composite
def queries(draw):
    args = []
    if draw(st.booleans()):
        args.append(draw(st.sampled_from(NODES[:3] + ["nope"])))
    if draw(st.booleans()):
        args += ["--probe", draw(st.sampled_from(["check", "matmul", "fleet:matmul_tflops", "x"]))]
    if draw(st.booleans()):
        args += ["--since", draw(st.sampled_from(["30m", "7d", "1970-01-01", "2999-01-01"]))]
    if draw(st.booleans()):
        args += ["--limit", str(draw(st.integers(1, 50)))]
    if draw(st.booleans()):
        args.append("--json")
    return args


@PROPS
@given(data=st.data())
def test_history_cli_on_generated_databases(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("hist")
    path = data.draw(databases(tmp))
    before = path.read_bytes()
    o = run_cli(["health", "history", *data.draw(queries()), "--db", str(path)])
    assert o.code in (0, 1, 2)
    assert path.read_bytes() == before           # a reader never writes


@PROPS
@given(data=st.data())
def test_history_library_on_generated_databases(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("histlib")
    path = data.draw(databases(tmp))
    try:
        h = History.open(path, create=False)
    except ClusteropsError as e:
        assert "\n" not in e.message
        return
    with h:
        for call in (lambda: h.rows(), lambda: h.rows(node="node1", probe="check", limit=5), lambda: h.latest(),
                     lambda: h.fail_history(["node1", "node2"], 5), lambda: h.sweeps(), lambda: h.probes()):
            try:
                got = call()
            except ClusteropsError as e:
                assert "\n" not in e.message
                continue
            if isinstance(got, list) and got and isinstance(got[0], Row):
                for r in got:
                    r.to_dict()            # every typed row is printable (time in range)
                    assert r.value is None or isinstance(r.value, float)
