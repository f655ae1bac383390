"""The Slurm layer's declared interface, and the rules every backend keeps.

``SlurmAPI`` is the ``Protocol`` of a Slurm client: what the CLI backend
(``client.Slurm``) and the pyslurm backend (``pyslurm_backend.PyslurmSlurm``) both offer,
and what consumers annotate (``slurm: SlurmAPI``). tests/test_layout.py compares the
signature of every method here with both backends and with every fake in
tests/support/fakes.py.

The shared rules live here once and both backends call them: the node-list and signal
checks (``hostlist_of``, ``check_signal``), a drain reason that is one line and ours
(``check_drain_reason``), the refusal to resume a node someone else drained
(``refuse_foreign``), submit's script-or-text check (``submit_body``), and reads retried
with backoff (``Backoff``, ``retry_read``: one rule, one budget; the supervisor's node poll
schedules its own retries with the same ``Backoff`` and asks the client for one attempt).
The Slurm errors are defined here so the rules and both backends share them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import (Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple, TypeVar, Union,
                    runtime_checkable)

import hostlist

from clusterops.drains import is_foreign, is_ours
from clusterops.errors import ClusteropsError, InputError, NotFoundError
from clusterops.slurm.parse import JobInfo, NodeInfo

log = logging.getLogger(__name__)

Nodes = Union[str, Iterable[str]]
T = TypeVar("T")

_SIGNALS = {"HUP", "INT", "QUIT", "KILL", "USR1", "USR2", "TERM", "CONT", "STOP", "TSTP", "ALRM", "ABRT"}


class SlurmError(ClusteropsError):
    """A Slurm command refused what we asked (exit code 1)."""


class SlurmUnavailable(SlurmError):
    """The controller did not answer after the bounded retries."""


class SlurmConfigError(SlurmError):
    """No usable slurm.conf: retrying cannot help."""


class ForeignDrainError(ClusteropsError):
    """Asked to resume a node whose drain reason clusterops did not write."""


@runtime_checkable
class SlurmAPI(Protocol):
    """A Slurm client: the CLI tools (``client.Slurm``) or pyslurm (``PyslurmSlurm``)."""

    backend: str

    # -- versions and configuration
    def version(self) -> Tuple[int, ...]: ...
    def show_config(self) -> str: ...
    def admin_level_text(self, user: str) -> str: ...
    def controller_version(self) -> Tuple[int, ...]: ...
    def topology(self) -> Dict[str, str]: ...

    # -- jobs
    def submit(self, script: Union[str, os.PathLike, None] = None, args: Sequence[str] = (), *,
               text: Optional[str] = None, workdir: Optional[str] = None) -> int: ...
    def jobs(self, job_ids: Optional[Iterable[int]] = None) -> List[JobInfo]: ...
    def job(self, job_id: Union[int, str]) -> JobInfo: ...
    def job_tasks(self, job_id: Union[int, str]) -> List[JobInfo]: ...
    def requeue(self, job_id: Union[int, str], *, hold: bool = False) -> None: ...
    def hold(self, job_id: Union[int, str]) -> None: ...
    def release(self, job_id: Union[int, str]) -> None: ...
    def update_job(self, job_id: Union[int, str], **fields: object) -> None: ...
    def cancel(self, job_id: Union[int, str], *, signal: Union[str, int, None] = None,
               batch: bool = False, full: bool = False, step: Optional[int] = None) -> None: ...
    def cancel_pending(self, job_id: Union[int, str]) -> None: ...
    def signal(self, job_id: Union[int, str], sig: Union[str, int], *, batch: bool = False,
               full: bool = False, step: Optional[int] = None) -> None: ...
    def steps(self, job_id: Union[int, str]) -> List[Tuple[str, str]]: ...

    # -- nodes
    def node_address(self, name: str) -> str: ...
    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]: ...
    def node_states(self) -> Dict[str, str]: ...
    def node(self, name: str) -> NodeInfo: ...
    def drain(self, nodes: Nodes, reason: str) -> None: ...
    def resume(self, nodes: Nodes) -> None: ...
    def partition_nodes(self, partition: str) -> List[str]: ...

    # -- reservations
    def create_reservation(self, name: str, nodes: Nodes, *, minutes: int, users: str,
                           flags: str = "MAINT,IGNORE_JOBS") -> None: ...
    def delete_reservation(self, name: str) -> None: ...


def api_methods() -> List[str]:
    """The public method names of ``SlurmAPI``, in declaration order."""
    return [k for k, v in vars(SlurmAPI).items() if callable(v) and not k.startswith("_")]


# ------------------------------------------------------------------------- shared rules
def hostlist_of(nodes: Nodes) -> str:
    """A node list (a hostlist expression or names) as one compressed hostlist; none is an error."""
    names = hostlist.expand_hostlist(nodes) if isinstance(nodes, str) else list(nodes)
    if not names:
        raise InputError("no nodes given")
    return hostlist.collect_hostlist(names)


def own_job_ref(env: Optional[Mapping[str, str]] = None) -> str:
    """How Slurm commands name the batch job this process runs in: ``SLURM_JOB_ID``, or
    ``<array id>_<task id>`` for the task of a job array whose own id is the array's. The last
    task of an array to start takes over the array's record, and its id with it; a bare
    ``scontrol requeue <id>`` (or update, or show) then names every task of the array (seen on
    22.05 and 24.11: "requeue 2 ... 2_2-3: No error" from a chain's last generation). "" outside
    a job."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    array_id, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    if job_id and job_id == array_id and task.isdigit():
        return f"{array_id}_{task}"
    return job_id


def _excluded(current: Optional[str]) -> set:
    """The nodes of a job's ExcNodeList as Slurm shows it (empty, None or "(null)": none)."""
    return set(hostlist.expand_hostlist(current)) if current and current != "(null)" else set()


def widened_exclusion(current: Optional[str], add: Iterable[str]) -> Optional[str]:
    """The ExcNodeList that keeps a job off ``add`` as well as off what it already excludes
    (``current``: Slurm's hostlist, empty or None for none); None when ``add`` brings
    nothing new (then no update is needed)."""
    have = _excluded(current)
    new = {n for n in add if n} - have
    if not new:
        return None
    return hostlist.collect_hostlist(sorted(have | new))


class UnschedulableExclusion(ClusteropsError):
    """An exclusion that would leave a job's partition too few nodes to ever start it."""


def schedulable_exclusion(members: Iterable[str], current: Optional[str], exclude: Sequence[str],
                          lost: Sequence[str], need: int, partition: str = "") -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The nodes a requeued job can be kept off and still start again -> (exclude, dropped).

    ``members``: the nodes of the job's partition(s); ``current``: its ExcNodeList now;
    ``need``: the nodes it asks for. A job whose ExcNodeList leaves its partition fewer nodes
    than it asks for pends for ever (Slurm holds it with reason ReqNodeNotAvail whatever the
    nodes' states). Then the ``lost`` nodes (held only because Slurm lost them: Slurm keeps a
    DOWN node out by itself) are left off the list, and ``dropped`` names them; if that is
    still not enough, raise :class:`UnschedulableExclusion` naming the numbers."""
    have = _excluded(current)
    pool = set(members)
    lost_set = set(lost)

    def left(excl: Iterable[str]) -> int:
        return len(pool - have - set(excl))

    if left(exclude) >= need:
        return tuple(exclude), ()
    kept = tuple(n for n in exclude if n not in lost_set)
    if left(kept) >= need:
        return kept, tuple(n for n in exclude if n in lost_set)
    where = f"partition {partition}" if partition else "the job's partition"
    raise UnschedulableExclusion(
        f"keeping the job off {hostlist.collect_hostlist(sorted(have | set(exclude)))} leaves {where} "
        f"{left(kept)} of its {len(pool)} node(s), {need} needed: the requeued job could never start")


def exclude_from_requeued(slurm: "SlurmAPI", job_id: Union[int, str], nodes: Iterable[str],
                          current: Optional[str] = None, *, attempts: int = 3, pause_s: float = 0.3,
                          sleep: Callable[[float], None] = time.sleep) -> Optional[str]:
    """Keep a job that was just requeued off ``nodes`` (ExcNodeList, widened, never narrowed).

    Slurm accepts ExcNodeList only on a pending job ("Job is no longer pending execution" on
    a running one), so this is called right after ``requeue``: verified on Slurm 22.05.8, where
    the job reads COMPLETING but is pending underneath from the moment `scontrol requeue`
    returns, `scontrol update JobId=N ExcNodeList=...` from the dying batch script is taken
    (rc 0), and the next incarnation starts elsewhere. The batch script's SIGTERM has come by
    then, or is on its way: `scontrol requeue` returns before slurmd signals the batch step, so
    an update started at once can itself be killed by that SIGTERM (seen: exit -15, and the
    next incarnation back on the node). Setting the same list twice is harmless, so the update
    is tried ``attempts`` times, ``pause_s`` apart; all within KillWait, after which Slurm
    SIGKILLs the batch step. ``current``: the job's ExcNodeList read before the requeue (None:
    read it now). Returns the list set, or None when nothing changed; raises the last error.
    """
    if current is None:
        current = slurm.job(job_id).excluded_nodes
    value = widened_exclusion(current, nodes)
    if value is None:
        return None
    for attempt in range(attempts):
        try:
            slurm.update_job(job_id, ExcNodeList=value)
            return value
        except ClusteropsError:
            if attempt + 1 >= attempts:
                raise
            sleep(pause_s)
    return value


def check_signal(sig: Union[str, int]) -> str:
    """A signal as Slurm spells it (``USR1``, ``9``); an unknown one is an ``InputError``."""
    s = str(sig).upper()
    if s.startswith("SIG"):
        s = s[3:]
    if s.isdigit() or s in _SIGNALS:
        return s
    raise InputError(f"unknown signal {sig!r}")


def check_drain_reason(reason: str) -> None:
    """A drain reason clusterops writes: one line, and ours (``clusterops.drains.make_reason``)."""
    if not reason or "\n" in reason:
        raise InputError("a drain reason is required, on one line")
    if not is_ours(reason):
        raise InputError(f"drain reason {reason!r}: clusterops writes only reasons starting 'clusterops:'")


def refuse_foreign(infos: Iterable[NodeInfo]) -> None:
    """``ForeignDrainError`` (nothing resumed) when any node carries a reason clusterops did
    not write: the last line that never bends, whatever the caller decided."""
    foreign = [f"{n.name} ({n.reason!r})" for n in infos if is_foreign(n.reason)]
    if foreign:
        raise ForeignDrainError(f"not resuming {', '.join(foreign)}: drained by someone else; "
                                "an administrator resumes it with scontrol")


def submit_body(script: Union[str, os.PathLike, None], text: Optional[str]) -> Optional[Path]:
    """Submit's argument check: a script path or its text, exactly one; a path must exist.
    Returns the path (None for text)."""
    if (script is None) == (text is None):
        raise InputError("submit takes a script path or its text, not both")
    if script is None:
        return None
    path = Path(script)
    if not path.is_file():
        raise InputError(f"{path}: no such script")
    return path


def pick_node(infos: Iterable[NodeInfo], name: str) -> NodeInfo:
    """The record of node ``name`` among ``infos``; ``NotFoundError`` when absent."""
    for n in infos:
        if n.name == name:
            return n
    raise NotFoundError(f"node {name} not found")


# ------------------------------------------------------------------------------- retries
@dataclass(frozen=True)
class Backoff:
    """The one retry rule: the n-th pause is ``first_s * 2**n`` (at most ``cap_s``), and
    ``retry_read`` makes ``attempts`` tries. A caller that schedules its own retries (the
    supervisor's node poll, which never gives up) takes only ``delay``."""

    first_s: float
    attempts: int = 1
    cap_s: Optional[float] = None

    def delay(self, n: int) -> float:
        d = self.first_s * (2 ** n)
        return d if self.cap_s is None else min(d, self.cap_s)


class Retry(Exception):
    """Raised by one attempt of a read to say: this failure may pass, try again."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def retry_read(attempt: Callable[[], T], backoff: Backoff, *, what: str, sleep: Callable[[float], None],
               label: str = "") -> T:
    """``attempt()`` until it returns, at most ``backoff.attempts`` times, pausing between
    tries; an attempt raises ``Retry`` for a failure that may pass and anything else for one
    that will not (that propagates at once). Out of attempts: ``SlurmUnavailable`` naming the
    last failure (``label`` before it, when given)."""
    last: Optional[BaseException] = None
    for n in range(backoff.attempts):
        try:
            return attempt()
        except Retry as r:
            last = r.cause
        if n + 1 < backoff.attempts:
            delay = backoff.delay(n)
            log.info("%s failed (%s); retrying in %.1fs", what, last, delay)
            sleep(delay)
    raise SlurmUnavailable(f"Slurm did not answer after {backoff.attempts} attempts: "
                           f"{label + ': ' if label else ''}{last}")
