"""Input-safety contracts of issue 10 that are not random: strict JSON from every --json
command reachable without a cluster, Prometheus output without duplicate series,
`launch render -o` onto special files, the sweep's argument checks and its "could not
run" exit code, and the shipped systemd unit."""

from __future__ import annotations

import json
import math
import os
import time
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.props_harness import PROPS, run_cli, strict_loads

from clusterops import health, report
from clusterops.jsonout import dumps

REPO = Path(__file__).resolve().parent.parent
SPEC = str(REPO / "examples" / "torchrun.yaml")


# -- strict JSON ---------------------------------------------------------------------------

def test_dumps_turns_nan_and_infinity_into_null():
    doc = {"value": float("nan"), "more": [float("inf"), -float("inf"), 1.5], "n": 2 ** 70, "p": Path("/x")}
    back = strict_loads(dumps(doc))
    assert back == {"value": None, "more": [None, None, 1.5], "n": 2 ** 70, "p": "/x"}


@PROPS
@given(doc=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text()),
                        lambda inner: st.one_of(st.lists(inner), st.dictionaries(st.text(), inner)),
                        max_leaves=30))
def test_dumps_is_always_strict_json(doc):
    back = strict_loads(dumps(doc))
    if isinstance(doc, float) and math.isfinite(doc):
        assert back == doc


def _health_report():
    return {"node": "n1", "profile": "fast", "status": "warn", "exit_code": 0, "duration_s": 0.5, "time": 1.7e9,
            "results": [{"name": "gpu_temp", "status": "warn", "value": float("nan"), "unit": "C", "detail": "x"},
                        {"name": "gpu_temp", "status": "pass", "value": float("inf"), "unit": "C", "detail": ""},
                        {"name": "matmul", "status": "pass", "value": 12.5, "unit": "TFLOPS", "detail": ""}]}


def test_health_report_with_nan_probe_value_is_strict_json():
    from clusterops.cli.common import echo_json
    from click.testing import CliRunner
    import click

    @click.command()
    def show():
        echo_json(_health_report())

    out = CliRunner().invoke(show).output
    back = strict_loads(out)
    assert [r["value"] for r in back["results"]] == [None, None, 12.5]


@pytest.mark.parametrize("args", [
    ["launch", "templates", "--json"],
    ["launch", "submit", SPEC, "--dry-run", "--json"],
    ["health", "profiles", "--json"],
    ["health", "profiles", "fast", "--json"],
    ["ckpt", "list", "{tmp}", "--json"],
    ["slurm", "version", "--json"],
    ["devcluster", "status", "--json"],
    ["job", "timeline", "{tmp}", "--json"],
    ["health", "history", "--db", "{tmp}/none.db", "--json"],
])
def test_every_reachable_json_output_is_strict(args, tmp_path):
    o = run_cli([a.replace("{tmp}", str(tmp_path)) for a in args])
    if o.code == 0:
        strict_loads(o.stdout)
    else:
        assert o.code in (1, 2)


def test_history_and_timeline_json_are_strict_with_infinite_values(tmp_path):
    import sqlite3

    from clusterops.history import SCHEMA

    db = tmp_path / "h.db"
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA)
    conn.execute("INSERT INTO results (time, sweep_id, node, probe, status, value, unit, detail) "
                 "VALUES (1.7e9, 's', 'node1', 'matmul', 'pass', ?, 'TFLOPS', '')", (float("inf"),))
    conn.commit()
    conn.close()
    o = run_cli(["health", "history", "node1", "--probe", "matmul", "--json", "--db", str(db)])
    assert o.code == 0 and o.json()["rows"][0]["value"] is None
    o = run_cli(["health", "history", "node1", "--probe", "matmul", "--db", str(db)])
    assert o.code == 0


# -- Prometheus: every series once -----------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_exposition(text: str) -> dict:
    """A small parser of the text exposition format: {(name, labels): value}; asserts
    each series appears once, HELP/TYPE once per metric, and values parse as floats."""
    series, seen_meta = {}, set()
    assert text.endswith("\n")
    for line in text[:-1].split("\n"):       # the format's only line separator
        if line.startswith("#"):
            parts = line.split(" ", 3)
            assert parts[1] in ("HELP", "TYPE") and (parts[1], parts[2]) not in seen_meta, line
            seen_meta.add((parts[1], parts[2]))
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        key = (m.group(1), tuple((k, v) for k, v, _ in labels))
        assert key not in series, f"duplicate series: {line}"
        value = m.group(4)
        assert value in ("NaN", "+Inf", "-Inf") or float(value) == float(value), line
        series[key] = value
    return series


