"""The tests' stand-ins for Slurm and for the runner, one place for all of them.

``FakeSlurm`` offers every method of ``clusterops.slurm.api.SlurmAPI`` with the Protocol's
exact signature (tests/test_layout.py compares them, and those of every ``FakeSlurm``
subclass here): each call is recorded in ``calls``, reads answer from ``node_infos`` and
``job_infos``, and what a test has not scripted raises ``UnexpectedCall``. The subclasses
are the scripted worlds of the fast tests: ``SweepSlurm`` (a sweep's check jobs answering on
a fake clock), ``PairSlurm`` (the --pairs jobs), ``FleetSlurm`` (an in-memory controller
for the drain guard), ``StepSlurm`` (a supervised job's steps), ``RecordingSlurm``
(a launch's submit) and ``FlakySlurm`` (a controller that times out on chosen calls).
``ScriptedRunner`` is the runner stand-in (``run`` with ``Runner.run``'s signature): each
call answers with the next scripted outcome, or from ``answer(argv)``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from clusterops.errors import NotFoundError
from clusterops.runner import CommandError, Completed
from clusterops.slurm.api import Nodes, SlurmError, SlurmUnavailable, pick_node
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import categorize


class UnexpectedCall(AssertionError):
    """The code under test asked the fake for something the test did not script."""


def _names(nodes: Nodes) -> List[str]:
    import hostlist

    return hostlist.expand_hostlist(nodes) if isinstance(nodes, str) else list(nodes)


class FakeSlurm:
    """Every ``SlurmAPI`` method, recorded; reads from ``node_infos`` / ``job_infos``."""

    backend = "fake"

    def __init__(self, nodes: Iterable[NodeInfo] = (), jobs: Iterable[JobInfo] = ()):
        self.node_infos = list(nodes)
        self.job_infos = list(jobs)
        self.calls: List[tuple] = []

    def _unexpected(self, what: str):
        raise UnexpectedCall(f"{type(self).__name__}: unexpected {what}")

    # -- versions and configuration
    def version(self) -> Tuple[int, ...]:
        self._unexpected("version()")

    def show_config(self) -> str:
        self._unexpected("show_config()")

    def admin_level_text(self, user: str) -> str:
        self._unexpected(f"admin_level_text({user!r})")

    def controller_version(self) -> Tuple[int, ...]:
        self._unexpected("controller_version()")

    def topology(self) -> Dict[str, str]:
        self._unexpected("topology()")

    # -- jobs
    def submit(self, script: Union[str, os.PathLike, None] = None, args: Sequence[str] = (), *,
               text: Optional[str] = None, workdir: Optional[str] = None) -> int:
        self._unexpected(f"submit({script!r}, {list(args)!r})")

    def jobs(self, job_ids: Optional[Iterable[int]] = None) -> List[JobInfo]:
        ids = None if job_ids is None else {int(j) for j in job_ids}
        self.calls.append(("jobs", None if ids is None else sorted(ids)))
        return [j for j in self.job_infos if ids is None or j.job_id in ids]

    def job(self, job_id: Union[int, str]) -> JobInfo:
        self.calls.append(("job", job_id))
        for j in self.job_infos:
            if str(j.job_id) == str(job_id):
                return j
        raise NotFoundError(f"job {job_id} not found")

    def job_tasks(self, job_id: Union[int, str]) -> List[JobInfo]:
        self.calls.append(("job_tasks", job_id))
        return [j for j in self.job_infos if str(j.job_id) == str(job_id) or str(j.array_job_id) == str(job_id)]

    def requeue(self, job_id: Union[int, str], *, hold: bool = False) -> None:
        self.calls.append(("requeue", job_id))

    def hold(self, job_id: Union[int, str]) -> None:
        self.calls.append(("hold", job_id))

    def release(self, job_id: Union[int, str]) -> None:
        self.calls.append(("release", job_id))

    def update_job(self, job_id: Union[int, str], **fields: object) -> None:
        self.calls.append(("update_job", job_id, dict(fields)))

    def cancel(self, job_id: Union[int, str], *, signal: Union[str, int, None] = None,
               batch: bool = False, full: bool = False, step: Optional[int] = None) -> None:
        self.calls.append(("cancel", job_id, signal, step))

    def signal(self, job_id: Union[int, str], sig: Union[str, int], *, batch: bool = False,
               full: bool = False, step: Optional[int] = None) -> None:
        self.cancel(job_id, signal=sig, batch=batch, full=full, step=step)

    def steps(self, job_id: Union[int, str]) -> List[Tuple[str, str]]:
        self.calls.append(("steps", job_id))
        return []

    # -- nodes
    def node_address(self, name: str) -> str:
        self.calls.append(("node_address", name))
        return name

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        wanted = None if names is None else set(_names(names))
        self.calls.append(("nodes", None if wanted is None else tuple(sorted(wanted))))
        return [n for n in self.node_infos if wanted is None or n.name in wanted]

    def node_states(self) -> Dict[str, str]:
        self.calls.append(("node_states",))
        return {n.name: n.state.lower() for n in self.node_infos}

    def node(self, name: str) -> NodeInfo:
        return pick_node(self.nodes(name), name)

    def drain(self, nodes: Nodes, reason: str) -> None:
        self.calls.append(("drain", tuple(_names(nodes)), reason))

    def resume(self, nodes: Nodes) -> None:
        self.calls.append(("resume", tuple(_names(nodes))))

    def partition_nodes(self, partition: str) -> List[str]:
        self.calls.append(("partition_nodes", partition))
        names = [n.name for n in self.node_infos if partition in n.partitions]
        if not names:
            raise NotFoundError(f"partition {partition} has no nodes (or does not exist)")
        return names

    # -- reservations
    def create_reservation(self, name: str, nodes: Nodes, *, minutes: int, users: str,
                           flags: str = "MAINT,IGNORE_JOBS") -> None:
        self.calls.append(("create_reservation", name, tuple(_names(nodes)), minutes, users, flags))

    def delete_reservation(self, name: str) -> None:
        self.calls.append(("delete_reservation", name))


# ----------------------------------------------------------------------- sweep check jobs
TIMES = "0m0.010s 0m0.000s\n0m0.300s 0m0.100s\n"   # bash `times`: the shell, then its children


def _nodelist(args: Sequence[str]) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith("--nodelist="))


class SweepSlurm(FakeSlurm):
    """What the real Slurm does, seen from the sweep: ``submit`` takes the check script and
    pinned ``--nodelist``, hands out job ids, and, once the clock reaches a node's scripted
    answer time, leaves the files the real check script leaves (``<jobid>.json``, ``.err``,
    then ``.done``); ``jobs`` answers the batched squeue with each job's scripted state.

    ``plan[node]``: ("answer", doc, rc, after_s) | ("hang", state) | ("refuse", message)
    | ("vanish", state, after_s): the job ends in ``state`` after ``after_s`` without a result."""

    def __init__(self, plan, clock=None, nodes=()):
        super().__init__(nodes)
        self.plan = plan
        self.clock = clock or time.monotonic
        self.lock = threading.Lock()
        self.next_id = 100
        self.submitted = {}        # job id -> (node, args, submitted at, work dir)
        self.submit_calls = []     # (script, args)
        self.jobs_calls = []       # the job ids asked about, per call
        self.cancelled = []
        self.drained = []
        self.resumed = []
        self.answered = set()
        self.in_flight_max = 0

    def submit(self, script: Union[str, os.PathLike, None] = None, args: Sequence[str] = (), *,
               text: Optional[str] = None, workdir: Optional[str] = None) -> int:
        node = _nodelist(args)
        with self.lock:
            self.submit_calls.append((Path(script), list(args)))
            what = self.plan[node]
            if what[0] == "refuse":
                raise SlurmError(f"sbatch: error: {what[1]}")
            jid = self.next_id
            self.next_id += 1
            self.submitted[jid] = (node, list(args), self.clock(), Path(script).parent)
            live = len(self.submitted) - len(self.answered) - len(self.cancelled)
            self.in_flight_max = max(self.in_flight_max, live)
        self.advance(self.clock())
        return jid

    def jobs(self, job_ids: Optional[Iterable[int]] = None) -> List[JobInfo]:
        ids = list(job_ids or self.submitted)
        self.jobs_calls.append(ids)
        out = []
        for jid in ids:
            state = self._state(jid, self.clock())
            if state is not None:
                out.append(JobInfo(jid, "clusterops-sweep", state, categorize(state),
                                   reason="Resources" if state == "PENDING" else None))
        return out

    def cancel(self, job_id: Union[int, str], *, signal: Union[str, int, None] = None,
               batch: bool = False, full: bool = False, step: Optional[int] = None) -> None:
        self.cancelled.append(job_id)

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        return [n for n in self.node_infos if names is None or n.name in names]

    def drain(self, nodes: Nodes, reason: str) -> None:
        self.drained.append((list(nodes), reason))

    def resume(self, nodes: Nodes) -> None:
        self.resumed.append(list(nodes))

    def _state(self, jid, now):
        node, _args, at, _work = self.submitted[jid]
        what = self.plan[node]
        if jid in self.cancelled:
            return "CANCELLED"
        if what[0] == "answer":
            return "COMPLETED" if now - at >= what[3] else "RUNNING"
        if what[0] == "hang":
            return what[1]
        if what[0] == "vanish":
            if now - at < what[2]:
                return "RUNNING"
            return None if what[1] == "gone" else what[1]
        return None

    def advance(self, now):
        """The jobs whose answer time has come leave their files, as check.sh does."""
        with self.lock:
            due = [(jid, rec) for jid, rec in self.submitted.items()
                   if jid not in self.answered and self.plan[rec[0]][0] == "answer"
                   and now - rec[2] >= self.plan[rec[0]][3]]
            self.answered.update(jid for jid, _ in due)
        for jid, (node, _args, _at, work) in due:
            _kind, doc, rc, _after = self.plan[node]
            (work / f"{jid}.json").write_text(json.dumps(dict(doc, node=node)))
            (work / f"{jid}.err").write_text("")
            (work / f"{jid}.done").write_text(f"{rc}\n{TIMES}")


class PairSlurm(FakeSlurm):
    """The --pairs jobs: a pair named in ``answers`` ("node1,node2" -> its result document)
    answers at once, as pair.sh would leave it (with its ``ib`` entry, the ibbw step's
    ``server.json``/``client.json``); any other pair stays silent."""

    def __init__(self, answers: Mapping[str, dict], first_id: int = 500):
        super().__init__()
        self.answers, self.first_id = dict(answers), first_id
        self.submitted: Dict[int, tuple] = {}
        self.cancelled: List = []

    def submit(self, script: Union[str, os.PathLike, None] = None, args: Sequence[str] = (), *,
               text: Optional[str] = None, workdir: Optional[str] = None) -> int:
        jid = self.first_id + len(self.submitted)
        nodes = _nodelist(args)
        self.submitted[jid] = (Path(script), list(args))
        if nodes in self.answers:
            pair_dir = Path(script).parent
            answer = dict(self.answers[nodes])
            ib = answer.pop("ib", None)          # {"server": {...}, "client": {...}}: the ibbw step's files
            (pair_dir / f"{jid}.json").write_text(json.dumps(answer))
            if ib:
                (pair_dir / f"{jid}.ib").mkdir()
                for role, doc in ib.items():
                    (pair_dir / f"{jid}.ib" / f"{role}.json").write_text(json.dumps(doc))
            (pair_dir / f"{jid}.done").write_text("0\n")
        return jid

    def cancel(self, job_id: Union[int, str], *, signal: Union[str, int, None] = None,
               batch: bool = False, full: bool = False, step: Optional[int] = None) -> None:
        self.cancelled.append(job_id)


# --------------------------------------------------------------------- a fleet to drain
class FleetSlurm(FakeSlurm):
    """An in-memory controller for ``apply_drain``: drains stamp the controller's second as
    the reason time (as slurmctld does), resumes clear the drain. Every call is recorded."""

    def __init__(self, n, *, clock, partitions=("gpu",)):
        super().__init__()
        self.clock = clock
        self.state = {f"n{i:02d}": {"drained": False, "down": False, "reason": None, "time": None}
                      for i in range(1, n + 1)}
        self.partitions = partitions
        self.calls = []
        self.fail_reads = False

    def _info(self, name):
        s = self.state[name]
        flags = frozenset({"DRAIN"}) if s["drained"] else frozenset()
        return NodeInfo(name, "down" if s["down"] else "idle", flags, s["reason"], "root",
                        s["time"], partitions=self.partitions)

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        self.calls.append("nodes")
        if self.fail_reads:
            raise SlurmUnavailable("Slurm did not answer after 2 attempts")
        return [self._info(n) for n in self.state]

    def drain(self, nodes: Nodes, reason: str) -> None:
        self.calls.append("drain")
        for n in nodes:
            self.state[n].update(drained=True, reason=reason, time=float(int(self.clock())))

    def resume(self, nodes: Nodes) -> None:
        self.calls.append("resume")
        if self.fail_reads:       # Slurm.resume reads the reasons before it writes
            raise SlurmUnavailable("Slurm did not answer after 2 attempts")
        for n in nodes:
            self.state[n].update(drained=False, reason=None, time=None)

    def drained(self):
        return sorted(n for n, s in self.state.items() if s["drained"])



# ------------------------------------------------------------------ a supervised job's steps
def opt(argv: Sequence[str], name: str) -> Optional[str]:
    """The value of ``--name=value`` in an argv, or None."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), None)


