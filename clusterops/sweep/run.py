"""One sweep, end to end: select the nodes, check them, judge, (drain), record.

The sweep's settings are ``clusterops.sweep.options.SweepOptions`` (validated before
Slurm is asked anything; bad ones: ``InputError``, exit 2); ``require_privilege`` then
refuses, in one line (exit 2), a sweep that would drain or resume nodes for a user who is
not a Slurm admin. ``run_sweep`` ties the pieces together: the targets
and their Slurm states, busy/down/foreign-drained nodes skipped and listed, nodes that
clusterops drained rechecked inside a short maintenance reservation, the checks run
through ``SlurmFanout`` or ``ssh_fanout``, stragglers marked, optional node pairs,
the drain plan made by ``policy.plan_drains`` from this sweep and the history, carried
out by ``apply_sweep_plan`` (the code here that changes node states after the checks; the
two others are ``run_sweep`` resuming the clusterops-drained nodes it rechecks, inside the
reservation (its step ``_open_recheck``), and ``_restore_drains`` draining them again when the recheck cannot run or
the sweep fails), and the ``SweepReport`` recorded. The exit codes (``EXIT_*``) are the ``clusterops sweep``
contract. A Slurm client comes from ``clusterops.slurm.factory.connect`` unless one is
passed in.
"""

from __future__ import annotations

import getpass
import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops import drains
from clusterops.errors import ClusteropsError, InputError
from clusterops.slurm import privilege
from clusterops.sweep.options import SweepOptions, expand_nodes, unique
from clusterops.sweep.pairs import run_pairs
from clusterops.sweep.policy import DrainPlan, NodeSnapshot, drain_reason, plan_drains
from clusterops.sweep.results import (STATUSES, NodeResult, mark_sdc_outliers, mark_stragglers,
                                      mark_version_outliers, natural_key)
from clusterops.sweep.scripts import check_argv
from clusterops.sweep.slurm_fanout import Progress, SlurmFanout, Target
from clusterops.sweep.ssh import ssh_fanout

log = logging.getLogger(__name__)

from clusterops.exitcodes import Sweep as _Exit  # noqa: E402 - the codes are written there

EXIT_OK = int(_Exit.OK)
EXIT_UNHEALTHY = int(_Exit.UNHEALTHY)
EXIT_GUARD = int(_Exit.GUARD)      # the safety guard refused to drain: too many nodes would go
EXIT_LOCKED = int(_Exit.LOCKED)     # another sweep holds the lock
EXIT_CANNOT_RUN = int(_Exit.CANNOT_RUN)  # no Slurm, no history database, nothing to sweep: nothing was judged


class SweepCannotRun(ClusteropsError):
    """The sweep could not run (or could not record what it found): exit 5, never
    mistaken for "ran and found unhealthy nodes" (1)."""

    exit_code = EXIT_CANNOT_RUN


# -- reservations (rechecking nodes we drained) --------------------------------------------

def create_reservation(slurm, name: str, nodes: str, minutes: int) -> None:
    """A maintenance reservation so a drained node can be resumed for its check without a
    user's job landing on it in between."""
    slurm.create_reservation(name, nodes, minutes=minutes, users=getpass.getuser(), flags="MAINT,IGNORE_JOBS")


def delete_reservation(slurm, name: str) -> None:
    slurm.delete_reservation(name)


# -- the sweep ---------------------------------------------------------------------

@dataclass
class SweepReport:
    sweep_id: str
    started: float
    finished: float
    options: dict
    targets: List[str]
    results: Dict[str, NodeResult]
    medians: Dict[str, float]
    plan: Optional[DrainPlan]
    applied: List[dict] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    pairs: List[dict] = field(default_factory=list)
    exit_code: int = 0

    def counts(self) -> Dict[str, int]:
        c = {s: 0 for s in STATUSES}
        for r in self.results.values():
            c[r.status] = c.get(r.status, 0) + 1
        c["stragglers"] = sum(1 for r in self.results.values() if r.stragglers)
        c["version_outliers"] = sum(1 for r in self.results.values() if r.version_outlier)
        return c

    def node_order(self) -> List[str]:
        return sorted(self.results, key=natural_key)

    def cpu_s(self) -> float:
        return sum(r.cpu_s or 0.0 for r in self.results.values())

    def to_dict(self) -> dict:
        return {
            "sweep_id": self.sweep_id,
            "started": self.started,
            "finished": self.finished,
            "duration_s": round(self.finished - self.started, 3),
            "options": self.options,
            "counts": self.counts(),
            "medians": self.medians,
            "check_cpu_s": round(self.cpu_s(), 3),
            "nodes": [self.results[n].to_dict() for n in self.node_order()],
            "plan": self.plan.to_dict() if self.plan else None,
            "applied": self.applied,
            "pairs": self.pairs,
            "errors": self.errors,
            "exit_code": self.exit_code,
        }


