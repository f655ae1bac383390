"""One node's sweep result, and the fleet comparison of the figures in them (pure).

``result_from_check`` turns one ``clusterops health check --json`` document (plus its
exit code) into a :class:`NodeResult`; ``parse_times`` reads the check's CPU time from
bash's ``times``; ``mark_stragglers`` compares per-node figures (matmul TFLOPS,
all-reduce busbw) with the sweep's median: a node below ``(1 - tolerance) x median`` is
a straggler; ``mark_sdc_outliers`` compares the ``sdc`` probe's digests per model key
(the majority digest; a minority node fails). Nothing here touches Slurm, SSH or the clock.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from clusterops.errors import InputError

HEALTHY = frozenset({"pass", "warn"})
FAILING = frozenset({"fail", "unreachable"})
# Every status a node can end a sweep with.
STATUSES = ("pass", "warn", "fail", "error", "unreachable", "skipped")

# Per-node figures compared across the fleet: metric name -> (probe name patterns, units).
METRICS = {
    "matmul_tflops": (("matmul",), ("tflops", "tflop/s")),
    "busbw_gbps": (("allreduce", "all_reduce", "all-reduce", "busbw", "bandwidth"), ("gb/s", "gbps")),
    "h2d_gbps": (("copybw.h2d",), ("gb/s",)),
    "d2h_gbps": (("copybw.d2h",), ("gb/s",)),
    "p2p_gbps": (("copybw.p2p",), ("gb/s",)),
    "hbm_gbps": (("copybw.hbm",), ("gb/s",)),
    "fabric_errors": (("fabric.errors",), ("errors",)),
    "fabric_flaps": (("fabric.flaps",), ("flaps",)),
}
#: Figures where more is worse (error counts): an outlier is above the fleet, not below it.
HIGHER_IS_WORSE = frozenset({"fabric_errors", "fabric_flaps"})
#: The check result whose value is a node's software versions (driver, VBIOS).
VERSIONS_PROBE = "nvml.versions"


@dataclass
class NodeResult:
    node: str
    status: str                       # one of STATUSES
    detail: str = ""                  # one line: the failing probe's detail, or why skipped
    probe: str = ""                   # the probe that failed ("" when none)
    exit_code: Optional[int] = None   # the check's exit code
    duration_s: Optional[float] = None  # the check's own wall time
    cpu_s: Optional[float] = None     # CPU time the check used (user + sys), when known
    latency_s: Optional[float] = None  # from submission/connection to result
    metrics: Dict[str, float] = field(default_factory=dict)
    probes: List[dict] = field(default_factory=list)
    stragglers: List[str] = field(default_factory=list)
    versions: str = ""                # driver/VBIOS versions from the check ("" when none)
    version_outlier: str = ""         # the partition's usual versions, when this node's differ
    job_id: Optional[int] = None
    profile: str = ""                 # the health profile the check ran (from its report)

    @property
    def checked(self) -> bool:
        """The node was really examined (its result says something about it)."""
        return self.status not in ("skipped", "error")

    @property
    def healthy(self) -> bool:
        return self.status in HEALTHY

    @property
    def failing(self) -> bool:
        return self.status in FAILING

    def to_dict(self) -> dict:
        d = asdict(self)
        d["healthy"] = self.healthy
        return d


def one_line(text: object, limit: int = 300) -> str:
    """``text`` on one line, whitespace folded, cut to ``limit`` characters."""
    s = " ".join(str(text or "").split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def extract_metrics(probes: Sequence[Mapping]) -> Dict[str, float]:
    """Per-node figures for the fleet comparison, from a check's probe results."""
    found: Dict[str, float] = {}
    for r in probes:
        name = str(r.get("name", "")).lower()
        unit = str(r.get("unit") or "").lower()
        value = r.get("value")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        for metric, (names, units) in METRICS.items():
            if metric in found:
                continue
            if any(n in name for n in names) and (not unit or unit in units):
                found[metric] = float(value)
    return found


