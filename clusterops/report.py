"""Sweep reports: a Prometheus textfile and a self-contained HTML page.

Both are rendered from the same ``SweepReport.to_dict()`` document the ``--json``
output prints, so the three always agree. Files are written atomically (a
temporary file in the same directory, fsync, rename): node_exporter's textfile
collector and a browser never see half a file.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Mapping

from clusterops.fsutil import write_atomic  # noqa: F401  (re-exported for callers)
from clusterops.textsafe import html_text

# Every value rendered into the page or the chart goes through this: shortened raw first
# (``limit``), control characters made visible, then &<>"' escaped.
esc = html_text

STATUSES = ("pass", "warn", "fail", "error", "unreachable", "skipped")
COLORS = {"pass": "#2e7d32", "warn": "#f9a825", "fail": "#c62828", "error": "#6a1b9a",
          "unreachable": "#d84315", "skipped": "#9e9e9e"}


# -- Prometheus -------------------------------------------------------------------

def _drained_after(doc: Mapping) -> Dict[str, str]:
    """node -> drain reason for the nodes that carry a drain after this sweep: what it
    applied (drain, keep), the drains it kept or left to someone else, less what it
    resumed. A foreign drain's reason is not in the plan: it reads as ``other``."""
    plan = doc.get("plan") or {}
    out: Dict[str, str] = {}
    planned: Dict[str, str] = {}
    for a in plan.get("actions", []):
        if a.get("reason"):
            planned[str(a["node"])] = str(a["reason"])
        if a.get("action") == "keep" and a.get("reason"):
            out[str(a["node"])] = str(a["reason"])
        elif a.get("action") == "untouched" and "by someone else" in str(a.get("why", "")):
            out[str(a["node"])] = ""
    for a in doc.get("applied", []):
        if a.get("action") in ("drain", "keep"):
            node = str(a["node"])
            # A drain this sweep applied is clusterops' even when its reason is not at hand.
            out[node] = str(a.get("reason") or planned.get(node) or "clusterops:sweep: drained")
        elif a.get("action") == "resume":
            out.pop(str(a["node"]), None)
    return out


def prometheus_text(doc: Mapping) -> str:
    """node_exporter textfile-collector format (Prometheus text exposition 0.0.4),
    written by prometheus-client from the metrics in :mod:`clusterops.metrics`."""
    return sweep_metrics(doc).text()


