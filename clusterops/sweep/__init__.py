"""Fleet health sweeps: run the health check on many nodes, judge, drain, resume.

The pieces, from pure to side-effecting:

- ``result_from_check`` turns one ``clusterops health check --json`` document (plus
  its exit code) into a :class:`NodeResult`;
- ``mark_stragglers`` compares per-node figures (matmul TFLOPS, all-reduce busbw)
  with the sweep's median: a node below ``(1 - tolerance) x median`` is a straggler;
- ``plan_drains`` is the drain policy as a pure function: node states from Slurm,
  this sweep's results and each node's recent history in, a :class:`DrainPlan` out
  (drains, resumes, nodes left alone, each with its reason), with the safety guard
  that refuses to drain more than ``max_drain_fraction`` of the swept nodes;
- ``SlurmFanout`` runs the check on each idle node as a short exclusive job pinned to
  it (submissions in parallel, results read from per-job files, one squeue call for
  all jobs now and then, never one poll per node);
- ``run_sweep`` ties it together and ``apply_sweep_plan`` is the thin code that changes
  node states.

Rules that never bend: a node whose check does not come back is ``unreachable``,
never healthy; a node that runs jobs is skipped and listed; a node drained or downed
by someone else is never touched; drain reasons carry their origin
(``clusterops:sweep:``, ``clusterops:straggler:``, ``clusterops:flapping:``) and who may
lift which drain is ``clusterops.drains.may_resume``.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from clusterops import drains
from clusterops.errors import ClusteropsError, InputError

log = logging.getLogger(__name__)

REASON_PREFIX = drains.PREFIX
EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_GUARD = 3      # the safety guard refused to drain: too many nodes would go
EXIT_LOCKED = 4     # another sweep holds the lock
EXIT_CANNOT_RUN = 5  # no Slurm, no history database, nothing to sweep: nothing was judged


class SweepCannotRun(ClusteropsError):
    """The sweep could not run (or could not record what it found): exit 5, never
    mistaken for "ran and found unhealthy nodes" (1)."""

    exit_code = EXIT_CANNOT_RUN

HEALTHY = frozenset({"pass", "warn"})
FAILING = frozenset({"fail", "unreachable"})
# Every status a node can end a sweep with.
STATUSES = ("pass", "warn", "fail", "error", "unreachable", "skipped")
MAX_REASON_CHARS = drains.MAX_REASON_CHARS
MAX_TARGETS = 100_000     # a hostlist typo like node[1-99999999] must not eat the memory
MAX_TIMEOUT_S = 7 * 86400.0  # also keeps NaN and infinity out (they fail every comparison)

# Per-node figures compared across the fleet: metric name -> (probe name patterns, units).
METRICS = {
    "matmul_tflops": (("matmul",), ("tflops", "tflop/s")),
    "busbw_gbps": (("allreduce", "all_reduce", "all-reduce", "busbw", "bandwidth"), ("gb/s", "gbps")),
}


# -- results ---------------------------------------------------------------------

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


def _one_line(text: object, limit: int = 300) -> str:
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
        why = _one_line(stderr.strip().splitlines()[-1] if stderr.strip() else "no JSON on stdout")
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
        detail = _one_line(worst.get("detail") or worst.get("status"))
    elif status not in HEALTHY:
        probe, detail = "check", _one_line(doc.get("detail") or f"check status {status}")
    else:
        warns = [r for r in probes if r.get("status") == "warn"]
        if warns:
            detail = _one_line(f"{warns[0].get('name')}: {warns[0].get('detail', '')}")
    dur = doc.get("duration_s")
    return NodeResult(node, status, detail=detail, probe=probe, exit_code=exit_code,
                      duration_s=float(dur) if isinstance(dur, (int, float)) else None,
                      metrics=extract_metrics(probes), probes=probes, profile=str(doc.get("profile") or ""))


def fleet_medians(results: Iterable[NodeResult]) -> Dict[str, float]:
    values: Dict[str, List[float]] = {}
    for r in results:
        if r.status in HEALTHY or r.status == "fail":
            for k, v in r.metrics.items():
                values.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in values.items() if v}


def mark_stragglers(results: Mapping[str, NodeResult], tolerance: float) -> Dict[str, float]:
    """Flag nodes below ``(1 - tolerance) x`` the sweep's median; returns the medians.

    A straggler may still pass its absolute thresholds: the point is the comparison
    with its peers. Needs at least 3 nodes with the figure to say anything.
    """
    if not 0 <= tolerance < 1:
        raise InputError(f"--straggler-tolerance: must be in [0, 1), got {tolerance}")
    medians = fleet_medians(results.values())
    counts = {k: sum(1 for r in results.values() if k in r.metrics) for k in medians}
    for r in results.values():
        r.stragglers = []
        for k, med in medians.items():
            if counts[k] >= 3 and k in r.metrics and med > 0 and r.metrics[k] < (1 - tolerance) * med:
                r.stragglers.append(k)
    return medians


# -- drain policy (pure) --------------------------------------------------------------

@dataclass(frozen=True)
class NodeSnapshot:
    """What the policy needs to know about a node's Slurm state."""
    name: str
    drained: bool = False
    down: bool = False
    busy: bool = False
    reason: Optional[str] = None

    @property
    def ours(self) -> bool:
        return drains.is_ours(self.reason)

    @classmethod
    def from_info(cls, info) -> "NodeSnapshot":
        return cls(info.name, drained=info.drained, down=info.is_down, busy=info.busy, reason=info.reason)


