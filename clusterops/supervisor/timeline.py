"""The supervisor's timeline: one JSON object per line in ``<job dir>/timeline.jsonl``.

Every event and decision of every incarnation of a supervised job is appended here
(``t`` epoch seconds, ``event`` kind, ``job_id``, ``incarnation`` = SLURM_RESTART_COUNT,
plus the event's own fields). ``clusterops job timeline JOBDIR`` prints it and renders
a self-contained chart (SVG, or HTML wrapping the SVG): training step against wall
time, with faults, restarts and requeues marked.
"""

from __future__ import annotations

import json
import math
import os
import time
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from clusterops.errors import InputError
from clusterops.jsonout import finite
from clusterops.textsafe import html_text, terminal

FILE_NAME = "timeline.jsonl"


class EventKind(str, Enum):
    """The ``event`` of a timeline record (a ``str``: the JSON is the plain word)."""

    # the state machine's records
    START = "start"
    PREFLIGHT_START = "preflight_start"
    PREFLIGHT = "preflight"
    LIVENESS = "liveness"
    POSTMORTEM = "postmortem"
    CHECK_BROKEN = "check_broken"
    LAUNCH = "launch"
    RESUME = "resume"
    PROGRESS = "progress"
    CHECKPOINT = "checkpoint"
    HEARTBEAT_LOST = "heartbeat_lost"
    EXIT_CONTRACT = "exit_contract"   # a script's exit code mapped by exit_codes: what it asked
    HANG_NAMED = "hang_named"         # the flight recorders' word on a hang: the rank that never entered
    STRAGGLER = "straggler"
    LOSS_SPIKE = "loss_spike"
    NAN = "nan"
    ROLLBACK = "rollback"
    NODE_DOWN = "node_down"
    NODE_BAD = "node_bad"
    NODE_DRAINED = "node_drained"     # drained by someone else while the job runs: replaced, or kept
    NODE_SUSPECT = "node_suspect"     # one program error from one node only, weighed across relaunches
    SDC_SUSPECT = "sdc_suspect"       # replicas that disagree (sdk.check_replicas): the ranks outside the majority
    REPLAY_STARTED = "replay_started"   # on_nan/on_spike: replay: the anomaly's steps rerun on other nodes
    REPLAY_DECIDED = "replay_decided"   # the replay's verdict: data, hardware (and the node) or ambiguous
    STOP_REQUESTED = "stop_requested"
    STOP_TIMEOUT = "stop_timeout"
    KILL_ESCALATED = "kill_escalated"
    STOPPED = "stopped"
    STEP_EXIT = "step_exit"
    SPARE_USED = "spare_used"
    TOPOLOGY = "topology"             # nodes by topology domain (block, leaf switch, NVLink domain): DomainSource
    SPARE_OUT_OF_DOMAIN = "spare_out_of_domain"   # a replacement from another topology domain (none free in its own)
    SHRINK = "shrink"
    RESTART = "restart"
    REQUEUE = "requeue"
    DONE = "done"
    GIVE_UP = "give_up"
    GENERATION_END = "generation_end"   # a chain's generation handed on to the next (supervisor.chain)
    WARNING = "warning"
    # the plumbing's own records (clusterops.supervisor.run)
    CHECKPOINT_BAD = "checkpoint_bad"
    CHECKPOINT_SET_ASIDE = "checkpoint_set_aside"
    DRAIN = "drain"
    DRAIN_REFUSED = "drain_refused"
    DRAIN_SKIPPED = "drain_skipped"
    HEARTBEAT_BIND = "heartbeat_bind"
    HEARTBEAT_RECEIVER_RESTARTED = "heartbeat_receiver_restarted"
    STACKS = "stacks"
    STATE_INVALID = "state_invalid"
    SUPERVISOR_ERROR = "supervisor_error"
    GENERATION = "generation"         # a chain's generation starts: its number, the chain's length, its job id
    CHAIN_END = "chain_end"           # the chain ended: why, and the queued generations cancelled
    REQUEUE_OFF = "requeue_off"       # Requeue=0 before a final exit (--requeue=expedite would hold the job)
    # the ranks' own records (clusterops.watchdog): the batch host lost, the job requeued
    SUPERVISOR_LOST = "supervisor_lost"
    TAKEOVER = "takeover"
    # in-process recovery (clusterops.supervisor.membership decides, rendezvous.py hosts)
    INPROC_FAULT = "inproc_fault"              # a rank lost: a new generation is being formed
    INPROC_RENDEZVOUS = "inproc_rendezvous"    # the new generation's plan (who replaces whom, the state's source)
    INPROC_STATE = "inproc_state"              # the state broadcast from a survivor, received
    INPROC_FIRST_STEP = "inproc_first_step"    # the new generation's first step: healed in-process
    INPROC_FALLBACK = "inproc_fallback"        # in-process gave up: the step is relaunched
    INPROC_REFILL = "inproc_refill"            # a new standby started on a node whose standby was used
    INPROC_STANDBY = "inproc_standby"          # that new standby is warm (said hello): in the pool
    INPROC_NODE_LOST = "inproc_node_lost"      # a node's standbys stopped beating: lost whole
    INPROC_SPARES = "inproc_spares"            # standbys started on the spare nodes (a step each)

    def __str__(self) -> str:
        return self.value


class Cause(str, Enum):
    """The ``cause`` of a ``step_exit`` record: why the training step ended."""

    FINISHED = "finished"            # exit 0, nothing failed
    HANG = "hang"                    # killed by us: heartbeats stopped
    NODE_LOST = "node_lost"          # srun or Slurm saw a node of the step fail
    PROGRAM_ERROR = "program_error"  # a rank exited after a traceback, or ranks on several nodes exited
    RANK_KILLED = "rank_killed"      # the first failed rank died of a signal
    RANK_EXIT = "rank_exit"          # the first failed rank exited with an error (no traceback)
    RANK_FAILED = "rank_failed"      # the first failed rank ended some other way (SIGTERM, ...)
    STEP_FAILED = "step_failed"      # non-zero exit with no failure srun named
    ROLLED_BACK = "rolled_back"      # killed by us: the stability guard rolls back (or stops)

    def __str__(self) -> str:
        return self.value