def sweep_metrics(doc: Mapping):
    from clusterops.metrics import Metrics, drain_origin

    prom = Metrics()
    add = prom.set

    # One entry per node (the last one given), so a node listed twice is one set of series.
    by_node = {str(n["node"]): n for n in doc.get("nodes", [])}
    for node, n in by_node.items():
        if n["status"] != "skipped" and n["status"] != "error":
            add("clusterops_sweep_node_healthy", {"node": node}, 1 if n.get("healthy") else 0)
        for s in STATUSES:
            add("clusterops_sweep_node_status", {"node": node, "status": s}, 1 if n["status"] == s else 0)
        if n["status"] not in ("skipped", "error"):
            add("clusterops_sweep_node_straggler", {"node": node}, 1 if n.get("stragglers") else 0)
        if n.get("duration_s") is not None:
            add("clusterops_sweep_node_check_duration_seconds", {"node": node}, n["duration_s"])
        m = n.get("metrics") or {}
        if "matmul_tflops" in m:
            add("clusterops_sweep_node_matmul_tflops", {"node": node}, m["matmul_tflops"])
        if "busbw_gbps" in m:
            add("clusterops_sweep_node_busbw_gbps", {"node": node}, m["busbw_gbps"])
        for key, kind in COPY_KINDS.items():
            if key in m:
                add("clusterops_sweep_node_copy_bandwidth_gbps", {"node": node, "kind": kind}, m[key])
        if "fabric_errors" in m:
            add("clusterops_sweep_node_fabric_errors", {"node": node}, m["fabric_errors"])
        if "fabric_flaps" in m:
            add("clusterops_sweep_node_fabric_flaps", {"node": node}, m["fabric_flaps"])
        if n.get("versions"):
            add("clusterops_sweep_node_version_outlier", {"node": node}, 1 if n.get("version_outlier") else 0)
    for pr in doc.get("pairs") or []:
        ib = pr.get("ib_write_bw")
        nodes = [str(n) for n in pr.get("nodes") or []]
        if not isinstance(ib, Mapping) or len(nodes) != 2:
            continue
        for node, peer in (nodes, nodes[::-1]):
            add("clusterops_sweep_pair_ib_write_bw_status", {"node": node, "peer": peer},
                PAIR_STATUS_VALUE.get(str(ib.get("status")), 3))
            for rail in ib.get("rails") or []:
                if isinstance(rail, Mapping) and isinstance(rail.get("gbps"), (int, float)) and rail.get("rail"):
                    add("clusterops_sweep_pair_ib_write_bw_gbps", {"node": node, "peer": peer,
                                                                   "rail": str(rail["rail"])}, rail["gbps"])
    for a in doc.get("applied", []):
        add("clusterops_sweep_node_action", {"node": a["node"], "action": a["action"]}, 1)
    by_origin: Dict[str, int] = {o: 0 for o in DRAIN_ORIGINS}
    for node, reason in _drained_after(doc).items():
        origin = drain_origin(reason)
        add("clusterops_sweep_node_drained", {"node": node, "origin": origin}, 1)
        by_origin[origin] = by_origin.get(origin, 0) + 1
    for origin, count in by_origin.items():
        add("clusterops_sweep_drained_nodes", {"origin": origin}, count)
    for k, v in (doc.get("medians") or {}).items():
        add("clusterops_sweep_fleet_median", {"metric": k}, v)
    counts = doc.get("counts") or {}
    for s in STATUSES:
        add("clusterops_sweep_nodes", {"status": s}, counts.get(s, 0))
    add("clusterops_sweep_stragglers", {}, counts.get("stragglers", 0))
    plan = doc.get("plan") or {}
    guard = bool(plan.get("guard_tripped"))
    add("clusterops_sweep_guard_tripped", {}, 1 if guard else 0)
    refused = sum(1 for a in plan.get("actions", []) if str(a.get("why", "")).startswith("guard:"))
    add("clusterops_sweep_drains_refused", {}, refused if guard else 0)
    add("clusterops_sweep_timestamp_seconds", {}, doc.get("finished", time.time()))
    add("clusterops_sweep_duration_seconds", {}, doc.get("duration_s", 0))
    add("clusterops_sweep_exit_code", {}, doc.get("exit_code", 0))
    return prom


# The pair ib_write_bw verdict as a number (as clusterops_health_probe_status counts).
PAIR_STATUS_VALUE = {"skip": -1, "pass": 0, "warn": 1, "fail": 2, "error": 3}
# The copy-bandwidth figures of a node (sweep metric key -> the `kind` label).
COPY_KINDS = {"h2d_gbps": "h2d", "d2h_gbps": "d2h", "p2p_gbps": "p2p", "hbm_gbps": "hbm"}
# The figure columns of the HTML report: metric key -> header. A cell of a figure the
# node is an outlier in (against the fleet median) is marked.
def _ib_cells(ib) -> str:
    """The pair's ib_write_bw cells: status, Gb/s (the slowest rail), detail and each rail's
    figure (empty when the pair has none)."""
    if not isinstance(ib, Mapping):
        return "<td></td><td></td><td></td><td></td>"
    gbps = "" if ib.get("gbps") is None else esc(ib["gbps"])
    gd = " (GPUDirect)" if ib.get("gpudirect") else ""
    rails = "<br>".join(
        f'<span class="s-{esc(r.get("status", ""))}">{esc(r.get("rail") or "?")}: '
        f'{"" if r.get("gbps") is None else esc(r["gbps"])} {esc(r.get("status", ""))}</span>'
        for r in ib.get("rails") or [] if isinstance(r, Mapping))
    return (f"<td class=\"s-{esc(ib.get('status', ''))}\">{esc(ib.get('status', ''))}{gd}</td>"
            f"<td>{gbps}</td><td>{esc(ib.get('detail') or '')}</td><td>{rails}</td>")


FIGURE_COLUMNS = {"matmul_tflops": "TFLOPS", "busbw_gbps": "busbw GB/s", "h2d_gbps": "H2D GB/s",
                  "d2h_gbps": "D2H GB/s", "p2p_gbps": "P2P GB/s", "hbm_gbps": "HBM GB/s",
                  "fabric_errors": "fabric errors", "fabric_flaps": "link flaps"}

# Always exported (0 when none), so a dashboard's stack and an alert's absence test work.
DRAIN_ORIGINS = ("health", "sweep", "supervisor", "straggler", "flapping", "legacy", "other")


def write_prometheus(path: os.PathLike | str, doc: Mapping) -> None:
    sweep_metrics(doc).write_textfile(path)


