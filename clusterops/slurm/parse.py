"""Pure parsers for Slurm's machine-readable output.

Shapes handled (fixtures for each in tests/fixtures/slurm/):
- ``squeue --json`` / ``sinfo --json`` of Slurm 22.05 (openapi v0.0.38): states as strings,
  plain integers for times, ``null`` for an unlimited time limit;
- the 23.02+ data_parser shapes (v0.0.39 and later): ``job_state`` and node ``state`` as lists,
  numbers wrapped as ``{"set": bool, "infinite": bool, "number": n}``, ``exit_code`` as an object;
- ``scontrol show job|node --oneliner`` (every version): ``Key=Value`` pairs on one line;
- ``srun``'s error lines about a step's tasks and nodes (``srun: error: node3: task 2: Killed``,
  ``Node failure on node3``), read from a step's log by the supervisor.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import hostlist

from clusterops.slurm.states import base_state, categorize


# -- small value helpers -------------------------------------------------------

def number(value: Any) -> Optional[float]:
    """A number from a plain value or a 23.02+ ``{"set", "infinite", "number"}`` object.

    Unset and infinite give None.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        value = value.get("number")
        if value is None:
            return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def epoch(value: Any) -> Optional[float]:
    """A timestamp in epoch seconds; 0 and unset mean 'not known'."""
    n = number(value)
    return float(n) if n else None


def expand(nodes: Optional[str]) -> List[str]:
    if not nodes or nodes in ("(null)", "None assigned"):
        return []
    return hostlist.expand_hostlist(nodes)


def parse_time_limit(text: Optional[str]) -> Optional[float]:
    """Slurm's time strings (``UNLIMITED``, ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``)
    to minutes; None for unlimited / unknown."""
    if text is None:
        return None
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "N/A", "NONE", "PARTITION_LIMIT"):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(p) for p in text.split(":")]
        while len(parts) < 3:
            parts.append(0)
        h, m, s = parts
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]
        else:
            h, m, s = parts
    return days * 1440 + h * 60 + m + s / 60.0


