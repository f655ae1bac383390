"""Sweep outputs: Prometheus textfile and the HTML report, from one report document."""

from __future__ import annotations

import os
import re
import threading

from clusterops.report import html_report, prometheus_text, write_atomic, write_prometheus
from clusterops.sweep import DrainPlan, Action, NodeResult, SweepReport, mark_stragglers


def make_report(guard=False):
    results = {}
    for i, (st, tf) in enumerate([("pass", 100.0), ("pass", 99.0), ("fail", 97.0), ("pass", 70.0),
                                  ("skipped", None), ("unreachable", None)], 1):
        r = NodeResult(f"gpu{i:03d}", st, detail="" if st == "pass" else f'why "{st}"\\n', duration_s=0.8,
                       probe="matmul" if st == "fail" else "")
        if tf is not None:
            r.metrics["matmul_tflops"] = tf
        results[r.node] = r
    medians = mark_stragglers(results, 0.1)
    actions = [Action("gpu003", "untouched" if guard else "drain", "fail", "clusterops: matmul: slow"),
               Action("gpu006", "untouched" if guard else "drain", "unreachable", "clusterops: sweep: gone")]
    plan = DrainPlan(actions, swept=5, allowed=1, guard_tripped=guard,
                     message="SAFETY GUARD: 2 of 5 swept nodes would be drained" if guard else "")
    rep = SweepReport("s1", 1000.0, 1010.0, {"via": "slurm", "profile": "deep", "drain": True}, list(results),
                      results, medians, plan,
                      applied=[] if guard else [{"node": "gpu003", "action": "drain", "reason": "x"}])
    rep.exit_code = 3 if guard else 1
    return rep.to_dict()


def test_prometheus_text_is_valid_exposition_and_says_what_json_says():
    doc = make_report()
    text = prometheus_text(doc)
    line = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                      r'-?[0-9.e+-]+$|^NaN$')
    for ln in text.splitlines():
        if ln.startswith("#"):
            assert ln.startswith("# HELP ") or ln.startswith("# TYPE ")
        else:
            assert line.match(ln), ln
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["gpu004"]["stragglers"] == ["matmul_tflops"]          # 70 < 0.9 * median 98
    assert 'clusterops_sweep_node_straggler{node="gpu004"} 1' in text
    assert 'clusterops_sweep_node_healthy{node="gpu003"} 0' in text
    assert 'clusterops_sweep_node_healthy{node="gpu006"} 0' in text
    assert 'clusterops_sweep_node_healthy{node="gpu005"}' not in text   # skipped: no verdict
    assert 'clusterops_sweep_node_matmul_tflops{node="gpu001"} 100' in text
    assert 'clusterops_sweep_node_action{action="drain",node="gpu003"} 1' in text   # labels sorted
    assert 'clusterops_sweep_fleet_median{metric="matmul_tflops"} 98' in text
    assert "clusterops_sweep_guard_tripped 0" in text
    # one TYPE line per metric family
    types = [ln for ln in text.splitlines() if ln.startswith("# TYPE")]
    assert len(types) == len(set(types))


def test_html_is_self_contained_and_marks_failures_stragglers_and_guard():
    page = html_report(make_report(guard=True))
    assert "<svg" in page and 'class="median"' in page
    assert not re.search(r'(src|href)=["\']?https?://', page)
    assert "<script" not in page
    assert 'data-node="gpu003" data-status="fail"' in page
    assert 'class="bar fail"' in page and "✗" in page
    assert "▼" in page                                         # the straggler gpu004
    assert 'class="guard"' in page and "SAFETY GUARD" in page
    assert "why &quot;fail&quot;" in page                    # escaped


def test_write_atomic_never_shows_half_a_file(tmp_path):
    target = tmp_path / "m.prom"
    big = "x" * 2_000_000 + "\n"
    small = "y\n"
    write_atomic(target, small)
    seen = set()
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.add(len(target.read_text()))
            except FileNotFoundError:
                seen.add(-1)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20):
        write_atomic(target, big if i % 2 == 0 else small)
    stop.set()
    t.join()
    assert seen <= {len(big), len(small)}
    assert [p for p in os.listdir(tmp_path) if p != "m.prom"] == []
    write_prometheus(tmp_path / "sub" / "x.prom", make_report())
    assert (tmp_path / "sub" / "x.prom").stat().st_mode & 0o777 == 0o644


def _pair_doc():
    rails = [{"rail": "mlx5_0/1", "status": "pass", "gbps": 393.9, "detail": "mlx5_0: 393.9 Gb/s"},
             {"rail": "mlx5_1/1", "status": "fail", "gbps": 196.1, "detail": "mlx5_1: 196.1 Gb/s < floor 380 Gb/s"}]
    return {"sweep_id": "s", "finished": 1.0, "duration_s": 1.0, "exit_code": 1, "counts": {"pass": 4},
            "nodes": [{"node": f"n{i}", "status": "pass", "healthy": True} for i in range(1, 5)],
            "pairs": [{"nodes": ["n1", "n2"], "status": "fail", "busbw_gbps": 1.5, "detail": "ib_write_bw: mlx5_1",
                       "ib_write_bw": {"status": "fail", "gbps": 196.1, "detail": rails[1]["detail"], "rails": rails}},
                      {"nodes": ["n3", "n4"], "status": "pass", "busbw_gbps": 1.5,
                       "ib_write_bw": {"status": "skip", "gbps": None, "detail": "n3: no HCA", "rails": []}}]}


def test_pair_ib_write_bw_exported_per_node_and_rail_with_its_verdict():
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(prometheus_text(_pair_doc()))}
    gbps = {(s.labels["node"], s.labels["peer"], s.labels["rail"]): s.value
            for s in fams["clusterops_sweep_pair_ib_write_bw_gbps"].samples}
    assert gbps == {("n1", "n2", "mlx5_0/1"): 393.9, ("n1", "n2", "mlx5_1/1"): 196.1,
                    ("n2", "n1", "mlx5_0/1"): 393.9, ("n2", "n1", "mlx5_1/1"): 196.1}
    status = {(s.labels["node"], s.labels["peer"]): s.value
              for s in fams["clusterops_sweep_pair_ib_write_bw_status"].samples}
    assert status == {("n1", "n2"): 2, ("n2", "n1"): 2, ("n3", "n4"): -1, ("n4", "n3"): -1}


def test_html_pairs_show_each_rails_figure():
    page = html_report(_pair_doc())
    assert "ib rails (Gb/s)" in page
    assert '<span class="s-fail">mlx5_1/1: 196.1 fail</span>' in page
    assert '<span class="s-pass">mlx5_0/1: 393.9 pass</span>' in page