# -- HTML -------------------------------------------------------------------------

def _chart_metric(nodes: List[Mapping]) -> tuple:
    for key, label in (("matmul_tflops", "matmul TFLOPS"), ("busbw_gbps", "all-reduce busbw GB/s")):
        if any(key in (n.get("metrics") or {}) for n in nodes):
            return key, label, lambda n, k=key: (n.get("metrics") or {}).get(k)
    return "duration_s", "check duration (s)", lambda n: n.get("duration_s")


# Above this many nodes the page is laid out for a large fleet: the chart is sorted by
# value (lowest first, nodes without a value before them), fits the page width and
# labels only the nodes with a problem; the table lists problem nodes first and folds
# the healthy ones away (<details>).
LARGE_FLEET = 128
MAX_CHART_WIDTH = 1300
MAX_PROBLEM_LABELS = 60
PROBLEM = ("fail", "unreachable", "error")
_SEVERITY = {"fail": 0, "unreachable": 1, "error": 2, "warn": 4, "skipped": 5, "pass": 6}


def _natural(name: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(name))]


def _problem(n: Mapping) -> bool:
    return n.get("status") in PROBLEM or bool(n.get("stragglers"))


def _severity(n: Mapping) -> tuple:
    rank = _SEVERITY.get(str(n.get("status")), 3)
    if n.get("stragglers") and n.get("status") in ("pass", "warn"):
        rank = 3
    return (rank, _natural(n.get("node", "")))


