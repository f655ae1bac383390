"""One ``clusterops health check`` on this node, end to end: everything the command does
besides parsing flags and printing.

``check_node(CheckRequest(...))`` reads and checks every input first (the profile, the
site config and its ``drain:`` guard, the history target, the Prometheus file, and with
``drain_on_fail`` the caller's Slurm privilege: a bad one is exit 2 before a probe runs),
then runs the profile; with ``drain_on_fail`` the node drains or resumes itself
(``selfdrain.self_drain``, under the fleet guard) and the site's ``notify:`` webhooks
hear of a drain, a resume or a guard refusal; the check is recorded through the bounded
spool (``clusterops.spool``: a database that is down never fails the check) and the
Prometheus textfile written. It returns a ``CheckOutcome``: the report (with
``exit_code``, ``slurm`` and ``history`` filled in), and whether a probe thread hung.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)

NOTIFY_WAIT_S = 5.0   # the most a check waits for its webhooks


@dataclass
class CheckRequest:
    profile: str = "fast"
    site_config: Optional[str] = None
    node: Optional[str] = None              # default: $SLURMD_NODENAME, else the short hostname
    drain_on_fail: bool = False
    drain_timeout_s: float = 20.0
    db: Optional[str] = None                # history target (None: the environment / site config)
    prometheus: Optional[str] = None


@dataclass
class CheckOutcome:
    """``report``: the check's report (``report["exit_code"]`` is the command's exit);
    ``hung``: a probe thread is stuck (maybe in the kernel), so the process should not
    wait for it at exit."""

    report: dict
    hung: bool = False

    @property
    def exit_code(self) -> int:
        return self.report["exit_code"]

    @property
    def node(self) -> str:
        return self.report["node"]


def check_node(req: CheckRequest, warn: Optional[Callable[[str], None]] = None) -> CheckOutcome:
    """Check this node (see the module). ``warn`` hears what fell short without changing the
    exit: an undelivered notification, a check not recorded now (default: the log)."""
    from clusterops import spool
    from clusterops.errors import ClusteropsError
    from clusterops.fsutil import check_output_target
    from clusterops.health import (drain_settings, exit_code, health_metrics, load_profile, load_site_config,
                                   run_check, self_drain)
    from clusterops.health.probes.base import ProbeContext, node_name

    warn = warn or log.warning
    profile = load_profile(req.profile, req.site_config)  # InputError -> exit 2
    guard = drain_settings(req.site_config) if req.drain_on_fail else None  # bad drain: settings -> exit 2
    site, site_path = load_site_config(req.site_config)
    record_to = spool.settings(req.db, site, site_path)   # a bad --db / history: is exit 2, before the check
    if req.prometheus:
        check_output_target(req.prometheus)   # /dev/null, a FIFO, a symlink: exit 2 before the check runs
    if req.drain_on_fail:
        require_drain_privilege(req.drain_timeout_s)   # not a Slurm admin: exit 2, nothing run
    ctx = ProbeContext(node=req.node or node_name())
    run = run_check(profile, ctx)
    report = run.report
    if req.drain_on_fail:
        report["slurm"] = self_drain(report, ctx.node, timeout_s=req.drain_timeout_s, guard=guard)
        notify_self_drain(report, site, site_path, warn)
    report["exit_code"] = exit_code(report["status"], report.get("slurm"))
    if record_to is not None:
        report["history"] = spool.record(report, record_to)
        if report["history"]["error"]:
            h = report["history"]
            warn(f"history not recorded now ({h['error']}); {h['pending']} check(s) wait in {h['spool']}")
    if req.prometheus:
        try:
            health_metrics(report).write_textfile(req.prometheus)
        except ClusteropsError as e:
            raise ClusteropsError(f"--prometheus {req.prometheus}: {e.message}", exit_code=e.exit_code) from None
    return CheckOutcome(report, hung=run.outcome.hung)


def require_drain_privilege(timeout_s: float) -> None:
    """--drain-on-fail by a user Slurm would not let drain: one line, exit 2, before the check.
    A Slurm that cannot be asked now decides nothing here: the check runs, and its self-drain
    reports what Slurm does then."""
    from clusterops.errors import ClusteropsError
    from clusterops.slurm import privilege
    from clusterops.slurm.factory import connect

    try:
        slurm = connect(timeout_s=max(2.0, timeout_s / 3), read_attempts=1)
        privilege.require(slurm, privilege.Level.ADMIN, "clusterops health check --drain-on-fail",
                          "draining or resuming a node")
    except privilege.PrivilegeError:
        raise
    except ClusteropsError:
        pass


def notify_self_drain(report: dict, site, site_path, warn: Callable[[str], None]) -> None:
    """Tell the site config's ``notify:`` webhooks of a drain, a resume or a guard refusal
    (rare events: a passing check sends nothing). Bounded at 5 s; never changes the exit."""
    s = report.get("slurm") or {}
    event = {"drain": "node_drained", "resume": "node_resumed"}.get(s.get("action")) if s.get("ok") else None
    if s.get("action") in ("refused", "undone") and (s.get("guard") or s.get("excess")):
        event = "guard_tripped"
    if event is None or not (site or {}).get("notify"):
        return
    from clusterops import notify

    try:
        targets = notify.parse_targets(site.get("notify"), f"{site_path}: notify")
    except Exception as e:  # noqa: BLE001 - validated with the site config already; never fail the check
        warn(f"notify: {e}")
        return
    node = report["node"]
    summary = {"node_drained": f"{node} drained by its health check: {s.get('reason', '')}",
               "node_resumed": f"{node} resumed: its health check passes again",
               "guard_tripped": f"{node} fails its health check, but the fleet guard refused the drain: "
                                f"{s.get('why', '')}"}[event]
    n = notify.Notifier(targets)
    n.send(event, summary, {"node": node, "profile": report.get("profile"), "reason": s.get("reason"),
                            "why": s.get("why"), "status": report.get("status")})
    for d in n.close(max_wait_s=NOTIFY_WAIT_S):
        if not d.ok:
            warn(f"notify {event}: {d.error}")
