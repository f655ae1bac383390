"""The Slurm layer's second backend: the controller through ``pyslurm`` (libslurm's API).

``PyslurmSlurm`` is an ``api.SlurmAPI`` that composes the CLI client (``client.Slurm``):
its job, step and node reads and its submit, requeue, hold/release, cancel/signal and
drain/resume go to slurmctld as RPCs in this process instead of starting
``squeue``/``scontrol``/``sbatch``/``scancel``. What pyslurm has no API for, or does
differently, is forwarded to the CLI client, and ``FORWARDED_TO_CLI`` is that list (the
forwarding methods are made from it): ``cancel_pending`` (a cancel by state), ``update_job``
(free-form ``Key=Value`` fields), ``partition_nodes``, ``node_states`` (sinfo's state words),
``node_address``, the reservations, ``show_config``, ``admin_level_text`` and ``topology``. Two
more fall back case by case: ``job`` of an array task id (``123_4``), and a ``submit`` with an option outside this
module's table or with ``SBATCH_*`` input variables set. This module runs no Slurm command
itself; the forwarded methods run them through the CLI client's Runner. The shared rules
(drain reasons, the foreign-resume refusal, submit's checks, retries) are ``api``'s.

``choose(cli, explicit=...)`` decides, once per process and slurm.conf: pyslurm is used
when it is installed and its major.minor (pyslurm versions follow Slurm's: 25.11.x is built
for Slurm 25.11) equals the controller's, which the CLI client reads (``scontrol show
config``) before libslurm is loaded at all; otherwise ``auto`` keeps the CLI client and logs
why (info), and an explicit ``pyslurm`` is a one-line ``InputError`` (exit 2). pyslurm is
imported here only, and only when it may be chosen: ``import clusterops`` never loads it.

libslurm reads one slurm.conf per process (``slurm_init``): the first pyslurm client binds
the process to its SLURM_CONF, and a client for another slurm.conf in the same process
stays on the CLI (or, asked for explicitly, is refused).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hostlist

from clusterops.errors import ClusteropsError, InputError, NotFoundError
from clusterops.slurm import parse
from clusterops.slurm.api import (Nodes, Retry, SlurmAPI, SlurmError, check_drain_reason, check_signal,
                                  hostlist_of, pick_node, refuse_foreign, retry_read, submit_body)
from clusterops.slurm.client import Slurm
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import base_state, categorize

log = logging.getLogger(__name__)

# libslurm's messages for a name it does not know (RPCError text): never retried.
_NOT_FOUND = re.compile(r"invalid job id|invalid node name|invalid job array|job/step already completing or "
                        r"completed|does not exist|invalid partition name", re.IGNORECASE)

_pyslurm: Any = None            # the module, once imported and initialised
_bound_conf: Optional[str] = None   # the slurm.conf libslurm was initialised with ("" = its default)
_decisions: Dict[Tuple[str, bool], Optional[str]] = {}   # (conf, explicit) -> None (use it) or why not


def _conf_of(cli: Slurm) -> str:
    return (cli.runner.env or {}).get("SLURM_CONF") or os.environ.get("SLURM_CONF") or ""


def _v(version: Sequence[int]) -> str:
    """(22, 5, 8) -> "22.05.8", as Slurm spells its versions."""
    return ".".join([str(version[0]), f"{version[1]:02d}", *map(str, version[2:])])


def installed_version() -> Optional[Tuple[int, ...]]:
    """pyslurm's version from its package metadata (no import of libslurm), or None."""
    from importlib import metadata

    try:
        return parse.parse_version(metadata.version("pyslurm"))
    except (metadata.PackageNotFoundError, ValueError):
        return None


def _load(conf: str) -> Any:
    """Import pyslurm and initialise libslurm with ``conf`` (once per process)."""
    global _pyslurm, _bound_conf
    if _pyslurm is not None:
        if conf != _bound_conf:
            raise ImportError(f"this process's pyslurm is bound to {_bound_conf or 'the default slurm.conf'}")
        return _pyslurm
    # Initialise explicitly with the conf this client uses (pyslurm's own import-time init
    # would read whatever SLURM_CONF the process happens to have).
    saved = os.environ.get("PYSLURM_DISABLE_AUTO_INIT")
    os.environ["PYSLURM_DISABLE_AUTO_INIT"] = "1"
    try:
        import pyslurm
    finally:
        if saved is None:
            os.environ.pop("PYSLURM_DISABLE_AUTO_INIT", None)
        else:
            os.environ["PYSLURM_DISABLE_AUTO_INIT"] = saved
    pyslurm.slurm_init(conf or None)
    _pyslurm, _bound_conf = pyslurm, conf
    return pyslurm