def svg_chart(doc: Mapping, width: int = 900) -> str:
    """Per-node bars of the fleet figure with the sweep median as a dashed line; failing
    nodes red, stragglers orange with a marker, skipped nodes a grey stub. A large fleet
    (more than LARGE_FLEET nodes) is drawn sorted by value in at most MAX_CHART_WIDTH
    pixels, with only the problem nodes named."""
    nodes = list(doc.get("nodes", []))
    if not nodes:
        return "<p>No nodes.</p>"
    key, label, get = _chart_metric(nodes)
    large = len(nodes) > LARGE_FLEET
    if large:
        def order(nd):
            v = get(nd)
            return (0, 0.0) if not isinstance(v, (int, float)) else (1, float(v))
        nodes.sort(key=order)
    values = [get(n) for n in nodes]
    known = [v for v in values if isinstance(v, (int, float))]
    vmax = max(known) if known else 1.0
    vmax = vmax * 1.1 or 1.0
    median = (doc.get("medians") or {}).get(key)
    if median is None and known:
        import statistics

        median = statistics.median(known)
    left, top, height = 56, 24, 220
    n = len(nodes)
    if large:
        slot = (MAX_CHART_WIDTH - left - 10) / n
        bar = slot
    else:
        slot = max(4.0, (width - left - 10) / n)
        bar = max(2.0, slot * 0.7)
    width = int(left + 10 + slot * n)
    title = f"{esc(label)} per node"
    if large:
        title += f", {n} nodes sorted lowest first; problem nodes named"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + 70}" '
             f'role="img" aria-label="{esc(label)} per node" class="{"large" if large else "small"}">',
             f'<text x="{left}" y="16" font-size="13" font-family="sans-serif">{title}'
             f'{" (dashed: fleet median)" if median is not None else ""}</text>',
             f'<line x1="{left}" y1="{top + height}" x2="{width - 5}" y2="{top + height}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + height}" stroke="#444"/>']
    for frac in (0, 0.5, 1):
        y = top + height - frac * height
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end" '
                     f'font-family="sans-serif">{vmax / 1.1 * frac * 1.1:.3g}</text>')
    label_every = max(1, int(n / 40))
    labelled = 0
    callouts: List[tuple] = []
    for i, (nd, v) in enumerate(zip(nodes, values)):
        x = left + i * slot + (slot - bar) / 2
        status = nd.get("status")
        color = COLORS.get(status, "#555")
        if status in ("pass", "warn") and nd.get("stragglers"):
            color = "#ef6c00"
        tip = esc(f"{nd['node']}: {status}" + (f", {v:.4g}" if isinstance(v, (int, float)) else "")
                          + (" straggler" if nd.get("stragglers") else "")
                          + (f" - {nd.get('detail')}" if nd.get("detail") else ""))
        if isinstance(v, (int, float)):
            h = max(1.0, v / vmax * height)
        else:
            h = 4.0 if not large or status in ("pass", "warn") else height * 0.15
        parts.append(f'<rect class="bar {esc(str(status))}" data-node="{esc(str(nd["node"]))}" '
                     f'x="{x:.2f}" y="{top + height - h:.1f}" width="{max(bar, 0.5):.2f}" height="{h:.1f}" '
                     f'fill="{color}"><title>{tip}</title></rect>')
        problem = _problem(nd)
        if problem and (not large or labelled < MAX_PROBLEM_LABELS):
            mark = "✗" if status in PROBLEM else "▼"
            parts.append(f'<text class="mark" x="{x + bar / 2:.1f}" y="{top + height - h - 3:.1f}" font-size="11" '
                         f'text-anchor="middle" fill="{color}">{mark}</text>')
        if large and problem and labelled < MAX_PROBLEM_LABELS:
            labelled += 1
            callouts.append((x + bar / 2, str(nd["node"]), color))
        elif not large and i % label_every == 0:
            parts.append(f'<text class="label" x="{x + bar / 2:.1f}" y="{top + height + 12}" font-size="9" '
                         f'font-family="sans-serif" text-anchor="end" '
                         f'transform="rotate(-60 {x + bar / 2:.1f} {top + height + 12})">'
                         f'{esc(nd["node"])}</text>')
    if callouts:
        # Problem nodes sit side by side (the chart is sorted): their names are spread
        # evenly along the axis, each tied to its bar by a thin leader line.
        span = (width - left - 10) / len(callouts)
        base = top + height
        for k, (bx, name, color) in enumerate(callouts):
            lx = left + span * (k + 0.5)
            parts.append(f'<polyline class="leader" points="{bx:.1f},{base} {bx:.1f},{base + 5} {lx:.1f},{base + 14}" '
                         f'fill="none" stroke="{color}" stroke-width="0.8"/>')
            parts.append(f'<text class="label" x="{lx:.1f}" y="{base + 24}" font-size="10" '
                         f'font-family="sans-serif" text-anchor="end" fill="{color}" '
                         f'transform="rotate(-45 {lx:.1f} {base + 24})">{esc(name)}</text>')
    if median is not None and vmax:
        y = top + height - median / vmax * height
        parts.append(f'<line class="median" x1="{left}" y1="{y:.1f}" x2="{width - 5}" y2="{y:.1f}" '
                     f'stroke="#1565c0" stroke-dasharray="6,4" stroke-width="1.5"/>')
        parts.append(f'<text x="{width - 8}" y="{y - 4:.1f}" font-size="10" text-anchor="end" fill="#1565c0" '
                     f'font-family="sans-serif">median {median:.4g}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f0f0f0}.s-pass{color:#2e7d32}.s-warn{color:#b28704}.s-fail,.s-unreachable{color:#c62828;font-weight:bold}
.s-error{color:#6a1b9a;font-weight:bold}.s-skipped{color:#777}.guard{background:#ffebee;border:2px solid #c62828;padding:8px}
.summary span{margin-right:1.2em}tr.straggler td{background:#fff3e0}td.outlier{font-weight:bold;color:#e65100}
td.version-outlier{color:#c62828}
"""


def html_report(doc: Mapping) -> str:
    counts = doc.get("counts") or {}
    plan = doc.get("plan") or {}
    opts = doc.get("options") or {}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(doc.get("started", 0)))
    actions = {a["node"]: a for a in plan.get("actions", [])}
    applied = {a["node"]: a for a in doc.get("applied", [])}
    nodes = list(doc.get("nodes", []))
    large = len(nodes) > LARGE_FLEET
    if large:
        nodes.sort(key=_severity)
    rows = []
    healthy_rows = []
    # matmul and busbw always (the first release's columns); the others when a node has them.
    columns = [k for k in FIGURE_COLUMNS if k in ("matmul_tflops", "busbw_gbps")
               or any(k in (n.get("metrics") or {}) for n in nodes)]
    with_versions = any(n.get("versions") for n in nodes)
    for n in nodes:
        m = n.get("metrics") or {}
        act = applied.get(n["node"]) or {}
        planned = actions.get(n["node"]) or {}
        action_text = act.get("action") or (f"(plan: {planned['action']})" if planned.get("action") not in
                                            (None, "untouched") else "")
        cls = "straggler" if n.get("stragglers") else ""
        dur = "" if n.get("duration_s") is None else f"{n['duration_s']:.2f}"
        cells = "".join(_figure_cell(key, m, n.get("stragglers") or []) for key in columns)
        vcls = ' class="version-outlier"' if n.get("version_outlier") else ""
        vtext = esc(n.get("versions") or "") + (f" (partition: {esc(n['version_outlier'])})"
                                                 if n.get("version_outlier") else "")
        (healthy_rows if large and n["status"] in ("pass", "warn", "skipped") and not n.get("stragglers")
         and not n.get("version_outlier") else rows).append(
            f'<tr class="{cls}" data-node="{esc(n["node"])}" data-status="{esc(n["status"])}">'
            f'<td>{esc(n["node"])}</td><td class="s-{esc(n["status"])}">{esc(n["status"])}</td>'
            f'<td>{esc(n.get("detail") or "")}</td>'
            f'<td>{dur}</td>{cells}'
            f'<td>{esc(", ".join(n.get("stragglers") or []))}</td>'
            + (f'<td{vcls}>{vtext}</td>' if with_versions else "") +
            f'<td>{esc(action_text)}</td></tr>')
    guard = ""
    if plan.get("guard_tripped"):
        guard = f'<p class="guard"><b>{esc(plan.get("message", "safety guard tripped"))}</b></p>'
    summary = " ".join(f'<span class="s-{s}">{s}: <b>{esc(counts.get(s, 0))}</b></span>' for s in STATUSES)
    summary += f' <span>stragglers: <b>{esc(counts.get("stragglers", 0))}</b></span>'
    errors = "".join(f"<li>{esc(e)}</li>" for e in doc.get("errors", []))
    pairs = ""
    if doc.get("pairs"):
        prow = "".join(f"<tr><td>{esc(','.join(p['nodes']))}</td><td class=\"s-{esc(p['status'])}\">"
                       f"{esc(p['status'])}</td><td>{'' if p.get('busbw_gbps') is None else esc(p['busbw_gbps'])}</td>"
                       f"{_ib_cells(p.get('ib_write_bw'))}"
                       f"<td>{esc(p.get('detail') or '')}</td></tr>" for p in doc["pairs"])
        pairs = ("<h2>Node pairs (2-node all-reduce, ib_write_bw)</h2><table><tr><th>nodes</th><th>status</th>"
                 "<th>busbw GB/s</th><th>ib_write_bw</th><th>ib Gb/s</th><th>ib detail</th><th>ib rails (Gb/s)</th>"
                 f"<th>detail</th></tr>{prow}</table>")
    header = ("<tr><th>node</th><th>status</th><th>detail</th><th>check s</th>"
              + "".join(f"<th>{esc(FIGURE_COLUMNS[k])}</th>" for k in columns)
              + "<th>straggler</th>" + ("<th>versions</th>" if with_versions else "") + "<th>action</th></tr>")
    folded = ""
    if large:
        folded = (f'<details id="healthy"><summary>{len(healthy_rows)} healthy or skipped nodes (show)</summary>'
                  f'<table id="healthy-nodes">{header}{"".join(healthy_rows)}</table></details>')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>clusterops sweep {esc(doc.get("sweep_id", ""))}</title>
<style>{CSS}</style></head>
<body>
<h1>clusterops health sweep</h1>
<p>Sweep <code>{esc(doc.get("sweep_id", ""))}</code>, started {esc(started)}, took {doc.get("duration_s", 0):.1f} s;
profile <code>{esc(str(opts.get("profile", "")))}</code> via {esc(str(opts.get("via", "")))};
{"dry run; " if opts.get("dry_run") else ""}{"drain on" if opts.get("drain") else "drain off"}; exit code {esc(doc.get("exit_code"))}.</p>
{guard}
<p class="summary">{summary}</p>
{svg_chart(doc)}
<h2>Nodes{" with a problem" if large else ""}</h2>
{"<p>" + str(len(rows)) + " of " + str(len(nodes)) + " nodes failed, did not answer or lag; worst first.</p>" if large else ""}
<table id="nodes">{header}
{"".join(rows)}
</table>
{folded}
{pairs}
{"<h2>Errors</h2><ul>" + errors + "</ul>" if errors else ""}
</body></html>
"""


def _figure_cell(key: str, m: Mapping, outliers: List[str]) -> str:
    if key not in m:
        return "<td></td>"
    mark = ' class="outlier" title="outlier against the fleet median"' if key in outliers else ""
    return f"<td{mark}>{m[key]:.4g}</td>"


def write_html(path: os.PathLike | str, doc: Mapping) -> None:
    write_atomic(path, html_report(doc))
