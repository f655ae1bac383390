"""The sweep's fleet comparison of the fabric and copy-bandwidth figures, the version rule per
partition, and how the HTML report and the metrics show them (pure, from check documents)."""

from __future__ import annotations

from clusterops.report import html_report, prometheus_text
from clusterops.sweep import DrainPlan, SweepReport, mark_stragglers, mark_version_outliers, result_from_check


def check_doc(errors=0, flaps=0, h2d=50.0, p2p=360.0, versions="driver 570.133.20, VBIOS 96.00.99.00.01"):
    results = [
        {"name": "fabric.ports", "status": "pass", "value": 8, "unit": "ports"},
        {"name": "fabric.errors", "status": "pass", "value": errors, "unit": "errors"},
        {"name": "fabric.flaps", "status": "warn" if flaps else "pass", "value": flaps, "unit": "flaps"},
        {"name": "copybw.h2d", "status": "pass", "value": h2d, "unit": "GB/s"},
        {"name": "copybw.p2p", "status": "pass", "value": p2p, "unit": "GB/s"},
        {"name": "nvml.versions", "status": "pass", "value": versions},
    ]
    return {"node": "x", "profile": "preflight", "status": "pass", "duration_s": 1.0, "results": results}


def fleet(**special):
    out = {}
    for i in range(1, 7):
        name = f"gpu{i:03d}"
        out[name] = result_from_check(name, check_doc(**special.get(name, {})), 0)
    return out


def test_fabric_figures_are_read_from_the_check_and_outliers_are_above_the_fleet():
    res = fleet(gpu002={"errors": 40}, gpu003={"flaps": 2}, gpu004={"h2d": 30.0}, gpu005={"p2p": 200.0})
    assert res["gpu001"].metrics == {"fabric_errors": 0.0, "fabric_flaps": 0.0, "h2d_gbps": 50.0,
                                     "p2p_gbps": 360.0}
    medians = mark_stragglers(res, 0.1)
    assert medians["fabric_errors"] == 0 and medians["h2d_gbps"] == 50.0
    assert res["gpu002"].stragglers == ["fabric_errors"]
    assert res["gpu003"].stragglers == ["fabric_flaps"]
    assert res["gpu004"].stragglers == ["h2d_gbps"]
    assert res["gpu005"].stragglers == ["p2p_gbps"]
    assert res["gpu001"].stragglers == [] and res["gpu006"].stragglers == []


def test_one_error_above_a_zero_median_is_not_an_outlier_but_two_are():
    res = fleet(gpu002={"errors": 1}, gpu003={"errors": 2})
    mark_stragglers(res, 0.1)
    assert res["gpu002"].stragglers == [] and res["gpu003"].stragglers == ["fabric_errors"]


def test_version_outlier_within_its_partition_only():
    odd = "driver 550.54.15, VBIOS 96.00.99.00.01"
    res = fleet(gpu002={"versions": odd}, gpu005={"versions": odd}, gpu006={"versions": odd})
    # One partition of all six: four on 570 against two... plus gpu005/6 on 550: 3 vs 3, no majority.
    mark_version_outliers(res, {n: "gpu" for n in res})
    assert not any(r.version_outlier for r in res.values())
    # gpu005 and gpu006 are their own partition (consistent there); gpu002 is odd among gpu001-004.
    parts = {n: ("old" if n in ("gpu005", "gpu006") else "gpu") for n in res}
    mark_version_outliers(res, parts)
    assert [n for n, r in res.items() if r.version_outlier] == ["gpu002"]
    assert res["gpu002"].version_outlier == "driver 570.133.20, VBIOS 96.00.99.00.01"


def _report(res):
    medians = mark_stragglers(res, 0.1)
    mark_version_outliers(res, {n: "gpu" for n in res})
    rep = SweepReport("s1", 1000.0, 1010.0, {"via": "slurm", "profile": "preflight"}, list(res), res, medians,
                      DrainPlan([], swept=len(res), allowed=1), [])
    return rep.to_dict()


def test_html_report_shows_the_figures_and_marks_outliers_and_versions():
    res = fleet(gpu002={"errors": 40}, gpu004={"versions": "driver 550.54.15, VBIOS <b>x</b>"})
    page = html_report(_report(res))
    for head in ("fabric errors", "link flaps", "H2D GB/s", "P2P GB/s", "versions"):
        assert f"<th>{head}</th>" in page
    assert '<td class="outlier" title="outlier against the fleet median">40</td>' in page
    assert 'class="version-outlier">driver 550.54.15, VBIOS &lt;b&gt;x&lt;/b&gt; (partition: driver 570.133.20' in page
    assert "<b>x</b>" not in page


def test_metrics_export_the_figures_and_the_version_rule():
    res = fleet(gpu002={"errors": 40, "flaps": 3}, gpu004={"versions": "driver 550.54.15, VBIOS 1"})
    doc = _report(res)
    text = prometheus_text(doc)
    assert 'clusterops_sweep_node_fabric_errors{node="gpu002"} 40' in text
    assert 'clusterops_sweep_node_fabric_flaps{node="gpu002"} 3' in text
    assert 'clusterops_sweep_node_copy_bandwidth_gbps{kind="h2d",node="gpu001"} 50' in text
    assert 'clusterops_sweep_node_version_outlier{node="gpu004"} 1' in text
    assert 'clusterops_sweep_node_version_outlier{node="gpu001"} 0' in text
    assert doc["counts"]["version_outliers"] == 1


def test_history_keeps_the_fabric_and_bandwidth_figures_and_the_version_verdict(tmp_path):
    from clusterops.history import History

    res = fleet(gpu002={"errors": 40, "flaps": 3}, gpu004={"versions": "driver 550.54.15, VBIOS 1"})
    medians = mark_stragglers(res, 0.1)
    mark_version_outliers(res, {n: "gpu" for n in res})
    rep = SweepReport("s1", 1000.0, 1010.0, {"via": "slurm", "profile": "preflight"}, list(res), res, medians,
                      DrainPlan([], swept=len(res), allowed=1), [])
    with History.open(tmp_path / "h.db") as h:
        h.record(rep)
        rows = {(r.node, r.probe): r for r in h.rows()}
    assert rows[("gpu002", "fleet:fabric_errors")].value == 40 and rows[("gpu002", "fleet:fabric_errors")].status == "straggler"
    assert rows[("gpu002", "fabric.flaps")].value == 3 and rows[("gpu002", "fabric.flaps")].unit == "flaps"
    assert rows[("gpu001", "fleet:h2d_gbps")].value == 50 and rows[("gpu001", "fleet:h2d_gbps")].unit == "gbps"
    assert rows[("gpu004", "fleet:versions")].status == "outlier"
    assert "(partition: driver 570.133.20" in rows[("gpu004", "fleet:versions")].detail
    assert rows[("gpu001", "fleet:versions")].status == "ok"
