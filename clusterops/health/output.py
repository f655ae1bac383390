"""A check report as text: Prometheus text exposition and the terminal table (pure)."""

from __future__ import annotations

import time
from typing import Any, Dict


_STATUS_NUM = {"pass": 0, "warn": 1, "fail": 2, "error": 3, "skip": -1}


def prometheus_text(report: Dict[str, Any]) -> str:
    """The check as Prometheus text exposition. Every series appears once: a profile that
    runs one probe name twice gets ``probe="name"``, ``probe="name#2"``, ... in order."""
    from clusterops.report import Exposition

    prom = Exposition({
        "clusterops_health_status": "Node health: 0 pass, 1 warn, 2 fail, 3 error.",
        "clusterops_health_check_duration_seconds": "Wall time of the check.",
        "clusterops_health_last_run_timestamp_seconds": "When the check ran.",
        "clusterops_health_probe_status": "Probe status: -1 skip, 0 pass, 1 warn, 2 fail, 3 error.",
        "clusterops_health_probe_value": "The probe's measured value (see unit).",
    })
    node, prof = report["node"], report["profile"]
    base = {"node": node, "profile": prof}
    prom.add("clusterops_health_status", base, _STATUS_NUM.get(report["status"], 3))
    prom.add("clusterops_health_check_duration_seconds", base, report["duration_s"])
    t = report.get("time", time.time())
    prom.add("clusterops_health_last_run_timestamp_seconds", base,
             round(t) if isinstance(t, (int, float)) and abs(t) < 1e15 else t)
    seen: Dict[str, int] = {}
    values = []
    for r in report["results"]:
        name = str(r["name"])
        seen[name] = seen.get(name, 0) + 1
        probe = name if seen[name] == 1 else f"{name}#{seen[name]}"
        prom.add("clusterops_health_probe_status", {"node": node, "probe": probe},
                 _STATUS_NUM.get(r["status"], 3))
        v = r.get("value")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            values.append(({"node": node, "probe": probe, "unit": r.get("unit") or ""}, v))
    for labels, v in values:
        prom.add("clusterops_health_probe_value", labels, v)
    return prom.text()


def format_table(report: Dict[str, Any]) -> str:
    """The check for a terminal: a summary line, then one line per result."""
    rows = []
    for r in report["results"]:
        v = r.get("value")
        val = "" if v is None else f"{v}{(' ' + r['unit']) if r.get('unit') else ''}"
        rows.append((r["status"].upper(), r["name"], val, r.get("detail", "")))
    w0 = max([len(x[1]) for x in rows] + [5])
    w1 = max([len(x[2]) for x in rows] + [5])
    w1 = min(w1, 22)
    out = [f"{report['node']}: {report['status'].upper()} (profile {report['profile']}, "
           f"{report['duration_s']:.2f}s)"]
    for st, name, val, detail in rows:
        out.append(f"  {st:<5} {name:<{w0}} {val[:22]:<{w1}} {detail}")
    return "\n".join(out)