def choose(cli: Slurm, *, explicit: bool) -> SlurmAPI:
    """``cli`` or a ``PyslurmSlurm`` built on it (see the module docstring)."""
    conf = _conf_of(cli)
    key = (conf, explicit)
    if key not in _decisions:
        why = _why_not(cli, conf)
        if why is None or not why.startswith("transient: "):
            _decisions[key] = why          # a controller that did not answer is asked again next time
    else:
        why = _decisions[key]
    if why is None:
        return PyslurmSlurm(cli)
    why = why.removeprefix("transient: ")
    if explicit:
        raise InputError(f"Slurm backend pyslurm: {why} (set CLUSTEROPS_SLURM_BACKEND=cli or auto)")
    log.info("Slurm backend: using the CLI tools, not pyslurm: %s", why)
    return cli


def mismatch(controller: Sequence[int]) -> Optional[str]:
    """Why pyslurm cannot serve a controller of this version (not installed, or built for
    another major.minor), or None when it can."""
    have = installed_version()
    if have is None:
        return "pyslurm is not installed (pip install 'clusterops[pyslurm]')"
    if tuple(have[:2]) != tuple(controller[:2]):
        return f"pyslurm {_v(have)} is for Slurm {_v(have[:2])}, the controller runs {_v(controller)}"
    return None


def _why_not(cli: Slurm, conf: str) -> Optional[str]:
    if installed_version() is None:
        return mismatch(())
    try:
        ctld = cli.controller_version()
    except ClusteropsError as e:
        return f"transient: the controller's version is unknown ({e})"
    except ValueError as e:
        return f"the controller's version is unknown ({e})"
    why = mismatch(ctld)
    if why:
        return why
    try:
        _load(conf)
    except Exception as e:   # ImportError, a libslurm that does not load: one line, never a crash
        return f"pyslurm does not load: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
    return None


# ------------------------------------------------------------------------ sbatch options
# The #SBATCH / command-line options submit() maps onto pyslurm's JobSubmitDescription,
# verified against what sbatch sends (tests/integration/test_slurm_contract.py). An option
# outside this table sends the whole submission through sbatch (the CLI backend).
_VALUE_OPTS = {
    "job-name": "name", "J": "name",
    "nodes": "nodes", "N": "nodes",
    "ntasks": "ntasks", "n": "ntasks",
    "ntasks-per-node": "ntasks_per_node",
    "cpus-per-task": "cpus_per_task", "c": "cpus_per_task",
    "time": "time_limit", "t": "time_limit",
    "partition": "partitions", "p": "partitions",
    "account": "account", "A": "account",
    "qos": "qos", "q": "qos",
    "exclude": "excluded_nodes", "x": "excluded_nodes",
    "nodelist": "required_nodes", "w": "required_nodes",
    "constraint": "constraints", "C": "constraints",
    "chdir": "working_directory", "D": "working_directory",
    "output": "standard_output", "o": "standard_output",
    "error": "standard_error", "e": "standard_error",
    "open-mode": "log_files_open_mode",
    "signal": "signal",
    "array": "array", "a": "array",
    "mem": "memory_per_node",
    "comment": "comment",
    "dependency": "dependencies", "d": "dependencies",
}
_FLAG_OPTS = {
    "requeue": ("is_requeueable", True),
    "no-requeue": ("is_requeueable", False),
    "hold": ("priority", 0), "H": ("priority", 0),
    "exclusive": ("resource_sharing", "no"),
    "no-kill": ("kill_on_node_fail", False), "k": ("kill_on_node_fail", False),
}
_SHORT_WITH_VALUE = {k for k in _VALUE_OPTS if len(k) == 1}


class Unmapped(Exception):
    """An sbatch option this backend does not map: the submission goes through sbatch."""