def _classify_targets(names: Sequence[str], infos: Mapping[str, object], opts: SweepOptions
                      ) -> Tuple[List[str], List[str], Dict[str, NodeResult]]:
    """-> (nodes to check now, clusterops-drained nodes to recheck, skipped results)."""
    check, recheck, skipped = [], [], {}
    for name in names:
        info = infos.get(name)
        if info is None:
            if opts.via == "ssh":
                check.append(name)
            else:
                skipped[name] = NodeResult(name, "error", detail="unknown to Slurm", probe="sweep")
            continue
        snap = NodeSnapshot.from_info(info)
        if snap.busy:
            skipped[name] = NodeResult(name, "skipped", detail=f"busy ({info.state}): running jobs, not disturbed")
        elif snap.down:
            why = f"down: {info.reason}" if info.reason else "down / not responding"
            skipped[name] = NodeResult(name, "skipped", detail=why)
        elif snap.drained and not snap.ours:
            skipped[name] = NodeResult(name, "skipped", detail=f"drained by someone else: {info.reason}")
        elif snap.drained and drains.parse_reason(info.reason).origin == drains.ADMIN:
            # May not be lifted by a sweep (drains.may_resume): do not even resume it for a recheck.
            skipped[name] = NodeResult(name, "skipped", detail=f"drained by an administrator: {info.reason}")
        elif snap.drained and drains.parse_reason(info.reason).origin == drains.QUARANTINE:
            # Quarantined: only a person lifts it (clusterops.quarantine); never resumed for a recheck.
            skipped[name] = NodeResult(name, "skipped", detail=f"quarantined: {info.reason}")
        elif snap.drained:
            if opts.via == "ssh":
                check.append(name)       # ssh reaches a drained node without touching Slurm
            elif opts.dry_run or not opts.recheck_drained:
                skipped[name] = NodeResult(name, "skipped", detail=f"drained by clusterops ({info.reason}); "
                                           "rechecked only by a real (not --dry-run) sweep")
            else:
                recheck.append(name)
        elif info.is_idle or opts.via == "ssh":
            check.append(name)
        else:
            skipped[name] = NodeResult(name, "skipped", detail=f"state {info.state} "
                                       f"{'+'.join(sorted(info.flags))}".strip())
    return check, recheck, skipped


def apply_sweep_plan(slurm, plan: DrainPlan, rechecked: Sequence[str], infos: Mapping[str, object], *,
                     drain: bool, guard: Optional[drains.GuardSettings] = None,
                     settle_s: float = 1.0) -> Tuple[List[dict], List[str]]:
    """Carry out the plan, one node at a time so one refusal does not stop the rest.

    ``rechecked`` nodes were drained by clusterops and resumed (inside a maintenance
    reservation) only for their check: each goes back to drained unless the plan
    resumes it and ``drain`` (the --drain flag) allows changes. Without ``drain``
    nothing else is touched. Every drain goes through ``drain_apply.apply_drain``: a new
    one under the partition-wide fleet guard (``guard``, the site's ``drain:`` settings),
    on top of this sweep's own ``--max-drain-fraction``; a drain the guard refuses or lifts
    again leaves its node in service and trips the plan's guard (exit 3).
    """
    from clusterops import drain_apply as da

    guard = guard or drains.GuardSettings()
    applied, errors = [], []
    by_node = {a.node: a for a in plan.actions}
    for n in rechecked:
        a = by_node.get(n)
        try:
            if drain and a is not None and a.action == "resume":
                applied.append({"node": n, "action": "resume", "reason": ""})
                continue
            if drain and a is not None and a.action == "keep" and a.reason:
                reason = a.reason
            else:
                reason = getattr(infos.get(n), "reason", None) or drain_reason("recheck", "drained")
            out = da.apply_drain(slurm, n, reason, guard, restore=True)
            if out.action != da.DRAINED:
                errors.append(f"re-drain {n}: {out.why}")
                continue
            applied.append({"node": n, "action": "keep", "reason": reason})
        except ClusteropsError as e:
            errors.append(f"re-drain {n}: {e}")
    if not drain:
        return applied, errors
    skip = set(rechecked)
    for a in plan.actions:
        if a.node in skip or a.action not in ("drain", "resume"):
            continue
        try:
            if a.action == "drain":
                out = da.apply_drain(slurm, a.node, a.reason, guard, settle_s=settle_s)
                if out.action in (da.REFUSED, da.UNDONE):
                    _guard_refused(plan, a, out.why)
                    continue
                if out.action != da.DRAINED:
                    errors.append(f"drain {a.node}: {out.why}")
                    continue
                if not out.ok:
                    errors.append(f"drain {a.node}: {out.why}")
            else:
                slurm.resume([a.node])
            applied.append({"node": a.node, "action": a.action, "reason": a.reason})
        except ClusteropsError as e:
            errors.append(f"{a.action} {a.node}: {e}")
    return applied, errors