class StepSlurm(FakeSlurm):
    """The Slurm a supervised job sees: ``world.step`` is the running training step (its
    ``attempt``, ``argv``, ``returncode``, ``killed()`` and ``usr2``); ``cancel`` of that step
    with KILL kills it, with USR2 sets its flag; ``requeue`` sets ``world.requeued`` (or raises
    ``requeue_error``, after taking the requeue when ``requeue_taken``); ``job`` carries
    ``preempt_time``, ``end_time``, ``restart_count`` and a state; ``nodes`` answers every node up (``ALLOCATED``)."""

    def __init__(self, world, nodes: Sequence[str]):
        super().__init__()
        self.world, self.all_nodes = world, list(nodes)
        self.preempt_time: Optional[float] = None
        self.end_time: Optional[float] = None      # the job's EndTime (start + time limit)
        self.restart_count = 0                     # Slurm's count, moved by a requeue taken
        # ``requeue`` raises this; with ``requeue_taken`` the controller took the requeue
        # first (scontrol killed as Slurm ends the batch step), else it did not.
        self.requeue_error: Optional[Exception] = None
        self.requeue_taken = True
        self.domains: Dict[str, str] = {}          # scontrol show topology (none by default)

    def topology(self) -> Dict[str, str]:
        self.calls.append(("topology",))
        return dict(self.domains)

    def job(self, job_id: Union[int, str]) -> JobInfo:
        self.calls.append(("job", job_id))
        return SimpleNamespace(job_id=int(job_id), preempt_time=self.preempt_time, end_time=self.end_time,
                               restart_count=self.restart_count, state_flags=(),
                               state="PENDING" if self.world.requeued else "RUNNING")

    def steps(self, job_id: Union[int, str]) -> List[Tuple[str, str]]:
        self.calls.append(("steps", job_id))
        s = self.world.step
        if s is None or s.returncode is not None:
            return []
        return [(str(s.attempt), opt(s.argv, "job-name"))]

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        self.calls.append(("nodes", tuple(names) if names else None))
        return [SimpleNamespace(name=n, is_down=False, drained=False, state="ALLOCATED", flags=frozenset(),
                                reason=None, partitions=("debug",)) for n in (names or self.all_nodes)]

    def node_address(self, name: str) -> str:
        self.calls.append(("node_address", name))
        return "10.0.0." + name[1:]

    def cancel(self, job_id: Union[int, str], *, signal: Union[str, int, None] = None,
               batch: bool = False, full: bool = False, step: Optional[int] = None) -> None:
        self.calls.append(("cancel", job_id, signal, step))
        s = self.world.step
        if s is not None and s.returncode is None and step == s.attempt:
            if signal == "KILL":
                s.killed()
            elif signal == "USR2":
                s.usr2 = True

    def requeue(self, job_id: Union[int, str], *, hold: bool = False) -> None:
        self.calls.append(("requeue", job_id))
        if self.requeue_error is None or self.requeue_taken:
            self.world.requeued = True
            self.restart_count += 1
        if self.requeue_error is not None:
            raise self.requeue_error


