"""Repeat offenders: a node or GPU blamed K times within a window is quarantined.

Every blame clusterops makes with evidence goes into the fleet history's ``blames`` table
(:meth:`clusterops.history.History.record_blame`): a failed health check (``check``), a
node failing a sweep (``sweep``), the supervisor judging a node bad (``supervisor``), by
node and, where the check's results name it, by GPU (NVML UUID and serial).

The decision is pure (:func:`offenders_of`, :func:`decide`): blames in, the subjects that
reached ``blames`` (K) within ``window_s`` out. A quarantine is a drain whose reason is
``clusterops:quarantine: <subject>: <k> blames in <window>: <sources>``, written through
``drain_apply.apply_drain`` (the fleet guard holds). It is written only when a real
failure is at hand (a failing check with ``--drain-on-fail``, a ``--drain`` sweep in
which the node fails): blames from elsewhere count toward K but never drain by
themselves. ``drains.may_resume`` never lets a passing check or a sweep lift it, and the
sweep does not even resume it for a recheck; only ``clusterops health quarantine clear
NODE [--gpu UUID]`` does, which also clears the blames so that they stop counting.

Settings: the site config's ``quarantine:`` block (``schema.QUARANTINE``): ``blames``
(K, default 3) and ``window_s`` (default 7 days).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from clusterops.history import check_blames, gpu_blames, offenders_of  # noqa: F401 - the pure counting

DEFAULT_BLAMES = 3
DEFAULT_WINDOW_S = 7 * 86400.0
SOURCES = ("check", "sweep", "supervisor")


@dataclass(frozen=True)
class Settings:
    blames: int = DEFAULT_BLAMES         # K
    window_s: float = DEFAULT_WINDOW_S


def settings_from_site(site: Optional[Mapping[str, Any]]) -> Settings:
    """The ``quarantine:`` block of a site config already validated against ``schema.SITE``."""
    block = (site or {}).get("quarantine") or {}
    return Settings(int(block.get("blames", DEFAULT_BLAMES)), float(block.get("window_s", DEFAULT_WINDOW_S)))


def load_settings(site_config: Optional[str] = None) -> Settings:
    """From ``--site-config`` or ``$CLUSTEROPS_HEALTH_SITE`` (validated: a bad value is exit 2)."""
    from clusterops.health.profiles import load_site_config

    site, _ = load_site_config(site_config)
    return settings_from_site(site)


# -- the decision (pure; the counting, offenders_of, is the history's) ---------------------------

def _window_text(window_s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if window_s >= n and window_s % n == 0:
            return f"{int(window_s // n)}{unit}"
    return f"{window_s:g}s"


def reason(offender: Mapping[str, Any], window_s: float) -> str:
    """The drain reason of a quarantine: ``clusterops:quarantine: <node or GPU>: <n> blames
    in <window> (<sources>)``."""
    from clusterops import drains

    subject = offender["node"] if offender["kind"] == "node" else f"GPU {offender['gpu_uuid']}"
    return drains.make_reason(drains.QUARANTINE, subject,
                              f"{offender['count']} blames in {_window_text(window_s)} "
                              f"({', '.join(offender.get('sources') or ())}); clear with "
                              f"`clusterops health quarantine clear {offender['node']}`")


def decide(offenders: Sequence[Mapping[str, Any]], failing: Iterable[str], window_s: float
           ) -> List[Tuple[str, str]]:
    """Which nodes to quarantine now -> [(node, reason)]: the offenders (node or GPU) whose
    node fails now (``failing``: a real failure at hand). One drain per node: a node
    offender before a GPU one."""
    failing = set(failing)
    out: Dict[str, str] = {}
    for o in offenders:
        if o["node"] in failing and o["node"] not in out:
            out[o["node"]] = reason(o, window_s)
    return sorted(out.items())


# -- applying it (through the one drain path) ---------------------------------------------------

def apply(slurm, decisions: Sequence[Tuple[str, str]], guard, **kw) -> List[dict]:
    """Drain each decided node with its quarantine reason (``drain_apply.apply_drain``; an
    existing clusterops drain of the node is relabelled, a new one is guarded)."""
    from clusterops import drain_apply as da
    from clusterops.errors import ClusteropsError

    done = []
    for node, why in decisions:
        try:
            out = da.apply_drain(slurm, node, why, guard, relabel=True, **kw)
            done.append({"node": node, "action": "quarantine" if out.action in (da.DRAINED, da.RELABELLED)
                         else out.action, "reason": why, "why": out.why})
        except ClusteropsError as e:
            done.append({"node": node, "action": "failed", "reason": why, "why": e.message})
    return done


def blame_bad_node(node: str, why: str, job_id: Optional[str] = None, target: Optional[str] = None,
                   timeout_s: float = 5.0) -> Optional[str]:
    """The supervisor judged ``node`` bad: record the blame in the fleet history named by
    ``target`` (default ``$CLUSTEROPS_HISTORY_DB``; none: nothing recorded). Never raises:
    -> None, or one line saying why it was not recorded (a supervisor goes on)."""
    import os

    from clusterops.history import FLEET_DB_ENV, History

    target = target or os.environ.get(FLEET_DB_ENV)
    if not target:
        return None
    try:
        with History.open(target, timeout_s=timeout_s) as h:
            h.record_blame(node, None, None, "supervisor", why, job_id)
        return None
    except Exception as e:  # noqa: BLE001 - the history must never stop a training job
        from clusterops.history import redact_text

        return f"blame of {node} not recorded: {redact_text(str(e), target)[:200]}"


def after_check(report: Mapping[str, Any], target: str, site: Optional[Mapping[str, Any]], guard,
                timeout_s: float = 3.0) -> Optional[dict]:
    """``health check --drain-on-fail`` whose check failed and was recorded: quarantine this
    node when it is now a repeat offender. -> the outcome (``quarantine`` key of the report),
    None when nothing was to decide. Never raises (the check's verdict stands)."""
    if report.get("status") != "fail" or (report.get("history") or {}).get("error"):
        return None
    node = str(report["node"])
    try:
        from clusterops.history import History
        from clusterops.slurm.factory import connect

        q = settings_from_site(site)
        with History.open(target, timeout_s=timeout_s) as h:
            found = h.offenders(q.blames, q.window_s, float(report.get("time") or 0) or None)
        decided = decide(found, [node], q.window_s)
        if not decided:
            return {"node": node, "action": "none", "why": "not a repeat offender"}
        return apply(connect(timeout_s=timeout_s, read_attempts=1), decided, guard)[0]
    except Exception as e:  # noqa: BLE001 - a quarantine that cannot be decided leaves the check as it is
        return {"node": node, "action": "failed", "why": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}


# -- what `clusterops health quarantine list|clear` call ----------------------------------------

def _target(db: Optional[str]) -> str:
    from clusterops.history import default_target

    return db or default_target()


def list_quarantine(db: Optional[str] = None, site_config: Optional[str] = None, slurm=None) -> dict:
    """The repeat offenders in the history, and the nodes Slurm holds with a quarantine drain
    (Slurm that cannot be asked: ``slurm_error``, the history's list still stands)."""
    from clusterops import drains
    from clusterops.errors import ClusteropsError
    from clusterops.history import History, parse_target

    q = load_settings(site_config)
    target = parse_target(_target(db))
    with History.open(target, create=False) as h:
        found = h.offenders(q.blames, q.window_s)
    doc: dict = {"db": target.display, "blames": q.blames, "window_s": q.window_s, "offenders": found,
                 "drained": []}
    try:
        if slurm is None:
            from clusterops.slurm.factory import connect

            slurm = connect(timeout_s=10, read_attempts=1)
        for n in slurm.nodes():
            r = drains.parse_reason(n.reason)
            if r is not None and r.origin == drains.QUARANTINE:
                doc["drained"].append({"node": n.name, "reason": n.reason})
    except ClusteropsError as e:
        doc["slurm_error"] = e.message
    return doc


def clear(node: str, gpu_uuid: Optional[str] = None, db: Optional[str] = None,
          site_config: Optional[str] = None, slurm=None) -> dict:
    """A person clears ``node`` (only ``gpu_uuid``'s blames with it): the blames stop
    counting, and a quarantine drain of the node is lifted once it is no longer an offender."""
    import getpass

    from clusterops import drains
    from clusterops.history import History

    q = load_settings(site_config)
    with History.open(_target(db)) as h:
        n = h.clear_blames(node, gpu_uuid, by=getpass.getuser())
        still = [o for o in h.offenders(q.blames, q.window_s) if o["node"] == node]
    doc: dict = {"node": node, "gpu_uuid": gpu_uuid, "cleared": n, "still_offending": still}
    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    me = next((x for x in slurm.nodes([node]) if x.name == node), None)
    r = drains.parse_reason(getattr(me, "reason", None))
    if r is None or r.origin != drains.QUARANTINE:
        doc["slurm"] = "no quarantine drain to lift"
    elif still:
        doc["slurm"] = "still a repeat offender: left drained"
    else:
        slurm.resume([node])
        doc["slurm"] = "resumed"
    return doc
