"""The job supervisor's decisions: a plain state machine, no side effects.

Events go in (preflight results, a step launched or exited, heartbeat snapshots, nodes
seen down, a stop requested, a checkpoint committed, clock ticks), actions come out
(run a preflight, launch the training step on these nodes, kill the step, capture
stacks, ask the ranks to stop, drain nodes, requeue, exit with a code, write a
timeline record). The clock is passed in with every event; nothing here reads the
time, touches a process, a file or Slurm. ``clusterops.supervisor.run`` is the thin
plumbing that turns actions into srun/scancel/scontrol calls and observations into
events.

Exit codes of ``clusterops supervise``: ``clusterops.exitcodes.Supervise`` (the ``--help``
epilog and the table in docs/supervisor.md are generated from it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from clusterops import drains, protocol, schema
from clusterops.exitcodes import Supervise as ExitCode
from clusterops.slurm.parse import FailureKind, TaskFailure
from clusterops.supervisor import stability as stb
from clusterops.supervisor.evidence import TaskOutput, first_error
from clusterops.supervisor.stragglers import Detector
from clusterops.supervisor.timeline import Cause, DomainSource, EventKind as E, Evidence

__all__ = [
    "EXIT_DONE",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_NO_PROGRESS",
    "EXIT_REQUEUE_BUDGET",
    "EXIT_RESTART_BUDGET",
    "EXIT_TOO_FEW_NODES",
    "EXIT_STOPPED_NO_REQUEUE",
    "EXIT_DIVERGED",
    "EXIT_ROLLBACK_BUDGET",
    "EXIT_SCRIPT_STOP",
    "EXIT_GENERATION_END",
    "EXIT_CHAIN_ENDED",
    "LIVENESS",
    "LOST_WHY",
    "Policy",
    "Event",
    "PreflightDone",
    "StepLaunched",
    "RanksMoved",
    "RankFailure",
    "StepExited",
    "Heartbeats",
    "NodesDown",
    "StopRequested",
    "CheckpointCommitted",
    "ResumeChosen",
    "RollbackPicked",
    "HangNamed",
    "RequeueFailed",
    "Tick",
    "Action",
    "Record",
    "RunPreflight",
    "Launch",
    "KillStep",
    "CaptureStacks",
    "RequestStop",
    "DrainNodes",
    "Requeue",
    "Exit",
    "SetAside",
    "PickRollback",
    "HoldCheckpoint",
    "ReplayPlan",
    "Memory",
    "Supervisor",
    "State",
    "StopReason",
    "KillCause",
    "TRANSITIONS",
    "IllegalTransition",
    "ExitCode",
    "Cause",
    "IDLE", "PREFLIGHT", "RUNNING", "KILLING", "STOPPING", "POSTMORTEM", "REQUEUEING", "DONE",
]

# The names the plumbing and the tests use; the codes are ``clusterops.exitcodes.Supervise``.
EXIT_DONE = ExitCode.DONE
EXIT_FAILED = ExitCode.FAILED
EXIT_USAGE = ExitCode.USAGE
EXIT_NO_PROGRESS = ExitCode.NO_PROGRESS
EXIT_REQUEUE_BUDGET = ExitCode.REQUEUE_BUDGET
EXIT_RESTART_BUDGET = ExitCode.RESTART_BUDGET
EXIT_TOO_FEW_NODES = ExitCode.TOO_FEW_NODES
EXIT_STOPPED_NO_REQUEUE = ExitCode.STOPPED_NO_REQUEUE
EXIT_DIVERGED = ExitCode.DIVERGED
EXIT_ROLLBACK_BUDGET = ExitCode.ROLLBACK_BUDGET
EXIT_SCRIPT_STOP = ExitCode.SCRIPT_STOP
EXIT_GENERATION_END = ExitCode.GENERATION_END
EXIT_CHAIN_ENDED = ExitCode.CHAIN_ENDED

#: Why a node is held bad when the only evidence is Slurm's own: it saw the node fail
#: during the step (srun's "Node failure on X", or the node DOWN/NOT_RESPONDING).
LOST_WHY = "node lost during the step"


# --------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------
@schema.dataclass_of(schema.policy_fields(), frozen=True)
class Policy:
    """What the job asked for: the ``supervise:`` mapping plus the node count.

    The fields, their types, defaults and bounds are ``clusterops.schema.policy_fields()``
    (the one table of the supervise keys); ``min_nodes`` None means ``nodes``.
    """

    def __post_init__(self):
        if self.min_nodes is None:
            object.__setattr__(self, "min_nodes", self.nodes)

    def validate(self) -> List[str]:
        """Problems as ``field: message`` strings (empty when fine)."""
        bad = schema.problems(self, schema.policy_fields())
        if isinstance(self.min_nodes, int) and isinstance(self.nodes, int) and self.min_nodes > self.nodes:
            bad.append(f"min_nodes: must be from 1 to nodes ({self.nodes}), got {self.min_nodes}")
        return bad


class StopReason(str, Enum):
    """Why the ranks are asked to save and stop (``StopRequested.reason``, ``RequestStop``)."""

    TIME_LIMIT = "time_limit"    # SIGUSR1, Slurm's lead time before the time limit
    PREEMPTION = "preemption"    # SIGTERM, or Slurm's PreemptTime seen on the job
    USER = "user"                # any other signal (an operator's SIGINT)
    SIGNAL = "signal"            # the ranks stopped on a signal that did not come through us
    STRAGGLER = "straggler"      # a planned stop to replace a slow node
    DRAINED = "node_drained"     # a planned stop to move off a node someone else drained

    def __str__(self) -> str:
        return self.value


class KillCause(str, Enum):
    """Why the machine kills a step (``KillStep.reason``)."""

    HANG = "hang"
    NODE_DOWN = "node_down"
    STOP_TIMEOUT = "stop_timeout"
    ROLLBACK = "rollback"        # the stability guard rolls back: the bad state is not saved
    DIVERGED = "diverged"        # the stability guard stops the job (or gives up)
    REPLAY = "replay"            # the stability guard replays the anomaly on other nodes first

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------------------
# Events (in)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    now: float


@dataclass(frozen=True)
class PreflightDone(Event):
    """Per-node health status: 'pass' | 'warn' | 'fail' | 'error' | 'missing'; ``fabric``:
    node -> the NVLink domain its check named (NVML's GPU fabric, ``nvml.fabric``), for the
    nodes that named one."""

    statuses: Mapping[str, str] = field(default_factory=dict)
    details: Mapping[str, str] = field(default_factory=dict)
    postmortem: bool = False
    fabric: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepLaunched(Event):
    step_id: Optional[str] = None


# One rank srun reported as ended badly: srun's own record (node, rank, reason), whose
# ``kind`` classifies srun's wording in clusterops.slurm.parse (the machine never reads it).
RankFailure = TaskFailure


@dataclass(frozen=True)
class StepExited(Event):
    returncode: int = 0
    failures: Tuple[RankFailure, ...] = ()   # in the order srun reported them; first is the culprit
    ckpt_step: Optional[int] = None          # latest good checkpoint step after the exit
    node_failure: Tuple[str, ...] = ()       # nodes srun reported as failed
    stopped_by: Optional[str] = None         # the ranks stopped on a request that bypassed us
                                             # (Slurm SIGTERMs only the steps on preemption)
    #: task (rank) -> what its own output says (clusterops.supervisor.evidence): the last
    #: line of its traceback, a hardware sign. Tasks that printed neither are absent.
    task_output: Mapping[int, TaskOutput] = field(default_factory=dict)
    #: what the script named before exiting (sdk.report_suspects): Slurm node names, ranks
    suspect_nodes: Tuple[str, ...] = ()
    suspect_ranks: Tuple[int, ...] = ()
    #: a replay attempt's reports (``protocol.read_replay_reports``): rank -> report
    replay: Mapping[int, Mapping] = field(default_factory=dict)


@dataclass(frozen=True)
class Heartbeats(Event):
    """Snapshot of the heartbeat files: rank -> (step, mtime); a missing rank has none yet.

    ``timing``: rank -> (step, step_ms, busy_ms) of its latest beat (-1: not known), what
    the node channel carries for straggler detection (empty on the per-rank file channel).
    """

    beats: Mapping[int, Tuple[int, float]] = field(default_factory=dict)
    timing: Mapping[int, Tuple[int, int, int]] = field(default_factory=dict)
    #: rank -> (step, loss, grad norm) of its latest beat that carried them (None: not
    #: reported), for the stability guard (clusterops.supervisor.stability).
    signals: Mapping[int, Tuple[int, Optional[float], Optional[float]]] = field(default_factory=dict)
    #: the replica checks' latest words (``protocol.read_replicas``): (source, report) per
    #: replica group's file of the current attempt (clusterops.replicas).
    replicas: Tuple[Tuple[str, Mapping], ...] = ()
    #: rank -> (its first non-finite step, its node) in this attempt (``protocol.read_nonfinite``),
    #: for a replay's verdict: which node's ranks went non-finite first
    nonfinite: Mapping[int, Tuple[int, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class NodesDown(Event):
    nodes: Mapping[str, str] = field(default_factory=dict)   # node -> state text
    #: nodes of the allocation drained by someone else (a reason clusterops did not write):
    #: node -> the reason, left as it is
    drained: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RanksMoved(Event):
    """In-process recovery moved ranks between nodes inside the running step: ``moves`` are
    (rank, from node, to node); ``holding`` the nodes that hold ranks now. A node left with
    no rank (lost whole, its ranks taken over by a spare's standbys) no longer ends the step
    when Slurm reports it down, and no later step uses it."""

    moves: Tuple[Tuple[int, str, str], ...] = ()
    holding: Tuple[str, ...] = ()


@dataclass(frozen=True)
class StopRequested(Event):
    reason: str = StopReason.TIME_LIMIT     # a StopReason


@dataclass(frozen=True)
class CheckpointCommitted(Event):
    step: int = 0
    path: str = ""


@dataclass(frozen=True)
class ResumeChosen(Event):
    """The checkpoint a launch really resumes from (after verifying it), None for a fresh start."""

    step: Optional[int] = None
    path: str = ""
    skipped: Tuple[str, ...] = ()     # newer checkpoints found bad and passed over


@dataclass(frozen=True)
class HangNamed(Event):
    """What the ranks' flight recorders say of a hang (clusterops.supervisor.flightrec), and
    NCCL's RAS report where it answered (clusterops.supervisor.ncclras), gathered before the
    kill: the ranks that never entered the collective the others wait in (empty: none
    named), why, the ranks that sent no dump, and which of the two named them."""

    ranks: Tuple[int, ...] = ()
    why: str = ""
    silent: Tuple[int, ...] = ()
    source: str = "flight_recorder"     # or "nccl_ras" (clusterops.supervisor.ncclras)
    ras: str = ""                       # what NCCL's RAS report said, when it was read


@dataclass(frozen=True)
class RollbackPicked(Event):
    """The plumbing's answer to :class:`PickRollback`: ``step`` is the newest checkpoint at or
    before the bound that exists and verifies (None: none does); ``bad`` the (step, path,
    problems) of the planned target when it is gone and of those found bad on the way."""

    step: Optional[int] = None
    path: str = ""
    bad: Tuple[Tuple[int, str, Tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class RequeueFailed(Event):
    error: str = ""
    # Not requeued because the exclusion would leave the job's partition too few nodes to
    # start it again (the job would pend for ever): ends with EXIT_TOO_FEW_NODES.
    unschedulable: bool = False


@dataclass(frozen=True)
class Tick(Event):
    pass


# --------------------------------------------------------------------------------------
# Actions (out)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    pass


@dataclass(frozen=True)
class Record(Action):
    """One timeline record."""

    kind: str
    data: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class RunPreflight(Action):
    nodes: Tuple[str, ...]
    profile: str
    timeout_s: float
    postmortem: bool = False


@dataclass(frozen=True)
class Launch(Action):
    nodes: Tuple[str, ...]
    attempt: int             # 0 for the first launch of this job, counting across requeues
    restart_count: int       # restarts so far (in-allocation, across requeues)
    hint: Optional[stb.ResumeHint] = None   # a stability rollback: resume from hint.from_step, skip, LR
    #: a replay of an anomaly: ``protocol.ReplayOrder`` JSON for the ranks (empty: an ordinary launch)
    replay: str = ""
    #: rank r runs on ``nodes[(r // ranks_per_node + rotate) % len(nodes)]`` (0: srun's block layout)
    rotate: int = 0


@dataclass(frozen=True)
class KillStep(Action):
    reason: str
    force: bool = False      # escalate: kill the srun itself


@dataclass(frozen=True)
class CaptureStacks(Action):
    ranks: Tuple[int, ...]
    nodes: Tuple[str, ...]


@dataclass(frozen=True)
class RequestStop(Action):
    reason: str


@dataclass(frozen=True)
class DrainNodes(Action):
    nodes: Tuple[str, ...]
    reason: str              # "clusterops:supervisor: <why>" (clusterops.drains.make_reason)


@dataclass(frozen=True)
class Requeue(Action):
    exclude: Tuple[str, ...]
    reason: str
    # The nodes of ``exclude`` held only because Slurm lost them (LOST_WHY): Slurm keeps a
    # DOWN node out itself, so these may be left off the ExcNodeList when keeping them out
    # too would leave the job's partition too few nodes to ever start it again.
    lost: Tuple[str, ...] = ()


@dataclass(frozen=True)
class SetAside(Action):
    """Move the checkpoints newer than ``after_step`` out of the checkpoint root (into a
    ``rolled-back-*`` directory beside them): they hold, or may hold, a diverged state, and
    no later resume may pick them (the stability guard)."""

    after_step: int
    reason: str


@dataclass(frozen=True)
class PickRollback(Action):
    """Look at the disk before a rollback moves anything: the guard's target ``planned`` may
    have been pruned by retention or damaged since it was saved. Answered at once with
    :class:`RollbackPicked`: the newest checkpoint at or before ``before`` (the guard's bound)
    that exists and verifies, as a resume would verify it."""

    before: int
    planned: int


@dataclass(frozen=True)
class HoldCheckpoint(Action):
    """Tell retention to keep checkpoint ``step`` (a prune never removes it; ``ckpt list``
    shows ``reason``): the newest good one before a loss spike or NaN."""

    step: int
    reason: str


@dataclass(frozen=True)
class Exit(Action):
    code: int
    reason: str
    error: str = ""          # the program's own last words (its traceback's last line), if known


# --------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------
# The profile name the plumbing runs as a bare "does this node still run a task" check.
LIVENESS = ":liveness"

class State(str, Enum):
    """Where the supervisor is (a ``str``: records and the state file keep the plain word)."""

    IDLE = "idle"                # before start()
    PREFLIGHT = "preflight"      # the health check before the first launch runs
    RUNNING = "running"          # a training step runs
    KILLING = "killing"          # the step is being killed (hang, lost node, stop timeout)
    STOPPING = "stopping"        # the ranks were asked to save and stop
    POSTMORTEM = "postmortem"    # the check after a failed step runs
    REQUEUEING = "requeueing"    # the job asked Slurm to requeue it
    DONE = "done"                # an exit code is decided

    def __str__(self) -> str:
        return self.value


IDLE, PREFLIGHT, RUNNING, KILLING, STOPPING, POSTMORTEM, REQUEUEING, DONE = State

#: The allowed moves, checked in one place (:meth:`Supervisor._enter`). Every state but DONE
#: may end (DONE) or requeue; a launch (RUNNING) follows the checks and a step's end.
TRANSITIONS: Mapping[State, FrozenSet[State]] = {
    IDLE: frozenset({PREFLIGHT, RUNNING, REQUEUEING, DONE}),
    PREFLIGHT: frozenset({RUNNING, REQUEUEING, DONE}),
    RUNNING: frozenset({RUNNING, STOPPING, KILLING, POSTMORTEM, REQUEUEING, DONE}),
    STOPPING: frozenset({KILLING, RUNNING, REQUEUEING, DONE}),
    KILLING: frozenset({RUNNING, POSTMORTEM, REQUEUEING, DONE}),
    POSTMORTEM: frozenset({RUNNING, REQUEUEING, DONE}),
    REQUEUEING: frozenset({DONE}),
    DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """The machine tried a move that :data:`TRANSITIONS` does not allow (a bug, not input)."""


@dataclass
class Memory:
    """What survives a requeue (kept in the job directory by the plumbing)."""

    bad_nodes: Dict[str, str] = field(default_factory=dict)   # node -> why
    attempts: int = 0                  # launches so far, all incarnations
    restarts: int = 0                  # restarts so far, all incarnations
    no_progress: int = 0               # restarts in a row that saw no new checkpoint
    last_ckpt_step: Optional[int] = None
    # The stability guard's: the anomaly steps of the rollbacks so far (max_rollbacks counts
    # them across requeues) and the hint still open (the next incarnation's launch carries it).
    rollbacks: List[int] = field(default_factory=list)
    hint: Optional[stb.ResumeHint] = None
    replica_agree: Optional[int] = None   # the step of the last replica check that agreed

    def to_dict(self) -> dict:
        return {"bad_nodes": dict(self.bad_nodes), "attempts": self.attempts, "restarts": self.restarts,
                "no_progress": self.no_progress, "last_ckpt_step": self.last_ckpt_step,
                "rollbacks": list(self.rollbacks), "replica_agree": self.replica_agree,
                "hint": None if self.hint is None else json.loads(self.hint.to_json())}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Memory":
        hint = d.get("hint")
        return cls(bad_nodes=dict(d.get("bad_nodes") or {}), attempts=int(d.get("attempts") or 0),
                   restarts=int(d.get("restarts") or 0), no_progress=int(d.get("no_progress") or 0),
                   last_ckpt_step=d.get("last_ckpt_step"), rollbacks=[int(a) for a in d.get("rollbacks") or []],
                   hint=None if hint is None else stb.ResumeHint.from_json(json.dumps(hint)),
                   replica_agree=d.get("replica_agree"))


@dataclass(frozen=True)
class Verdict:
    """Why a step failed (:meth:`Supervisor.judge`): the cause, the nodes the evidence points
    at (none without evidence), that evidence, and the program's own error line if it printed one."""

    cause: Cause
    blamed: List[str] = field(default_factory=list)
    evidence: Optional[Evidence] = None
    error: Optional[str] = None
    sign: Optional[Tuple[str, str]] = None      # (name, line) of a hardware sign, with HARDWARE


@dataclass(frozen=True)
class ReplayPlan:
    """A replay under way (``on_nan``/``on_spike: replay``): the finding, the checkpoint it runs
    from, the step it stops at, what the original run said of where the values went non-finite
    (rank -> (step, node)), and the original run's nodes."""

    finding: stb.Finding
    from_step: int
    until: int
    nonfinite: Mapping[int, Tuple[int, str]]
    nodes: Tuple[str, ...]


@dataclass
class Suspect:
    """One program error that came from one node only (:meth:`Supervisor._weigh_error`).
    The same rank failing the same way there twice says nothing yet (the rank or the node?);
    a relaunch without the node (``trial``, on a spare) decides: the error again elsewhere is
    the program's, a run that gets past ``past_step`` without it is the node's."""

    node: str
    rank: int
    error: str
    times: int = 1
    trial: bool = False
    past_step: Optional[int] = None


class Supervisor:
    """Decides what to do. Call :meth:`start`, then :meth:`handle` for every event.

    ``nodes`` is the allocation (batch host first), ``slurm_restart_count`` is
    ``SLURM_RESTART_COUNT`` of this incarnation, ``memory`` what earlier incarnations
    left behind.
    """

    def __init__(self, policy: Policy, nodes: Sequence[str], *, slurm_restart_count: int = 0,
                 memory: Optional[Memory] = None, ckpt_step: Optional[int] = None,
                 stability: Optional[stb.StabilityConfig] = None, exit_codes: Optional[Mapping[int, str]] = None,
                 domains: Optional[Mapping[str, str]] = None, chain_next: bool = False):
        self.policy = policy
        # node -> its topology domain (Slurm's block or leaf switch: ``scontrol show topology``,
        # or the NVLink domain a check named: :meth:`_take_fabric`); a replacement comes from
        # the lost node's domain first (:meth:`_fill`).
        self.domains: Dict[str, str] = dict(domains or {})
        # A generation of a chain with a later one queued hands on instead of requeueing
        # (clusterops.supervisor.chain): the next generation is a fresh allocation.
        self.chain_next = chain_next
        # What a script's own exit code asks (supervise: exit_codes:, over the published defaults).
        self.exit_codes: Dict[int, str] = dict(schema.DEFAULT_EXIT_CODES if exit_codes is None else exit_codes)
        self.allocation: List[str] = list(nodes)
        self.slurm_restart_count = slurm_restart_count
        self.memory = memory or Memory()
        if self.memory.last_ckpt_step is None:
            self.memory.last_ckpt_step = ckpt_step
        self.state: State = IDLE
        self.bad: Dict[str, str] = {}             # node -> why (this incarnation)
        self.blame: Dict[str, int] = {}           # node -> failures blamed on it
        self.down_seen: Set[str] = set()
        self.left_inprocess: Set[str] = set()    # nodes whose ranks moved away in-process (RanksMoved)
        self.active: List[str] = []               # nodes of the current/next step
        self.spares: List[str] = []
        self.restarts_here = 0
        self.step_started_at: Optional[float] = None
        self.kill_sent_at: Optional[float] = None
        self.kill_cause: Optional[str] = None
        self.hung_ranks: Tuple[int, ...] = ()
        self.hang_culprits: Tuple[int, ...] = ()
        self.stop_reason: Optional[str] = None
        self.stop_deadline: Optional[float] = None
        self.pending_stop: Optional[str] = None
        self.last_progress_step: Optional[int] = None
        self.last_progress_record: Optional[float] = None
        self.preflight_done = False
        self.ckpt_at_launch: Optional[int] = None
        self.last_cause: Optional[str] = None
        self.last_error: Optional[str] = None     # the last failed step's traceback line (give-up carries it)
        self.suspect: Optional[Suspect] = None    # a program error from one node only, being weighed
        self.everywhere: Set[str] = set()         # error lines seen from two nodes: the program's for good
        self.exit_code: Optional[int] = None
        self.detector: Optional[Detector] = None   # straggler detection of the current step
        self.replacing: Optional[str] = None        # the node (straggler, drained) a planned stop will replace
        self.foreign_drains: Dict[str, str] = {}     # node -> someone else's drain reason, seen while we run
        self.drain_deadline: Optional[float] = None  # drain_grace_s: when to stop and requeue without them
        self.straggler_why: Dict[str, Tuple[str, str]] = {}   # node -> (why, drain reason)
        # The stability guard (supervise: stability:), its decision while the step is killed.
        # The loss is watched only with a stability config; a job whose script may check its
        # replicas (replica_check_every) gets a guard that records only, for the rollback and
        # checkpoint bookkeeping a disagreement needs (clusterops.replicas).
        self.watch_loss = stability is not None
        if stability is None and policy.replica_check_every:
            stability = stb.StabilityConfig(on_nan=stb.Action.RECORD.value, on_spike=stb.Action.RECORD.value)
        self.stability = (stb.Guard(stability, rollbacks=self.memory.rollbacks, hint=self.memory.hint)
                          if stability is not None else None)   # the rollbacks list is shared
        self.replicas_seen: Dict[str, int] = {}   # report source -> the newest step handled
        self.stability_decision: Optional[stb.Decision] = None
        self.rollback_to_pick: Optional[stb.Decision] = None   # a rollback whose target the disk must confirm
        self.rotate = 0                              # the current step's rank rotation (Launch.rotate)
        self.replay_evidence: Mapping[int, Tuple[int, str]] = {}   # the finding's ev.nonfinite, until the replay
        self.replay_nodes: Tuple[str, ...] = ()      # the nodes of the run the replay's finding came from
        self.replay: Optional[ReplayPlan] = None     # the replay step under way
        if self.stability is not None and self.memory.last_ckpt_step is not None:
            self.stability.checkpoint(self.memory.last_ckpt_step)
            self.memory.hint = self.stability.hint

    # -- helpers ---------------------------------------------------------------------
    def _enter(self, state: State) -> None:
        """Move to ``state``: the one place a state changes, checked against TRANSITIONS."""
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"supervisor: {self.state} -> {state} is not an allowed transition")
        self.state = state

    def _usable(self) -> List[str]:
        return [n for n in self.allocation if n not in self.bad and n not in self.left_inprocess]

    def _mark_bad(self, node: str, why: str, now: float, out: List[Action], *, drain: bool = True,
                  reason: Optional[str] = None) -> None:
        """Keep ``node`` out of later steps; drain it too when the policy says so and ``drain``
        (a check that could not decide -- status error -- excludes but never drains).
        ``reason``: the drain reason (default: ``clusterops:supervisor: <why>``)."""
        if node in self.bad:
            return
        self.bad[node] = why
        self.memory.bad_nodes[node] = why
        out.append(Record(E.NODE_BAD, {"node": node, "why": why}))
        if self.policy.drain_bad_nodes and drain:
            out.append(DrainNodes((node,), reason or drains.make_reason(drains.SUPERVISOR, why)))

    def _exit(self, code: int, reason: str, out: List[Action]) -> List[Action]:
        self._enter(DONE)
        self.exit_code = code
        kind = E.DONE if code == EXIT_DONE else E.GENERATION_END if code == EXIT_GENERATION_END else E.GIVE_UP
        error = self.last_error if code != EXIT_DONE and self.last_error else ""
        out.append(Record(kind, {"code": code, "reason": reason, **({"error": error} if error else {})}))
        out.append(Exit(code, reason, error))
        return out

    def _requeue(self, reason: str, out: List[Action]) -> List[Action]:
        """Requeue the job (once, only from here) or give up when not allowed; a chain's
        generation with a later one queued ends instead, and the next one resumes."""
        if self.chain_next:
            return self._exit(EXIT_GENERATION_END, f"{reason}; the chain's next generation resumes", out)
        if self.slurm_restart_count >= self.policy.max_requeues:
            return self._exit(EXIT_REQUEUE_BUDGET,
                              f"{reason}; requeue budget spent ({self.slurm_restart_count} of "
                              f"{self.policy.max_requeues})", out)
        if not self.policy.requeue:
            code = EXIT_STOPPED_NO_REQUEUE if self.stop_reason else EXIT_TOO_FEW_NODES
            return self._exit(code, f"{reason}; requeue not allowed", out)
        self._enter(REQUEUEING)
        exclude = tuple(sorted(set(self.memory.bad_nodes)))
        lost = tuple(n for n in exclude if self.memory.bad_nodes[n] == LOST_WHY)
        out.append(Record(E.REQUEUE, {"reason": reason, "exclude": list(exclude),
                                      "restart_count": self.slurm_restart_count + 1}))
        out.append(Requeue(exclude, reason, lost))
        return out

    # -- entry -----------------------------------------------------------------------
    def start(self, now: float, stop: Optional[str] = None) -> List[Action]:
        """The first actions. ``stop``: a stop request (a ``StopReason``) that came before
        the supervisor ran: the lead-time signal or a SIGTERM caught by the batch script
        while its setup ran, or the time limit's lead already passed by Slurm's end time.
        Nothing has trained in this incarnation, so nothing is saved: requeue at once."""
        out: List[Action] = []
        known = {n: w for n, w in self.memory.bad_nodes.items() if n in self.allocation}
        out.append(Record(E.START, {"nodes": list(self.allocation),
                                    "slurm_restart_count": self.slurm_restart_count,
                                    "known_bad": sorted(known),
                                    "policy": {"nodes": self.policy.nodes, "spare_nodes": self.policy.spare_nodes,
                                               "min_nodes": self.policy.min_nodes}}))
        if stop is not None:
            self.stop_reason = self.pending_stop = stop
            out.append(Record(E.STOP_REQUESTED, {"reason": stop, "state": "starting"}))
            return self._requeue(f"stop requested ({stop}) before the first step", out)
        for node, why in known.items():
            # Slurm gave us a node an earlier incarnation judged bad (the requeue's ExcNodeList
            # update did not land, or the job was requeued by Slurm, not by us): keep it out
            # of this allocation's steps.
            self.bad[node] = why
        self._take_back_lost(known, out)
        if self.policy.preflight and not self.preflight_done:
            self._enter(PREFLIGHT)
            nodes = tuple(self._usable())
            out.append(Record(E.PREFLIGHT_START, {"nodes": list(nodes), "profile": self.policy.preflight}))
            out.append(RunPreflight(nodes, self.policy.preflight, self.policy.preflight_timeout_s))
            return out
        return self._plan_launch(now, out, first=True)

    def _take_back_lost(self, known: Dict[str, str], out: List[Action]) -> None:
        """Use again the nodes an earlier incarnation (or generation) left only because Slurm
        lost them, when keeping them out would leave too few nodes to train. Slurm's loss is
        the only evidence against them, and Slurm has since taken them back into service and
        given them to this job: newer word on the same thing. Without this, a chain whose
        partition has no other nodes requeues itself off them and pends for ever. A node
        blamed on our own evidence (a signal, a check, hardware text, repeated failures) is
        never taken back here; a node lost again is caught by the restart budgets."""
        lost = sorted(n for n, why in known.items() if why == LOST_WHY)
        usable = len(self._usable())
        if not lost or usable >= self.policy.min_nodes or usable + len(lost) < self.policy.min_nodes:
            return       # not needed, or not enough: the requeue names them (Requeue.lost)
        for node in lost:
            del self.bad[node]
            del self.memory.bad_nodes[node]
        out.append(Record(E.WARNING, {
            "what": f"{', '.join(lost)}: left out earlier only because Slurm lost them; Slurm has given "
                    f"them back, and without them {usable} node(s) are left, "
                    f"{self.policy.min_nodes} needed: used again",
            "nodes": lost}))

    def _plan_launch(self, now: float, out: List[Action], *, first: bool = False,
                     replay: Optional[ReplayPlan] = None) -> List[Action]:
        if self.pending_stop:
            # A stop arrived while no step ran: nothing to save, requeue straight away.
            self.stop_reason = self.pending_stop
            return self._requeue(f"stop requested ({self.pending_stop}) with no step running", out)
        usable = self._usable()
        want = self.policy.nodes
        s = self.suspect
        if s is not None and s.trial:
            # A relaunch without the suspect node tells the node from the program; not at
            # the price of a smaller run (a node lost meanwhile: it is given back).
            without = [n for n in usable if n != s.node]
            if len(without) >= want:
                usable = without
            else:
                s.trial = False
        previous = list(self.active)
        if len(usable) >= want:
            # Keep surviving nodes of the previous step in place (same ranks), fill holes
            # with spares in allocation order.
            keep = [n for n in previous if n in usable][:want]
            rest = [n for n in usable if n not in keep]
            holes = [n for n in previous if n not in keep]
            active = keep + self._fill(holes, rest, want - len(keep), out)
            active = sorted(active, key=self.allocation.index)
        elif len(usable) >= self.policy.min_nodes:
            active = usable
        else:
            return self._requeue(
                f"{len(usable)} healthy node(s) left, {self.policy.min_nodes} needed", out)
        rotate, placement = 0, None
        if replay is not None:
            # Other hardware for the same ranks: each node's ranks move to the next node of the
            # step (rank r runs where rank r + ranks_per_node ran); one node: a spare, if any.
            free = [n for n in usable if n not in active]
            if len(active) >= 2:
                rotate, placement = 1, "rotated"
            elif free:
                active, placement = free[:1], "spare"
            else:
                placement = "same nodes"
        self.spares = [n for n in usable if n not in active]
        if previous and not first:
            added = [n for n in active if n not in previous]
            if added:
                out.append(Record(E.SPARE_USED, {"nodes": added}))
            if len(active) < len(previous):
                out.append(Record(E.SHRINK, {"from": len(previous), "to": len(active)}))
        if not first:
            out.append(Record(E.RESTART, {"cause": self.last_cause, "restart": self.memory.restarts,
                                          "resume_step": self.memory.last_ckpt_step}))
        self.active = active
        self.rotate = rotate
        self.replay = replay
        self._enter(RUNNING)
        self.step_started_at = now
        self.kill_sent_at = None
        self.kill_cause = None
        self.hung_ranks = ()
        self.hang_culprits = ()
        self.last_progress_step = None
        self.stop_reason = None
        self.stop_deadline = None
        self.replacing = None
        p = self.policy
        self.detector = (Detector(self.rank_node, ratio=p.straggler_ratio, window=p.straggler_window,
                                  warmup_steps=p.straggler_warmup_steps) if p.detect_stragglers else None)
        attempt = self.memory.attempts
        self.memory.attempts += 1
        self.ckpt_at_launch = self.memory.last_ckpt_step
        rec = {"nodes": list(active), "spares": list(self.spares), "attempt": attempt,
               "restart_count": self.memory.restarts, "resume_step": self.memory.last_ckpt_step}
        if replay is not None:
            rec["replay"] = {"from_step": replay.from_step, "until": replay.until, "placement": placement,
                             "rotate": rotate, "ranks": {str(r): self.rank_node(r) for r in range(self.expected_ranks)}}
            out.append(Record(E.LAUNCH, rec))
            out.append(Launch(tuple(active), attempt, self.memory.restarts, hint=None,
                              replay=protocol.ReplayOrder(replay.from_step, replay.until).to_json(), rotate=rotate))
            return out
        out.append(Record(E.LAUNCH, rec))
        out.append(Launch(tuple(active), attempt, self.memory.restarts,
                          hint=self.stability.hint if self.stability is not None else None))
        return out

    def _in_domain_first(self, node: str, free: Sequence[str]) -> List[str]:
        """``free`` with the nodes of ``node``'s topology domain first (each part in its order)."""
        d = self.domains.get(node)
        if d is None:
            return list(free)
        return [n for n in free if self.domains.get(n) == d] + [n for n in free if self.domains.get(n) != d]

    def _take_fabric(self, fabric: Mapping[str, str], out: List[Action]) -> None:
        """Nodes whose check named their NVLink domain (NVML's GPU fabric: the domain itself,
        where Slurm's block or switch stands for it) take it over the domain they had; the
        others keep theirs. A change is said in the timeline (``topology``, ``nvml_fabric``)."""
        new = {n: d for n, d in sorted(fabric.items()) if self.domains.get(n) != d}
        if new:
            self.domains.update(new)
            out.append(Record(E.TOPOLOGY, {"domains": new, "source": DomainSource.NVML_FABRIC}))

    def _fill(self, holes: Sequence[str], free: Sequence[str], count: int, out: List[Action]) -> List[str]:
        """``count`` nodes from ``free`` (in allocation order) for a step whose nodes ``holes``
        left: each hole's replacement from its own topology domain when one is free there (a
        spare outside an NVLink domain or a block is no spare for a job laid out in it); a
        replacement from another domain is said in the timeline (``spare_out_of_domain``)."""
        free, picked = list(free), []
        for hole in holes:
            if len(picked) == count or not free:
                break
            spare = self._in_domain_first(hole, free)[0]
            free.remove(spare)
            picked.append(spare)
            d = self.domains.get(hole)
            if d is not None and self.domains.get(spare) != d:
                out.append(Record(E.SPARE_OUT_OF_DOMAIN, {
                    "node": hole, "spare": spare, "domain": d, "spare_domain": self.domains.get(spare),
                    "why": f"no free node left in {hole}'s domain {d}"}))
        return picked + free[: count - len(picked)]

    # -- dispatch --------------------------------------------------------------------
    def handle(self, ev: Event) -> List[Action]:
        if self.state == DONE:
            return []
        handler = self.HANDLERS.get(type(ev))
        if handler is None:
            raise TypeError(f"unknown event {ev!r}")
        return handler(self, ev)

    def _on_preflight_done(self, ev: PreflightDone) -> List[Action]:
        out: List[Action] = []
        if self.state not in (PREFLIGHT, POSTMORTEM):
            return out
        statuses = dict(ev.statuses)
        answered = [n for n, s in statuses.items() if s in ("pass", "warn", "fail")]
        kind = E.PREFLIGHT if not ev.postmortem else (
            E.LIVENESS if self.policy.postmortem is None else E.POSTMORTEM)
        out.append(Record(kind, {"statuses": statuses, "details": dict(ev.details)}))
        self._take_fabric(ev.fabric, out)
        if not answered:
            # Nobody could run the check: the check is broken, not every node. Do not
            # empty the allocation on its word (the sweep's safety idea).
            out.append(Record(E.WARNING, {"what": f"{kind} gave no usable result on any node; ignored"}))
        elif len(statuses) >= 2 and not any(s in ("pass", "warn") for s in statuses.values()):
            # Failing on every node of the allocation: a broken check (a bad profile or site
            # setting pushed everywhere), not a broken allocation. Nobody excluded or drained.
            out.append(Record(E.CHECK_BROKEN, {
                "check": kind, "nodes": sorted(statuses),
                "what": f"{kind} failed on all {len(statuses)} nodes: treated as a broken check; "
                        "no node excluded or drained"}))
        else:
            for node, status in sorted(statuses.items()):
                if status in ("fail", "missing", "error"):
                    # A fail, or no answer at all (a lost node), may drain; an error -- the
                    # check itself crashed or could not decide -- only keeps the node out.
                    self._mark_bad(node, f"{kind} {status}: {ev.details.get(node, '')}".strip().rstrip(":"),
                                   ev.now, out, drain=status != "error")
        self.preflight_done = True
        if self.pending_stop:
            self.stop_reason = self.pending_stop
            return self._requeue(f"stop requested ({self.pending_stop}) before launch", out)
        return self._plan_launch(ev.now, out, first=not ev.postmortem)

    def _on_step_launched(self, ev: StepLaunched) -> List[Action]:
        if self.state == RUNNING:
            self.step_started_at = ev.now   # the startup allowance counts from here
        return []

    def _on_heartbeats(self, ev: Heartbeats) -> List[Action]:
        out: List[Action] = []
        if self.state != RUNNING or self.step_started_at is None:
            return out
        p = self.policy
        steps = [s for s, _ in ev.beats.values()]
        if steps:
            low = min(steps)
            if self.last_progress_step != low and (
                    self.last_progress_record is None
                    or ev.now - self.last_progress_record >= p.progress_interval_s):
                rec = {"step": low, "max_step": max(steps), "ranks": len(steps)}
                slowest = self.detector.slowest() if self.detector is not None else None
                if slowest is not None:
                    rec["slowest"] = [slowest[0], slowest[1]]   # node, its ratio to the others (metrics)
                if self.watch_loss and ev.signals:    # the loss curve of the timeline chart
                    s = stb.sample_of(ev.signals)
                    if s is not None and s.loss is not None:
                        rec["loss"] = s.loss if math.isfinite(s.loss) else str(s.loss)
                out.append(Record(E.PROGRESS, rec))
                self.last_progress_step = low
                self.last_progress_record = ev.now
        stale = []
        ranks = set(ev.beats) | set(range(self.expected_ranks))
        for r in sorted(ranks):
            beat = ev.beats.get(r)
            if beat is None:
                # Not started yet (imports, process group, resume): the startup allowance.
                if ev.now - self.step_started_at > p.startup_timeout_s:
                    stale.append((r, None))
            elif ev.now - beat[1] > p.hang_timeout_s:
                stale.append((r, round(ev.now - beat[1], 1)))
        if stale:
            stale = self._silent_together(stale, ev, ranks)
            self.hung_ranks = tuple(r for r, _ in stale)
            self.hang_culprits = self._hang_culprits(ev.beats, ranks)
            nodes = tuple(sorted({self.rank_node(r) for r in self.hung_ranks if self.rank_node(r)}))
            out.append(Record(E.HEARTBEAT_LOST, {"ranks": list(self.hung_ranks), "nodes": list(nodes),
                                                 "ages_s": [a for _, a in stale],
                                                 "culprits": list(self.hang_culprits)}))
            out.append(CaptureStacks(self.hung_ranks, nodes))
            out += self._kill(ev.now, KillCause.HANG)
            return out
        # A replay is judged when it ends (_exited_replay), not by the guard's band.
        if ev.replicas and self.stability is not None and self.replay is None:
            out += self._replicas(ev)
            if self.state != RUNNING:
                return out
        if self.watch_loss and ev.signals and self.replay is None:
            out += self._stability(ev)
            if self.state != RUNNING:
                return out
        if self.detector is not None and ev.timing:
            for f in self.detector.feed(ev.timing):
                out += self._straggler(f, ev.now)
        return out

    def _stability(self, ev: Heartbeats) -> List[Action]:
        """A loss spike or a non-finite value: record it, and stop or roll back as decided
        (clusterops.supervisor.stability); the step is killed, so its bad state is never saved."""
        d = self.stability.feed(ev.signals)
        if d is None:
            return []
        out: List[Action] = [Record(str(d.finding.kind), dict(d.finding.record(), decision=str(d.action), why=d.why))]
        if d.hold is not None:
            out.append(HoldCheckpoint(d.hold, f"stability: newest checkpoint before the {d.finding.kind} that began "
                                              f"after step {d.finding.began - 1} ({d.action})"))
        if d.action == stb.Action.RECORD:
            return out
        self.stability_decision = d
        self.memory.hint = self.stability.hint
        if d.action == stb.Action.REPLAY:
            # Where the values went non-finite first, as the ranks said it (the replay's verdict
            # names that node when the replay does not reproduce it).
            self.replay_evidence = dict(ev.nonfinite)
            self.replay_nodes = tuple(self.active)
            return out + self._kill(ev.now, KillCause.REPLAY)
        if d.action == stb.Action.ROLLBACK:
            # The rollback record (and its webhook) waits for the disk's word on the target
            # (_on_rollback_picked): it says where the job really goes back to, if anywhere.
            return out + self._kill(ev.now, KillCause.ROLLBACK)
        return out + self._kill(ev.now, KillCause.DIVERGED)

    def _replicas(self, ev: Heartbeats) -> List[Action]:
        """The replica checks' words (clusterops.replicas): an agreement moves the last good
        step; a disagreement is silent data corruption on the ranks outside the majority. The
        step is killed (nothing saved), the job rolls back to the newest checkpoint at or
        before the last check that agreed, and the suspects' nodes are kept out (drained with
        the ``sdc`` origin under ``drain_bad_nodes``); with no strict majority the evidence is
        ambiguous: the rollback happens, nobody is blamed."""
        out: List[Action] = []
        for source, rep in ev.replicas:
            step = int(rep["step"])
            if step <= self.replicas_seen.get(source, -1):
                continue
            self.replicas_seen[source] = step
            if rep["agree"]:
                if self.memory.replica_agree is None or step > self.memory.replica_agree:
                    self.memory.replica_agree = step
                continue
            # The ranks' own last agreeing check of this attempt counts too: the supervisor
            # reads the report file when it looks, and a fast run rewrites it in between.
            own = rep.get("last_agree")
            last = self.memory.replica_agree
            if isinstance(own, int) and not isinstance(own, bool) and own < step and (last is None or own > last):
                last = self.memory.replica_agree = own
            ranks = [int(r) for r in rep.get("suspects") or []]
            ambiguous = bool(rep.get("ambiguous")) or not ranks
            nodes = sorted({n for n in (self.rank_node(r) for r in ranks) if n})
            f = stb.Finding(stb.Kind.SDC, step, (last + 1) if last is not None else 0, "replicas", float("nan"),
                            ranks=tuple(ranks))
            d = self.stability.decide_sdc(f)
            out.append(Record(E.SDC_SUSPECT, {"step": step, "last_agree": last, "ranks": ranks, "nodes": nodes,
                                              "ambiguous": ambiguous, "groups": rep.get("digests") or {},
                                              "decision": str(d.action), "why": d.why}))
            if d.hold is not None:
                out.append(HoldCheckpoint(d.hold, f"replicas: newest checkpoint at or before the last agreeing "
                                                  f"check (step {last})"))
            if not ambiguous:
                for node in nodes:
                    why = (f"sdc_suspect: rank(s) {','.join(map(str, ranks))} held parameters that differ from "
                           f"the other replicas at step {step}")
                    self._mark_bad(node, why, ev.now, out,
                                   reason=drains.make_reason(drains.SDC, f"ranks {','.join(map(str, ranks))}",
                                                             f"replicas differ at step {step}"))
            self.stability_decision = d
            self.memory.hint = self.stability.hint
            return out + self._kill(ev.now, KillCause.ROLLBACK if d.action == stb.Action.ROLLBACK
                                    else KillCause.DIVERGED)
        return out

    def _exited_on_stability(self, ev: StepExited, out: List[Action]) -> List[Action]:
        """The step the stability guard killed is gone: relaunch from the rollback's
        checkpoint, or end the job (stop, give up)."""
        d, self.stability_decision = self.stability_decision, None
        out.append(Record(E.STEP_EXIT, {"returncode": ev.returncode, "cause": Cause.ROLLED_BACK,
                                        "decision": str(d.action)}))
        if d.action in (stb.Action.ROLLBACK, stb.Action.REPLAY):
            # Nothing is moved before the target is known to be there and good: retention may
            # have pruned it, or it may be damaged (the step is gone: nothing writes meanwhile).
            self.rollback_to_pick = d
            self.kill_sent_at = None            # no step left to escalate against
            out.append(PickRollback(d.before, d.hint.from_step))
            return out
        # Ending: whatever was saved since the anomaly began is no good checkpoint either.
        out.append(SetAside(d.finding.began - 1, f"{d.finding.kind} from step {d.finding.began}"))
        if d.action == stb.Action.STOP:
            return self._exit(EXIT_DIVERGED, f"training diverged ({d.finding.kind} at step {d.finding.step}); "
                                             f"stopped without saving", out)
        return self._exit(EXIT_ROLLBACK_BUDGET, f"training diverged again ({d.finding.kind} at step "
                                                f"{d.finding.step}): {d.why}", out)

    def _on_rollback_picked(self, ev: RollbackPicked) -> List[Action]:
        """The disk's word on a rollback's target: roll back to the checkpoint found (only the
        newer ones are set aside), or, when none is there, give up as the guard does when it
        knows of none: exit 9, nothing from before the anomaly moved."""
        d, self.rollback_to_pick = self.rollback_to_pick, None
        if d is None or self.state != KILLING:
            return []
        out: List[Action] = [Record(E.CHECKPOINT_BAD, {"step": s, "path": p, "problems": list(pr)[:3]})
                             for s, p, pr in ev.bad]
        problems = "; ".join(f"step {s}: {', '.join(pr[:1]) or 'bad'}" for s, _, pr in ev.bad)
        if d.action == stb.Action.REPLAY:
            return self._start_replay(d, ev, problems, out)
        planned = d.hint.from_step
        d = self.stability.retarget(d, ev.step, problems)
        self.memory.hint = self.stability.hint
        if d.action != stb.Action.ROLLBACK:
            # The guard's give-up path: nothing from before the anomaly moves (the good ones
            # stay for the person taking over); only what was saved since it began, which may
            # hold the bad state, goes aside, so that no resume picks it up.
            f = d.finding
            if d.hold is not None:
                out.append(HoldCheckpoint(d.hold, f"stability: newest checkpoint before the {f.kind} that "
                                                  f"began after step {f.began - 1} ({d.action})"))
            out.append(SetAside(f.began - 1, f"{f.kind} from step {f.began}"))
            return self._exit(EXIT_ROLLBACK_BUDGET, f"training diverged ({f.kind} at step {f.step}) and cannot roll "
                                                    f"back: {d.why}; no checkpoint from before step {f.began} "
                                                    f"set aside", out)
        h = d.hint
        if h.from_step != planned:      # another target than planned: retention keeps it from here on
            out.append(HoldCheckpoint(h.from_step, f"stability: rollback {h.rollback} target ({d.finding.kind} "
                                                   f"from step {d.finding.began})"))
        out.append(Record(E.ROLLBACK, {"to_step": h.from_step, "anomaly_step": h.anomaly_step,
                                       "skip_batches": h.skip_batches, "lr_factor": h.lr_factor,
                                       "rollback": h.rollback, "lost_steps": max(0, d.finding.step - h.from_step)}))
        self.memory.last_ckpt_step = h.from_step   # not the newer ones: they are set aside
        self.memory.restarts += 1
        self.last_cause = Cause.ROLLED_BACK
        out.append(SetAside(h.from_step, f"rollback {h.rollback} ({d.finding.kind} from step {d.finding.began})"))
        return self._plan_launch(ev.now, out)

    def _start_replay(self, d: stb.Decision, ev: RollbackPicked, problems: str, out: List[Action]) -> List[Action]:
        """The disk's word on the replay's checkpoint (the newest before the anomaly began that
        exists and verifies): set aside what was saved after it (the anomaly may be in it,
        whatever the verdict), and relaunch from it on other nodes, in replay mode."""
        f = d.finding
        if ev.step is None:
            out.append(SetAside(f.began - 1, f"{f.kind} from step {f.began}"))
            return self._exit(EXIT_ROLLBACK_BUDGET, f"training diverged ({f.kind} at step {f.step}) and cannot be "
                                                    f"replayed: no checkpoint at or before step {d.before} exists "
                                                    f"and verifies" + (f" ({problems})" if problems else ""), out)
        if ev.step != d.hint.from_step:
            out.append(HoldCheckpoint(ev.step, f"stability: replay of the {f.kind} from step {f.began}"))
        self.stability.replayed(ev.step)
        self.memory.last_ckpt_step = ev.step
        self.memory.restarts += 1
        self.last_cause = Cause.ROLLED_BACK
        evidence = dict(self.replay_evidence)
        plan = ReplayPlan(f, ev.step, stb.replay_until(f, evidence, self.stability.cfg.replay_margin_steps),
                          evidence, self.replay_nodes)
        first, ranks, nodes = stb.origin(plan.nonfinite)
        out.append(SetAside(ev.step, f"replay of the {f.kind} from step {f.began}"))
        out.append(Record(E.REPLAY_STARTED, {"kind": str(f.kind), "step": f.step, "began": f.began,
                                             "from_step": ev.step, "until": plan.until, "first_step": first,
                                             "first_ranks": list(ranks), "first_nodes": list(nodes)}))
        return self._plan_launch(ev.now, out, replay=plan)

    def _exited_replay(self, ev: StepExited, out: List[Action]) -> List[Action]:
        """The replay ended (it reached its last step, or failed): data or hardware
        (:func:`clusterops.supervisor.stability.judge_replay`). Data -- or a replay that could not
        tell -- rolls back with the skip, as ``rollback`` does; hardware keeps the node whose ranks
        went non-finite first out (drained with the ``sdc`` origin under ``drain_bad_nodes``)
        and goes on from the replay's checkpoint with nothing skipped; not reproduced but no
        single node to name: the same, with nobody blamed."""
        plan, self.replay, self.rotate = self.replay, None, 0
        self.replay_evidence, self.replay_nodes = {}, ()
        f = plan.finding
        j = stb.judge_replay(f, plan.nonfinite, ev.replay, ranks=self.expected_ranks, until=plan.until,
                             single_node=len(plan.nodes) == 1)
        out.append(Record(E.REPLAY_DECIDED, {"verdict": str(j.verdict), "reproduced": j.reproduced, "node": j.node,
                                             "ranks": list(j.ranks), "kind": str(f.kind), "step": f.step,
                                             "from_step": plan.from_step, "until": plan.until,
                                             "replay_step": j.replay_step, "returncode": ev.returncode,
                                             "reports": len(ev.replay), "why": j.why}))
        if j.reproduced is not False:
            d = self.stability.decide_rollback(f)
            self.memory.hint = self.stability.hint
            if d.action != stb.Action.ROLLBACK:
                out.append(SetAside(f.began - 1, f"{f.kind} from step {f.began}"))
                return self._exit(EXIT_ROLLBACK_BUDGET, f"training diverged ({f.kind} at step {f.step}, replayed: "
                                                        f"{j.verdict}): {d.why}", out)
            if d.hold is not None:
                out.append(HoldCheckpoint(d.hold, f"stability: rollback target ({f.kind} from step {f.began})"))
            if self.state != KILLING:
                self._enter(KILLING)
            self.kill_sent_at = None
            self.rollback_to_pick = d
            out.append(PickRollback(d.before, d.hint.from_step))
            return out
        if j.verdict == stb.ReplayVerdict.HARDWARE and j.node:
            ranks = ",".join(map(str, j.ranks))
            self._mark_bad(j.node, f"replay: rank(s) {ranks} went non-finite at step {f.began}-{f.step} on it and "
                                   f"not on other nodes", ev.now, out,
                           reason=drains.make_reason(drains.SDC, f"ranks {ranks}",
                                                     f"{f.kind} at step {f.step} not reproduced on other nodes"))
        d = self.stability.decide_clean_rollback(f, plan.from_step, "the replay's checkpoint (not reproduced)")
        self.memory.hint = self.stability.hint
        if d.action != stb.Action.ROLLBACK:
            out.append(SetAside(plan.from_step, f"{f.kind} from step {f.began}"))
            return self._exit(EXIT_ROLLBACK_BUDGET, f"training diverged ({f.kind} at step {f.step}, replayed: "
                                                    f"{j.verdict}): {d.why}", out)
        h = d.hint
        out.append(Record(E.ROLLBACK, {"to_step": h.from_step, "anomaly_step": h.anomaly_step,
                                       "skip_batches": h.skip_batches, "lr_factor": h.lr_factor,
                                       "rollback": h.rollback, "lost_steps": max(0, f.step - h.from_step),
                                       "replay": str(j.verdict)}))
        self.memory.last_ckpt_step = h.from_step
        self.memory.restarts += 1
        self.last_cause = Cause.ROLLED_BACK
        return self._plan_launch(ev.now, out)

    def _straggler(self, f, now: float) -> List[Action]:
        """A node found slow: record it; replace it at a checkpoint when asked and a spare is free."""
        metric = f"{f.measure} time {f.ratio:g}x the other nodes' median"
        detail = f"{f.node_ms:g} vs {f.others_ms:g} ms/step"
        reason = drains.make_reason(drains.STRAGGLER, metric, f"{detail}, seen by the job supervisor")
        self.straggler_why[f.node] = (f"straggler: {metric} ({detail})", reason)
        rec = {"node": f.node, "ratio": f.ratio, "measure": f.measure, "node_ms": f.node_ms,
               "others_ms": f.others_ms, "ranks": list(f.ranks), "step": f.step}
        free = [n for n in self.spares if n not in self.bad]
        if not self.policy.replace_stragglers:
            return [Record(E.STRAGGLER, dict(rec, action="record", why="replace_stragglers is off"))]
        if not free:
            return [Record(E.STRAGGLER, dict(rec, action="record", why="no spare node"))]
        if self.state != RUNNING or self.replacing:
            return [Record(E.STRAGGLER, dict(rec, action="record", why="a stop is already under way"))]
        # A planned stop through the ordinary stop path: the ranks agree on a step, save it
        # and exit; the relaunch resumes from exactly that step without the slow node.
        self.replacing = f.node
        self.stop_reason = StopReason.STRAGGLER
        self._enter(STOPPING)
        self.stop_deadline = now + self.policy.stop_timeout_s
        return [Record(E.STRAGGLER, dict(rec, action="replace", spare=self._in_domain_first(f.node, free)[0])),
                Record(E.STOP_REQUESTED, {"reason": StopReason.STRAGGLER, "state": RUNNING, "node": f.node}),
                RequestStop(StopReason.STRAGGLER)]

    def _foreign_drains(self, ev: NodesDown) -> List[Action]:
        """Nodes of the allocation an administrator (anyone but clusterops) drained while the
        job runs: a planned replacement. A spare free: stop the ranks with a checkpoint now
        and relaunch on the spare (0 steps lost). None: keep running and say so; with
        ``drain_grace_s`` stop with a checkpoint and requeue without the node before the grace
        ends. A drained spare is only dropped. The drain and its reason are never touched."""
        out: List[Action] = []
        for node, reason in sorted(ev.drained.items()):
            if node not in self.allocation or node in self.foreign_drains or node in self.bad:
                continue
            self.foreign_drains[node] = reason
            rec = {"node": node, "reason": reason}
            if node not in self.active:
                if node in self.spares:
                    self.spares.remove(node)
                self.bad[node] = f"drained by someone else: {reason}"
                out.append(Record(E.NODE_DRAINED, dict(rec, action="spare dropped")))
                continue
            free = [n for n in self.spares if n not in self.bad]
            if free and self.state == RUNNING and not self.replacing:
                self.replacing = node
                self.stop_reason = StopReason.DRAINED
                self._enter(STOPPING)
                self.stop_deadline = ev.now + self.policy.stop_timeout_s
                out += [Record(E.NODE_DRAINED, dict(rec, action="replace", spare=self._in_domain_first(node, free)[0])),
                        Record(E.STOP_REQUESTED, {"reason": StopReason.DRAINED, "state": RUNNING, "node": node}),
                        RequestStop(StopReason.DRAINED)]
                continue
            grace = self.policy.drain_grace_s
            if grace:
                at = ev.now + max(0.0, grace - self.policy.stop_timeout_s)
                self.drain_deadline = at if self.drain_deadline is None else min(self.drain_deadline, at)
            out.append(Record(E.NODE_DRAINED, dict(
                rec, action="keep running", why="no spare node" if not free else "a stop is already under way",
                **({"stop_in_s": round(self.drain_deadline - ev.now, 1)} if grace else {}))))
        return out

    def _drain_grace_over(self, now: float) -> List[Action]:
        """``drain_grace_s`` ran out for a drained node with no spare: stop with a save and
        requeue without the drained nodes (left out, never drained again by us)."""
        self.drain_deadline = None
        out: List[Action] = []
        for node, reason in self.foreign_drains.items():
            if node in self.active:
                self._mark_bad(node, f"drained by someone else: {reason}", now, out, drain=False)
        out.append(Record(E.STOP_REQUESTED, {"reason": StopReason.DRAINED, "state": RUNNING,
                                             "nodes": sorted(self.foreign_drains)}))
        self.stop_reason = StopReason.DRAINED
        self._enter(STOPPING)
        self.stop_deadline = now + self.policy.stop_timeout_s
        return out + [RequestStop(StopReason.DRAINED)]

    def _mark_straggler(self, node: str, now: float, out: List[Action]) -> None:
        if node in self.foreign_drains:     # replaced for someone else's drain: left out, the drain left alone
            self._mark_bad(node, f"drained by someone else: {self.foreign_drains[node]}", now, out, drain=False)
            return
        why, reason = self.straggler_why.get(node, ("straggler", drains.make_reason(drains.STRAGGLER, "straggler")))
        self._mark_bad(node, why, now, out, reason=reason)

    def _replace_straggler(self, now: float, out: List[Action], *, clean: bool) -> List[Action]:
        """The planned stop is over: keep the slow node out (drained as a straggler when the
        policy drains) and relaunch on the spare; a clean stop is no failed attempt."""
        node, self.replacing = self.replacing, None
        self._mark_straggler(node, now, out)
        self.stop_reason = None
        self.stop_deadline = None
        self.last_cause = StopReason.STRAGGLER
        if not clean:
            self.restarts_here += 1
            self.memory.restarts += 1
        return self._plan_launch(now, out)

    def _silent_together(self, stale, ev: Heartbeats, ranks) -> List[Tuple[int, Optional[float]]]:
        """The ranks past the hang timeout, and with them every rank that fell silent within
        a few seconds of the oldest (``hang_blame_margin_s``, at most half the timeout). One
        stopped rank blocks the others in their next collective, so all of them go quiet at
        about the same step, and which one crosses the timeout first is a matter of scheduling
        under load, not evidence: the record names them all (and their stacks are all taken);
        ``culprits`` says whether the beats alone single anyone out."""
        ages = [a for _, a in stale if a is not None]
        if not ages:
            return stale
        window = min(self.policy.hang_blame_margin_s, self.policy.hang_timeout_s / 2)
        floor = max(ages) - window
        named = dict(stale)
        for r in sorted(ranks):
            beat = ev.beats.get(r)
            if r not in named and beat is not None and ev.now - beat[1] >= floor:
                named[r] = round(ev.now - beat[1], 1)
        return sorted(named.items())

    def _hang_culprits(self, beats: Mapping[int, Tuple[int, float]], ranks) -> Tuple[int, ...]:
        """Ranks that stopped first. One stuck rank soon blocks all the others in their next
        collective, so "every rank is stale" says little; the culprits are the ranks that
        fell silent clearly before the rest (or never started while the rest did)."""
        silent = [r for r in ranks if r not in beats]
        if silent and len(silent) < len(ranks):
            return tuple(sorted(silent))
        if silent:
            return ()
        times = sorted(t for _, t in beats.values())
        newest = times[-1]
        margin = self.policy.hang_blame_margin_s
        early = tuple(sorted(r for r, (_, t) in beats.items() if t < newest - margin))
        return early if len(early) < len(beats) else ()

    @property
    def expected_ranks(self) -> int:
        return self.policy.ranks_per_node * len(self.active)

    def rank_node(self, rank: int) -> Optional[str]:
        """The node a rank runs on: srun's block distribution lays ranks out node by node
        (a replay's launch rotates them by ``rotate`` nodes)."""
        i = rank // max(self.policy.ranks_per_node, 1)
        if not 0 <= i < len(self.active):
            return None
        return self.active[(i + self.rotate) % len(self.active)]

    def _kill(self, now: float, cause: str) -> List[Action]:
        self._enter(KILLING)
        self.kill_cause = cause
        self.kill_sent_at = now
        return [KillStep(cause)]

    def _on_nodes_down(self, ev: NodesDown) -> List[Action]:
        out: List[Action] = self._foreign_drains(ev)
        fresh = {n: s for n, s in ev.nodes.items() if n in self.allocation and n not in self.down_seen}
        for node, st in sorted(fresh.items()):
            self.down_seen.add(node)
            out.append(Record(E.NODE_DOWN, {"node": node, "state": st}))
            self._mark_bad(node, f"node {st}", ev.now, out)
            if node in self.spares:
                self.spares.remove(node)
        if any(n in self.active and n not in self.left_inprocess for n in fresh) and self.state == RUNNING:
            out += self._kill(ev.now, KillCause.NODE_DOWN)
        return out

    def _on_ranks_moved(self, ev: RanksMoved) -> List[Action]:
        out: List[Action] = []
        for rank, src, dst in ev.moves:
            if src == dst or src in ev.holding or src not in self.active:
                continue
            self.left_inprocess.add(src)
            i = self.active.index(src)
            if dst in self.spares and dst not in self.active:
                self.active[i] = dst       # rank // ranks_per_node is dst's now
                self.spares.remove(dst)
                out.append(Record(E.SPARE_USED, {"nodes": [dst], "replacing": src, "inprocess": True}))
            # else its ranks went to standbys on nodes of the step: it keeps its place in
            # ``active`` (rank // ranks_per_node), and its loss no longer ends the step.
        return out

    def _on_stop_requested(self, ev: StopRequested) -> List[Action]:
        out: List[Action] = [Record(E.STOP_REQUESTED, {"reason": ev.reason, "state": self.state})]
        if self.replacing and not self.pending_stop:
            # The ranks are already stopping (to replace a straggler): their checkpoint
            # serves this stop too, which then wins (requeue, not relaunch).
            self.pending_stop = ev.reason
            return out
        if self.stop_reason or self.pending_stop:
            return out          # one stop is enough; the first deadline stands
        if self.state == RUNNING:
            self.stop_reason = ev.reason
            self._enter(STOPPING)
            self.stop_deadline = ev.now + self.policy.stop_timeout_s
            out.append(RequestStop(ev.reason))
        elif self.state == KILLING:
            # The step is going away anyway; requeue once it is gone.
            self.pending_stop = ev.reason
        elif self.state in (PREFLIGHT, POSTMORTEM, IDLE):
            self.pending_stop = ev.reason
            if self.state == IDLE:
                self.stop_reason = ev.reason
                return out + self._requeue(f"stop requested ({ev.reason})", out=[])
        return out

    def _on_checkpoint_committed(self, ev: CheckpointCommitted) -> List[Action]:
        out: List[Action] = [Record(E.CHECKPOINT, {"step": ev.step, "path": ev.path})]
        if self.memory.last_ckpt_step is None or ev.step > self.memory.last_ckpt_step:
            self.memory.last_ckpt_step = ev.step
        if self.state == RUNNING:
            self._trial_passed(ev.step, ev.now, out)
        if self.stability is not None and self.state == RUNNING:   # not the dying step's, after a finding
            self.stability.checkpoint(ev.step)
            self.memory.hint = self.stability.hint
        return out

    def _on_tick(self, ev: Tick) -> List[Action]:
        out: List[Action] = []
        if self.state == RUNNING and self.drain_deadline is not None and ev.now >= self.drain_deadline:
            return self._drain_grace_over(ev.now)
        if self.state == STOPPING and self.stop_deadline is not None and ev.now > self.stop_deadline:
            out.append(Record(E.STOP_TIMEOUT, {"after_s": self.policy.stop_timeout_s}))
            out += self._kill(ev.now, KillCause.STOP_TIMEOUT)
            if not self.replacing:      # a straggler's stop that timed out: relaunch, not requeue
                self.pending_stop = self.stop_reason
        elif self.state == KILLING and self.kill_sent_at is not None:
            if ev.now - self.kill_sent_at > self.policy.kill_timeout_s:
                self.kill_sent_at = ev.now
                out.append(Record(E.KILL_ESCALATED, {"cause": self.kill_cause}))
                out.append(KillStep(self.kill_cause or "unknown", force=True))
        return out

    def _on_resume_chosen(self, ev: ResumeChosen) -> List[Action]:
        self.memory.last_ckpt_step = ev.step
        if self.stability is not None:
            self.stability.launched(ev.step)
        # A new attempt checks its replicas from the resumed state on: its reports start over,
        # and what agreed after the resume point belongs to a discarded timeline.
        self.replicas_seen.clear()
        if ev.step is not None:
            a = self.memory.replica_agree
            self.memory.replica_agree = ev.step if a is None else min(a, ev.step)
        if self.state == RUNNING:
            self.ckpt_at_launch = ev.step
        return [Record(E.RESUME, {"step": ev.step, "path": ev.path, "skipped": list(ev.skipped)})]

    def _on_hang_named(self, ev: HangNamed) -> List[Action]:
        """The flight recorders' word on a hang being killed: the ranks that never entered the
        collective the others wait in become the hang's culprits (blamed at the step's end,
        dropped at ``node_fail_threshold`` blames: a node named twice is left out). Without a
        name the heartbeats' culprits stand."""
        if self.state != KILLING or self.kill_cause != KillCause.HANG:
            return []
        nodes = sorted({n for n in (self.rank_node(r) for r in ev.ranks) if n})
        out: List[Action] = [Record(E.HANG_NAMED, {"ranks": list(ev.ranks), "nodes": nodes, "why": ev.why,
                                                   "silent": list(ev.silent), "source": ev.source,
                                                   "heartbeat_culprits": list(self.hang_culprits),
                                                   **({"ras": ev.ras} if ev.ras else {})})]
        if ev.ranks:
            self.hang_culprits = tuple(ev.ranks)
        return out

    def _on_requeue_failed(self, ev: RequeueFailed) -> List[Action]:
        if ev.unschedulable:
            return self._exit(EXIT_TOO_FEW_NODES, f"not requeued: {ev.error}", [])
        return self._exit(EXIT_FAILED, f"requeue failed: {ev.error}", [])

    def classify(self, ev: StepExited) -> Tuple[Cause, List[str]]:
        """(cause, blamed nodes) for a failed step (:meth:`judge`)."""
        v = self.judge(ev)
        return v.cause, v.blamed

    def judge(self, ev: StepExited) -> Verdict:
        """Why a failed step failed, and the nodes the evidence points at: a hang's first
        silent ranks, a lost node, the first failed rank's death by a signal, a hardware
        sign in its own output. A rank that exited or aborted on its own -- after a
        traceback or a C++ "terminate called", with a bare error code or SIGABRT, or ranks
        of several nodes -- blames nobody: the program's error
        (an error from one node only is weighed across relaunches, :meth:`_weigh_error`).
        srun's wording is read by each failure's ``kind`` (clusterops.slurm.parse), the
        ranks' output by clusterops.supervisor.evidence."""
        if self.kill_cause == KillCause.HANG:
            blamed = sorted({self.rank_node(r) for r in self.hang_culprits if self.rank_node(r)})
            return Verdict(Cause.HANG, blamed, Evidence.HANG if blamed else None)
        lost = sorted((set(ev.node_failure) | (self.down_seen & set(self.active))) - self.left_inprocess)
        if lost or self.kill_cause == KillCause.NODE_DOWN:
            return Verdict(Cause.NODE_LOST, lost, Evidence.NODE_LOST if lost else None)
        if not ev.failures:
            return Verdict(Cause.STEP_FAILED)
        first, out = ev.failures[0], ev.task_output
        found = first_error(out, [first.rank] + [f.rank for f in ev.failures])
        error = found[1] if found else None
        if first.kind == FailureKind.KILLED and not first.aborted:
            # srun names the rank that died first; the ranks it ends itself afterwards
            # (--kill-on-bad-exit: a SIGTERM, then a SIGKILL after KillWait) come later and
            # say nothing about their nodes.
            return Verdict(Cause.RANK_KILLED, [first.node] if first.node else [], Evidence.SIGNAL, error)
        # A SIGABRT is raised by the process itself (std::terminate, abort(), an assert):
        # like an exit, it points at the node only through a hardware sign in its output.
        own = self._sign_on(first.node, ev)
        if own is not None and first.node:
            cause = Cause.RANK_EXIT if first.kind == FailureKind.EXITED else Cause.RANK_FAILED
            return Verdict(cause, [first.node], Evidence.HARDWARE, error, own)
        exited = {f.node for f in ev.failures if f.kind == FailureKind.EXITED}
        if error is not None or (first.kind == FailureKind.EXITED and len(exited) >= 2):
            return Verdict(Cause.PROGRAM_ERROR, [], None, error)
        # An exit code (or an ending) with nothing said: no evidence either way.
        return Verdict(Cause.RANK_EXIT if first.kind == FailureKind.EXITED else Cause.RANK_FAILED)

    @staticmethod
    def _sign_on(node: str, ev: StepExited) -> Optional[Tuple[str, str]]:
        """The hardware sign a failed rank on ``node`` printed, unless failed ranks of another
        node printed the same kind: then it is the run's (a NCCL setting, a peer lost), not
        this node's."""
        out = ev.task_output
        signs = [(f.node, out[f.rank].sign) for f in ev.failures if f.rank in out and out[f.rank].sign]
        mine = [sg for n, sg in signs if n == node]
        if not mine:
            return None
        if any(n != node and sg[0] == mine[0][0] for n, sg in signs):
            return None
        return mine[0]

    def _weigh_error(self, v: Verdict, ev: StepExited, out: List[Action]) -> None:
        """The program error of one node only, across relaunches. The same rank failing the
        same way on the same node twice cannot tell the rank from the node; with a spare free
        the next launch goes without that node (a trial): the error again from another node
        is the program's, a run past the step it failed at without it blames the node
        (:meth:`_trial_passed`). Without a spare nothing is blamed, and the no-progress rule
        ends the crash loop as for any program error."""
        if v.cause != Cause.PROGRAM_ERROR or not v.error:
            return            # another failure (a kill, a hang) neither confirms nor clears it
        # Only ranks that printed this very error count: a peer's own traceback about the
        # failed rank ("Connection closed by peer", a collective timing out) is a consequence.
        said = [f for f in ev.failures if f.node and ev.task_output.get(f.rank, TaskOutput()).error == v.error]
        sites = sorted({f.node for f in said})
        s = self.suspect
        ranks = [f.rank for f in said]
        if len(sites) != 1 or v.error in self.everywhere or (s is not None and s.error == v.error
                                                              and s.node != sites[0]):
            # The same error from several nodes: the program's (no node is suspected of it again).
            if s is not None and s.error == v.error:
                out.append(Record(E.NODE_SUSPECT, {"node": s.node, "rank": s.rank, "error": s.error,
                                                   "decision": "cleared", "why": "the same error from "
                                                   + ", ".join(n for n in sites if n != s.node)}))
                self.suspect = None
            if len(sites) > 1 or s is not None and s.error == v.error:
                self.everywhere.add(v.error)
            return
        node, rank = sites[0], ranks[0]
        if s is None or s.node != node or s.error != v.error or s.rank != rank:
            self.suspect = Suspect(node, rank, v.error)
            return
        s.times += 1
        free = [n for n in self._usable() if n not in self.active and n != node]
        if not s.trial and free:
            s.trial, s.past_step = True, self.memory.last_ckpt_step
            out.append(Record(E.NODE_SUSPECT, {"node": node, "rank": rank, "error": v.error, "times": s.times,
                                               "decision": "trial", "past_step": s.past_step,
                                               "why": "the same error from this node alone: relaunching "
                                                      "without it to tell the node from the program"}))

    def _trial_passed(self, step: Optional[int], now: float, out: List[Action], *, finished: bool = False) -> None:
        """A run without the suspect node got past the step the error stopped it at (or
        finished): the error was the node's (rank ``rank`` failed only there)."""
        s = self.suspect
        if s is None or not s.trial or s.node in self.active:
            return
        if not finished and (step is None or (s.past_step is not None and step <= s.past_step)):
            return
        self.suspect = None
        why = (f"the same error {s.times} times on it alone ({s.error}); rank {s.rank} ran past step "
               f"{s.past_step} without it")
        out.append(Record(E.NODE_SUSPECT, {"node": s.node, "rank": s.rank, "error": s.error,
                                           "decision": "blamed", "step": step, "finished": finished, "why": why}))
        self._mark_bad(s.node, why, now, out)

    def _on_step_exited(self, ev: StepExited) -> List[Action]:
        out: List[Action] = []
        if self.state not in (RUNNING, KILLING, STOPPING):
            return out
        if ev.ckpt_step is not None:
            # The plumbing's look at the disk is the truth (a corrupted newest checkpoint
            # can move the latest good one back).
            self.memory.last_ckpt_step = ev.ckpt_step
        if self.replay is not None:
            if self.state == STOPPING:      # a stop (time limit, preemption) came first: it wins
                self.replay, self.rotate = None, 0
            else:
                return self._exited_replay(ev, out)
        if self.state == RUNNING:
            # A trial without the suspect node that got further, or to the end, blames it.
            finished = ev.returncode == 0 and not ev.failures and not ev.node_failure and not ev.stopped_by
            self._trial_passed(self.memory.last_ckpt_step, ev.now, out, finished=finished)
        if self.state == KILLING and self.stability_decision is not None:
            return self._exited_on_stability(ev, out)
        if self.state == STOPPING:
            return self._exited_on_our_stop(ev, out)
        if self.state == RUNNING and ev.returncode == 0 and ev.stopped_by:
            return self._exited_on_a_foreign_stop(ev, out)
        if self.state == RUNNING and ev.returncode == 0 and not ev.failures and not ev.node_failure:
            out.append(Record(E.STEP_EXIT, {"returncode": 0, "cause": Cause.FINISHED}))
            return self._exit(EXIT_DONE, "training finished", out)
        return self._exited_failed(ev, out)

    def _exited_on_our_stop(self, ev: StepExited, out: List[Action]) -> List[Action]:
        """The ranks stopped as we asked (time limit, preemption, a straggler's replacement)."""
        # (A clean exit without the stopped marker may also be a training that reached
        # its end before it heard the stop; a script without the marker cannot say which.
        # The relaunch then resumes from its last checkpoint: safe either way.)
        out.append(Record(E.STOPPED, {"returncode": ev.returncode, "ckpt_step": self.memory.last_ckpt_step,
                                      "reason": self.stop_reason}))
        if self.replacing and not self.pending_stop:
            return self._replace_straggler(ev.now, out, clean=ev.returncode == 0)
        if self.replacing:
            node, self.replacing = self.replacing, None
            self._mark_straggler(node, ev.now, out)
            self.stop_reason = self.pending_stop
        return self._requeue(f"stopped for {self.stop_reason}", out)

    def _exited_on_a_foreign_stop(self, ev: StepExited, out: List[Action]) -> List[Action]:
        """Exit 0 is not "finished" when the ranks were told to stop behind our back."""
        self.stop_reason = ev.stopped_by
        out.append(Record(E.STOP_REQUESTED, {"reason": ev.stopped_by, "state": "seen after the exit"}))
        out.append(Record(E.STOPPED, {"returncode": 0, "ckpt_step": self.memory.last_ckpt_step,
                                      "reason": self.stop_reason}))
        return self._requeue(f"stopped for {self.stop_reason}", out)

    def _exited_failed(self, ev: StepExited, out: List[Action]) -> List[Action]:
        """A failed step: classify it, count the attempt, blame nodes, check, relaunch."""
        failures = [{"node": f.node, "rank": f.rank, "reason": f.reason} for f in ev.failures]
        v = self.judge(ev)
        cause, blamed = v.cause, v.blamed
        rec = {"returncode": ev.returncode, "cause": cause, "blamed": blamed, "failures": failures[:8]}
        if v.evidence is not None:
            rec["evidence"] = v.evidence
        if v.sign is not None:
            rec["sign"] = list(v.sign)
        if v.error:
            rec["error"] = v.error
        code, action = self._exit_contract(ev)
        if action is not None:
            rec["exit_code"], rec["exit_action"] = code, action
        out.append(Record(E.STEP_EXIT, rec))
        self.last_error = v.error
        if self.replacing:
            # The straggler's planned stop timed out and the step was killed: relaunch
            # without the slow node from the latest checkpoint (or requeue for a stop that
            # came meanwhile).
            if not self.pending_stop:
                return self._replace_straggler(ev.now, out, clean=False)
            node, self.replacing = self.replacing, None
            self._mark_straggler(node, ev.now, out)
        if self.pending_stop:
            self.stop_reason = self.pending_stop
            return self._requeue(f"stopped for {self.pending_stop}", out)
        if action is not None:
            return self._exited_by_contract(ev, cause, code, action, out)
        given_up = self._count_failed_attempt(ev, cause, out)
        if given_up is not None:
            return given_up
        self._weigh_error(v, ev, out)
        self._blame(blamed, cause, ev.now, out)
        self.last_cause = cause
        return self._check_then_relaunch(ev.now, out)

    def _exit_contract(self, ev: StepExited) -> Tuple[Optional[int], Optional[str]]:
        """(code, action) when the first rank that exited on its own exited with a code the
        job maps (``exit_codes``); a rank killed by a signal is no such word. (None, None) else."""
        first = next((f for f in ev.failures if f.kind == FailureKind.EXITED), None)
        code = first.exit_code if first is not None else (ev.returncode if not ev.failures else None)
        if code is None or code not in self.exit_codes:
            return None, None
        return code, self.exit_codes[code]

    def _exited_by_contract(self, ev: StepExited, cause: Cause, code: int, action: str,
                            out: List[Action]) -> List[Action]:
        """The script said with its exit code what should happen (``exit_codes``): stop (no
        restart), requeue, or relaunch -- without the nodes it named (``sdk.report_suspects``:
        drained with ``drain_bad_nodes``, through the fleet guard, else only left out). The
        script's word replaces the blame rules; the restart budgets still hold."""
        suspects = sorted({n for n in ev.suspect_nodes if n in self.allocation}
                          | {n for n in (self.rank_node(r) for r in ev.suspect_ranks) if n})
        rec = {"code": code, "action": action}
        if action == "relaunch_without_suspects":
            rec["suspects"] = suspects
            if not suspects:
                rec["note"] = "the script named no suspect (sdk.report_suspects): relaunched on the same nodes"
        out.append(Record(E.EXIT_CONTRACT, rec))
        self.last_cause = cause
        if action == "stop":
            return self._exit(EXIT_SCRIPT_STOP, f"the script exited with {code}, which asks not to restart "
                                                f"(exit_codes: {code}: stop)", out)
        if action == "requeue":
            return self._requeue(f"the script exited with {code} (exit_codes: {code}: requeue)", out)
        given_up = self._count_failed_attempt(ev, cause, out)
        if given_up is not None:
            return given_up
        for node in suspects:
            self._mark_bad(node, f"exit_code {code}: the script named it suspect", ev.now, out)
        return self._check_then_relaunch(ev.now, out)

    def _count_failed_attempt(self, ev: StepExited, cause: Cause, out: List[Action]) -> Optional[List[Action]]:
        """Count the attempt against the budgets; the exit's actions when one is spent, else None."""
        # A failed attempt that ended with no newer checkpoint than it started from made
        # no progress; K of those in a row is a crash loop, not bad luck.
        start, end = self.ckpt_at_launch, self.memory.last_ckpt_step
        if end is not None and (start is None or end > start):
            self.memory.no_progress = 0
        else:
            self.memory.no_progress += 1
        self.restarts_here += 1
        self.memory.restarts += 1
        if self.memory.no_progress > self.policy.no_progress_restarts:
            return self._exit(EXIT_NO_PROGRESS,
                              f"no progress: latest checkpoint step {self.memory.last_ckpt_step} unchanged "
                              f"across {self.memory.no_progress} failed attempts "
                              f"(last: {cause}, exit {ev.returncode}"
                              + (f": {self.last_error}" if self.last_error else "") + ")", out)
        if self.restarts_here > self.policy.max_restarts:
            return self._exit(EXIT_RESTART_BUDGET,
                              f"restart budget spent ({self.policy.max_restarts}); last failure: {cause}"
                              + (f" ({self.last_error})" if self.last_error else ""), out)
        return None

    def _blame(self, blamed: Sequence[str], cause: Cause, now: float, out: List[Action]) -> None:
        """A lost node is out at once; another blamed node after node_fail_threshold failures."""
        for node in blamed:
            self.blame[node] = self.blame.get(node, 0) + 1
            if cause == Cause.NODE_LOST:
                self._mark_bad(node, LOST_WHY, now, out)
            elif self.blame[node] >= self.policy.node_fail_threshold:
                self._mark_bad(node, f"{self.blame[node]} failures blamed on it (last: {cause})", now, out)

    def _check_then_relaunch(self, now: float, out: List[Action]) -> List[Action]:
        profile = self.policy.postmortem or (LIVENESS if self.policy.liveness_check else None)
        targets = tuple(n for n in self.active + self.spares if n not in self.bad)
        if profile and targets:
            # Before trusting the same nodes again: does every node still answer (a
            # lost slurmd is seen here in a second, by Slurm only after SlurmdTimeout)?
            self._enter(POSTMORTEM)
            timeout = self.policy.preflight_timeout_s if self.policy.postmortem else self.policy.liveness_timeout_s
            out.append(RunPreflight(targets, profile, timeout, postmortem=True))
            return out
        return self._plan_launch(now, out)

    # One handler per event class, spelled out so that grep finds them (handle() looks here).
    HANDLERS = {
        PreflightDone: _on_preflight_done,
        StepLaunched: _on_step_launched,
        Heartbeats: _on_heartbeats,
        NodesDown: _on_nodes_down,
        RanksMoved: _on_ranks_moved,
        StopRequested: _on_stop_requested,
        CheckpointCommitted: _on_checkpoint_committed,
        Tick: _on_tick,
        ResumeChosen: _on_resume_chosen,
        RollbackPicked: _on_rollback_picked,
        HangNamed: _on_hang_named,
        RequeueFailed: _on_requeue_failed,
        StepExited: _on_step_exited,
    }