class FlakySlurm(FakeSlurm):
    """``FakeSlurm`` whose controller times out now and then: ``fail`` names, per method
    (``"job"``, ``"node"``, ``"requeue"``), which of its calls (1 = the first) raise
    ``SlurmUnavailable`` as a timed-out command does, and ``when(method)``, when given, makes
    any call it returns True for raise too; each call is recorded first, as ``FakeSlurm``
    records it, and ``failed`` lists the (method, call number) that raised."""

    def __init__(self, nodes: Iterable[NodeInfo] = (), jobs: Iterable[JobInfo] = (), *,
                 fail: Optional[Mapping[str, Iterable[int]]] = None,
                 when: Optional[Callable[[str], bool]] = None):
        super().__init__(nodes, jobs)
        self.fail = {k: set(v) for k, v in (fail or {}).items()}
        self.when = when
        self.counts: Dict[str, int] = {}
        self.failed: List[Tuple[str, int]] = []

    def _maybe_fail(self, what: str) -> None:
        n = self.counts[what] = self.counts.get(what, 0) + 1
        if n in self.fail.get(what, ()) or (self.when is not None and self.when(what)):
            self.failed.append((what, n))
            raise SlurmUnavailable(f"Slurm did not answer after 2 attempts: {what} timed out after 10 s")

    def job(self, job_id: Union[int, str]) -> JobInfo:
        found = super().job(job_id)
        self._maybe_fail("job")
        return found

    def node(self, name: str) -> NodeInfo:
        found = super().node(name)
        self._maybe_fail("node")
        return found

    def requeue(self, job_id: Union[int, str], *, hold: bool = False) -> None:
        self._maybe_fail("requeue")
        super().requeue(job_id, hold=hold)