class Evidence(str, Enum):
    """The ``evidence`` of a ``step_exit`` record that blames nodes: what points at them.
    A failed step with none blames no node (clusterops.supervisor.machine, ``judge``)."""

    HANG = "hang"                    # their ranks' heartbeats stopped first
    NODE_LOST = "node_lost"          # srun or Slurm saw the node fail
    SIGNAL = "signal"                # the first failed rank died of a signal (srun's own ending
                                     # of the other ranks comes after it and counts for nothing)
    HARDWARE = "hardware"            # a hardware sign in that rank's own output (evidence.HARDWARE_SIGNS)

    def __str__(self) -> str:
        return self.value


class DomainSource(str, Enum):
    """The ``source`` of a ``topology`` record: where its nodes' domains come from. A later
    record's nodes take its domains over what an earlier one said of them."""

    SLURM = "slurm"                  # scontrol show topology at start: the block or the leaf switch
    NVML_FABRIC = "nvml_fabric"      # the nodes' own checks: NVML's GPU fabric, the NVLink domain itself

    def __str__(self) -> str:
        return self.value


E = EventKind
# Event kinds drawn as markers on the chart, and how.
FAULT_KINDS = {E.SUPERVISOR_LOST, E.HEARTBEAT_LOST, E.NODE_DOWN, E.NODE_BAD, E.STEP_EXIT, E.STOP_TIMEOUT,
               E.KILL_ESCALATED, E.ROLLBACK, E.INPROC_FAULT}
DECISION_KINDS = {E.EXIT_CONTRACT, E.TAKEOVER, E.RESTART, E.REQUEUE, E.GIVE_UP, E.SPARE_USED, E.SHRINK, E.STOP_REQUESTED, E.STOPPED,
                  E.DONE, E.INPROC_FIRST_STEP, E.INPROC_FALLBACK}
# Findings that are neither a fault nor a decision: a slow node (drawn in orange).
FINDING_KINDS = {E.STRAGGLER, E.LOSS_SPIKE, E.NAN, E.NODE_SUSPECT, E.SDC_SUSPECT, E.HANG_NAMED, E.REPLAY_DECIDED}


class Timeline:
    """Appends records to ``<job_dir>/timeline.jsonl`` (one write per record, flushed)."""

    def __init__(self, job_dir: os.PathLike, *, job_id: Optional[str] = None, incarnation: int = 0,
                 clock: Callable[[], float] = time.time):
        self.path = Path(job_dir) / FILE_NAME
        self.job_id = job_id
        self.incarnation = incarnation
        self.clock = clock

    def append(self, event: str, data: Optional[Mapping] = None, *, t: Optional[float] = None) -> dict:
        rec = {"t": round(self.clock() if t is None else t, 3), "event": str(event),
               "job_id": self.job_id, "incarnation": self.incarnation}
        rec.update(data or {})
        from clusterops.jsonout import dumps

        line = dumps(rec, indent=None, sort_keys=False)   # strict: NaN -> null
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: one write per line, so two writers never interleave inside a line.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        return rec


def timeline_path(job_dir: os.PathLike) -> Path:
    p = Path(job_dir)
    return p if p.is_file() else p / FILE_NAME


# Times outside this range cannot be a supervisor's clock (and break gmtime): year 1970..9999.
_T_MAX = 253402300799.0


_finite = finite   # the one finite-number reader (clusterops.jsonout)