def _sbatch_header(text: str) -> List[str]:
    """The options of a script's ``#SBATCH`` lines, read as sbatch does: from the top, up to
    the first line that is neither blank nor a comment; each line split like a shell word list."""
    opts: List[str] = []
    for i, line in enumerate(text.splitlines()):
        s = line.strip()
        if i == 0 and s.startswith("#!"):
            continue
        if not s or (s.startswith("#") and not s.startswith("#SBATCH")):
            continue
        if not s.startswith("#SBATCH"):
            break
        body = s[len("#SBATCH"):]
        try:
            words = shlex.split(body, comments=True)
        except ValueError as e:
            raise Unmapped(f"#SBATCH line {i + 1}: {e}") from None
        opts += words
    return opts


def _apply_options(fields: Dict[str, Any], words: Sequence[str]) -> None:
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            if name in _FLAG_OPTS and not eq:
                attr, val = _FLAG_OPTS[name]
                fields[attr] = val
            elif name in _VALUE_OPTS:
                if not eq:
                    if i + 1 >= len(words):
                        raise Unmapped(f"--{name} without a value")
                    i += 1
                    value = words[i]
                fields[_VALUE_OPTS[name]] = value
            else:
                raise Unmapped(w)
        elif w.startswith("-") and len(w) >= 2:
            name, rest = w[1], w[2:]
            if name in _FLAG_OPTS and not rest:
                attr, val = _FLAG_OPTS[name]
                fields[attr] = val
            elif name in _SHORT_WITH_VALUE:
                if not rest:
                    if i + 1 >= len(words):
                        raise Unmapped(f"-{name} without a value")
                    i += 1
                    rest = words[i]
                fields[_VALUE_OPTS[name]] = rest
            else:
                raise Unmapped(w)
        else:
            raise Unmapped(w)
        i += 1


def _warn_signal(spec: str) -> Dict[str, Any]:
    """sbatch's ``--signal=[{R|B}:]<sig>[@sig_time]`` as pyslurm's dict. pyslurm parses the
    text form itself but knows signal names only with "SIG" (``B:USR1@30`` is refused)."""
    import signal as _signal

    flags, _, rest = spec.rpartition(":")
    name, _, when = rest.partition("@")
    if flags not in ("", "B", "R", "BR", "RB") or (when and not when.isdigit()):
        raise Unmapped(f"--signal={spec}")
    try:
        sig = check_signal(name)
    except InputError:
        raise Unmapped(f"--signal={spec}") from None
    num = int(sig) if sig.isdigit() else int(getattr(_signal, f"SIG{sig}"))
    out: Dict[str, Any] = {"signal": num, "time": int(when) if when else 60}   # sbatch's default: 60 s
    if "B" in flags:
        out["batch_only"] = True
    if "R" in flags:
        out["allow_reservation_overlap"] = True
    return out


def _sbatch_env() -> Dict[str, str]:
    """What sbatch itself adds to a job's environment and pyslurm does not: the submit
    directory and host, the umask and the nice value slurmd applies to the batch shell.
    (sbatch's SLURM_RLIMIT_* are not set: the job gets slurmd's resource limits.)"""
    import socket

    mask = os.umask(0)
    os.umask(mask)
    return {"SLURM_SUBMIT_DIR": os.getcwd(), "SLURM_SUBMIT_HOST": socket.gethostname(),
            "SLURM_UMASK": f"{mask:04o}", "SLURM_PRIO_PROCESS": str(os.getpriority(os.PRIO_PROCESS, 0))}


def submit_fields(script_text: str, args: Sequence[str], workdir: Optional[str]) -> Dict[str, Any]:
    """JobSubmitDescription fields for a script and sbatch-style ``args`` (the command line
    wins over #SBATCH, as with sbatch). Raises ``Unmapped`` for anything not in the tables."""
    fields: Dict[str, Any] = {}
    _apply_options(fields, _sbatch_header(script_text))
    _apply_options(fields, list(args))
    if workdir:
        fields["working_directory"] = workdir
    if "partitions" in fields:
        fields["partitions"] = fields["partitions"].split(",")
    for key in ("excluded_nodes", "required_nodes"):
        if key in fields:
            fields[key] = hostlist.expand_hostlist(fields[key])
    if "signal" in fields:
        fields["signal"] = _warn_signal(fields["signal"])
    # pyslurm wants numbers as ints (a time of "5" would reach libslurm as text).
    for key in ("ntasks", "ntasks_per_node", "cpus_per_task", "time_limit"):
        value = fields.get(key)
        if isinstance(value, str) and value.isdigit():
            fields[key] = int(value)
        elif value is not None and key != "time_limit":
            raise Unmapped(f"{key}={value!r}")
    # sbatch leaves the task count to slurmctld (one per node); pyslurm would default it to 1,
    # which a multi-node job refuses. Say it as sbatch would mean it.
    if "ntasks" not in fields and "nodes" in fields:
        per = int(fields.get("ntasks_per_node") or 1)
        fields["ntasks"] = int(str(fields["nodes"]).split("-")[0]) * per
    return fields