def _guard_refused(plan: DrainPlan, a, why: str) -> None:
    """The partition-wide guard kept ``a.node`` in service: the plan's guard is tripped."""
    a.action = "untouched"
    a.why = f"guard: {why}"
    if not plan.guard_tripped:
        plan.guard_tripped = True
        plan.message = (f"SAFETY GUARD (partition): {why}. One drain per sweep is still a broken check "
                        f"emptying the partition over enough sweeps: look at the failures first.")


def require_privilege(opts: SweepOptions, slurm=None) -> None:
    """A sweep that may drain or resume nodes needs a Slurm admin (``privilege.require``):
    anyone else gets one ``PrivilegeError`` line (exit 2) before any check job is submitted
    or any node touched. Run by root this asks Slurm nothing; a Slurm that cannot be asked
    decides nothing here (the sweep then reports that itself)."""
    if not opts.changes_nodes():
        return
    try:
        if slurm is None:
            from clusterops.slurm.factory import connect

            slurm = connect(timeout_s=10, read_attempts=1)
        privilege.require(slurm, privilege.Level.ADMIN, "clusterops sweep",
                          "a sweep that drains or resumes nodes (--drain, or rechecking "
                          "clusterops-drained nodes via Slurm; --dry-run changes none)")
    except privilege.PrivilegeError:
        raise
    except ClusteropsError:
        pass


def _setup(opts: SweepOptions, slurm, errors: List[str]):
    """Slurm client, target names and their Slurm states, before any check runs."""
    if slurm is None:
        from clusterops.slurm.factory import connect

        if opts.via == "slurm" or opts.partition or not opts.nodes:
            slurm = connect()
        else:
            # SSH mode is also for when Slurm itself is broken: ask it once, briefly; without
            # an answer the sweep still runs, it just cannot skip busy nodes or drain.
            slurm = connect(timeout_s=10, read_attempts=1)
    names = unique(resolve_targets(opts, slurm))
    if not names:
        raise ClusteropsError("nothing to sweep (no nodes found)")
    infos: Dict[str, object] = {}
    if slurm is not None:
        try:
            infos = {n.name: n for n in slurm.nodes(names)}
        except ClusteropsError as e:
            if opts.via == "slurm":
                raise
            if opts.drain:
                errors.append(f"Slurm unavailable, node states unknown: nothing drained or resumed ({e})")
            else:
                log.info("Slurm unavailable; sweeping without node states: %s", e)
            slurm = None
    return slurm, names, infos


def resolve_targets(opts: SweepOptions, slurm) -> List[str]:
    if opts.nodes:
        return expand_nodes(opts.nodes)
    if slurm is None:
        raise InputError("--via ssh without Slurm needs --nodes HOSTLIST")
    if opts.partition:
        return slurm.partition_nodes(opts.partition)
    return [n.name for n in slurm.nodes()]


@dataclass
class _SweepState:
    """What one sweep holds while it runs, for the steps of ``run_sweep`` and its unwinding:
    ``recheck`` are clusterops-drained nodes resumed for their check (re-drained on any
    exit until the plan has been applied), ``reservation`` the maintenance reservation
    they sit in (deleted on any exit)."""

    opts: SweepOptions
    sweep_id: str
    started: float
    slurm: object
    names: List[str]
    infos: Dict[str, object]
    errors: List[str]
    work: Optional[Path] = None
    results: Dict[str, NodeResult] = field(default_factory=dict)
    recheck: List[str] = field(default_factory=list)
    reservation: Optional[str] = None