def _record(line: bytes) -> Tuple[Optional[dict], str]:
    """One line -> (record, "") or (None, why it is not one)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    try:
        rec = json.loads(text)
    except (ValueError, RecursionError):
        return None, "not a JSON line"
    if not isinstance(rec, dict):
        return None, "not a JSON object"
    t = _finite(rec.get("t"))
    if t is None or not 0 <= t <= _T_MAX or not isinstance(rec.get("event"), str):
        return None, "no valid 't' and 'event'"
    rec["t"] = t
    return rec, ""


def load(job_dir: os.PathLike) -> Tuple[List[dict], List[Tuple[int, str]]]:
    """All readable records in file order, and the lines skipped as ``(line number, why)``.

    A writer killed mid-write leaves a torn line, and the next incarnation (after a
    requeue) appends after it, so a damaged line can sit anywhere: it is skipped and
    counted, never a reason to refuse the rest of the story.
    """
    path = timeline_path(job_dir)
    try:
        if path.exists() and not path.is_file() and not path.is_dir():
            # A FIFO or a device would block the reader or never end.
            raise InputError(f"{path}: not a regular file")
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no timeline here (is this a supervised job's directory?)") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a timeline") from None
    except OSError as e:
        raise InputError(f"{path}: unreadable: {e.strerror}") from None
    out: List[dict] = []
    skipped: List[Tuple[int, str]] = []
    for i, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        rec, why = _record(line)
        if rec is None:
            skipped.append((i, why))
        else:
            out.append(rec)
    return out, skipped


def read(job_dir: os.PathLike) -> List[dict]:
    """All readable records, in file order (damaged lines skipped; see :func:`load`)."""
    return load(job_dir)[0]


def _join(v: object) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return "" if v is None else str(v)


def _began(fields: Mapping) -> object:
    b = fields.get("began")
    return b - 1 if isinstance(b, int) and not isinstance(b, bool) else b


def describe(rec: Mapping) -> str:
    """One human line for a record."""
    e = rec.get("event")
    skip = {"t", "event", "job_id", "incarnation"}
    fields = {k: v for k, v in rec.items() if k not in skip}
    if e == E.LAUNCH:
        return (f"launch attempt {fields.get('attempt')} on {_join(fields.get('nodes', []))}"
                f" (resume from step {fields.get('resume_step')}"
                + (f", spares {_join(fields['spares'])}" if fields.get("spares") else "") + ")")
    if e == E.PROGRESS:
        return f"step {fields.get('step')}"
    if e == E.CHECKPOINT:
        return f"checkpoint committed: step {fields.get('step')}"
    if e == E.STEP_EXIT:
        s = f"step exited {fields.get('returncode')}: {fields.get('cause')}"
        if fields.get("blamed"):
            s += f" (blamed: {_join(fields['blamed'])}" + (
                f", evidence: {fields['evidence']}" if fields.get("evidence") else "") + ")"
        if fields.get("error"):
            s += f"; error: {fields['error']}"
        failures = fields.get("failures")
        if isinstance(failures, list) and failures and isinstance(failures[0], dict):
            f0 = failures[0]
            s += f"; first failure: rank {f0.get('rank')} on {f0.get('node')}: {f0.get('reason')}"
        return s
    if e == E.STRAGGLER:
        s = (f"straggler {fields.get('node')}: {fields.get('measure', 'busy')} time {fields.get('ratio')}x the other "
             f"nodes' median ({fields.get('node_ms')} vs {fields.get('others_ms')} ms/step"
             + (f", ranks {_join(fields['ranks'])}" if fields.get("ranks") else "") + ")")
        if fields.get("action") == "replace":
            return s + f"; replacing it with {fields.get('spare')} at a checkpoint"
        return s + f"; recorded only ({fields.get('why', 'no replacement')})"
    if e == E.SUPERVISOR_LOST:
        return (f"supervisor lost (batch host {fields.get('batch_host')}): rank {fields.get('rank')} on "
                f"{fields.get('node')} heard no beacon for {fields.get('silent_s')} s ({fields.get('why')})")
    if e == E.TAKEOVER:
        if fields.get("asked"):
            return f"takeover: rank {fields.get('rank')} on {fields.get('node')} requeues the job"
        return f"takeover by rank {fields.get('rank')} on {fields.get('node')} not done: {fields.get('why')}"
    if e in (E.LOSS_SPIKE, E.NAN):
        what = "loss spike" if e == E.LOSS_SPIKE else "non-finite"
        band = f" (band: median {fields.get('median')}, limit {fields.get('limit')})" if e == E.LOSS_SPIKE else ""
        return (f"{what} {fields.get('signal')} {fields.get('value')} at step {fields.get('step')}, began after step "
                f"{_began(fields)}{band}; decision: {fields.get('decision')}")
    if e == E.REPLAY_STARTED:
        return (f"REPLAY of the {fields.get('kind')} at step {fields.get('step')}: from the checkpoint of step "
                f"{fields.get('from_step')} to step {fields.get('until')} on other nodes (first non-finite: step "
                f"{fields.get('first_step')}, rank(s) {_join(fields.get('first_ranks') or [])} on "
                f"{_join(fields.get('first_nodes') or [])})")
    if e == E.REPLAY_DECIDED:
        node = f", node {fields.get('node')}" if fields.get("node") else ""
        return f"replay verdict: {fields.get('verdict')}{node}: {fields.get('why')}"
    if e == E.ROLLBACK:
        return (f"ROLLBACK {fields.get('rollback')}: to the checkpoint of step {fields.get('to_step')}, skip "
                f"{fields.get('skip_batches')} batches, lr x{fields.get('lr_factor')} ({fields.get('lost_steps')} "
                f"steps lost)")
    if e == E.GIVE_UP:
        return f"GIVE UP (exit {fields.get('code')}): {fields.get('reason')}"
    if e == E.DONE:
        return f"DONE: {fields.get('reason')}"
    parts = []
    for k, v in fields.items():
        if isinstance(v, (list, tuple)):
            v = _join(v)
        elif isinstance(v, dict):
            v = json.dumps(v, sort_keys=True, default=str)
        parts.append(f"{k}={v}")
    return f"{e}: " + " ".join(parts) if parts else str(e)


def format_text(records: Iterable[Mapping], *, progress: bool = False) -> str:
    """Printable timeline; progress samples are left out unless asked for."""
    recs = list(records)
    if not recs:
        return "(empty timeline)"
    t0 = recs[0]["t"]
    lines = []
    for r in recs:
        if r.get("event") == E.PROGRESS and not progress:
            continue
        stamp = time.strftime("%H:%M:%S", time.gmtime(r["t"]))
        # Every field comes from the file: control characters are shown, never sent.
        lines.append(f"{stamp} +{r['t'] - t0:7.1f}s [{terminal(r.get('incarnation', 0))}] {terminal(describe(r))}")
    return "\n".join(lines)


def summary(records: Iterable[Mapping]) -> dict:
    """Counts a test or a report wants: restarts, requeues, outcome, final step."""
    recs = list(records)
    out = {"events": len(recs), "restarts": 0, "requeues": 0, "launches": 0, "faults": [],
           "outcome": None, "exit_code": None, "last_step": None, "checkpoints": [], "stragglers": [],
           "anomalies": [], "rollbacks": 0}
    for r in recs:
        e = r.get("event")
        if e == E.RESTART:
            out["restarts"] += 1
        elif e == E.REQUEUE:
            out["requeues"] += 1
        elif e == E.LAUNCH:
            out["launches"] += 1
        elif e in (E.HEARTBEAT_LOST, E.NODE_DOWN, E.STOP_REQUESTED) or (e == E.STEP_EXIT and r.get("cause") != Cause.FINISHED):
            out["faults"].append(r.get("cause") or e)
        elif e in (E.DONE, E.GIVE_UP):
            out["outcome"] = e
            out["exit_code"] = r.get("code")
        elif e == E.PROGRESS:
            out["last_step"] = r.get("step")
        elif e == E.CHECKPOINT and r.get("step") is not None and r["step"] not in out["checkpoints"]:
            out["checkpoints"].append(r["step"])
        elif e == E.STRAGGLER:
            out["stragglers"].append({"node": r.get("node"), "ratio": r.get("ratio"), "action": r.get("action")})
        elif e in (E.LOSS_SPIKE, E.NAN):
            out["anomalies"].append({"kind": e, "step": r.get("step"), "decision": r.get("decision")})
        elif e == E.ROLLBACK:
            out["rollbacks"] += 1
    return out


LOST_CAUSES = ("startup", "restart", "inprocess", "requeue_wait", "recomputed", "checkpoint_stall", "stalled",
               "other")
# The phases of an in-process recovery, in order (see :func:`inprocess_windows`).
INPROC_PHASES = ("abort", "rendezvous", "state", "first_step")


def _at(r: Mapping) -> Optional[float]:
    """When an ``inproc_*`` record happened (its ``at``, the rendezvous's clock), else its ``t``
    (when the supervisor's loop wrote it, up to one poll later)."""
    v = _finite(r.get("at"))
    return v if v is not None else _finite(r.get("t"))


def inprocess_windows(records: Iterable[Mapping]) -> List[dict]:
    """The faults healed in-process, from the ``inproc_*`` records: for each, ``start`` (the
    fault heard), ``end`` (rank 0 finished the new generation's first step), ``gen``, and
    ``phases``, four contiguous (name, from, to) spans that sum to the whole:

    - ``abort``: the fault heard -> the first survivor had destroyed its group and asked for
      the next generation;
    - ``rendezvous``: -> the new generation's plan published (every old rank rejoined or known lost);
    - ``state``: -> rank 0 received the state a survivor broadcast (the new group formed, then
      the broadcast itself);
    - ``first_step``: -> rank 0 finished the first step of the new generation.

    A fault followed by ``inproc_fallback`` (or a launch or step exit before its first step)
    was not healed in-process and is not here: the relaunch's time is ``restart``'s."""
    out: List[dict] = []
    cur: Optional[dict] = None
    for r in sorted((r for r in records if _finite(r.get("t")) is not None), key=lambda r: r["t"]):
        e = r.get("event")
        if e == E.INPROC_FAULT:
            if cur is None:
                cur = {"start": _at(r), "gen": None, "rdzv": None, "abort_s": None, "state": None, "fault": r}
        elif cur is None:
            continue
        elif e == E.INPROC_RENDEZVOUS:
            cur["rdzv"], cur["gen"], cur["abort_s"] = _at(r), r.get("gen"), _finite(r.get("abort_s"))
        elif e == E.INPROC_STATE:
            cur["state"] = _at(r)
        elif e == E.INPROC_FIRST_STEP:
            end = _at(r)
            start = cur["start"]
            took = _finite(r.get("fault_to_step_s"))
            if took is not None and _finite(r.get("at")) is not None:
                start = end - took          # the rendezvous's own measure of the same span
            bounds = [start, None if cur["abort_s"] is None else start + cur["abort_s"], cur["rdzv"], cur["state"], end]
            # A missing or out-of-order bound gives its phase no time (the next phase takes it).
            for k in range(1, 4):
                b = bounds[k]
                bounds[k] = bounds[k - 1] if b is None else min(max(b, bounds[k - 1]), end)
            out.append({"start": start, "end": end, "gen": r.get("gen", cur["gen"]), "fault": cur["fault"],
                        "phases": [(name, bounds[k], bounds[k + 1]) for k, name in enumerate(INPROC_PHASES)]})
            cur = None
        elif e in (E.INPROC_FALLBACK, E.LAUNCH, E.STEP_EXIT, E.RESTART, E.REQUEUE, E.GIVE_UP, E.DONE):
            cur = None
    return out


def _overlap(a: float, b: float, windows: List[dict]) -> float:
    return sum(max(0.0, min(b, w["end"]) - max(a, w["start"])) for w in windows)


def goodput_report(records: Iterable[Mapping]) -> Optional[dict]:
    """Productive time against wall time, and the time lost by cause. None before the first launch.

    Wall time runs from the first launch to the last record. Productive time is the time
    between consecutive progress samples of one launch in which the step advanced past
    every step reached before (the high-water mark); the rest of the wall time is lost to:

    - ``recomputed``: advancing intervals (or their share, by steps) that redo steps
      already done before a restart;
    - ``checkpoint_stall``: in an advancing interval with a checkpoint record, the time
      beyond what its steps take at the job's median seconds per step (intervals without
      a checkpoint); and time without progress around a checkpoint record;
    - ``restart``: from a fault or a restart decision (and the silent time before a fault
      since the last progress) to the first progress of the next launch, requeue wait
      excluded;
    - ``inprocess``: a fault healed in-process (:func:`inprocess_windows`), from the fault
      heard to the new generation's first step; the launch goes on, so the steps done
      before the fault and after that first step stay productive;
    - ``requeue_wait``: from a requeue decision to the next launch;
    - ``startup``: from the first launch to its first progress;
    - ``stalled``: time without progress that no fault or checkpoint explains;
    - ``other``: after the end (done / give_up) until the last record.

    ``restarts`` counts restart and requeue decisions; ``mttr_s`` is the mean time from
    a fault (or a restart/requeue decision with no fault before it) to the first advancing
    progress after it, over the recoveries that completed (a fault healed in-process: to
    its first step). ``inprocess`` has the in-process recoveries' count and the seconds
    of each phase, summed.
    """
    recs = sorted((r for r in records if _finite(r.get("t")) is not None), key=lambda r: r["t"])
    first = next((i for i, r in enumerate(recs) if r.get("event") == E.LAUNCH), None)
    if first is None:
        return None
    recs = recs[first:]
    t0, t1 = recs[0]["t"], recs[-1]["t"]
    lost = dict.fromkeys(LOST_CAUSES, 0.0)
    windows = inprocess_windows(recs)
    healed = {id(w["fault"]) for w in windows}
    intervals = _advancing_intervals(recs, healed)
    productive, spp = _productive_time(recs, intervals, lost, windows)
    recoveries = _lost_gaps(recs, intervals, lost, healed, windows)
    recoveries += [w["end"] - w["start"] for w in windows]
    wall = t1 - t0
    s = summary(recs)
    phases = dict.fromkeys(INPROC_PHASES, 0.0)
    for w in windows:
        for name, a, b in w["phases"]:
            phases[name] += b - a
    return {
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "goodput": round(productive / wall, 6) if wall > 0 else 0.0,
        "lost_s": {k: round(v, 3) for k, v in lost.items()},
        "restarts": s["restarts"] + s["requeues"],
        "recoveries": len(recoveries),
        "mttr_s": round(sum(recoveries) / len(recoveries), 3) if recoveries else None,
        "seconds_per_step": round(spp, 6) if spp is not None else None,
        "inprocess": {"recoveries": len(windows), "phases_s": {k: round(v, 3) for k, v in phases.items()}},
    }


def _advancing_intervals(recs: List[Mapping], healed=frozenset()) -> List[Tuple[int, int, float, float, bool]]:
    """Pass 1 of :func:`goodput_report`: the advancing intervals, each (i_start, i_end,
    new_steps, recomputed_steps, has_checkpoint), over records sorted by time. A fault healed
    in-process (its record's id in ``healed``) does not break the launch's progress."""
    intervals = []
    last: Optional[Tuple[int, float]] = None   # (record index, step) of the last progress of this launch
    hwm = None
    ckpt_since_last = False
    for i, r in enumerate(recs):
        e = r.get("event")
        if e == E.LAUNCH:
            rs = _finite(r.get("resume_step"))
            last = (i, rs) if rs is not None else None
            ckpt_since_last = False
        elif e == E.PROGRESS and _finite(r.get("step")) is not None:
            step = _finite(r["step"])
            if last is not None and step > last[1]:
                base = last[1] if hwm is None else max(last[1], min(step, hwm))
                intervals.append((last[0], i, step - base, base - last[1], ckpt_since_last))
                hwm = step if hwm is None else max(hwm, step)
            last = (i, step)
            ckpt_since_last = False
        elif e == E.CHECKPOINT:
            ckpt_since_last = True
        elif (e in FAULT_KINDS and id(r) not in healed) or e in (E.RESTART, E.REQUEUE, E.GIVE_UP):
            last = None
    return intervals


def _productive_time(recs: List[Mapping], intervals, lost: Dict[str, float],
                     windows: List[dict] = ()) -> Tuple[float, Optional[float]]:
    """The productive seconds of the advancing intervals and the median seconds per step;
    their recomputed, checkpoint-stall and in-process shares are added to ``lost``."""
    spans = [(recs[a]["t"], recs[b]["t"]) for a, b, _, _, _ in intervals]
    inproc = [_overlap(ta, tb, list(windows)) for ta, tb in spans]
    rates = sorted((tb - ta) / new for (ta, tb), (a, b, new, rec, ck), ip in zip(spans, intervals, inproc)
                   if new > 0 and not ck and ip == 0)
    spp = rates[len(rates) // 2] if rates else None
    productive = 0.0
    for (ta, tb), (a, b, new, rec, has_ck), ip in zip(spans, intervals, inproc):
        d = tb - ta - ip
        lost["inprocess"] += ip
        d_rec = d * rec / (new + rec)
        d_new = d - d_rec
        lost["recomputed"] += d_rec
        if has_ck and spp is not None and d_new > new * spp:
            lost["checkpoint_stall"] += d_new - new * spp
            d_new = new * spp
        productive += d_new
    return productive, spp


def _lost_gaps(recs: List[Mapping], intervals, lost: Dict[str, float], healed=frozenset(),
               windows: List[dict] = ()) -> List[float]:
    """Pass 2 of :func:`goodput_report`: every gap between two records outside the advancing
    intervals, added to ``lost`` by the state it is in (its part inside a fault healed
    in-process to ``inprocess``); returns the recovery times (MTTR) of the relaunches."""
    windows = list(windows)
    covered = set()
    for a, b, _, _, _ in intervals:
        covered.update(range(a, b))
    mode = "startup"
    pending: List[float] = []          # running-mode gaps not yet explained (a later fault claims them)
    fault_at: Optional[float] = None
    recoveries: List[float] = []
    adv_ends = {b for _, b, _, _, _ in intervals}
    for i, r in enumerate(recs):
        e = r.get("event")
        if (e in FAULT_KINDS and id(r) not in healed) or e in (E.RESTART, E.REQUEUE):
            lost["restart"] += sum(pending)
            pending = []
            if mode != "ended":
                if fault_at is None:
                    fault_at = r["t"]
                mode = "requeue_wait" if e == E.REQUEUE else "restart"
        elif e == E.LAUNCH and i > 0 and mode != "ended":
            mode = "restart"
        elif e in (E.DONE, E.GIVE_UP):
            lost["stalled"] += sum(pending)
            pending = []
            mode = "ended"
        elif i in adv_ends:
            if mode in ("startup", "restart", "requeue_wait") and fault_at is not None:
                recoveries.append(r["t"] - fault_at)
            fault_at = None
            mode = "running"
        if e == E.CHECKPOINT and pending:
            lost["checkpoint_stall"] += sum(pending)
            pending = []
        if i + 1 >= len(recs) or i in covered:
            continue
        gap = recs[i + 1]["t"] - r["t"]
        if windows and mode == "running":
            ip = min(gap, _overlap(r["t"], recs[i + 1]["t"], windows))
            lost["inprocess"] += ip
            gap -= ip
        nxt = recs[i + 1].get("event")
        if mode == "running":
            if e == E.CHECKPOINT or nxt == E.CHECKPOINT:
                lost["checkpoint_stall"] += gap
            else:
                pending.append(gap)
        elif mode == "ended":
            lost["other"] += gap
        else:
            lost[mode] += gap
    lost["stalled"] += sum(pending)
    return recoveries


def format_goodput(rep: Mapping) -> str:
    """One line: goodput, productive and wall time, the time lost by cause, restarts and MTTR."""
    lost = ", ".join(f"{k} {v:.1f}s" for k, v in rep["lost_s"].items() if v > 0) or "none"
    mttr = f"{rep['mttr_s']:.1f}s" if rep.get("mttr_s") is not None else "-"
    return (f"-- goodput {rep['goodput']:.1%} ({rep['productive_s']:.1f}s productive of {rep['wall_s']:.1f}s wall); "
            f"lost: {lost}; restarts {rep['restarts']}, "
            + (f"healed in-process {rep['inprocess']['recoveries']}, " if rep.get("inprocess", {}).get("recoveries")
               else "") + f"MTTR {mttr}")


def goodput(records: Iterable[Mapping]) -> Optional[float]:
    """Productive share of the job's wall time (:func:`goodput_report`); None before the first launch."""
    rep = goodput_report(records)
    return None if rep is None else rep["goodput"]


def prometheus_text(records: Iterable[Mapping], job: str) -> str:
    return job_metrics(records, job).text()


def job_metrics(records: Iterable[Mapping], job: str):
    """The supervised job's metrics (:mod:`clusterops.metrics`), labelled ``job``."""
    from clusterops.metrics import Metrics

    recs = list(records)
    s = summary(recs)
    prom = Metrics()
    lab = {"job": job}
    prom.set("clusterops_job_restarts", lab, s["restarts"])
    prom.set("clusterops_job_requeues", lab, s["requeues"])
    prom.set("clusterops_job_launches", lab, s["launches"])
    prom.set("clusterops_job_faults", lab, len(s["faults"]))
    prom.set("clusterops_job_given_up", lab, 1 if s["outcome"] == "give_up" else 0)
    prom.set("clusterops_job_finished", lab, 1 if s["outcome"] == "done" else 0)
    if isinstance(s["exit_code"], int) and not isinstance(s["exit_code"], bool):
        prom.set("clusterops_job_exit_code", lab, s["exit_code"])
    if _finite(s["last_step"]) is not None:
        prom.set("clusterops_job_last_step", lab, s["last_step"])
    rep = goodput_report(recs)
    if rep is not None:
        prom.set("clusterops_job_goodput_ratio", lab, rep["goodput"])
        prom.set("clusterops_job_wall_seconds", lab, rep["wall_s"])
        prom.set("clusterops_job_productive_seconds", lab, rep["productive_s"])
        for cause, v in rep["lost_s"].items():
            prom.set("clusterops_job_lost_seconds", dict(lab, cause=cause), v)
        if rep["mttr_s"] is not None:
            prom.set("clusterops_job_mttr_seconds", lab, rep["mttr_s"])
    prom.set("clusterops_job_stragglers", lab, len(s["stragglers"]))
    for kind in (E.LOSS_SPIKE, E.NAN):
        prom.set("clusterops_job_anomalies", dict(lab, kind=str(kind)),
                 sum(1 for a in s["anomalies"] if a["kind"] == kind))
    prom.set("clusterops_job_rollbacks", lab, s["rollbacks"])
    prom.set("clusterops_job_stragglers_replaced", lab, sum(1 for x in s["stragglers"] if x["action"] == "replace"))
    healed = [r for r in recs if r.get("event") == E.INPROC_FIRST_STEP]
    prom.set("clusterops_job_inprocess_recoveries", lab, len(healed))
    prom.set("clusterops_job_inprocess_fallbacks", lab, sum(1 for r in recs if r.get("event") == E.INPROC_FALLBACK))
    if healed and _finite(healed[-1].get("fault_to_step_s")) is not None:
        prom.set("clusterops_job_inprocess_recovery_seconds", lab, _finite(healed[-1]["fault_to_step_s"]))
    ratios = {}
    for r in recs:
        if r.get("event") == E.STRAGGLER and isinstance(r.get("node"), str) and _finite(r.get("ratio")) is not None:
            ratios[r["node"]] = _finite(r["ratio"])
    last = next((r for r in reversed(recs) if r.get("event") == E.PROGRESS), None)
    slow = last.get("slowest") if last is not None else None
    if isinstance(slow, list) and len(slow) == 2 and isinstance(slow[0], str) and _finite(slow[1]) is not None:
        ratios[slow[0]] = _finite(slow[1])
    for node, ratio in sorted(ratios.items()):
        prom.set("clusterops_job_node_slowness_ratio", dict(lab, node=node), ratio)
    times = [_finite(r.get("t")) for r in recs if _finite(r.get("t")) is not None]
    if times:
        prom.set("clusterops_job_last_event_timestamp_seconds", lab, max(times))
    return prom


# ------------------------------------------------------------------------------ chart
class _Frame:
    """The chart's geometry: wall time and step mapped to pixels."""

    def __init__(self, recs: List[Mapping], width: int, height: int):
        self.pad_l, self.pad_r, self.pad_t, self.pad_b = 60, 20, 40, 90
        self.width, self.height = width, height
        self.w, self.h = width - self.pad_l - self.pad_r, height - self.pad_t - self.pad_b
        self.t0 = recs[0]["t"]
        self.span = max(max(r["t"] for r in recs) - self.t0, 1.0)
        points = []
        for r in recs:
            step = None
            if r.get("event") == E.PROGRESS:
                step = r.get("step")
            elif r.get("event") in (E.CHECKPOINT, E.STOPPED) and (r.get("step") or r.get("ckpt_step")) is not None:
                step = r.get("step", r.get("ckpt_step"))
            step = _finite(step)
            if step is not None:
                points.append((r["t"], step, r.get("event")))
        self.smax = max([p[1] for p in points] + [1])

    def x(self, t: float) -> float:
        return self.pad_l + (t - self.t0) / self.span * self.w

    def y(self, s: float) -> float:
        return self.pad_t + self.h - (s / self.smax) * self.h


def render_svg(records: Iterable[Mapping], *, width: int = 900, height: int = 360, title: str = "") -> str:
    """Training step against wall time; faults (red) and decisions (blue) marked."""
    recs = list(records)
    if not recs:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60"><text x="10" y="30">empty timeline</text></svg>'
    f = _Frame(recs, width, height)
    windows = inprocess_windows(recs)
    parts = (_svg_axes(f, title) + _svg_inprocess(f, windows) + _svg_steps(f, recs) + _svg_loss(f, recs)
             + _svg_checkpoints(f, recs) + _svg_markers(f, recs))
    parts.append(_svg_legend(f, any(r.get("event") in FINDING_KINDS for r in recs)))
    if windows:
        parts.append(_svg_phase_legend(f))
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_axes(f: _Frame, title: str) -> List[str]:
    """The frame, the title, the axes and their ticks."""
    pad_l, pad_t, w, h = f.pad_l, f.pad_t, f.w, f.h
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{f.width}" height="{f.height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect x="0" y="0" width="{f.width}" height="{f.height}" fill="white"/>',
             f'<text x="{pad_l}" y="20" font-size="14" font-weight="bold">{html_text(title or "supervised job timeline")}</text>',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="black"/>',
             f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}" stroke="black"/>',
             f'<text x="{pad_l + w / 2}" y="{pad_t + h + 30}" text-anchor="middle">wall time (s)</text>',
             f'<text x="15" y="{pad_t + h / 2}" transform="rotate(-90 15 {pad_t + h / 2})" text-anchor="middle">step</text>']
    for i in range(6):
        tv = f.span * i / 5
        parts.append(f'<text x="{f.x(f.t0 + tv):.1f}" y="{pad_t + h + 14}" text-anchor="middle">{tv:.0f}</text>')
        sv = f.smax * i / 5
        parts.append(f'<text x="{pad_l - 6}" y="{f.y(sv) + 4:.1f}" text-anchor="end">{sv:.0f}</text>')
        parts.append(f'<line x1="{pad_l}" y1="{f.y(sv):.1f}" x2="{pad_l + w}" y2="{f.y(sv):.1f}" stroke="#eee"/>')
    return parts


def _svg_steps(f: _Frame, recs: List[Mapping]) -> List[str]:
    """The step line, broken at each launch so a restart shows as a drop back to the resume step."""
    parts = []
    segs: List[List[tuple]] = [[]]
    for r in recs:
        if r.get("event") == E.LAUNCH:
            segs.append([])
            if _finite(r.get("resume_step")) is not None:
                segs[-1].append((r["t"], _finite(r["resume_step"])))
        elif r.get("event") == E.PROGRESS and _finite(r.get("step")) is not None:
            segs[-1].append((r["t"], _finite(r["step"])))
    for seg in segs:
        if len(seg) >= 2:
            d = " ".join(f"{f.x(t):.1f},{f.y(s):.1f}" for t, s in seg)
            parts.append(f'<polyline class="step" points="{d}" fill="none" stroke="#2a7" stroke-width="2"/>')
        for t, s in seg:
            parts.append(f'<circle cx="{f.x(t):.1f}" cy="{f.y(s):.1f}" r="1.8" fill="#2a7"/>')
    return parts


def _svg_loss(f: _Frame, recs: List[Mapping]) -> List[str]:
    """The loss of the progress records (the stability guard's), on its own scale at the right:
    a purple line, broken at each launch; a value that is not finite is a cross at the top."""
    segs: List[List[tuple]] = [[]]
    for r in recs:
        if r.get("event") == E.LAUNCH:
            segs.append([])
        elif r.get("event") == E.PROGRESS and "loss" in r:
            v = r["loss"]
            segs[-1].append((r["t"], float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None))
    vals = [v for seg in segs for _, v in seg if v is not None and math.isfinite(v)]
    if not vals:
        return []
    lo, hi = min(vals), max(vals)
    hi = hi if hi > lo else lo + 1.0
    y = lambda v: f.pad_t + f.h * (1 - (v - lo) / (hi - lo))  # noqa: E731
    xr = f.pad_l + f.w
    parts = [f'<text x="{xr + 6}" y="{f.pad_t - 4}" fill="#84c">loss</text>',
             f'<text x="{xr + 6}" y="{f.pad_t + 10}" fill="#84c">{hi:.3g}</text>',
             f'<text x="{xr + 6}" y="{f.pad_t + f.h}" fill="#84c">{lo:.3g}</text>']
    for seg in segs:
        run: List[str] = []
        for t, v in seg + [(None, None)]:
            if t is not None and v is not None and math.isfinite(v):
                run.append(f"{f.x(t):.1f},{y(v):.1f}")
                continue
            if len(run) >= 2:
                parts.append(f'<polyline class="loss" points="{" ".join(run)}" fill="none" stroke="#84c" '
                             f'stroke-width="1.5"/>')
            run = []
            if t is not None:
                xx = f.x(t)
                parts.append(f'<text class="loss-nonfinite" x="{xx:.1f}" y="{f.pad_t + 4}" fill="#84c" '
                             f'text-anchor="middle">x</text>')
    return parts


def _svg_checkpoints(f: _Frame, recs: List[Mapping]) -> List[str]:
    esc = html_text
    return [f'<rect class="checkpoint" x="{f.x(r["t"]) - 3:.1f}" y="{f.y(_finite(r["step"])) - 3:.1f}" width="6" height="6" '
            f'fill="#fc3" stroke="#960"><title>checkpoint step {esc(str(r["step"]))}</title></rect>'
            for r in recs if r.get("event") == E.CHECKPOINT and _finite(r.get("step")) is not None]


def _svg_markers(f: _Frame, recs: List[Mapping]) -> List[str]:
    """A dashed line and a label for each fault, decision and finding."""
    esc = html_text
    parts = []
    row = 0
    # Findings last, so that a decision taken at the same moment does not hide them.
    for r in sorted(recs, key=lambda r: r.get("event") in FINDING_KINDS):
        e = r.get("event")
        if e == E.STEP_EXIT and r.get("cause") == Cause.FINISHED:
            e = E.DONE
        if e in FAULT_KINDS or e in DECISION_KINDS or e in FINDING_KINDS:
            color = "#d22" if e in FAULT_KINDS else ("#e80" if e in FINDING_KINDS else "#25c")
            kind = "fault" if e in FAULT_KINDS else ("finding" if e in FINDING_KINDS else "decision")
            xx = f.x(r["t"])
            label = esc(describe(r), limit=80)   # shortened raw, then escaped: no cut entity
            parts.append(f'<line class="{kind}" data-event="{esc(e, limit=40)}" x1="{xx:.1f}" y1="{f.pad_t}" x2="{xx:.1f}" y2="{f.pad_t + f.h}" stroke="{color}" '
                         f'stroke-dasharray="4,3"><title>{label}</title></line>')
            short = esc(e.replace("_", " ") + (f": {r.get('cause')}" if r.get("cause") else "")
                        + (f": {r.get('node')}" if e in FINDING_KINDS and r.get("node") else ""), limit=60)
            ly = f.pad_t + f.h + 46 + 12 * (row % 3)
            parts.append(f'<text class="{kind}-label" x="{xx + 2:.1f}" y="{ly}" fill="{color}">{short}</text>')
            row += 1
    return parts


PHASE_COLORS = {"abort": "#f4a6a6", "rendezvous": "#f6d58e", "state": "#9fd3f0", "first_step": "#a9e4b4"}


def _svg_inprocess(f: _Frame, windows: List[dict]) -> List[str]:
    """Each fault healed in-process as four bands across the plot, one per phase
    (:func:`inprocess_windows`), at least a pixel wide: a sub-second healing in a long run
    is still seen."""
    parts = []
    for w in windows:
        for name, a, b in w["phases"]:
            x0, x1 = f.x(a), f.x(b)
            parts.append(f'<rect class="inproc-phase" data-phase="{name}" x="{x0:.2f}" y="{f.pad_t}" '
                         f'width="{max(x1 - x0, 1.0):.2f}" height="{f.h}" fill="{PHASE_COLORS[name]}" '
                         f'fill-opacity="0.8"><title>in-process recovery to generation {html_text(w["gen"])}: '
                         f'{name.replace("_", " ")} {b - a:.3f} s</title></rect>')
    return parts


def _svg_phase_legend(f: _Frame) -> str:
    items = []
    for k, (name, color) in enumerate(PHASE_COLORS.items()):
        items.append(f'<rect x="{k * 90}" y="-5" width="10" height="10" fill="{color}"/>'
                     f'<text x="{k * 90 + 14}" y="4">{name.replace("_", " ")}</text>')
    return (f'<g class="inproc-legend" transform="translate({f.pad_l},{f.pad_t + f.h + 84})">'
            '<text x="-55" y="4">in-process:</text>' + "".join(items) + "</g>")


def _svg_legend(f: _Frame, findings: bool) -> str:
    return (f'<g transform="translate({f.pad_l + f.w - (320 if findings else 250)},{f.pad_t - 14})">'
            '<line x1="0" y1="0" x2="16" y2="0" stroke="#2a7" stroke-width="2"/><text x="20" y="4">step</text>'
            '<rect x="60" y="-4" width="7" height="7" fill="#fc3" stroke="#960"/><text x="70" y="4">checkpoint</text>'
            '<line x1="140" y1="-6" x2="140" y2="6" stroke="#d22"/><text x="144" y="4">fault</text>'
            '<line x1="185" y1="-6" x2="185" y2="6" stroke="#25c"/><text x="189" y="4">decision</text>'
            + ('<line x1="240" y1="-6" x2="240" y2="6" stroke="#e80"/><text x="244" y="4">straggler</text>'
               if findings else "") + '</g>')


def render_html(records: Iterable[Mapping], *, title: str = "") -> str:
    recs = list(records)
    rows = "\n".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.gmtime(r['t']))}</td><td>{html_text(r.get('incarnation', 0))}</td>"
        f"<td>{html_text(r.get('event'))}</td><td>{html_text(describe(r))}</td></tr>"
        for r in recs if r.get("event") != E.PROGRESS)
    t = html_text(title or "supervised job timeline")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{t}</title>"
            "<style>body{font-family:sans-serif;margin:20px}td{padding:2px 8px;border-bottom:1px solid #eee}"
            "</style></head><body>"
            f"<h1>{t}</h1>{render_svg(recs, title=title)}{_goodput_html(recs)}<table><tr><th>time (UTC)</th><th>incarnation</th>"
            f"<th>event</th><th>what</th></tr>{rows}</table></body></html>\n")