# -------------------------------------------------------------------------------- client
# What pyslurm has no API for, or spells otherwise: these methods are the CLI client's.
FORWARDED_TO_CLI = (
    "show_config", "admin_level_text",   # text only scontrol/sacctmgr print
    "topology",            # scontrol show topology's blocks and switches
    "cancel_pending",      # scancel --state=PENDING: pyslurm has no state filter on a cancel
    "update_job",          # scontrol's free-form field names (ExcNodeList=, TimeLimit=)
    "node_states",         # sinfo's state words with their *, ~ suffixes
    "partition_nodes",     # sinfo's partition membership
    "node_address",        # NodeAddr, after the name's own resolution
    "create_reservation",  # scontrol's flag words (MAINT,IGNORE_JOBS): one spelling, one path
    "delete_reservation",
)


class PyslurmSlurm:
    """The Slurm layer through pyslurm, composing the CLI client ``cli`` for
    ``FORWARDED_TO_CLI`` (and for array-task ``job`` and unmapped ``submit``)."""

    backend = "pyslurm"

    def __init__(self, cli: Slurm):
        # Same runner, tools and settings as the CLI client it was chosen over: the forwarded
        # methods behave exactly as on the CLI backend.
        self.cli = cli
        self.runner, self.settings, self.tools, self.sleep = cli.runner, cli.settings, cli.tools, cli.sleep
        self.timeout_s, self.read_attempts, self.backoff_s = cli.timeout_s, cli.read_attempts, cli.backoff_s
        self.ps = _load(_conf_of(cli))

    # -- plumbing ---------------------------------------------------------------------
    def _error(self, e: Exception, what: str) -> ClusteropsError:
        text = str(e).strip() or type(e).__name__
        if _NOT_FOUND.search(text):
            return NotFoundError(f"{what}: {text}")
        return SlurmError(f"{what}: {text}")

    def _rpc_read(self, what: str, fn, *args):
        """A read RPC, retried by the CLI backend's rule (``api.retry_read``, its ``Backoff``)."""
        def attempt():
            try:
                return fn(*args)
            except self.ps.PyslurmError as e:
                err = self._error(e, what)
                if isinstance(err, NotFoundError):
                    raise err from None
                raise Retry(e) from None

        return retry_read(attempt, self.cli.backoff, what=what, sleep=self.sleep, label=what)

    def _rpc_write(self, what: str, fn, *args):
        """A write RPC: once, never retried (as the CLI backend's writes)."""
        try:
            return fn(*args)
        except self.ps.PyslurmError as e:
            raise self._error(e, what) from None

    # -- version ------------------------------------------------------------------------
    def version(self) -> Tuple[int, ...]:
        """The client library's version (libslurm that pyslurm was built against)."""
        return tuple(int(x) for x in self.ps.slurm_api_version())

    def controller_version(self) -> Tuple[int, ...]:
        cfg = self._rpc_read("load config", self.ps.slurmctld.Config.load)
        return parse.parse_version(str(cfg.version))

    # -- jobs ---------------------------------------------------------------------------
    def _job_info(self, j: Any) -> JobInfo:
        state = j.state or "UNKNOWN"
        nodes = j.allocated_nodes or ""
        tl = j.time_limit
        reason = j.state_reason
        return JobInfo(
            job_id=int(j.id),
            name=j.name or "",
            state=base_state(state),
            category=categorize(state),
            reason=None if reason in (None, "", "None") else reason,
            nodes=nodes,
            node_names=tuple(hostlist.expand_hostlist(nodes)) if nodes else (),
            restart_count=int(j.requeue_count or 0),
            time_limit_min=float(tl) if tl is not None else None,
            submit_time=float(j.submit_time) if j.submit_time else None,
            start_time=float(j.start_time) if j.start_time else None,
            end_time=float(j.end_time) if j.end_time else None,
            exit_code=j.exit_code,
            exit_signal=j.exit_code_signal or None,
            batch_host=j.batch_host or None,
            excluded_nodes=j.excluded_nodes or "",
            partition=j.partition or "",
            requeue=bool(j.is_requeueable),
            array_job_id=int(j.array_id) if j.array_id else None,
            array_task_id=int(j.array_task_id) if j.array_task_id is not None else None,
            # pyslurm's Job: the pending tasks of one record as a string, like scontrol's ArrayTaskId
            array_tasks=(str(j.array_task_id) if j.array_task_id is not None
                         else str(getattr(j, "array_tasks_waiting", None) or "")),
            preempt_time=float(j.preempt_time) if j.preempt_time else None,
            user=getattr(j, "user_name", None) or "",
            command=getattr(j, "command", None) or "",
        )

    def _all_jobs(self) -> List[Any]:
        loaded = self._rpc_read("load jobs", self.ps.Jobs.load)
        return list(loaded.values())

    def jobs(self, job_ids=None) -> List[JobInfo]:
        """Every job slurmctld still holds (finished ones included, as with the CLI's
        ``--states=all``); named ids that it no longer knows are absent."""
        found = [self._job_info(j) for j in self._all_jobs()]
        if job_ids is None:
            return found
        wanted = {int(j) for j in job_ids}
        return [j for j in found if j.job_id in wanted or j.array_job_id in wanted]

    def job(self, job_id) -> JobInfo:
        jid = str(job_id)
        if not jid.isdigit():
            if jid.replace("_", "").isdigit():
                return self.cli.job(job_id)   # array task ids (123_4): pyslurm loads by number only
            raise InputError(f"job id must be a number, got {job_id!r}")
        return self._job_info(self._rpc_read(f"job {jid}", self.ps.Job.load, int(jid)))

    def job_tasks(self, job_id) -> List[JobInfo]:
        jid = int(str(job_id).split("_")[0])
        found = [self._job_info(j) for j in self._all_jobs()]
        return [j for j in found if j.job_id == jid or j.array_job_id == jid]

    def submit(self, script=None, args: Sequence[str] = (), *, text: Optional[str] = None,
               workdir: Optional[str] = None) -> int:
        path = submit_body(script, text)
        body = path.read_text() if path is not None else text or ""
        # sbatch reads SBATCH_* input variables too; this backend does not: let sbatch do it.
        sbatch_env = sorted(k for k in os.environ if k.startswith("SBATCH_"))
        try:
            if sbatch_env:
                raise Unmapped(f"input variables {', '.join(sbatch_env)}")
            fields = submit_fields(body, args, workdir)
        except Unmapped as e:
            log.debug("pyslurm backend: %s is not mapped; submitting with sbatch", e)
            return self.cli.submit(script, args, text=text, workdir=workdir)
        # sbatch exports the submitter's whole environment (--export=ALL) with the client's
        # extras (SLURM_CONF, the prefix's PATH): the same here.
        env = {**os.environ, **dict(self.runner.env or {}), **self.tools.env(), **_sbatch_env()}
        fields.setdefault("working_directory", os.getcwd())
        desc = self.ps.JobSubmitDescription(script=str(script) if script is not None else body,
                                            environment=env, **fields)
        try:
            return int(self._rpc_write("submit", desc.submit))
        except ValueError as e:   # pyslurm's own checks of a value (a time, a node count)
            raise InputError(f"submit: {e}") from None

    def requeue(self, job_id, *, hold: bool = False) -> None:
        if "_" in str(job_id):
            return self.cli.requeue(job_id, hold=hold)   # an array task (123_4): pyslurm names jobs by number
        self._rpc_write(f"requeue {job_id}", self.ps.Job(int(job_id)).requeue, hold)

    def hold(self, job_id) -> None:
        # pyslurm's default hold is the same request as `scontrol hold` (priority 0).
        self._rpc_write(f"hold {job_id}", self.ps.Job(int(job_id)).hold)

    def release(self, job_id) -> None:
        self._rpc_write(f"release {job_id}", self.ps.Job(int(job_id)).release)

    def cancel(self, job_id, *, signal=None, batch: bool = False, full: bool = False,
               step: Optional[int] = None) -> None:
        # As on the CLI backend, an unknown id is an error (pyslurm, like scancel, ignores a
        # SIGKILL for a job it does not know).
        self.job(job_id)
        jid = int(job_id)
        sig = check_signal(signal) if signal is not None else "KILL"
        signum = int(sig) if sig.isdigit() else f"SIG{sig}"
        if step is not None:
            # A step built by hand (JobStep(job, step)) lacks the het-component id slurmctld
            # checks ("Invalid job id"); the loaded one carries it.
            st = self._rpc_read(f"step {jid}.{step}", self.ps.JobStep.load, jid, int(step))
            if signal is None:
                self._rpc_write(f"cancel {jid}.{step}", st.cancel)
            else:
                self._rpc_write(f"signal {jid}.{step}", st.send_signal, signum)
            return
        if signal is None and not batch and not full:
            self._rpc_write(f"cancel {jid}", self.ps.Job(jid).cancel)
            return
        # scancel --signal without --batch/--full signals the job's steps and its batch shell
        # ... only the steps ("children"); --batch: the batch shell; --full: all of them.
        steps = "all" if full else "batch" if batch else "children"
        self._rpc_write(f"signal {jid}", self.ps.Job(jid).send_signal, signum, steps)

    def signal(self, job_id, sig, *, batch: bool = False, full: bool = False,
               step: Optional[int] = None) -> None:
        """As on the CLI backend: a signal without ending the job, through ``cancel``."""
        self.cancel(job_id, signal=sig, batch=batch, full=full, step=step)

    def steps(self, job_id) -> List[Tuple[str, str]]:
        # Job.load brings the steps of a job that is not pending along (one RPC).
        job = self._rpc_read(f"job {job_id}", self.ps.Job.load, int(job_id))
        return [(str(k), s.name or "") for k, s in (job.steps or {}).items()]

    # -- nodes ----------------------------------------------------------------------------
    def _node_info(self, n: Any) -> NodeInfo:
        base, flags = parse.split_node_state((n.state or "UNKNOWN").split("+"))
        reason = parse.live_reason(base, flags, n.reason or None)
        return NodeInfo(
            name=n.name,
            state=base,
            flags=flags,
            reason=reason,
            reason_user=(n.reason_user or None) if reason else None,
            reason_time=float(n.reason_time) if reason and n.reason_time else None,
            gres=_gres_text(n.configured_gres),
            partitions=tuple(n.partitions or ()),
            cpus=int(n.total_cpus or 0),
            alloc_cpus=int(n.allocated_cpus or 0),
        )

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        loaded = self._rpc_read("load nodes", self.ps.Nodes.load)
        found = [self._node_info(n) for n in loaded.values()]
        if names is None:
            return found
        wanted = hostlist.expand_hostlist(hostlist_of(names))
        by_name = {n.name: n for n in found}
        missing = [w for w in wanted if w not in by_name]
        if missing:
            # scontrol show node names an unknown node as an error; so does this backend.
            raise NotFoundError(f"node {hostlist.collect_hostlist(missing)} not found")
        return [by_name[w] for w in wanted]

    def node(self, name: str) -> NodeInfo:
        return pick_node(self.nodes(name), name)

    def drain(self, nodes: Nodes, reason: str) -> None:
        check_drain_reason(reason)
        names = hostlist_of(nodes)
        self._update_nodes(names, f"drain {names}", state="DRAIN", reason=reason)

    def resume(self, nodes: Nodes) -> None:
        names = hostlist_of(nodes)
        # Read, then write, as on the CLI backend: the window is one RPC round trip.
        refuse_foreign(self.nodes(names))
        self._update_nodes(names, f"resume {names}", state="RESUME")

    def _update_nodes(self, names: str, what: str, **changes: str) -> None:
        ps = self.ps
        target = ps.Nodes(hostlist.expand_hostlist(names))
        self._rpc_write(what, target.modify, ps.Node(**changes))



def _forward(name: str):
    cli_method = getattr(Slurm, name)

    @functools.wraps(cli_method)   # the CLI's signature and docstring
    def method(self, *args, **kwargs):
        return getattr(self.cli, name)(*args, **kwargs)

    return method


for _name in FORWARDED_TO_CLI:
    setattr(PyslurmSlurm, _name, _forward(_name))
del _name


def _gres_text(gres: Any) -> str:
    """pyslurm's configured_gres ({"gpu": 4} or {"gpu:tesla": 4}) -> scontrol's "gpu:4"."""
    if not gres:
        return ""
    if isinstance(gres, str):
        return gres
    return ",".join(f"{k}:{v}" for k, v in gres.items())