def test_health_prometheus_two_results_of_one_probe_are_two_series():
    s = parse_exposition(health.prometheus_text(_health_report()))
    probes = sorted(dict(k[1])["probe"] for k in s if k[0] == "clusterops_health_probe_status")
    assert probes == ["gpu_temp", "gpu_temp#2", "matmul"]
    vals = {dict(k[1])["probe"]: v for k, v in s.items() if k[0] == "clusterops_health_probe_value"}
    assert vals == {"gpu_temp": "NaN", "gpu_temp#2": "+Inf", "matmul": "12.5"}


def _sweep_doc(nodes):
    return {"sweep_id": "s", "started": 1.0, "finished": 2.0, "duration_s": 1.0, "exit_code": 1,
            "counts": {"pass": 1, "fail": 1}, "medians": {"matmul_tflops": float("nan")},
            "nodes": [{"node": n, "status": st_, "healthy": st_ == "pass", "duration_s": 1.0,
                       "metrics": {"matmul_tflops": float("inf")}, "stragglers": []} for n, st_ in nodes],
            "plan": {"guard_tripped": False, "actions": []},
            "applied": [{"node": "node1", "action": "drain"}, {"node": "node1", "action": "drain"}]}


def test_sweep_prometheus_repeated_node_is_one_set_of_series():
    s = parse_exposition(report.prometheus_text(_sweep_doc([("node1", "fail"), ("node2", "pass"),
                                                            ("node1", "pass")])))
    healthy = {dict(k[1])["node"]: float(v) for k, v in s.items() if k[0] == "clusterops_sweep_node_healthy"}
    assert healthy == {"node1": 1, "node2": 1}       # the last entry of node1 counts


@PROPS
@given(names=st.lists(st.text(max_size=6), max_size=8), statuses=st.lists(
    st.sampled_from(["pass", "warn", "fail", "error", "unreachable", "skipped"]), min_size=8, max_size=8),
    probes=st.lists(st.tuples(st.sampled_from(["a", "b", 'c"\\\n']), st.floats()), max_size=6))
def test_prometheus_never_duplicates_a_series(names, statuses, probes):
    parse_exposition(report.prometheus_text(_sweep_doc(list(zip(names, statuses)))))
    rep = dict(_health_report(), results=[{"name": n, "status": "pass", "value": v, "unit": "u"} for n, v in probes])
    parse_exposition(health.prometheus_text(rep))


def test_sweep_with_repeated_nodes_sweeps_each_once():
    from clusterops.sweep import expand_nodes

    assert expand_nodes("node1,node[1-2],node2,node1") == ["node1", "node2"]


# -- launch render -o onto special files -----------------------------------------------------

def test_render_o_writes_a_regular_file_atomically(tmp_path):
    out = tmp_path / "job.sh"
    out.write_text("old")
    os.chmod(out, 0o600)
    o = run_cli(["launch", "render", SPEC, "-o", str(out)])
    assert o.code == 0
    assert out.read_text().startswith("#!") and stat.S_IMODE(out.stat().st_mode) == 0o755
    assert out.read_text() == run_cli(["launch", "render", SPEC]).stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sh"]        # no temporary left


def _refused(target, tmp_path):
    o = run_cli(["launch", "render", SPEC, "-o", str(target)], max_wall_s=5)
    assert o.code == 2, o
    assert "refused" in o.stderr


def test_render_o_onto_dev_null_is_refused_and_its_mode_kept(tmp_path):
    before = os.stat("/dev/null")
    _refused("/dev/null", tmp_path)
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_mode == before.st_mode and after.st_ino == before.st_ino


def test_render_o_onto_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    _refused(fifo, tmp_path)
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and stat.S_IMODE(fifo.lstat().st_mode) == 0o600


