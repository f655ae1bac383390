"""deploy/: the Prometheus alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`), every alert has a test that fires it, and every metric the
rules and the Grafana dashboard use is one clusterops really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from clusterops import health, report
from clusterops.supervisor import timeline
from clusterops.metrics import CATALOGUE

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "clusterops-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "clusterops-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "clusterops-fleet.json"
METRIC = re.compile(r"\bclusterops_[a-z0-9_]+")


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not found (scripts/setup.sh installs Debian's prometheus package)")
    return path


def _alerts():
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _dashboard_exprs():
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
    return exprs


def test_rules_pass_promtool_check():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


def test_rule_unit_tests_pass():
    r = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                       timeout=120, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired, quiet = set(), set()
    for t in tests:
        for a in t.get("alert_rule_test", []):
            (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts no test fires"
    # Every alert is also checked not to fire (before its `for:`, or on healthy series),
    # except the ones that fire on a single sample by design.
    assert names - quiet <= {"ClusteropsNodeFlapping"}


def test_dashboard_queries_are_valid_promql(tmp_path):
    # promtool parses every dashboard query as a recording rule.
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e}
                                                        for i, (_, e) in enumerate(_dashboard_exprs())]}]}
    tmp = tmp_path / "dashboard-queries.yml"
    tmp.write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool(), "check", "rules", str(tmp)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "d:q", "expr": "sum(("}]}]}))
    assert subprocess.run([promtool(), "check", "rules", str(bad)], capture_output=True).returncode != 0


def test_dashboard_shows_what_the_fleet_team_asked_for():
    dash = json.loads(DASHBOARD.read_text())
    used = {m for _, e in _dashboard_exprs() for m in METRIC.findall(e)}
    for needed in ("clusterops_sweep_nodes", "clusterops_health_status", "clusterops_sweep_drained_nodes",
                   "clusterops_sweep_node_straggler", "clusterops_sweep_guard_tripped",
                   "clusterops_sweep_timestamp_seconds", "clusterops_job_restarts", "clusterops_job_goodput_ratio"):
        assert needed in used, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dash["panels"] for t in p.get("targets", []))


def _exported_families():
    """Metric families clusterops really writes: rendered from a health report, a sweep
    document that has every kind of node and action, and a job timeline."""
    from prometheus_client.parser import text_string_to_metric_families

    hrep = {"node": "n1", "profile": "fast", "status": "fail", "exit_code": 3, "duration_s": 1.0, "time": 1.0,
            "results": [{"name": "matmul", "status": "fail", "value": 1.0, "unit": "TFLOPS"}]}
    sdoc = {"sweep_id": "s", "started": 0.0, "finished": 1.0, "duration_s": 1.0, "exit_code": 3,
            "counts": {"pass": 1, "fail": 1, "stragglers": 1}, "medians": {"matmul_tflops": 9.0},
            "nodes": [{"node": "n1", "status": "pass", "healthy": True, "duration_s": 1.0,
                       "metrics": {"matmul_tflops": 9.0, "busbw_gbps": 3.0}, "stragglers": ["matmul_tflops"]}],
            "plan": {"guard_tripped": True, "actions": [{"node": "n2", "action": "keep", "why": "still failing",
                                                         "reason": "clusterops:health:fast: x: y"}]},
            "applied": [{"node": "n2", "action": "keep", "reason": "clusterops:health:fast: x: y"}]}
    recs = [{"t": 1.0, "event": "launch", "resume_step": 0}, {"t": 2.0, "event": "progress", "step": 5},
            {"t": 3.0, "event": "restart", "cause": "crash"}, {"t": 4.0, "event": "launch", "resume_step": 5},
            {"t": 5.0, "event": "progress", "step": 6, "slowest": ["n2", 1.1]},
            {"t": 5.5, "event": "straggler", "node": "n3", "ratio": 2.0, "action": "replace"},
            {"t": 6.0, "event": "give_up", "code": 5}]
    text = health.prometheus_text(hrep) + report.prometheus_text(sdoc) + timeline.prometheus_text(recs, "j")
    return {f.name for f in text_string_to_metric_families(text)}


def test_every_metric_used_is_one_clusterops_exports():
    exported = _exported_families()
    assert exported == set(CATALOGUE), "the catalogue names a metric no code writes, or the reverse"
    used = {m for _, e in _dashboard_exprs() for m in METRIC.findall(e)}
    used |= {m for a in _alerts() for m in METRIC.findall(a["expr"])}
    unknown = used - exported
    assert not unknown, f"dashboard/rules use metrics clusterops does not export: {sorted(unknown)}"
    # The rule tests feed only exported series too (a typo there would test nothing).
    fed = {m for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for s in t["input_series"]
           for m in METRIC.findall(s["series"])}
    assert fed <= exported, sorted(fed - exported)