@dataclass
class Action:
    node: str
    action: str          # drain | resume | keep | untouched
    why: str
    reason: str = ""     # the Slurm reason a drain writes

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DrainPlan:
    actions: List[Action]
    swept: int
    allowed: int
    guard_tripped: bool = False
    message: str = ""

    def of(self, kind: str) -> List[Action]:
        return [a for a in self.actions if a.action == kind]

    @property
    def drains(self) -> List[Action]:
        return self.of("drain")

    @property
    def resumes(self) -> List[Action]:
        return self.of("resume")

    def to_dict(self) -> dict:
        return {"swept": self.swept, "allowed_drains": self.allowed, "guard_tripped": self.guard_tripped,
                "message": self.message, "actions": [a.to_dict() for a in self.actions]}


def drain_reason(probe: str, detail: str, origin: str = drains.SWEEP) -> str:
    """``clusterops:<origin>: <probe>: <detail>``; origin sweep, straggler or flapping."""
    return drains.make_reason(origin, probe or "check", detail or "failed")


def allowed_drains(swept: int, max_drain_fraction: float) -> int:
    """How many new drains one sweep may make: floor(fraction x swept), at least one
    unless the fraction is 0 (one bad node in a small pool must still be drainable)."""
    if max_drain_fraction <= 0 or swept <= 0:
        return 0
    return max(1, int(max_drain_fraction * swept + 1e-9))


def plan_drains(nodes: Mapping[str, NodeSnapshot], results: Mapping[str, NodeResult],
                fail_history: Mapping[str, Sequence[bool]], *, max_drain_fraction: float = 0.1,
                flap_k: int = 3, flap_n: int = 5, drain_stragglers: bool = False) -> DrainPlan:
    """Decide drains and resumes. Pure: no Slurm, no clock.

    ``fail_history[node]``: for the node's previous checked sweeps, newest first,
    whether each one failed. Today's result counts as the newest of the ``flap_n``.
    """
    if not 0 <= max_drain_fraction <= 1:
        raise InputError(f"--max-drain-fraction: must be between 0 and 1, got {max_drain_fraction}")
    if not 1 <= flap_k <= flap_n:
        raise InputError(f"--flap-k/--flap-n: need 1 <= k <= n, got k={flap_k} n={flap_n}")
    actions: List[Action] = []
    swept = sum(1 for r in results.values() if r.checked)
    for name in sorted(results, key=_natural_key):
        r = results[name]
        snap = nodes.get(name)
        if snap is None:
            actions.append(Action(name, "untouched", "not a Slurm node"))
            continue
        if snap.reason and not snap.ours and (snap.drained or snap.down):
            actions.append(Action(name, "untouched", f"drained/down by someone else: {snap.reason}"))
            continue
        if not r.checked:
            actions.append(Action(name, "untouched", f"{r.status}: {r.detail}".rstrip(": ")))
            continue
        ours_drained = snap.drained and snap.ours
        if ours_drained:
            # Still failing: the reason changes hands only when this sweep could lift the old
            # drain itself; a deeper check's, or an administrator's, keeps its owner.
            relabel, _ = drains.may_resume(snap.reason, drains.Resumer(
                drains.BY_SWEEP, r.profile or None, drains.probes_ran(r.probes)))
        failed_before = list(fail_history.get(name, ()))[: flap_n - 1]
        fails = sum(1 for f in [r.failing] + failed_before if f)
        straggling = drain_stragglers and bool(r.stragglers)
        if r.failing or straggling:
            if r.failing:
                reason = drain_reason(r.probe or r.status, r.detail)
            else:
                reason = drain_reason(", ".join(r.stragglers), "below the fleet median", drains.STRAGGLER)
            if ours_drained:
                actions.append(Action(name, "keep", "still failing", reason if relabel else snap.reason or ""))
            else:
                actions.append(Action(name, "drain", f"{r.status}: {r.detail}".rstrip(": "), reason))
        elif fails >= flap_k:
            reason = drain_reason(f"{fails}/{flap_n}", f"failed {fails} of the last {flap_n} sweeps",
                                  drains.FLAPPING)
            if ours_drained:
                actions.append(Action(name, "keep", f"passes today but flapping ({fails}/{flap_n})",
                                      reason if relabel else snap.reason or ""))
            else:
                actions.append(Action(name, "drain", f"flapping: failed {fails} of the last {flap_n} sweeps",
                                      reason))
        elif ours_drained:
            ok, why = drains.may_resume(snap.reason, drains.Resumer(
                drains.BY_SWEEP, r.profile or None, drains.rechecked_probes(r.probes), flap_clean=True))
            if ok:
                actions.append(Action(name, "resume", f"passes now (was: {snap.reason})"))
            else:
                actions.append(Action(name, "keep", f"passes, but {why}", snap.reason or ""))
        else:
            actions.append(Action(name, "untouched", r.status))
    allowed = allowed_drains(swept, max_drain_fraction)
    plan = DrainPlan(actions, swept, allowed)
    new = plan.drains
    if len(new) > allowed:
        plan.guard_tripped = True
        plan.message = (f"SAFETY GUARD: {len(new)} of {swept} swept nodes would be drained, more than "
                        f"--max-drain-fraction {max_drain_fraction:g} allows ({allowed}); draining NONE. "
                        f"A broken check must not empty the cluster: look at the failures, then rerun "
                        f"with a higher --max-drain-fraction if they are real.")
        for a in new:
            a.action = "untouched"
            a.why = f"guard: would drain ({a.why})"
    return plan


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# -- the check command --------------------------------------------------------------