def run_sweep(opts: SweepOptions, *, slurm=None, history=None, on_result: Optional[Progress] = None,
              on_targets: Optional[Callable[[int], None]] = None, clock: Callable[[], float] = time.time,
              guard: Optional[drains.GuardSettings] = None) -> SweepReport:
    """One sweep: select, check, judge, (drain), record. Returns the report; never raises
    for a node's failure, only for bad input or an unusable Slurm. ``guard``: the
    partition-wide fleet guard (default: the site config's ``drain:`` block and
    ``$CLUSTEROPS_MAX_DRAINED_FRACTION``, as for the health self-drain)."""
    opts.validate()
    if guard is None and opts.drain and not opts.dry_run:
        from clusterops.health.profiles import drain_settings

        guard = drain_settings(None)   # a bad drain: block is exit 2 before anything runs
    st = _start(opts, slurm, clock)
    check = _select(st, on_result, on_targets)
    st.work = _work_dir(opts, st.sweep_id)
    try:
        _check(st, check, on_result)
        medians = mark_stragglers(st.results, opts.straggler_tolerance)
        mark_version_outliers(st.results, {n: opts.partition or _first_partition(st.infos.get(n))
                                           for n in st.results})
        mark_sdc_outliers(st.results)   # before the plan: a minority digest is a fail it drains
        pair_results: List[dict] = []
        if opts.pairs and opts.via == "slurm":
            # Rechecked nodes sit in the sweep's maintenance reservation: not paired.
            pair_results = run_pairs(st.slurm, {n: r for n, r in st.results.items() if n not in st.recheck},
                                     opts, st.work, st.errors)
        plan = _plan(st, history)
        applied: List[dict] = []
        if st.slurm is not None and not opts.dry_run:
            done_, errs = apply_sweep_plan(st.slurm, plan, st.recheck, st.infos, drain=opts.drain, guard=guard)
            applied += done_
            st.errors += errs
        st.recheck = []      # restored: nothing left to undo
        report = SweepReport(st.sweep_id, st.started, clock(), _opts_dict(opts), list(st.names), st.results,
                             medians, plan, applied, st.errors, pair_results)
        report.exit_code = _exit_code(report, opts)
        _record(report, history)
        if history is not None and st.slurm is not None and opts.drain and not opts.dry_run:
            _quarantine(st, report, history, guard)
        return report
    except BaseException:
        if st.recheck and st.slurm is not None and not opts.dry_run:
            _restore_drains(st.slurm, st.recheck, st.infos, st.errors)
        raise
    finally:
        if st.reservation:
            reservation_cleanup(st.slurm, st.reservation, st.errors)
        if not opts.keep_work_dir:
            shutil.rmtree(st.work, ignore_errors=True)


def _start(opts: SweepOptions, slurm, clock: Callable[[], float]) -> _SweepState:
    """The sweep's id, its Slurm client, targets and their states; a Slurm that cannot be asked (or nothing to sweep) is ``SweepCannotRun``."""
    sweep_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock())) + "-" + uuid.uuid4().hex[:6]
    started = clock()
    errors: List[str] = []
    try:
        slurm, names, infos = _setup(opts, slurm, errors)
        require_privilege(opts, slurm)
    except InputError:
        raise
    except privilege.PrivilegeError:
        raise
    except ClusteropsError as e:
        # Nothing was checked: no Slurm, an unknown/empty partition, no node list.
        raise SweepCannotRun(f"sweep could not run: {e.message}") from None
    return _SweepState(opts, sweep_id, started, slurm, names, infos, errors)


def _work_dir(opts: SweepOptions, sweep_id: str) -> Path:
    # Slurm mode: the check jobs write their results here, so on a real cluster this must
    # be on a filesystem the nodes share (--work-dir); the default suits one machine.
    if opts.work_dir:
        return Path(opts.work_dir) / sweep_id
    return Path(tempfile.mkdtemp(prefix=f"clusterops-sweep-{sweep_id}-"))


def _select(st: _SweepState, on_result: Optional[Progress],
            on_targets: Optional[Callable[[int], None]]) -> List[str]:
    """Sort the targets: the nodes to check now are returned, the clusterops-drained ones
    to recheck go to ``st.recheck``, the skipped ones straight into the results."""
    check, st.recheck, skipped = _classify_targets(st.names, st.infos, st.opts)
    st.results.update(skipped)
    if on_targets:
        on_targets(len(st.names))
    for r in skipped.values():
        if on_result:
            on_result(r)
    return check


def _check(st: _SweepState, check: Sequence[str], on_result: Optional[Progress]) -> None:
    """Run the checks: Slurm jobs (the rechecks inside a maintenance reservation) or SSH."""
    opts = st.opts
    argv = check_argv(opts.profile, opts.check_cmd)
    if opts.via != "slurm":
        st.results.update(ssh_fanout(check, argv, opts, on_result))
        return
    targets = [Target(n, opts.partition or _first_partition(st.infos.get(n))) for n in check]
    if st.recheck:
        targets += _open_recheck(st)
    fan = SlurmFanout(st.slurm, argv, st.work, timeout_s=opts.timeout_s,
                      submit_concurrency=min(opts.concurrency, 16), max_running=opts.max_running)
    st.results.update(fan.run(targets, on_result))