def parse_iso(text: Optional[str]) -> Optional[float]:
    if not text or text in ("Unknown", "None", "N/A", "(null)"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


_KEY = re.compile(r"(?:^|(?<= ))([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_oneliner(line: str, *, last: Optional[str] = None) -> Dict[str, str]:
    """``Key=Value Key2=Value with spaces`` -> dict. A value runs to the next `` Key=``.

    ``last``: a field that Slurm prints last on the line and whose value is free text
    (a node's ``Reason``, which administrators write): its value is the rest of the line
    from its first `` last=``, and nothing inside it is read as another field -- a reason
    that says ``State=IDLE`` or ``Reason=clusterops:...`` overrides nothing.
    """
    line = line.strip()
    tail: Optional[str] = None
    if last:
        m = re.search(rf"(?:^| ){re.escape(last)}=", line)
        if m:
            tail, line = line[m.end():], line[:m.start()]
    matches = list(_KEY.finditer(line))
    out: Dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out.setdefault(m.group(1), line[m.end():end].strip())
    if tail is not None:
        out[last] = tail.strip()
    return out


def _null(v: Optional[str]) -> Optional[str]:
    return None if v in (None, "", "(null)", "N/A", "None") else v


# -- jobs --------------------------------------------------------------------------

@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    state: str
    category: str
    reason: Optional[str] = None
    nodes: str = ""
    node_names: Tuple[str, ...] = ()
    restart_count: int = 0
    time_limit_min: Optional[float] = None
    submit_time: Optional[float] = None
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    exit_code: Optional[int] = None
    exit_signal: Optional[int] = None
    batch_host: Optional[str] = None
    excluded_nodes: str = ""
    partition: str = ""
    requeue: bool = False
    array_job_id: Optional[int] = None
    array_task_id: Optional[int] = None
    # ArrayTaskId as scontrol shows it: "3" for one task, "2-3%1" for pending tasks that share
    # one record (expand with array_task_ids)
    array_tasks: str = ""
    state_flags: Tuple[str, ...] = ()
    preempt_time: Optional[float] = None   # set once Slurm chose to preempt the job
    user: str = ""           # the owner's name
    command: str = ""        # the batch script as submitted (its path), or the command

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["node_names"] = list(self.node_names)
        d["state_flags"] = list(self.state_flags)
        return d


def _exit_code(value: Any) -> Tuple[Optional[int], Optional[int]]:
    """(return code, signal) from an int, ``"code:signal"`` text or a 23.02+ object."""
    if value is None:
        return None, None
    if isinstance(value, dict):
        rc = number(value.get("return_code"))
        sig = value.get("signal")
        sig_n = number(sig.get("id") if isinstance(sig, dict) else sig)
        return (int(rc) if rc is not None else None), (int(sig_n) if sig_n else None)
    if isinstance(value, str) and ":" in value:
        a, b = value.split(":", 1)
        return int(a), (int(b) or None)
    n = number(value)
    if n is None:
        return None, None
    # 22.05's squeue --json gives the raw wait status (exit 3 -> 768).
    status = int(n)
    return status >> 8, (status & 0x7F) or None


def job_from_json(j: Dict[str, Any]) -> JobInfo:
    """One element of ``squeue --json``'s ``jobs`` list (22.05 or 23.02+ shape)."""
    raw_state = j.get("job_state")
    flags: Tuple[str, ...] = ()
    if isinstance(raw_state, list):
        flags = tuple(s.upper() for s in raw_state[1:])
    rc, sig = _exit_code(j.get("exit_code"))
    nodes = j.get("nodes") or ""
    tl = number(j.get("time_limit"))
    array_task = number(j.get("array_task_id"))
    array_job = number(j.get("array_job_id"))
    return JobInfo(
        job_id=int(number(j.get("job_id"))),
        name=j.get("name") or "",
        state=base_state(raw_state),
        category=categorize(raw_state),
        reason=_null(j.get("state_reason")),
        nodes=nodes,
        node_names=tuple(expand(nodes)),
        restart_count=int(number(j.get("restart_cnt")) or 0),
        time_limit_min=float(tl) if tl is not None else None,
        submit_time=epoch(j.get("submit_time")),
        start_time=epoch(j.get("start_time")),
        end_time=epoch(j.get("end_time")),
        exit_code=rc,
        exit_signal=sig,
        batch_host=_null(j.get("batch_host")),
        excluded_nodes=j.get("excluded_nodes") or "",
        partition=j.get("partition") or "",
        requeue=bool(j.get("requeue", False)),
        array_job_id=int(array_job) if array_job else None,
        array_task_id=int(array_task) if array_task is not None else None,
        state_flags=flags,
        preempt_time=epoch(j.get("preempt_time")),
        user=j.get("user_name") or "",
        command=j.get("command") or "",
    )


def parse_squeue_json(text: str) -> List[JobInfo]:
    data = json.loads(text)
    return [job_from_json(j) for j in data.get("jobs", [])]


def array_task_ids(text: str) -> List[int]:
    """The task ids of an ``ArrayTaskId`` (``3``, ``2-3%1``, ``1,4-5:2``); [] for anything else."""
    body = (text or "").split("%", 1)[0]
    out: List[int] = []
    for part in body.split(","):
        rng, _, stride = part.partition(":")
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (stride and not stride.isdigit()):
            return []
        out.extend(range(int(lo), int(hi or lo) + 1, int(stride or 1) or 1))
    return out


def job_from_oneliner(line: str) -> JobInfo:
    """One line of ``scontrol show job --oneliner``."""
    kv = parse_oneliner(line)
    state = kv.get("JobState", "UNKNOWN")
    rc, sig = _exit_code(kv.get("ExitCode"))
    nodes = _null(kv.get("NodeList")) or ""
    array_task = kv.get("ArrayTaskId")
    return JobInfo(
        job_id=int(kv["JobId"]),
        name=kv.get("JobName", ""),
        state=base_state(state),
        category=categorize(state),
        reason=_null(kv.get("Reason")),
        nodes=nodes,
        node_names=tuple(expand(nodes)),
        restart_count=int(kv.get("Restarts", "0") or 0),
        time_limit_min=parse_time_limit(kv.get("TimeLimit")),
        submit_time=parse_iso(kv.get("SubmitTime")),
        start_time=parse_iso(kv.get("StartTime")),
        end_time=parse_iso(kv.get("EndTime")),
        exit_code=rc,
        exit_signal=sig,
        batch_host=_null(kv.get("BatchHost")),
        excluded_nodes=_null(kv.get("ExcNodeList")) or "",
        partition=kv.get("Partition", ""),
        requeue=kv.get("Requeue") == "1",
        array_job_id=int(kv["ArrayJobId"]) if kv.get("ArrayJobId", "").isdigit() else None,
        array_task_id=int(array_task) if array_task and array_task.isdigit() else None,
        array_tasks=array_task or "",
        preempt_time=parse_iso(kv.get("PreemptTime")),
        user=(kv.get("UserId") or "").split("(", 1)[0],
        command=_null(kv.get("Command")) or "",
    )


def parse_scontrol_jobs(text: str) -> List[JobInfo]:
    return [job_from_oneliner(line) for line in text.splitlines() if line.startswith("JobId=")]


# -- nodes -------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str                      # base state, lower case: idle, allocated, mixed, down, ...
    flags: FrozenSet[str] = field(default_factory=frozenset)   # DRAIN, NOT_RESPONDING, ...
    reason: Optional[str] = None
    reason_user: Optional[str] = None
    reason_time: Optional[float] = None
    gres: str = ""
    partitions: Tuple[str, ...] = ()
    cpus: int = 0
    alloc_cpus: int = 0

    @property
    def drained(self) -> bool:
        """DRAIN set (draining or drained)."""
        return "DRAIN" in self.flags

    @property
    def is_down(self) -> bool:
        return self.state == "down" or "NOT_RESPONDING" in self.flags

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags

    @property
    def is_idle(self) -> bool:
        return self.state == "idle" and not self.flags & {"DRAIN", "NOT_RESPONDING", "MAINTENANCE", "RESERVED"}

    @property
    def busy(self) -> bool:
        return self.state in ("allocated", "mixed", "completing") or "COMPLETING" in self.flags

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["flags"] = sorted(self.flags)
        d["partitions"] = list(self.partitions)
        d["drained"] = self.drained
        return d


# Base states as Slurm spells them in lists (23.02+) and in scontrol's State= field.
_NODE_BASES = {"IDLE", "ALLOCATED", "ALLOC", "MIXED", "DOWN", "ERROR", "FUTURE", "UNKNOWN", "COMPLETING"}
_SCONTROL_FLAG_ALIASES = {"NOT_RESPONDING": "NOT_RESPONDING", "DRAIN": "DRAIN", "DRAINED": "DRAIN",
                          "DRAINING": "DRAIN", "MAINT": "MAINTENANCE", "RESERVED": "RESERVED",
                          "POWERED_DOWN": "POWERED_DOWN", "POWERING_UP": "POWERING_UP",
                          "REBOOT_REQUESTED": "REBOOT_REQUESTED", "FAIL": "FAIL",
                          "COMPLETING": "COMPLETING", "CLOUD": "CLOUD", "PLANNED": "PLANNED",
                          "INVALID_REG": "INVALID_REG", "DYNAMIC_NORM": "DYNAMIC_NORM"}


# A node reason means something only while one of these holds. Slurm 24.11 and 25.11 keep
# the old reason on a node resumed with State=RESUME (22.05 clears it), so an idle node can
# show "clusterops:... [root@...]" long after it returned to service: that reason is stale.
# NOT_RESPONDING alone is no holder: a resumed node carries it until slurmd re-registers
# (about a second), and a node that really stopped answering turns DOWN with its own reason.
_REASON_FLAGS = frozenset({"DRAIN", "FAIL", "REBOOT_REQUESTED", "REBOOT_ISSUED",
                           "POWER_DOWN", "POWERING_DOWN", "INVALID_REG"})


def live_reason(base: str, flags: FrozenSet[str], reason: Optional[str]) -> Optional[str]:
    """``reason`` while the node is drained, down or failing; None once it is back in service."""
    if reason and (base in ("down", "error", "unknown") or flags & _REASON_FLAGS):
        return reason
    return None


def split_node_state(items: List[str]) -> Tuple[str, FrozenSet[str]]:
    base = "unknown"
    flags = set()
    for it in items:
        u = it.upper().rstrip("*")
        if u in _NODE_BASES and base == "unknown":
            base = "allocated" if u == "ALLOC" else u.lower()
        else:
            flags.add(_SCONTROL_FLAG_ALIASES.get(u, u))
    return base, frozenset(flags)


def node_from_json(n: Dict[str, Any]) -> NodeInfo:
    raw = n.get("state")
    if isinstance(raw, list):                 # 23.02+: ["IDLE", "DRAIN"]
        base, flags = split_node_state(raw)
    else:                                     # 22.05: "idle" + state_flags
        base, flags = split_node_state([raw or "unknown"] + list(n.get("state_flags") or []))
    parts = n.get("partitions") or []
    if isinstance(parts, str):
        parts = [p for p in parts.split(",") if p]
    reason = live_reason(base, flags, _null(n.get("reason")))
    return NodeInfo(
        name=n["name"],
        state=base,
        flags=flags,
        reason=reason,
        reason_user=_null(n.get("reason_set_by_user")) if reason else None,
        reason_time=epoch(n.get("reason_changed_at")) if reason else None,
        gres=n.get("gres") or "",
        partitions=tuple(parts),
        cpus=int(number(n.get("cpus")) or 0),
        alloc_cpus=int(number(n.get("alloc_cpus")) or 0),
    )


def _node_from_sinfo_entry(name: str, e: Dict[str, Any]) -> NodeInfo:
    """A node from one 24.05+ ``sinfo --json`` entry: a group of nodes of one partition that
    share a state. Per-node figures are exact for a one-node group; a group's allocated CPUs
    are split evenly (the layer reads node detail from scontrol, not from here)."""
    base, flags = split_node_state(list((e.get("node") or {}).get("state") or ["UNKNOWN"]))
    reason_obj = e.get("reason") if isinstance(e.get("reason"), dict) else {}
    reason = live_reason(base, flags, _null(reason_obj.get("description")))
    cpus = e.get("cpus") or {}
    count = int(number((e.get("nodes") or {}).get("total")) or 1)
    part = (e.get("partition") or {}).get("name") or ""
    return NodeInfo(
        name=name,
        state=base,
        flags=flags,
        reason=reason,
        reason_user=_null(reason_obj.get("user")) if reason else None,
        reason_time=epoch(reason_obj.get("time")) if reason else None,
        gres=(e.get("gres") or {}).get("total") or "",
        partitions=(part,) if part else (),
        cpus=int(number(cpus.get("maximum")) or 0),
        alloc_cpus=int(number(cpus.get("allocated")) or 0) // max(count, 1),
    )


def parse_sinfo_json(text: str) -> List[NodeInfo]:
    """``sinfo --json``: up to 23.11 a ``nodes`` list (one element per node); from 24.05 on a
    ``sinfo`` list of groups (partition x state), where a node appears once per partition."""
    data = json.loads(text)
    if "nodes" in data:
        return [node_from_json(n) for n in data["nodes"]]
    seen: Dict[str, NodeInfo] = {}
    for entry in data.get("sinfo", []):
        names = (entry.get("nodes") or {}).get("nodes") or []
        for name in names:
            node = _node_from_sinfo_entry(name, entry)
            if name in seen:    # the same node under another partition
                node = NodeInfo(**{**asdict(seen[name]), "partitions": seen[name].partitions + node.partitions})
            seen[name] = node
    return list(seen.values())


def parse_sinfo_node_states(text: str) -> Dict[str, str]:
    """``sinfo --noheader --Node --format='%N %T'`` -> {node: state}; a node listed once per
    partition keeps its one state. The state keeps sinfo's suffixes (``down*``, ``idle~``)."""
    states: Dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


_SINFO_SUFFIX = (("NOT_RESPONDING", "*"), ("POWERED_DOWN", "~"), ("POWERING_UP", "#"),
                 ("POWERING_DOWN", "%"), ("MAINTENANCE", "$"), ("REBOOT_REQUESTED", "@"))


def sinfo_state_word(n: NodeInfo) -> str:
    """The word ``sinfo --format=%T`` prints for a node record (``idle``, ``drained``,
    ``draining``, ``down*``...): what a backend without sinfo (slurmrestd) says for
    ``node_states``. A drain names the state whatever the base (as Slurm's
    node_state_string does): draining while jobs still run on it, drained after."""
    if "DRAIN" in n.flags:
        busy = n.state in ("allocated", "mixed", "completing") or "COMPLETING" in n.flags
        word = "draining" if busy else "drained"
    elif "COMPLETING" in n.flags:
        word = "completing"
    else:
        word = n.state
    for flag, mark in _SINFO_SUFFIX:
        if flag in n.flags:
            return word + mark
    return word


def parse_hostlist_lines(text: str) -> List[str]:
    """Hostlists, one or more a line (``sinfo --format=%N``) -> node names in order, once each."""
    names: List[str] = []
    for token in text.split():
        for name in hostlist.expand_hostlist(token):
            if name not in names:
                names.append(name)
    return names


# Slurm appends `` [user@2026-12-01T05:09:21]`` to a node's reason (every version recorded),
# and prints a node's Comment= and Extra= (free text too) after that stamp when they are set
# (seen on 22.05). The reason ends at the first stamp followed by nothing or by one of those
# fields; failing that, at the last stamp followed by any field; failing that, at the line's end.
_STAMP = r"\s\[(?P<user>[^@\]\s]+)@(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\]"
_REASON_TAILS = (re.compile(r"^(?P<reason>.*?)" + _STAMP + r"(?P<rest>(?:\s+(?:Comment|Extra)=.*)?)$"),
                 re.compile(r"^(?P<reason>.*)" + _STAMP + r"(?P<rest>(?:\s+[A-Za-z][A-Za-z0-9_]*=.*)?)$"))


def node_from_oneliner(line: str) -> NodeInfo:
    """One line of ``scontrol show node --oneliner``; State is like ``IDLE+DRAIN``. ``Reason``
    is the rest of the line (22.05, 24.11, 25.11), whatever it says, up to Slurm's
    ``[user@time]`` stamp, after which only a set ``Comment=`` or ``Extra=`` follows."""
    kv = parse_oneliner(line, last="Reason")
    base, flags = split_node_state(kv.get("State", "UNKNOWN").split("+"))
    reason = _null(kv.get("Reason"))
    user = when = None
    if reason:
        m = next((m for m in (t.match(reason) for t in _REASON_TAILS) if m), None)
        if m:
            reason, user, when = m.group("reason").strip(), m.group("user"), parse_iso(m.group("time"))
            for k, v in parse_oneliner(m.group("rest")).items():
                kv.setdefault(k, v)      # Comment=, Extra=: never over a field before Reason
    if live_reason(base, flags, reason) is None:
        reason = user = when = None
    return NodeInfo(
        name=kv["NodeName"],
        state=base,
        flags=flags,
        reason=reason,
        reason_user=user,
        reason_time=when,
        gres=_null(kv.get("Gres")) or "",
        partitions=tuple(p for p in (_null(kv.get("Partitions")) or "").split(",") if p),
        cpus=int(kv.get("CPUTot", "0") or 0),
        alloc_cpus=int(kv.get("CPUAlloc", "0") or 0),
    )


def parse_scontrol_nodes(text: str) -> List[NodeInfo]:
    return [node_from_oneliner(line) for line in text.splitlines() if line.startswith("NodeName=")]


def parse_steps(text: str) -> List[Tuple[str, str]]:
    """``squeue --noheader --steps --format='%i %j'`` -> [(step id, step name)], e.g. ("12.0", "train")."""
    steps = []
    for line in text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and "." in parts[0]:
            steps.append((parts[0].split(".", 1)[1], parts[1].strip()))
    return steps


def parse_topology(text: str) -> Dict[str, str]:
    """``scontrol show topology`` -> {node: its domain}: the block of topology/block
    (``BlockName=b1 BlockIndex=0 Nodes=node[1-2] BlockSize=2``), or the leaf switch of
    topology/tree (``SwitchName=s1 Level=0 LinkSpeed=1 Nodes=node[1-2]``; the upper levels,
    which span several leaves, are no domain). A node in several blocks keeps the first.
    No topology (the plugin is topology/flat or none, "No topology information available"):
    {}."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        name = fields.get("BlockName")
        if name is None and "SwitchName" in fields and fields.get("Level", "0") == "0":
            name = fields["SwitchName"]
        nodes = fields.get("Nodes")
        if not name or not nodes or nodes in ("(null)", "None"):
            continue
        try:
            members = hostlist.expand_hostlist(nodes)
        except hostlist.BadHostlist:
            raise ValueError(f"bad node list {nodes!r} in scontrol show topology") from None
        for n in members:
            out.setdefault(n, name)
    return out


def parse_version(text: str) -> Tuple[int, ...]:
    """``slurm 22.05.8`` (or ``slurm-wlm 22.05.8``) -> (22, 5, 8)."""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"no Slurm version in {text!r}")
    return tuple(int(g) for g in m.groups() if g is not None)


def parse_config_version(text: str) -> Tuple[int, ...]:
    """``scontrol show config``'s ``SLURM_VERSION = 22.05.8`` line -> (22, 5, 8)."""
    m = re.search(r"^SLURM_VERSION\s*=\s*(\S+)", text, re.MULTILINE)
    if not m:
        raise ValueError("no SLURM_VERSION line in scontrol show config")
    return parse_version(m.group(1))


def parse_jwt_token(text: str) -> str:
    """``scontrol token``'s ``SLURM_JWT=<token>`` -> the token."""
    m = re.search(r"^SLURM_JWT=(\S+)\s*$", text, re.MULTILINE)
    if not m:
        raise ValueError("scontrol token printed no SLURM_JWT= line")
    return m.group(1)


def parse_sbatch_parsable(text: str) -> int:
    """``sbatch --parsable`` prints ``jobid`` or ``jobid;cluster``."""
    first = text.strip().splitlines()[-1] if text.strip() else ""
    jid = first.split(";", 1)[0]
    if not jid.isdigit():
        raise ValueError(f"sbatch printed no job id: {text.strip()!r}")
    return int(jid)


# -- srun's error output ---------------------------------------------------------
SRUN_FAILURE = re.compile(r"srun: error: (\S+): tasks? ([\d,\-\[\] ]+): (.+?)\s*$")
SRUN_NODE_FAILURE = re.compile(r"[Nn]ode failure on (\S+?)[\s,.;]*$")


class FailureKind(str, Enum):
    """What srun's wording for one task's end says happened (:func:`failure_kind`)."""

    EXITED = "exited"        # "Exited with exit code 3": the program ended itself with an error
    KILLED = "killed"        # "Killed", a signal, "Segmentation fault", "Aborted"
    OTHER = "other"          # any other wording ("Terminated", ...); srun never writes both of the above

    def __str__(self) -> str:
        return self.value


def failure_kind(reason: str) -> FailureKind:
    """Classify srun's reason text for one task (the only place that reads that wording)."""
    text = reason.lower()
    if any(w in text for w in ("killed", "signal", "segmentation", "aborted")):
        return FailureKind.KILLED
    if "exit code" in text:
        return FailureKind.EXITED
    return FailureKind.OTHER


@dataclass(frozen=True)
class TaskFailure:
    """One task (rank) of a step that srun reported as ended badly (also the job
    supervisor's ``RankFailure``: one dataclass for both)."""

    node: str
    rank: int            # -1 when srun named the tasks in a form we do not know
    reason: str          # "Killed", "Exited with exit code 3", "Terminated", ...

    @property
    def kind(self) -> FailureKind:
        return failure_kind(self.reason)

    @property
    def aborted(self) -> bool:
        """srun says the task died of SIGABRT ("Aborted", "Aborted (core dumped)"): a signal the
        process raises itself (abort(), C++'s std::terminate, a failed assert), not one a node
        or an operator sends."""
        return self.kind == FailureKind.KILLED and "aborted" in self.reason.lower()

    @property
    def exit_code(self) -> Optional[int]:
        """The task's own exit code when srun says it exited with one ("Exited with exit code N")."""
        m = re.search(r"[Ee]xit(?:ed with exit)? code (\d+)", self.reason)
        return int(m.group(1)) if m else None


def parse_srun_failures(text: str) -> Tuple[List[TaskFailure], List[str]]:
    """Per-task failures in the order srun reported them, and the nodes srun saw fail
    (seen on 22.05, 24.11 and 25.11: ``srun: error: NODE: task(s) LIST: REASON``)."""
    failures: List[TaskFailure] = []
    lost: List[str] = []
    for line in text.splitlines():
        m = SRUN_FAILURE.search(line)
        if m:
            node, tasks, reason = m.group(1), m.group(2).strip(), m.group(3)
            try:
                ranks = [int(t) for t in hostlist.expand_hostlist(f"[{tasks.strip('[]')}]")]
            except Exception:  # noqa: BLE001 - a format we do not know: keep the line anyway
                ranks = [-1]
            for r in ranks:
                failures.append(TaskFailure(node=node, rank=r, reason=reason))
            continue
        m = SRUN_NODE_FAILURE.search(line)
        if m and m.group(1) not in lost:
            lost.append(m.group(1))
    return failures, lost