def test_render_o_onto_a_symlink_is_refused_and_the_target_untouched(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    os.chmod(target, 0o600)
    link = tmp_path / "link.sh"
    link.symlink_to(target)
    _refused(link, tmp_path)
    assert target.read_text() == "keep me" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert link.is_symlink()


def test_render_o_in_a_missing_directory_is_exit_2(tmp_path):
    o = run_cli(["launch", "render", SPEC, "-o", str(tmp_path / "no" / "job.sh")])
    assert o.code == 2 and "does not exist" in o.stderr


# -- sweep: arguments first, and "could not run" is exit 5 ----------------------------------

SWEEP_CODES = {0, 1, 2, 3, 4, 5}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Slurm's commands replaced by stand-ins that log their call and fail, to prove that
    a bad argument stops the sweep before any of them runs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "slurm-calls.log"
    for name in ("sbatch", "scontrol", "sinfo", "squeue", "scancel", "sacct", "srun"):
        p = bindir / name
        p.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {log}\necho 'slurm_load_node error: Unable to contact "
                     "slurm controller (connect failure)' >&2\nexit 1\n")
        p.chmod(0o755)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=fake\n")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setenv("CLUSTEROPS_SLURM_READ_ATTEMPTS", "1")
    return log


def _bad_sweep_args(tmp_path):
    fifo = tmp_path / "prom.fifo"
    os.mkfifo(fifo)
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    return [
        (["--check-cmd", "'unbalanced"], "--check-cmd"),
        (["--retention-days", "0"], "--retention-days"),
        (["--prometheus", "/dev/null"], "--prometheus"),
        (["--prometheus", str(fifo)], "--prometheus"),
        (["--report", str(tmp_path / "adir")], "--report"),
        (["--ssh-port", "0"], "--ssh-port"),
        (["--connect-timeout", "0"], "--connect-timeout"),
        (["--pairs", "--via", "ssh"], "--pairs"),
        (["--drain-stragglers"], "--drain-stragglers"),
        (["--profile", "no-such-profile"], "no-such-profile"),
        (["--nodes", "node[1-"], "--nodes"),
        (["--concurrency", "0"], "--concurrency"),
        (["--work-dir", str(tmp_path / "afile")], "--work-dir"),
        (["--db", str(tmp_path / "adir")], "--db"),
        (["--via", "ssh", "--ssh-key", str(tmp_path / "missing-key")], "--ssh-key"),
        (["--max-drain-fraction", "nan"], "--max-drain-fraction"),
        (["--timeout", "-1"], "--timeout"),
    ]


def test_sweep_bad_arguments_exit_2_before_any_slurm_call(fake_slurm, tmp_path):
    for args, word in _bad_sweep_args(tmp_path):
        full = ["sweep", "--quiet", "--db", str(tmp_path / "h.db"), *args]
        if "--nodes" not in args:
            full += ["--nodes", "node1"]
        o = run_cli(full, allowed={2})
        assert word in o.stderr, (args, o.stderr)
        assert not fake_slurm.exists(), (args, fake_slurm.read_text())
    # The stand-ins do run when the arguments are fine (so the check above can fail):
    o = run_cli(["sweep", "--quiet", "--nodes", "node1", "--db", str(tmp_path / "h.db")], allowed={5})
    assert "scontrol" in fake_slurm.read_text()
    assert o.stderr.strip().startswith("Error: sweep could not run") and len(o.stderr.strip().splitlines()) == 1


