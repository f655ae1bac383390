"""From outside the job: a cron pass over a cluster's supervised jobs and chains.

``clusterops job watch`` without a job id (:func:`scan`) lists the supervised jobs and chains
Slurm knows (every user's when the caller is root or a Slurm operator/administrator, else the
caller's own: :func:`clusterops.jobs.list_jobs`), sums each one up as ``job status`` does, and
flags (:func:`assess`, pure):

- ``restart_storm``: more than ``max_restarts`` restarts and requeues (and hand-ons of a chain)
  within the last ``window_s`` seconds of its timeline;
- ``stalled``: running for more than ``stall_s`` seconds (this incarnation or generation) while
  its latest good checkpoint is older than that, or there is none;
- ``chain_dry``: a chain with no generation queued (none pending) and none running although its
  training has not finished and the chain did not end by a give-up or a stop.

For each flag: one webhook event ``job_flagged`` (the ``notify:`` targets of a file, as the
sweep's ``--notify-config``), one series of ``clusterops_watch_job_flagged`` in a Prometheus
textfile, and with ``cancel`` the job (a chain: its array, every generation) made not requeueable
and cancelled (a supervisor takes a plain ``scancel``'s SIGTERM for a preemption and requeues).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

from clusterops.errors import ClusteropsError


class Flag(str, Enum):
    RESTART_STORM = "restart_storm"
    STALLED = "stalled"
    CHAIN_DRY = "chain_dry"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Rules:
    """What counts as trouble; None turns a rule off."""

    max_restarts: Optional[int] = None     # restarts + requeues + hand-ons allowed within window_s
    window_s: float = 3600.0
    stall_s: Optional[float] = None        # a running job's latest good checkpoint older than this
    chain_dry: bool = True


@dataclass
class Finding:
    job_id: str
    user: str
    flag: str
    detail: str
    job_dir: str
    cancelled: Optional[bool] = None     # with cancel: whether the cancel went through

    def to_dict(self) -> dict:
        return asdict(self)


def _running_since(records: Sequence[Mapping]) -> Optional[float]:
    """When the current incarnation or generation started (its last ``start`` record)."""
    from clusterops.supervisor.timeline import E

    starts = [r.get("t") for r in records if r.get("event") == E.START and isinstance(r.get("t"), (int, float))]
    return float(starts[-1]) if starts else None


def assess(st, records: Sequence[Mapping], rules: Rules, *, now: float,
           ckpt_time: Optional[float]) -> List[Finding]:
    """The flags of one job from its status (``jobs.JobStatus``), its timeline records, and the
    time its latest good checkpoint was committed (None: none). Pure."""
    from clusterops.supervisor.timeline import E

    out: List[Finding] = []

    def flag(kind: Flag, detail: str) -> None:
        out.append(Finding(st.job_id, st.user, kind.value, detail, st.job_dir))

    if st.finished:
        return out
    running = st.state in ("RUNNING", "COMPLETING")
    if rules.max_restarts is not None:
        kinds = (E.RESTART, E.REQUEUE, E.GENERATION_END)
        recent = [r for r in records if r.get("event") in kinds and isinstance(r.get("t"), (int, float))
                  and r["t"] >= now - rules.window_s]
        if len(recent) > rules.max_restarts:
            flag(Flag.RESTART_STORM, f"{len(recent)} restarts/requeues in the last {rules.window_s:g} s "
                                     f"(more than {rules.max_restarts})")
    if rules.stall_s is not None and running:
        since = _running_since(records)
        if since is not None and now - since > rules.stall_s:
            if ckpt_time is None:
                flag(Flag.STALLED, f"running {now - since:.0f} s with no good checkpoint (limit {rules.stall_s:g} s)")
            elif now - ckpt_time > rules.stall_s:
                step = (st.latest_checkpoint or {}).get("step")
                flag(Flag.STALLED, f"latest good checkpoint (step {step}) is {now - ckpt_time:.0f} s old while the "
                                   f"job runs (limit {rules.stall_s:g} s)")
    c = st.chain
    if rules.chain_dry and c and not c.get("ended") and st.outcome is None:
        gens = c.get("generations") or []
        pending = [g for g in gens if g.get("state") == "PENDING"]
        if not pending:
            flag(Flag.CHAIN_DRY, f"no generation of {c.get('length')} queued and training not finished"
                                 + (" (the last one runs)" if running else ""))
    return out


def _ckpt_time(latest: Optional[Mapping]) -> Optional[float]:
    """When the latest good checkpoint was committed: its directory's modification time (the
    last file written into it before the rename)."""
    if not latest or not latest.get("path"):
        return None
    try:
        return Path(latest["path"]).stat().st_mtime
    except OSError:
        return None


def scan(rules: Rules, *, slurm=None, cancel: bool = False, now: Optional[float] = None) -> List[Finding]:
    """One pass (see the module): the findings, after any cancel."""
    from clusterops import jobs
    from clusterops.supervisor import timeline as tl

    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    found: List[Finding] = []
    for st in jobs.list_jobs(slurm, all_users=jobs.is_admin(slurm)):
        try:
            records, _ = tl.load(st.job_dir)
        except ClusteropsError:
            records = []
        at = time.time() if now is None else now
        found.extend(assess(st, records, rules, now=at, ckpt_time=_ckpt_time(st.latest_checkpoint)))
    if cancel:
        for f in found:
            try:
                # A supervisor takes scancel's SIGTERM for a preemption and requeues its job (a
                # chain's generation hands on): not requeueable first, then the cancel ends it.
                slurm.update_job(f.job_id, Requeue=0)
                slurm.cancel(f.job_id)
                f.cancelled = True
            except ClusteropsError as e:
                f.cancelled = False
                f.detail += f"; cancel failed: {e.message}"
    return found


def notify(findings: Sequence[Finding], targets) -> List[Any]:
    """One ``job_flagged`` webhook event per finding; the failed deliveries."""
    from clusterops import notify as nt

    if not targets or not findings:
        return []
    n = nt.Notifier(targets)
    for f in findings:
        n.send("job_flagged", f"job {f.job_id} ({f.user or '?'}): {f.flag}: {f.detail}", f.to_dict())
    return [d for d in n.close(max_wait_s=10.0) if not d.ok]


def metrics(findings: Sequence[Mapping], *, when: float):
    """The pass as a ``Metrics``: one ``clusterops_watch_job_flagged`` series per finding."""
    from clusterops.metrics import Metrics

    m = Metrics()
    for f in findings:
        m.set("clusterops_watch_job_flagged", {"job": f["job_id"], "user": f["user"], "flag": f["flag"]}, 1)
    m.set("clusterops_watch_flagged_jobs", {}, len({f["job_id"] for f in findings}))
    m.set("clusterops_watch_timestamp_seconds", {}, when)
    return m


def prometheus_text(findings: Sequence[Mapping], *, when: float) -> str:
    return metrics(findings, when=when).text()