def clusterops_argv() -> List[str]:
    """How to run this very clusterops elsewhere (absolute path: cron and Slurm jobs have a
    bare PATH)."""
    here = Path(sys.executable).parent / "clusterops"
    if here.exists():
        return [str(here)]
    found = shutil.which("clusterops")
    if found:
        return [str(Path(found).absolute())]
    return [sys.executable, "-m", "clusterops"]


def check_argv(profile: str, check_cmd: Optional[Sequence[str]] = None) -> List[str]:
    """The per-node command. ``check_cmd`` replaces ``clusterops health check --json``
    (for sites that wrap it); ``--profile`` is appended either way."""
    base = list(check_cmd) if check_cmd else clusterops_argv() + ["health", "check", "--json"]
    return base + ["--profile", profile]


def parse_times(text: str) -> Optional[float]:
    """CPU seconds (user + sys) of the children from bash's ``times`` output: its last line."""
    pat = re.compile(r"(\d+)m([\d.]+)s\s+(\d+)m([\d.]+)s")
    lines = [ln for ln in text.splitlines() if pat.fullmatch(ln.strip())]
    if len(lines) < 2:
        return None
    m = pat.fullmatch(lines[-1].strip())
    return int(m.group(1)) * 60 + float(m.group(2)) + int(m.group(3)) * 60 + float(m.group(4))


# -- Slurm fan-out ------------------------------------------------------------------

JOB_SCRIPT = """#!/bin/bash
# clusterops sweep: one health check on the node this job is pinned to.
# Results go to files named by the job id; the sweep reads them (no per-node polling).
out={out}/"$SLURM_JOB_ID"
{cmd} >"$out.json.part" 2>"$out.err" </dev/null
rc=$?
{{ echo "$rc"; times; }} >"$out.meta.part"
mv -f "$out.json.part" "$out.json"
mv -f "$out.meta.part" "$out.done"
"""


@dataclass
class Target:
    node: str
    partition: Optional[str] = None
    reservation: Optional[str] = None


Progress = Callable[[NodeResult], None]