def result_from_check(node: str, doc: Optional[Mapping], exit_code: Optional[int], *,
                      stderr: str = "") -> NodeResult:
    """Judge one node from its check's JSON and exit code (pure).

    Exit 0 is healthy, 1 unhealthy, 3 unhealthy (its own fleet guard kept it from
    draining itself), 2 means the check itself was used wrongly (bad profile) and 4 that
    it could not decide (a probe raised or timed out): both are an ``error`` of the
    sweep, not the node's fault, so it is never drained for them. Output that is not the
    contract's JSON is ``error`` too.
    """
    if not isinstance(doc, Mapping) or "status" not in doc:
        why = one_line(stderr.strip().splitlines()[-1] if stderr.strip() else "no JSON on stdout")
        status = "error" if exit_code in (2, 4, None) else "fail"
        return NodeResult(node, status, detail=f"check exit {exit_code}: {why}", probe="check",
                          exit_code=exit_code)
    probes = list(doc.get("results") or [])
    status = str(doc.get("status", "error"))
    if exit_code in (2, 4):
        status = "error"
    elif exit_code in (1, 3) and status in HEALTHY | {"error"}:
        # The exit code is the contract: 1 is unhealthy, whatever the label says (an
        # ``error`` probe, e.g. a stat that hung on a dead mount, is the node's fault).
        status = "fail"
    elif exit_code == 0 and status not in HEALTHY:
        status = "warn"
    if status not in STATUSES:
        status = "error"
    bad = [r for r in probes if r.get("status") in ("fail", "error")]
    worst = next((r for r in bad if r.get("status") == "fail"), bad[0] if bad else None)
    detail, probe = "", ""
    if worst is not None:
        probe = str(worst.get("name", "check"))
        detail = one_line(worst.get("detail") or worst.get("status"))
    elif status not in HEALTHY:
        probe, detail = "check", one_line(doc.get("detail") or f"check status {status}")
    else:
        warns = [r for r in probes if r.get("status") == "warn"]
        if warns:
            detail = one_line(f"{warns[0].get('name')}: {warns[0].get('detail', '')}")
    dur = doc.get("duration_s")
    versions = next((str(r.get("value")) for r in probes if r.get("name") == VERSIONS_PROBE and r.get("value")), "")
    return NodeResult(node, status, detail=detail, probe=probe, exit_code=exit_code,
                      duration_s=float(dur) if isinstance(dur, (int, float)) else None,
                      metrics=extract_metrics(probes), probes=probes, profile=str(doc.get("profile") or ""),
                      versions=versions[:200])


def fleet_medians(results: Iterable[NodeResult]) -> Dict[str, float]:
    values: Dict[str, List[float]] = {}
    for r in results:
        if r.status in HEALTHY or r.status == "fail":
            for k, v in r.metrics.items():
                values.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in values.items() if v}


def mark_stragglers(results: Mapping[str, NodeResult], tolerance: float) -> Dict[str, float]:
    """Flag nodes below ``(1 - tolerance) x`` the sweep's median; returns the medians.

    For the figures in ``HIGHER_IS_WORSE`` (fabric error and flap counts) the outlier is
    above ``(1 + tolerance) x`` the median and more than one count above it (with a median
    of 0, a node with two or more errors stands out; a single one is noise). A straggler may still pass its absolute
    thresholds: the point is the comparison with its peers. Needs at least 3 nodes with
    the figure to say anything.
    """
    if not 0 <= tolerance < 1:
        raise InputError(f"--straggler-tolerance: must be in [0, 1), got {tolerance}")
    medians = fleet_medians(results.values())
    counts = {k: sum(1 for r in results.values() if k in r.metrics) for k in medians}
    for r in results.values():
        r.stragglers = []
        for k, med in medians.items():
            if counts[k] < 3 or k not in r.metrics:
                continue
            v = r.metrics[k]
            if k in HIGHER_IS_WORSE:
                if v > (1 + tolerance) * med and v > med + 1:
                    r.stragglers.append(k)
            elif med > 0 and v < (1 - tolerance) * med:
                r.stragglers.append(k)
    return medians


