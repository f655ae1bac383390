"""``clusterops health check`` as a library call: ``health.flow.check_node`` checks its inputs
before any probe runs, returns the report with its exit code and history record, and says
what fell short through ``warn`` without changing the exit."""

from __future__ import annotations

import textwrap

import pytest

from clusterops.errors import InputError
from clusterops.health.flow import CheckOutcome, CheckRequest, check_node


def _profile(tmp_path, scratch):
    p = tmp_path / "p.yaml"
    p.write_text(textwrap.dedent(f"""\
        extends: fast
        probes:
          host.paths:
            paths: [{{path: "{scratch}", min_free_gb: 0.001}}]
        """))
    return p


@pytest.fixture
def node_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CLUSTEROPS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CLUSTEROPS_HEALTH_SITE", raising=False)
    monkeypatch.delenv("CLUSTEROPS_HISTORY_DB", raising=False)
    return tmp_path


def test_check_node_returns_the_report_exit_code_and_history_record(node_env):
    tmp_path = node_env
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    prof = _profile(tmp_path, scratch)
    warned = []
    req = CheckRequest(profile=str(prof), node="node7", db=str(tmp_path / "fleet.db"),
                       prometheus=str(tmp_path / "h.prom"))
    out = check_node(req, warn=warned.append)
    assert isinstance(out, CheckOutcome) and not out.hung
    assert out.node == "node7" and out.exit_code == 0 == out.report["exit_code"]
    assert out.report["history"]["error"] is None and out.report["history"]["recorded"] >= 1
    assert 'clusterops_health_status{node="node7",profile="p"} ' in (tmp_path / "h.prom").read_text()
    assert warned == []
    scratch.rmdir()
    out = check_node(req, warn=warned.append)
    assert out.exit_code == 1 and out.report["status"] == "fail" and "slurm" not in out.report


def test_a_bad_prometheus_file_is_exit_2_before_any_probe_runs(node_env):
    tmp_path = node_env
    prof = _profile(tmp_path, tmp_path)
    with pytest.raises(InputError) as e:
        check_node(CheckRequest(profile=str(prof), node="node7", prometheus="/dev/null"))
    assert e.value.exit_code == 2 and "/dev/null" in e.value.message
    assert not (tmp_path / "state").exists()   # no probe ran (the xid probe keeps its state there)