class SlurmFanout:
    """Run one check job per target node and collect results from files.

    ``work_dir`` must be visible from the nodes at the same path (a shared
    filesystem on a real cluster; the dev cluster shares one machine).

    ``max_running`` caps the check jobs in flight (0: no cap, every node at once —
    right on a real cluster, where each node has its own CPUs). On the dev cluster,
    whose nodes all share one machine, a cap near a few times the core count keeps
    the machine busy without starving the checks into their own probe timeouts.
    Each job has its own deadline, ``timeout_s`` from its submission.
    """

    def __init__(self, slurm, argv: Sequence[str], work_dir: Path, *, timeout_s: float = 300.0,
                 submit_concurrency: int = 16, max_running: int = 0, poll_s: float = 0.1,
                 squeue_every_s: float = 3.0, end_grace_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.slurm = slurm
        self.argv = list(argv)
        self.work_dir = Path(work_dir)
        self.timeout_s = timeout_s
        self.submit_concurrency = max(1, submit_concurrency)
        self.max_running = max(0, max_running)
        self.poll_s = poll_s
        self.squeue_every_s = squeue_every_s
        self.end_grace_s = end_grace_s
        self.clock = clock
        self.sleep = sleep

    def _script(self) -> Path:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path = self.work_dir / "check.sh"
        path.write_text(JOB_SCRIPT.format(out=shlex.quote(str(self.work_dir)), cmd=shlex.join(self.argv)))
        path.chmod(0o755)
        return path

    def _sbatch_args(self, t: Target) -> List[str]:
        minutes = max(1, int((self.timeout_s + 59) // 60))
        args = [f"--nodelist={t.node}", "--nodes=1", "--ntasks=1", "--exclusive", f"--time={minutes}",
                "--no-requeue", "--job-name=clusterops-sweep",
                f"--output={self.work_dir}/%j.slurm.out", f"--chdir={self.work_dir}"]
        if t.partition:
            args.append(f"--partition={t.partition}")
        if t.reservation:
            args.append(f"--reservation={t.reservation}")
        return args

    def run(self, targets: Sequence[Target], on_result: Optional[Progress] = None) -> Dict[str, NodeResult]:
        script = self._script()
        results: Dict[str, NodeResult] = {}
        lock = threading.Lock()
        pending: Dict[int, str] = {}          # job id -> node, submitted, no result yet
        submitted_at: Dict[int, float] = {}
        queue = list(reversed(targets))       # pop() from the end: submission order kept
        in_submit = [0]

        def done(r: NodeResult) -> None:
            with lock:
                results[r.node] = r
            if on_result:
                on_result(r)

        def submit(t: Target) -> None:
            try:
                jid = self.slurm.submit(script, args=self._sbatch_args(t))
            except BaseException as e:
                with lock:
                    in_submit[0] -= 1
                if isinstance(e, ClusteropsError):
                    done(NodeResult(t.node, "error", detail=_one_line(f"submit failed: {e}"), probe="sweep"))
                    return
                raise
            with lock:       # one step: the collector never sees it in neither place
                pending[jid] = t.node
                submitted_at[jid] = self.clock()
                in_submit[0] -= 1

        pool = ThreadPoolExecutor(max_workers=self.submit_concurrency)

        def top_up() -> None:
            with lock:
                room = len(queue) if not self.max_running else \
                    self.max_running - len(pending) - in_submit[0]
                batch = [queue.pop() for _ in range(max(0, min(room, len(queue))))]
                in_submit[0] += len(batch)
            for t in batch:
                pool.submit(submit, t)

        try:
            self._collect(pending, submitted_at, done, lock, top_up, lambda: bool(queue) or in_submit[0] > 0)
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM from systemd): leave no check job behind.
            queue.clear()
            pool.shutdown(wait=True)
            with lock:
                left = list(pending)
            for jid in left:
                try:
                    self.slurm.cancel(jid)
                except ClusteropsError:
                    pass
            raise
        pool.shutdown(wait=True)
        return results

    def _collect(self, pending: Dict[int, str], submitted_at: Dict[int, float], done: Progress,
                 lock: threading.Lock, top_up: Callable[[], None], more: Callable[[], bool]) -> None:
        ended_at: Dict[int, Tuple[float, str]] = {}   # job gone without a result: when, state
        next_squeue = self.clock() + self.squeue_every_s
        while True:
            top_up()
            with lock:
                snapshot = dict(pending)
            if not snapshot and not more():
                break
            for jid in self._finished(snapshot):
                with lock:
                    node = pending.pop(jid)
                done(self._read_result(jid, node, self.clock() - submitted_at[jid]))
                snapshot.pop(jid)
            now = self.clock()
            late = {j: n for j, n in snapshot.items() if now - submitted_at[j] >= self.timeout_s}
            if late:
                with lock:
                    for j in late:
                        pending.pop(j, None)
                self._expire(late, submitted_at, done)
                for j in late:
                    snapshot.pop(j)
            if snapshot and now >= next_squeue:
                next_squeue = now + self.squeue_every_s
                for jid, state in self._ended_without_result(snapshot).items():
                    ended_at.setdefault(jid, (now, state))
            for jid, (when, state) in list(ended_at.items()):
                if jid in snapshot and now - when >= self.end_grace_s and not self._has_result(jid):
                    with lock:
                        node = pending.pop(jid)
                    ended_at.pop(jid)
                    done(NodeResult(node, "unreachable", probe="sweep", job_id=jid,
                                    detail=_one_line(f"check job {jid} ended ({state}) without a result"
                                                     f"{self._err_tail(jid)}")))
            self.sleep(self.poll_s)

    # -- helpers --
    def _has_result(self, jid: int) -> bool:
        return (self.work_dir / f"{jid}.done").exists()

    def _finished(self, pending: Mapping[int, str]) -> List[int]:
        found = []
        with os.scandir(self.work_dir) as it:
            for e in it:
                if e.name.endswith(".done"):
                    stem = e.name[:-5]
                    if stem.isdigit() and int(stem) in pending:
                        found.append(int(stem))
        return found

    def _err_tail(self, jid: int) -> str:
        for name in (f"{jid}.err", f"{jid}.slurm.out"):
            try:
                text = (self.work_dir / name).read_text(errors="replace").strip()
            except OSError:
                continue
            if text:
                return ": " + _one_line(text.splitlines()[-1], 160)
        return ""

    def _read_result(self, jid: int, node: str, latency_s: float) -> NodeResult:
        meta = (self.work_dir / f"{jid}.done").read_text(errors="replace")
        first = meta.split("\n", 1)[0].strip()
        rc = int(first) if first.lstrip("-").isdigit() else None
        raw = (self.work_dir / f"{jid}.json").read_text(errors="replace")
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        err = ""
        try:
            err = (self.work_dir / f"{jid}.err").read_text(errors="replace")
        except OSError:
            pass
        r = result_from_check(node, doc, rc, stderr=err)
        r.cpu_s = parse_times(meta)
        r.job_id = jid
        r.latency_s = round(latency_s, 3)
        if isinstance(doc, Mapping) and doc.get("node") and doc.get("node") != node:
            log.info("check for %s reported node %s", node, doc.get("node"))
        return r

    def _ended_without_result(self, pending: Mapping[int, str]) -> Dict[int, str]:
        """Jobs Slurm says are over (or no longer knows) that left no result file."""
        try:
            infos = {j.job_id: j for j in self.slurm.jobs(list(pending))}
        except ClusteropsError as e:
            log.warning("squeue failed during the sweep: %s", e)
            return {}
        gone = {}
        for jid in pending:
            info = infos.get(jid)
            if info is None:
                gone[jid] = "gone"
            elif info.category in ("done", "failed"):
                gone[jid] = info.state
        return gone

    def _expire(self, pending: Dict[int, str], submitted_at: Mapping[int, float], done: Progress) -> None:
        """Deadline passed: cancel what is left; never call it healthy."""
        try:
            infos = {j.job_id: j for j in self.slurm.jobs(list(pending))}
        except ClusteropsError:
            infos = {}
        for jid, node in pending.items():
            info = infos.get(jid)
            try:
                self.slurm.cancel(jid)
            except ClusteropsError as e:
                log.info("cancel %s: %s", jid, e)
            if self._has_result(jid):   # finished in the last moment
                done(self._read_result(jid, node, self.clock() - submitted_at[jid]))
                continue
            if info is not None and info.category == "pending":
                detail = f"check job {jid} never started within {self.timeout_s:g}s ({info.reason or 'pending'})"
            else:
                detail = f"no result within {self.timeout_s:g}s (check job {jid} cancelled)"
            done(NodeResult(node, "unreachable", detail=detail, probe="sweep", job_id=jid))


# -- SSH fan-out adapter ---------------------------------------------------------------

def ssh_fanout(targets: Sequence[str], argv: Sequence[str], opts: "SweepOptions",
               on_result: Optional[Progress] = None) -> Dict[str, NodeResult]:
    from clusterops.sweep import ssh as sshfan

    results: Dict[str, NodeResult] = {}
    lock = threading.Lock()
    # bash's `times` gives the check's CPU time, as in Slurm jobs.
    command = "{ " + shlex.join(list(argv)) + "; rc=$?; times >&2; exit $rc; }"
    remote = shlex.join(["bash", "-c", command])

    def one(res: "sshfan.RemoteResult") -> None:
        if res.error:
            r = NodeResult(res.host, "unreachable", detail=_one_line(f"ssh: {res.error}"), probe="ssh",
                           latency_s=round(res.duration_s, 3))
        else:
            try:
                doc = json.loads(res.stdout)
            except ValueError:
                doc = None
            r = result_from_check(res.host, doc, res.exit_code, stderr=res.stderr)
            r.cpu_s = parse_times("\n".join(res.stderr.strip().splitlines()[-2:]))
            r.latency_s = round(res.duration_s, 3)
        with lock:
            results[r.node] = r
        if on_result:
            on_result(r)

    sshfan.fan_out(list(targets), remote, sshfan.SSHOptions(
        concurrency=opts.concurrency, timeout_s=opts.timeout_s, connect_timeout_s=opts.connect_timeout_s,
        accept_new_hosts=opts.accept_new_hosts, ssh_config=opts.ssh_config, known_hosts=opts.known_hosts,
        key_filename=opts.ssh_key, user=opts.ssh_user, port=opts.ssh_port), on_result=one)
    return results


# -- reservations (rechecking nodes we drained) --------------------------------------------

def create_reservation(slurm, name: str, nodes: str, minutes: int) -> None:
    """A maintenance reservation so a drained node can be resumed for its check without a
    user's job landing on it in between."""
    slurm.create_reservation(name, nodes, minutes=minutes, users=getpass.getuser(), flags="MAINT,IGNORE_JOBS")


def delete_reservation(slurm, name: str) -> None:
    slurm.delete_reservation(name)


# -- the sweep ---------------------------------------------------------------------

@dataclass
class SweepOptions:
    partition: Optional[str] = None
    nodes: Optional[str] = None            # hostlist
    profile: str = "fast"
    via: str = "slurm"                     # slurm | ssh
    concurrency: int = 32                  # ssh sessions / parallel sbatch calls
    max_running: int = 0                   # Slurm: check jobs in flight at once (0: all)
    drain: bool = False
    max_drain_fraction: float = 0.1
    dry_run: bool = False
    timeout_s: float = 300.0               # per check (Slurm: from submission)
    connect_timeout_s: float = 10.0
    pairs: bool = False
    flap_k: int = 3
    flap_n: int = 5
    straggler_tolerance: float = 0.10
    drain_stragglers: bool = False
    recheck_drained: bool = True           # resume-check nodes clusterops drained (Slurm, not dry-run)
    check_cmd: Optional[List[str]] = None
    work_dir: Optional[str] = None
    keep_work_dir: bool = False
    accept_new_hosts: bool = False
    ssh_config: Optional[str] = None
    known_hosts: Optional[str] = None
    ssh_key: Optional[str] = None
    ssh_user: Optional[str] = None
    ssh_port: Optional[int] = None

    def validate(self) -> None:
        if self.partition and self.nodes:
            raise InputError("--partition and --nodes: give one or the other")
        if self.via not in ("slurm", "ssh"):
            raise InputError(f"--via: must be slurm or ssh, got {self.via!r}")
        if self.concurrency < 1:
            raise InputError(f"--concurrency: must be at least 1, got {self.concurrency}")
        if self.max_running < 0:
            raise InputError(f"--max-running: must be 0 (no cap) or more, got {self.max_running}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise InputError(f"--timeout: must be positive and at most {MAX_TIMEOUT_S:g} s, got {self.timeout_s}")
        if not 0 <= self.max_drain_fraction <= 1:
            raise InputError(f"--max-drain-fraction: must be between 0 and 1, got {self.max_drain_fraction}")
        if not 1 <= self.flap_k <= self.flap_n:
            raise InputError(f"--flap-k/--flap-n: need 1 <= k <= n, got k={self.flap_k} n={self.flap_n}")
        if not 0 <= self.straggler_tolerance < 1:
            raise InputError(f"--straggler-tolerance: must be in [0, 1), got {self.straggler_tolerance}")
        if not 0 < self.connect_timeout_s <= MAX_TIMEOUT_S:
            raise InputError(f"--connect-timeout: must be positive and at most {MAX_TIMEOUT_S:g} s, "
                             f"got {self.connect_timeout_s}")
        if self.flap_n > 1000:
            raise InputError(f"--flap-n: at most 1000 sweeps, got {self.flap_n}")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise InputError(f"--ssh-port: must be 1..65535, got {self.ssh_port}")
        if self.drain_stragglers and not self.drain:
            raise InputError("--drain-stragglers: needs --drain")
        if self.check_cmd is not None and not self.check_cmd:
            raise InputError("--check-cmd: empty command")
        if self.pairs and self.via != "slurm":
            raise InputError("--pairs: needs --via slurm (pairs run as 2-node Slurm jobs)")
        if self.work_dir is not None and Path(self.work_dir).exists() and not Path(self.work_dir).is_dir():
            raise InputError(f"--work-dir: {self.work_dir} exists and is not a directory")
        if self.via == "ssh":
            for flag, value in (("--ssh-key", self.ssh_key), ("--ssh-config", self.ssh_config)):
                if value is not None and not Path(os.path.expanduser(value)).is_file():
                    raise InputError(f"{flag}: {value}: no such file")
            if self.known_hosts is not None and Path(os.path.expanduser(self.known_hosts)).is_dir():
                raise InputError(f"--known-hosts: {self.known_hosts} is a directory")
        if self.nodes is not None:
            expand_nodes(self.nodes)

    def validate_profile(self) -> None:
        """The profile must load here (name or file, with the site config) before any node
        is asked to run it; a wrapped check (--check-cmd) is the site's own business."""
        if self.check_cmd:
            return
        from clusterops.health import load_profile

        load_profile(self.profile)


def expand_nodes(text: str) -> List[str]:
    import hostlist

    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as e:
        raise InputError(f"--nodes: bad hostlist {text!r}: {e}") from None
    except (ValueError, MemoryError, OverflowError) as e:
        raise InputError(f"--nodes: bad hostlist {text!r}: {e}") from None
    if not names:
        raise InputError("--nodes: empty hostlist")
    if len(names) > MAX_TARGETS:
        raise InputError(f"--nodes: {len(names)} nodes is more than one sweep takes ({MAX_TARGETS})")
    return unique(names)


def unique(names: Iterable[str]) -> List[str]:
    """Names in first-seen order, each once (a node listed twice is checked once)."""
    return list(dict.fromkeys(names))


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
        return c

    def node_order(self) -> List[str]:
        return sorted(self.results, key=_natural_key)

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
                     drain: bool) -> Tuple[List[dict], List[str]]:
    """Carry out the plan, one node at a time so one refusal does not stop the rest.

    ``rechecked`` nodes were drained by clusterops and resumed (inside a maintenance
    reservation) only for their check: each goes back to drained unless the plan
    resumes it and ``drain`` (the --drain flag) allows changes. Without ``drain``
    nothing else is touched.
    """
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
            slurm.drain([n], reason)
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
                slurm.drain([a.node], a.reason)
            else:
                slurm.resume([a.node])
            applied.append({"node": a.node, "action": a.action, "reason": a.reason})
        except ClusteropsError as e:
            errors.append(f"{a.action} {a.node}: {e}")
    return applied, errors


def _setup(opts: SweepOptions, slurm, errors: List[str]):
    """Slurm client, target names and their Slurm states, before any check runs."""
    if slurm is None:
        from clusterops.slurm import Slurm

        if opts.via == "slurm" or opts.partition or not opts.nodes:
            slurm = Slurm.from_environment()
        else:
            # SSH mode is also for when Slurm itself is broken: ask it once, briefly; without
            # an answer the sweep still runs, it just cannot skip busy nodes or drain.
            slurm = Slurm.from_environment(timeout_s=10, read_attempts=1)
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


def run_sweep(opts: SweepOptions, *, slurm=None, history=None, on_result: Optional[Progress] = None,
              on_targets: Optional[Callable[[int], None]] = None, clock: Callable[[], float] = time.time
              ) -> SweepReport:
    """One sweep: select, check, judge, (drain), record. Returns the report; never raises
    for a node's failure, only for bad input or an unusable Slurm."""
    opts.validate()
    sweep_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock())) + "-" + uuid.uuid4().hex[:6]
    started = clock()
    errors: List[str] = []
    try:
        slurm, names, infos = _setup(opts, slurm, errors)
    except InputError:
        raise
    except ClusteropsError as e:
        # Nothing was checked: no Slurm, an unknown/empty partition, no node list.
        raise SweepCannotRun(f"sweep could not run: {e.message}") from None
    check, recheck, skipped = _classify_targets(names, infos, opts)
    results: Dict[str, NodeResult] = dict(skipped)
    if on_targets:
        on_targets(len(names))
    for r in skipped.values():
        if on_result:
            on_result(r)
    argv = check_argv(opts.profile, opts.check_cmd)
    reservation = None
    # Slurm mode: the check jobs write their results here, so on a real cluster this must
    # be on a filesystem the nodes share (--work-dir); the default suits one machine.
    if opts.work_dir:
        work = Path(opts.work_dir) / sweep_id
    else:
        work = Path(tempfile.mkdtemp(prefix=f"clusterops-sweep-{sweep_id}-"))
    try:
        if opts.via == "slurm":
            targets = [Target(n, opts.partition or _first_partition(infos.get(n))) for n in check]
            if recheck:
                import hostlist

                reservation = f"clusterops-sweep-{sweep_id}"
                minutes = max(2, int(opts.timeout_s // 60) + 2)
                try:
                    create_reservation(slurm, reservation, hostlist.collect_hostlist(recheck), minutes)
                    slurm.resume(recheck)
                    targets += [Target(n, opts.partition or _first_partition(infos.get(n)), reservation)
                                for n in recheck]
                except ClusteropsError as e:
                    errors.append(f"could not recheck drained nodes {','.join(recheck)}: {e}")
                    _restore_drains(slurm, recheck, infos, errors)
                    reservation_cleanup(slurm, reservation, errors)
                    reservation = None
                    for n in recheck:
                        results[n] = NodeResult(n, "skipped", detail=f"drained by clusterops "
                                                f"({infos[n].reason}); recheck failed")
                    recheck = []
            fan = SlurmFanout(slurm, argv, work, timeout_s=opts.timeout_s,
                              submit_concurrency=min(opts.concurrency, 16), max_running=opts.max_running)
            results.update(fan.run(targets, on_result))
        else:
            results.update(ssh_fanout(check, argv, opts, on_result))
        medians = mark_stragglers(results, opts.straggler_tolerance)
        pair_results: List[dict] = []
        if opts.pairs and opts.via == "slurm":
            # Rechecked nodes sit in the sweep's maintenance reservation: not paired.
            pair_results = run_pairs(slurm, {n: r for n, r in results.items() if n not in recheck},
                                     opts, work, errors)
        snaps = {n: NodeSnapshot.from_info(i) for n, i in infos.items()}
        try:
            history_fail = history.fail_history([n for n, r in results.items() if r.checked], opts.flap_n) \
                if history is not None else {}
        except ClusteropsError as e:
            # Without the history the flapping rule cannot be applied: change no node.
            raise SweepCannotRun(f"sweep could not read its history: {e.message}; no node changed") from None
        plan = plan_drains(snaps, results, history_fail, max_drain_fraction=opts.max_drain_fraction,
                           flap_k=opts.flap_k, flap_n=opts.flap_n, drain_stragglers=opts.drain_stragglers)
        applied: List[dict] = []
        if slurm is not None and not opts.dry_run:
            done_, errs = apply_sweep_plan(slurm, plan, recheck, infos, drain=opts.drain)
            applied += done_
            errors += errs
        recheck = []      # restored: nothing left to undo
        finished = clock()
        report = SweepReport(sweep_id, started, finished, _opts_dict(opts), list(names), results, medians,
                             plan, applied, errors, pair_results)
        report.exit_code = _exit_code(report, opts)
        if history is not None:
            try:
                history.record(report)
            except ClusteropsError as e:
                report.errors.append(f"history not recorded: {e.message}")
                report.exit_code = EXIT_CANNOT_RUN
        return report
    except BaseException:
        if recheck and slurm is not None and not opts.dry_run:
            _restore_drains(slurm, recheck, infos, errors)
        raise
    finally:
        if reservation:
            reservation_cleanup(slurm, reservation, errors)
        if not opts.keep_work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _restore_drains(slurm, nodes: Sequence[str], infos: Mapping[str, object], errors: List[str]) -> None:
    for n in nodes:
        try:
            slurm.drain([n], infos[n].reason or drain_reason("recheck", "interrupted"))
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


# -- pairs ------------------------------------------------------------------------

def run_pairs(slurm, results: Mapping[str, NodeResult], opts: SweepOptions, work: Path,
              errors: List[str]) -> List[dict]:
    """2-node all-reduce on pairs of healthy nodes (``clusterops health dist``), so a bad
    link shows up, not only a bad node. Each pair is one 2-node exclusive job."""
    healthy = sorted((n for n, r in results.items() if r.healthy), key=_natural_key)
    pairs = [(healthy[i], healthy[i + 1]) for i in range(0, len(healthy) - 1, 2)]
    if not pairs:
        return []
    pair_dir = work / "pairs"
    pair_dir.mkdir(parents=True, exist_ok=True)
    minutes = max(1, int((opts.timeout_s + 59) // 60))
    base = clusterops_argv()
    script = pair_dir / "pair.sh"
    dist = base + ["health", "dist", "--timeout-s", str(max(10, int(opts.timeout_s * 0.8))),
                   "--size", "16M", "--warmup", "2", "--iters", "5"]
    script.write_text(
        "#!/bin/bash\n# clusterops sweep: 2-node all-reduce over one pair (rank 0 writes the report)\n"
        f"out={shlex.quote(str(pair_dir))}/\"$SLURM_JOB_ID\"\n"
        # Rendezvous on the first node's Slurm address (NodeAddr): node names need not resolve.
        "first=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
        "addr=$(scontrol show node --oneliner \"$first\" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)\n"
        "export MASTER_ADDR=\"${addr:-$first}\"\n"
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {shlex.join(dist)} "
        "--result-dir \"$out.d\" --report \"$out.json\" >\"$out.out\" 2>\"$out.err\"\nrc=$?\n"
        "echo \"$rc\" >\"$out.meta.part\"\nmv -f \"$out.meta.part\" \"$out.done\"\n")
    jobs: Dict[int, Tuple[str, str]] = {}
    for a, b in pairs:
        try:
            jid = slurm.submit(script, args=[f"--nodelist={a},{b}", "--nodes=2", "--ntasks-per-node=1",
                                             "--exclusive", f"--time={minutes}", "--no-requeue",
                                             "--job-name=clusterops-sweep-pair",
                                             f"--output={pair_dir}/%j.slurm.out"]
                             + ([f"--partition={opts.partition}"] if opts.partition else []))
            jobs[jid] = (a, b)
        except ClusteropsError as e:
            errors.append(f"pair {a},{b}: submit failed: {e}")
    deadline = time.monotonic() + opts.timeout_s
    out: List[dict] = []
    while jobs and time.monotonic() < deadline:
        for jid in [j for j in jobs if (pair_dir / f"{j}.done").exists()]:
            a, b = jobs.pop(jid)
            rc_text = (pair_dir / f"{jid}.done").read_text().strip()
            try:
                doc = json.loads((pair_dir / f"{jid}.json").read_text())
            except (OSError, ValueError):
                doc = None
            status = "pass" if rc_text == "0" else "fail"
            busbw, detail = None, ""
            if isinstance(doc, Mapping):
                busbw = doc.get("busbw_gbps")
                detail = _one_line(doc.get("detail") or "")
            elif status != "pass":
                try:
                    detail = _one_line((pair_dir / f"{jid}.err").read_text(errors="replace")[-300:])
                except OSError:
                    detail = f"exit {rc_text}, no report"
            out.append({"nodes": [a, b], "status": status, "busbw_gbps": busbw, "job_id": jid,
                        "detail": detail})
        time.sleep(0.3)
    for jid, (a, b) in jobs.items():
        try:
            slurm.cancel(jid)
        except ClusteropsError:
            pass
        out.append({"nodes": [a, b], "status": "unreachable", "busbw_gbps": None, "job_id": jid,
                    "detail": f"no result within {opts.timeout_s:g}s"})
    return out