def mark_version_outliers(results: Mapping[str, NodeResult], partition_of: Mapping[str, Optional[str]]) -> None:
    """Flag a node whose driver/VBIOS versions differ from the rest of its partition.

    Per partition (``partition_of``: node -> partition; None is one group), the versions
    most of its checked nodes run are the partition's; a node on others gets
    ``version_outlier`` set to them. Needs at least 3 nodes with versions and a strict
    majority: a partition split down the middle (a rolling upgrade) names no one.
    """
    groups: Dict[Optional[str], List[NodeResult]] = {}
    for name, r in results.items():
        r.version_outlier = ""
        if r.versions:
            groups.setdefault(partition_of.get(name), []).append(r)
    for members in groups.values():
        if len(members) < 3:
            continue
        counts: Dict[str, int] = {}
        for r in members:
            counts[r.versions] = counts.get(r.versions, 0) + 1
        usual, n = max(counts.items(), key=lambda kv: kv[1])
        if n * 2 <= len(members):
            continue
        for r in members:
            if r.versions != usual:
                r.version_outlier = usual


SDC_PROBE = "sdc"


def sdc_digests(results: Mapping[str, NodeResult]) -> Dict[str, tuple]:
    """node -> (model key, digest) from each checked node's ``sdc`` result (not its errors or skips)."""
    out: Dict[str, tuple] = {}
    for name, r in results.items():
        if not r.checked:
            continue
        for p in r.probes:
            key = (p.get("data") or {}).get("model_key")
            if p.get("name") == SDC_PROBE and p.get("status") in ("pass", "fail") and key and p.get("value"):
                out[name] = (str(key), str(p["value"]))
                break
    return out


def sdc_verdicts(digests: Mapping[str, tuple]) -> Dict[str, tuple]:
    """Compare nodes' sdc digests per model key (pure): node -> ("fail" | "warn", why).

    Per model key, the digest a strict majority of at least 3 nodes gave is the model's; a
    node with another digest fails. A group with no strict majority (a tie, three different
    digests) or of one or two nodes that disagree is ambiguous: its nodes warn and nobody is
    blamed, as nothing says which side is wrong. Nodes that agree with their group are absent.
    """
    groups: Dict[str, Dict[str, List[str]]] = {}
    for node, (key, dig) in digests.items():
        groups.setdefault(key, {}).setdefault(dig, []).append(node)
    out: Dict[str, tuple] = {}
    for key, by_digest in groups.items():
        if len(by_digest) < 2:
            continue
        total = sum(len(v) for v in by_digest.values())
        usual, members = max(by_digest.items(), key=lambda kv: len(kv[1]))
        if total >= 3 and len(members) * 2 > total:
            for dig, nodes in by_digest.items():
                if dig != usual:
                    for n in nodes:
                        out[n] = ("fail", f"sdc digest differs from the majority of {total} nodes of model {key} "
                                          f"({dig[:12]}, not {usual[:12]}, the digest of {len(members)})")
            continue
        split = ", ".join(f"{len(v)} x {d[:12]}" for d, v in sorted(by_digest.items()))
        for nodes in by_digest.values():
            for n in nodes:
                out[n] = ("warn", f"sdc digests of the {total} nodes of model {key} disagree with no majority "
                                  f"({split}): ambiguous, nobody drained")
    return out


def mark_sdc_outliers(results: Mapping[str, NodeResult]) -> Dict[str, tuple]:
    """Apply ``sdc_verdicts`` to the results: a minority node becomes ``fail`` on probe ``sdc``
    (so the drain plan and the fleet guard take it from there); an ambiguous one that passed
    becomes ``warn``. A node already failing keeps its own first failure. Returns the verdicts."""
    verdicts = sdc_verdicts(sdc_digests(results))
    for name, (status, why) in verdicts.items():
        r = results[name]
        if status == "fail" and not r.failing:
            r.status, r.probe, r.detail = "fail", SDC_PROBE, one_line(why)
        elif status == "warn" and r.status == "pass":
            r.status, r.detail = "warn", one_line(f"{SDC_PROBE}: {why}")
    return verdicts


def parse_times(text: str) -> Optional[float]:
    """CPU seconds (user + sys) of the children from bash's ``times`` output: its last line."""
    pat = re.compile(r"(\d+)m([\d.]+)s\s+(\d+)m([\d.]+)s")
    lines = [ln for ln in text.splitlines() if pat.fullmatch(ln.strip())]
    if len(lines) < 2:
        return None
    m = pat.fullmatch(lines[-1].strip())
    return int(m.group(1)) * 60 + float(m.group(2)) + int(m.group(3)) * 60 + float(m.group(4))


def natural_key(name: str):
    """Sort key that puts node2 before node10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