class RecordingSlurm(FakeSlurm):
    """Slurm at ``submit``: records each submitted script's text, answers job 4242 (or
    raises ``fail``)."""

    def __init__(self, fail: Optional[Exception] = None):
        super().__init__()
        self.submitted: List[str] = []
        self.fail = fail

    def submit(self, script: Union[str, os.PathLike, None] = None, args: Sequence[str] = (), *,
               text: Optional[str] = None, workdir: Optional[str] = None) -> int:
        self.submitted.append(Path(script).read_text())
        if self.fail:
            raise self.fail
        return 4242


# ------------------------------------------------------------------------------ the runner
Outcome = Union[str, Completed, BaseException]


class ScriptedRunner:
    """A runner whose ``run`` answers each call with the next of ``outcomes`` (stdout text,
    a ``Completed``, or an exception to raise) or, with none left, with ``answer(argv)``;
    ``calls`` holds every argv. ``spawn`` is not scripted (a subclass adds it)."""

    def __init__(self, outcomes: Iterable[Outcome] = (), *, answer: Optional[Callable[[List[str]], Outcome]] = None,
                 env: Optional[Mapping[str, str]] = None):
        self.outcomes = list(outcomes)
        self.answer = answer
        self.env = dict(env or {})
        self.calls: List[List[str]] = []

    def run(self, argv: Sequence[str], *, timeout_s: Optional[float] = None, check: bool = True,
            input: Optional[str] = None, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
            unset: Iterable[str] = ()) -> Completed:
        argv = list(argv)
        self.calls.append(argv)
        if self.outcomes:
            out = self.outcomes.pop(0)
        elif self.answer is not None:
            out = self.answer(argv)
        else:
            raise UnexpectedCall(f"ScriptedRunner: unexpected run {argv}")
        if isinstance(out, BaseException):
            raise out
        if isinstance(out, Completed):
            return out
        return Completed(tuple(argv), 0, out, "", 0.01)

    def spawn(self, argv: Sequence[str], *, log_path: str, env: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, unset: Iterable[str] = ()):
        raise UnexpectedCall(f"ScriptedRunner: unexpected spawn {list(argv)}")


def replay(result: Mapping[str, object]) -> Callable[[List[str]], Outcome]:
    """An ``answer`` that replays one recorded command result (its stdout, stderr and exit
    code, as tests/fixtures/slurm records them)."""
    def answer(argv: List[str]) -> Outcome:
        if result["rc"] != 0:
            return CommandError(argv, result["rc"], result["stderr"] or result["stdout"])
        return Completed(tuple(argv), 0, result["stdout"], result["stderr"], 0.0)

    return answer


SLURM_FAKES = (FakeSlurm, SweepSlurm, PairSlurm, FleetSlurm, StepSlurm, RecordingSlurm, FlakySlurm)
RUNNER_FAKES = (ScriptedRunner,)
