"""Metrics through prometheus-client: one catalogue, parsed back by prometheus-client's
own parser, drains counted by origin, guard trips, the supervised job's metrics, and
nothing of it imported at CLI start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clusterops import health, report
from clusterops.supervisor import timeline
from clusterops.errors import InputError
from clusterops.metrics import CATALOGUE, Metrics, drain_origin

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")


def samples(text):
    """{(name, frozenset(labels)): value}, parsed by prometheus-client (so: valid text)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name in CATALOGUE and fam.type == "gauge"
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out
            out[key] = s.value
    return out


def test_import_stays_light():
    code = ("import sys, clusterops, clusterops.cli, clusterops.metrics, clusterops.report, clusterops.health, "
            "clusterops.history, clusterops.spool, clusterops.supervisor.timeline; "
            "print([m for m in ('prometheus_client', 'psycopg') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stderr


@pytest.mark.parametrize("reason,origin", [
    ("clusterops:health:deep: dcgm: diag failed", "health"), ("clusterops:sweep: matmul: slow", "sweep"),
    ("clusterops:supervisor: hang on rank 3", "supervisor"), ("clusterops:straggler: 20% below", "straggler"),
    ("clusterops:flapping: failed 3 of 5", "flapping"), ("clusterops: host.paths: /scratch missing", "legacy"),
    ("clusterops: sweep: gone", "legacy"), ("bad DIMM, ticket 4711", "other"), ("", "other"), (None, "other")])
def test_drain_origin(reason, origin):
    assert drain_origin(reason) == origin


def _sweep_doc(guard=False):
    acts = [
        {"node": "n1", "action": "drain", "why": "fail", "reason": "clusterops:sweep: matmul: slow"},
        {"node": "n2", "action": "keep", "why": "still failing", "reason": "clusterops:health:fast: nvml: ecc"},
        {"node": "n3", "action": "keep", "why": "still failing", "reason": "clusterops: host.paths: gone"},
        {"node": "n4", "action": "untouched", "why": "drained/down by someone else: DIMM", "reason": ""},
        {"node": "n5", "action": "resume", "why": "passes now", "reason": ""},
        {"node": "n6", "action": "drain", "why": "flapping", "reason": "clusterops:flapping: 3 of 5"},
    ]
    if guard:
        for a in acts:
            if a["action"] == "drain":
                a["action"], a["why"] = "untouched", f"guard: would drain ({a['why']})"
    applied = [] if guard else [{"node": a["node"], "action": a["action"], "reason": a["reason"]}
                                for a in acts if a["action"] in ("drain", "resume", "keep")]
    return {"sweep_id": "s", "started": 1.0, "finished": 1_700_000_000.0, "duration_s": 9.0, "exit_code": 3 if guard else 1,
            "counts": {"pass": 3, "fail": 3, "stragglers": 1}, "medians": {},
            "nodes": [{"node": f"n{i}", "status": "pass", "healthy": True, "metrics": {}, "stragglers": []}
                      for i in range(1, 7)],
            "plan": {"guard_tripped": guard, "actions": acts}, "applied": applied}


def test_sweep_metrics_count_drains_by_origin_and_guard_trips():
    s = samples(report.prometheus_text(_sweep_doc()))
    by_origin = {dict(k[1])["origin"]: v for k, v in s.items() if k[0] == "clusterops_sweep_drained_nodes"}
    assert by_origin == {"health": 1, "sweep": 1, "supervisor": 0, "straggler": 0, "flapping": 1, "legacy": 1,
                         "other": 1}
    node_origin = {dict(k[1])["node"]: dict(k[1])["origin"] for k in s if k[0] == "clusterops_sweep_node_drained"}
    assert node_origin == {"n1": "sweep", "n2": "health", "n3": "legacy", "n4": "other", "n6": "flapping"}
    assert s[("clusterops_sweep_guard_tripped", frozenset())] == 0
    assert s[("clusterops_sweep_stragglers", frozenset())] == 1
    g = samples(report.prometheus_text(_sweep_doc(guard=True)))
    assert g[("clusterops_sweep_guard_tripped", frozenset())] == 1
    assert g[("clusterops_sweep_drains_refused", frozenset())] == 2
    # The refused drains were not made: n1 and n6 carry none.
    assert {dict(k[1])["node"] for k in g if k[0] == "clusterops_sweep_node_drained"} == {"n2", "n3", "n4", "n5"} - {"n5"}


def test_health_check_prometheus_file_is_written_by_prometheus_client(tmp_path):
    out = tmp_path / "textfile" / "health.prom"
    # The real fast check on this host, less the stray-process probe: it scans every process
    # here, and the suite's other workers run test processes that carry a job's variables
    # (that probe is tested on the dev cluster: test_health_busy_node, test_health_cluster).
    site = tmp_path / "site.yaml"
    site.write_text("defaults:\n  probes:\n    host.stray_processes: {enabled: false}\n")
    r = subprocess.run([CLUSTEROPS, "health", "check", "--node", "nodeP", "--site-config", str(site),
                        "--prometheus", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    s = samples(out.read_text())
    assert s[("clusterops_health_status", frozenset({"node": "nodeP", "profile": "fast"}.items()))] == 0
    assert s[("clusterops_health_exit_code", frozenset({"node": "nodeP", "profile": "fast"}.items()))] == 0
    assert not [p for p in out.parent.iterdir() if p.name != "health.prom"]    # no temporary left behind
    link = tmp_path / "link.prom"
    link.symlink_to(tmp_path / "elsewhere.prom")
    r = subprocess.run([CLUSTEROPS, "health", "check", "--node", "nodeP", "--prometheus", str(link)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "symlink" in r.stderr and not (tmp_path / "elsewhere.prom").exists()


def test_metrics_reject_labels_that_are_not_the_catalogue_s():
    m = Metrics()
    with pytest.raises(ValueError):
        m.set("clusterops_sweep_nodes", {"status": "pass", "extra": "x"}, 1)
    with pytest.raises(KeyError):
        m.set("clusterops_not_a_metric", {}, 1)


def _job_records():
    t = 1000.0
    recs = [{"t": t, "event": "launch", "job_id": "77", "resume_step": 0}]
    for i in range(1, 6):
        recs.append({"t": t + 10 * i, "event": "progress", "job_id": "77", "step": 10 * i})
    recs += [{"t": t + 60, "event": "heartbeat_lost", "job_id": "77"},
             {"t": t + 80, "event": "restart", "job_id": "77", "cause": "hang"},
             {"t": t + 100, "event": "launch", "job_id": "77", "resume_step": 40}]
    for i in range(1, 3):
        recs.append({"t": t + 100 + 10 * i, "event": "progress", "job_id": "77", "step": 40 + 10 * i})
    recs.append({"t": t + 125, "event": "done", "job_id": "77", "code": 0})
    return recs


def test_job_metrics_from_the_timeline(tmp_path):
    recs = _job_records()
    # Step advanced 0..50 (t 1000..1050) and 50..60 (t 1110..1120); 40..50 was recomputed: 60 s of 125.
    assert timeline.goodput(recs) == pytest.approx(60 / 125)
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "job.prom"
    r = subprocess.run([CLUSTEROPS, "job", "timeline", str(tmp_path), "--prometheus", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    s = {k[0]: v for k, v in samples(out.read_text()).items()}
    assert s["clusterops_job_restarts"] == 1 and s["clusterops_job_launches"] == 2
    assert s["clusterops_job_finished"] == 1 and s["clusterops_job_given_up"] == 0
    assert s["clusterops_job_goodput_ratio"] == pytest.approx(0.48)
    assert s["clusterops_job_last_step"] == 60 and s["clusterops_job_exit_code"] == 0
    assert 'job="77"' in out.read_text()
