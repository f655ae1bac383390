"""The sweep's Slurm fan-out: one short exclusive check job pinned to each node.

``SlurmFanout.run`` submits the jobs (a few ``sbatch`` calls in parallel, at most
``max_running`` in flight), and collects results from the per-job files the check
script (``scripts.check_script``) leaves in the shared work folder: it scans the folder
for ``<jobid>.done``, never polls per node, and asks Slurm about all its jobs in one call
only every ``squeue_every_s``, to notice jobs that ended without a result. A node whose
check does not come back within ``timeout_s`` of its submission is ``unreachable`` and
its job is cancelled; a refused submission is the sweep's ``error``, not the node's.
Slurm, the clock and the sleep are passed in (``slurm`` needs ``submit``, ``jobs`` and
``cancel``), so tests drive it without a cluster.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, TYPE_CHECKING, Tuple

from clusterops.errors import ClusteropsError
from clusterops.sweep import scripts
from clusterops.sweep.results import NodeResult, one_line, parse_times, result_from_check

if TYPE_CHECKING:   # annotations only: the Slurm layer is imported where it is used
    from clusterops.slurm.api import SlurmAPI

log = logging.getLogger(__name__)


@dataclass
class Target:
    """A node to check, and where its job must run (partition, maintenance reservation)."""
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

    def __init__(self, slurm: SlurmAPI, argv: Sequence[str], work_dir: Path, *, timeout_s: float = 300.0,
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
        path.write_text(scripts.check_script(self.work_dir, self.argv))
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
                    done(NodeResult(t.node, "error", detail=one_line(f"submit failed: {e}"), probe="sweep"))
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
                                    detail=one_line(f"check job {jid} ended ({state}) without a result"
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
                return ": " + one_line(text.splitlines()[-1], 160)
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