def _goodput_html(recs: List[dict]) -> str:
    rep = goodput_report(recs)
    if rep is None:
        return ""
    rows = "".join(f"<tr><td>lost: {html_text(k)}</td><td>{v:.1f} s</td></tr>" for k, v in rep["lost_s"].items())
    mttr = f"{rep['mttr_s']:.1f} s" if rep["mttr_s"] is not None else "-"
    ip = rep["inprocess"]
    if ip["recoveries"]:
        rows += (f"<tr><td>in-process recoveries</td><td>{ip['recoveries']}</td></tr>"
                 + "".join(f"<tr><td>in-process: {html_text(k.replace('_', ' '))}</td><td>{v:.3f} s</td></tr>"
                           for k, v in ip["phases_s"].items()))
    return (f"<table class='goodput'><tr><td>goodput</td><td>{rep['goodput']:.1%}</td></tr>"
            f"<tr><td>productive</td><td>{rep['productive_s']:.1f} s</td></tr>"
            f"<tr><td>wall</td><td>{rep['wall_s']:.1f} s</td></tr>{rows}"
            f"<tr><td>restarts</td><td>{rep['restarts']}</td></tr><tr><td>MTTR</td><td>{mttr}</td></tr></table>")


def write_chart(records: Iterable[Mapping], path: os.PathLike, *, title: str = "") -> Path:
    path = Path(path)
    if path.suffix.lower() not in (".svg", ".html", ".htm"):
        raise InputError(f"--chart {path}: the file name must end in .svg or .html")
    text = render_svg(records, title=title) if path.suffix.lower() == ".svg" else render_html(records, title=title)
    from clusterops.errors import ClusteropsError
    from clusterops.fsutil import write_atomic

    try:
        write_atomic(path, text, create_parents=False)
    except ClusteropsError as e:
        raise InputError(f"--chart {e.message}") from None
    return path
