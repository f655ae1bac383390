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
``exit_code``, ``slurm`` and ``history`` filled in), whether a probe thread hung, and the
lines the command prints besides the report (``notes``).

The other ``clusterops health`` commands have their one call here too: ``validate_file``
(``profiles --check``), ``dist_rank`` and ``ibbw_rank`` (one task's share of the two-node
tests: the command line's values resolved, then the probe's ``run_rank``) and ``ack_xids``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

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

    def notes(self, drain_on_fail: bool) -> Tuple[Optional[str], Optional[str]]:
        """(a line for stdout after the table, a line for stderr), either None. With
        --drain-on-fail the table ends with what Slurm was asked; the two outcomes that
        leave a sick-looking node in service say so on stderr, one line."""
        report = self.report
        s = report.get("slurm") or {}
        out = f"slurm: {s['action']} ({s['why']})" if drain_on_fail else None
        err = None
        if report["status"] not in ("pass", "warn", "fail"):
            err = (f"clusterops health: {self.node}: check status {report['status']}: it could not decide; "
                   "node left in service (exit 4); see the ERROR results")
        elif drain_on_fail and s.get("action") in ("refused", "undone"):
            err = f"clusterops health: {s['why']}"
        return out, err


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
        elif req.drain_on_fail:
            from clusterops.quarantine import after_check   # repeat offenders (K blames in a window)

            q = after_check(report, record_to.target, site, guard, timeout_s=req.drain_timeout_s)
            if q is not None:
                report["quarantine"] = q
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


# ------------------------------------------------------------------------------ the other commands
def validate_file(path: str, site_config: Optional[str] = None) -> str:
    """``profiles --check FILE``: validate a profile or site config (and the site config
    given with it) without running anything -> what FILE is. InputError (exit 2) names
    file, line and key."""
    from clusterops.health import check_file, load_site_config

    what = check_file(path)
    if site_config:
        load_site_config(site_config)
    return what


def parse_size(text: str, option: str = "--size", example: str = "1048576, 64M, 1G") -> int:
    """A byte count with an optional K/M/G (binary) suffix; InputError naming the option."""
    from clusterops.errors import InputError

    t = text.strip().upper().rstrip("B")
    mult = 1
    if t and t[-1] in "KMG":
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[t[-1]]
        t = t[:-1]
    try:
        n = int(float(t) * mult)
    except (ValueError, OverflowError):
        n = 0
    if n <= 0:
        raise InputError(f"{option}: {text!r} is not a byte count (e.g. {example})")
    return n


def dist_rank(*, result_dir: Optional[str], sizes: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **options: Any) -> int:
    """``health dist``: this rank's torch-distributed test -> its exit code. The result
    directory defaults to ``$SLURM_SUBMIT_DIR/.clusterops-dist/<job>.<step>`` (shared by
    the step's ranks); ``options``: the rest of ``DistOptions``."""
    import os

    from clusterops.health.probes.dist import DistOptions, run_rank

    env = dict(os.environ if env is None else env)
    if not result_dir:
        base = env.get("SLURM_SUBMIT_DIR") or os.getcwd()
        result_dir = os.path.join(base, ".clusterops-dist",
                                  f"{env.get('SLURM_JOB_ID', 'nojob')}.{env.get('SLURM_STEP_ID', '0')}")
    parsed = [parse_size(s) for s in sizes]      # every size checked before a rank starts
    return run_rank(DistOptions(result_dir=result_dir, sizes_bytes=parsed, env=env, **options))


def ibbw_rank(report_dir: str, *, profile: Optional[str] = None, site_config: Optional[str] = None,
              size: Optional[str] = None, **over: Any) -> Dict[str, Any]:
    """``health ibbw``: this task's side of the pair test -> its document (``role``,
    ``status``, ``detail``...). The profile's ``probes.ibbw`` settings (default: the
    built-in ones) under the command line's ``over`` (None: not given); a profile that
    disables ibbw is a ``skip`` without a test (its ``role`` is then ``ibbw``)."""
    import os

    from clusterops.health import load_profile
    from clusterops.health.probes.ibbw import options_from_profile, run_rank

    size_bytes = None if size is None else parse_size(size, example="65536, 1M")
    cfg: Mapping[str, Any] = {"timeout_s": 60.0}
    if profile:
        prof = load_profile(profile, site_config)
        if "ibbw" not in prof.probes:
            return {"role": "ibbw", "status": "skip", "detail": f"disabled in profile {prof.name}"}
        cfg = prof.probes["ibbw"]
    opts = options_from_profile(cfg, report_dir, size_bytes=size_bytes,
                                host_root=os.environ.get("CLUSTEROPS_HOST_ROOT") or "/", **over)
    return run_rank(opts)


def ack_xids(state_file: Optional[str] = None, node: Optional[str] = None) -> Tuple[int, str]:
    """``health xid-ack``: acknowledge the open Xid failures in the xid probe's state file
    (default: this node's) -> (how many, the file)."""
    from pathlib import Path

    from clusterops.health.probes.base import ProbeContext, node_name
    from clusterops.health.probes.xid import ack, default_state_file

    path = Path(state_file) if state_file else default_state_file(ProbeContext(node=node or node_name()))
    return ack(path), str(path)