def test_sweep_without_slurm_conf_exits_5(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere" / "slurm.conf"))
    o = run_cli(["sweep", "--quiet", "--db", str(tmp_path / "h.db")], allowed={5})
    assert "could not run" in o.stderr and "SLURM_CONF" in o.stderr


@pytest.mark.skipif(not __import__("shutil").which("scontrol"), reason="needs Slurm's client tools")
def test_sweep_with_no_controller_exits_5(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={port}\n"
                    "MessageTimeout=1\nAuthType=auth/munge\nNodeName=node1 NodeAddr=127.0.0.1 CPUs=1\n"
                    "PartitionName=debug Nodes=node1 Default=YES State=UP\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setenv("CLUSTEROPS_SLURM_READ_ATTEMPTS", "1")
    o = run_cli(["sweep", "--quiet", "--partition", "debug", "--db", str(tmp_path / "h.db")], allowed={5},
                max_wall_s=60)
    assert "could not run" in o.stderr


def _wrong_schema_db() -> bytes:
    import sqlite3
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        conn = sqlite3.connect(f"{d}/x.db")
        conn.execute("CREATE TABLE results (time TEXT)")
        conn.commit()
        conn.close()
        return Path(f"{d}/x.db").read_bytes()


@pytest.mark.parametrize("content", [b"garbage, not SQLite\n" * 200, _wrong_schema_db()])
def test_sweep_with_an_unusable_database_exits_5_before_any_check(fake_slurm, tmp_path, content):
    db = tmp_path / "h.db"
    db.write_bytes(content)
    o = run_cli(["sweep", "--quiet", "--nodes", "node1", "--db", str(db)], allowed={5})
    assert "could not run" in o.stderr and str(db) in o.stderr
    assert not fake_slurm.exists()
    assert db.read_bytes() == content


def test_sweep_help_and_docs_list_every_exit_code():
    o = run_cli(["sweep", "--help"])
    docs = (REPO / "docs" / "sweep.md").read_text()
    for code in range(6):
        assert re.search(rf"^\s+{code}\s+\S", o.stdout, re.M), code
        assert re.search(rf"^\| {code} \|", docs, re.M), code


def test_systemd_unit_counts_only_0_and_1_as_success():
    unit = (REPO / "slurm" / "clusterops-sweep.service").read_text()
    lines = [ln.strip() for ln in unit.splitlines() if ln.strip().startswith("SuccessExitStatus")]
    assert lines == ["SuccessExitStatus=1"]


numbers = st.one_of(st.integers(-5, 5).map(str), st.sampled_from(["nan", "inf", "-inf", "1e300", "0", "-0.0",
                                                                    "1e-300", "99999999999999999999", "x", ""]))
sweep_options = st.lists(st.one_of(
    st.tuples(st.sampled_from(["--timeout", "--connect-timeout", "--max-drain-fraction", "--straggler-tolerance",
                               "--retention-days", "--concurrency", "--max-running", "--flap-k", "--flap-n",
                               "--ssh-port"]), numbers),
    st.tuples(st.sampled_from(["--nodes", "--partition", "--profile", "--check-cmd", "--via"]),
              st.one_of(st.text(max_size=15), st.sampled_from(["node[1-4]", "node[4-1]", "n[1-100000000]", "ssh",
                                                               "fast", "'", "a,,b", "[", "node1,node1"]))),
    st.tuples(st.sampled_from(["--drain", "--drain-stragglers", "--pairs", "--dry-run", "--no-history"]))),
    max_size=5)


@PROPS
@given(opts=sweep_options)
def test_sweep_arguments_never_traceback_and_bad_ones_stop_before_slurm(fake_slurm, tmp_path, opts):
    if fake_slurm.exists():
        fake_slurm.unlink()
    # Short SSH deadlines: with --via ssh and --nodes the sweep really runs (Slurm is optional
    # there), and its nodes are unreachable (exit 1).
    args = ["sweep", "--quiet", "--db", str(tmp_path / "h.db"), "--connect-timeout", "1", "--timeout", "2"]
    for o in opts:
        args += list(o)
    out = run_cli(args, allowed={1, 2, 5}, max_wall_s=30)
    if out.code == 2:
        assert not fake_slurm.exists(), (args, fake_slurm.read_text())


def test_a_spec_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    """`launch render` on a FIFO (or a directory) is exit 2 at once: no read waits for a writer."""
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo, 0o600)
    t0 = time.monotonic()
    r = run_cli(["launch", "render", str(fifo)])
    assert r.code == 2 and "not a regular file" in r.stderr and time.monotonic() - t0 < 5
    r = run_cli(["launch", "render", str(tmp_path)])
    assert r.code == 2 and "is a directory" in r.stderr


def test_health_check_refuses_a_bad_prometheus_target_before_running(tmp_path):
    """`health check --prometheus /dev/null` (or a FIFO) is exit 2 before any probe runs: the
    report never shows up, and /dev/null is left as it was."""
    fifo = tmp_path / "prom.fifo"
    os.mkfifo(fifo)
    before = os.stat("/dev/null")
    for target in ("/dev/null", str(fifo)):
        r = run_cli(["health", "check", "--profile", "fast", "--json", "--prometheus", target])
        assert r.code == 2 and r.stdout == "" and "regular file" in r.stderr, (target, r)
    after = os.stat("/dev/null")
    assert (before.st_mode, before.st_rdev) == (after.st_mode, after.st_rdev)