def _open_recheck(st: _SweepState) -> List[Target]:
    """Resume the clusterops-drained nodes inside a fresh maintenance reservation for their
    check; if that cannot be done they are drained again and listed as skipped."""
    import hostlist

    opts, recheck = st.opts, st.recheck
    st.reservation = f"clusterops-sweep-{st.sweep_id}"
    minutes = max(2, int(opts.timeout_s // 60) + 2)
    try:
        create_reservation(st.slurm, st.reservation, hostlist.collect_hostlist(recheck), minutes)
        st.slurm.resume(recheck)
        return [Target(n, opts.partition or _first_partition(st.infos.get(n)), st.reservation) for n in recheck]
    except ClusteropsError as e:
        st.errors.append(f"could not recheck drained nodes {','.join(recheck)}: {e}")
        _restore_drains(st.slurm, recheck, st.infos, st.errors)
        reservation_cleanup(st.slurm, st.reservation, st.errors)
        st.reservation = None
        for n in recheck:
            st.results[n] = NodeResult(n, "skipped", detail=f"drained by clusterops "
                                       f"({st.infos[n].reason}); recheck failed")
        st.recheck = []
        return []


def _plan(st: _SweepState, history) -> DrainPlan:
    """The drain plan from this sweep's results and the history's recent failures."""
    opts = st.opts
    snaps = {n: NodeSnapshot.from_info(i) for n, i in st.infos.items()}
    try:
        history_fail = history.fail_history([n for n, r in st.results.items() if r.checked], opts.flap_n) \
            if history is not None else {}
    except ClusteropsError as e:
        # Without the history the flapping rule cannot be applied: change no node.
        raise SweepCannotRun(f"sweep could not read its history: {e.message}; no node changed") from None
    return plan_drains(snaps, st.results, history_fail, max_drain_fraction=opts.max_drain_fraction,
                       flap_k=opts.flap_k, flap_n=opts.flap_n, drain_stragglers=opts.drain_stragglers)


def _record(report: SweepReport, history) -> None:
    """Record the report in the history; a sweep whose result is not recorded exits 5."""
    if history is None:
        return
    try:
        history.record(report)
    except ClusteropsError as e:
        report.errors.append(f"history not recorded: {e.message}")
        report.exit_code = EXIT_CANNOT_RUN


def _quarantine(st: _SweepState, report: SweepReport, history, guard) -> None:
    """Repeat offenders among the nodes failing this sweep are quarantined (clusterops.quarantine)."""
    from clusterops import quarantine

    failing = [n for n, r in st.results.items() if r.status == "fail"]
    if not failing:
        return
    try:
        q = quarantine.load_settings(None)
        found = history.offenders(q.blames, q.window_s, report.finished)
    except ClusteropsError as e:
        report.errors.append(f"quarantine not decided: {e.message}")
        return
    decided = quarantine.decide(found, failing, q.window_s)
    report.applied += quarantine.apply(st.slurm, decided, guard or drains.GuardSettings())


def _restore_drains(slurm, nodes: Sequence[str], infos: Mapping[str, object], errors: List[str]) -> None:
    from clusterops import drain_apply as da

    for n in nodes:
        try:
            out = da.apply_drain(slurm, n, infos[n].reason or drain_reason("recheck", "interrupted"),
                                 drains.GuardSettings(), restore=True)
            if out.action != da.DRAINED:
                errors.append(f"re-drain {n}: {out.why}")
        except ClusteropsError as e:
            errors.append(f"re-drain {n}: {e}")


def reservation_cleanup(slurm, name: str, errors: List[str]) -> None:
    try:
        delete_reservation(slurm, name)
    except ClusteropsError as e:
        errors.append(f"delete reservation {name}: {e}")


def _first_partition(info) -> Optional[str]:
    parts = getattr(info, "partitions", ()) or ()
    return parts[0] if parts else None


def _opts_dict(opts: SweepOptions) -> dict:
    d = asdict(opts)
    return {k: v for k, v in d.items() if v is not None}


def _exit_code(report: SweepReport, opts: SweepOptions) -> int:
    if report.plan and report.plan.guard_tripped and opts.drain:
        return EXIT_GUARD
    if any(r.failing or r.status == "error" for r in report.results.values()):
        return EXIT_UNHEALTHY
    if report.errors or any(p["status"] != "pass" for p in report.pairs):
        return EXIT_UNHEALTHY
    return EXIT_OK
