"""A check report as text: Prometheus text exposition and the terminal table (pure)."""

from __future__ import annotations

import time
from typing import Any, Dict


_STATUS_NUM = {"pass": 0, "warn": 1, "fail": 2, "error": 3, "skip": -1}


def prometheus_text(report: Dict[str, Any]) -> str:
    """The check as Prometheus text exposition. Every series appears once: a profile that
    runs one probe name twice gets ``probe="name"``, ``probe="name#2"``, ... in order."""
    return health_metrics(report).text()


def health_metrics(report: Dict[str, Any]):
    """The check's metrics (:mod:`clusterops.metrics`); ``.text()`` or ``.write_textfile()``."""
    from clusterops.metrics import Metrics

    prom = Metrics()
    node, prof = report["node"], report["profile"]
    base = {"node": node, "profile": prof}
    prom.set("clusterops_health_status", base, _STATUS_NUM.get(report["status"], 3))
    prom.set("clusterops_health_check_duration_seconds", base, report["duration_s"])
    t = report.get("time", time.time())
    prom.set("clusterops_health_last_run_timestamp_seconds", base,
             round(t) if isinstance(t, (int, float)) and abs(t) < 1e15 else t)
    if isinstance(report.get("exit_code"), int):
        prom.set("clusterops_health_exit_code", base, report["exit_code"])
    seen: Dict[str, int] = {}
    for r in report["results"]:
        name = str(r["name"])
        seen[name] = seen.get(name, 0) + 1
        probe = name if seen[name] == 1 else f"{name}#{seen[name]}"
        prom.set("clusterops_health_probe_status", {"node": node, "probe": probe},
                 _STATUS_NUM.get(r["status"], 3))
        v = r.get("value")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            prom.set("clusterops_health_probe_value", {"node": node, "probe": probe, "unit": r.get("unit") or ""}, v)
    return prom


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
