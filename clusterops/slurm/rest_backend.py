"""The Slurm layer's third backend: slurmrestd, Slurm's REST API (``restd`` is the wire).

``RestSlurm`` is an ``api.SlurmAPI`` that composes the CLI client (``client.Slurm``), as the
pyslurm backend does. It asks the server which OpenAPI plugin versions it serves
(``GET /openapi/v3``) and takes the newest one it has an adapter for (``ADAPTERS``):
``v0.0.38`` (Slurm 22.05, which serves v0.0.36-38) and ``v0.0.40``-``v0.0.42`` (24.11 serves
v0.0.40-42, 25.11 v0.0.41-44; 26.05 drops v0.0.41 and 26.11 v0.0.42). A server that serves
none of them, or answers the discovery with an error, is a one-line ``InputError`` naming
the URL (exit 2).

The job and node records are the same data parsers' output as ``squeue --json`` and
``sinfo --json`` of the same Slurm, so ``parse.job_from_json`` and ``parse.node_from_json``
read them for every version. What differs by version is what a request looks like and what
the server can do at all; each adapter says so:

- v0.0.38 has no node update, no requeue, no signal flags and no ``excluded_nodes`` on a
  job, and 22.05 refuses its ``no_kill`` and a ``B:`` warning signal: ``drain``,
  ``resume``, ``requeue``, a signal (or a cancel of one step, or with ``batch``/``full``), an
  ``update_job`` of ``ExcNodeList`` and a submit with ``--exclude``, ``--nodelist``,
  ``--no-kill`` or ``--signal=B:...`` go to the CLI client there;
- v0.0.40+ drain and resume a node (``POST /node/{name}``), send signals with flags
  (``BATCH_JOB``, ``FULL_JOB``, ``FULL_STEPS_ONLY``, ``DELETE /job/{id}``) and set
  ``excluded_nodes``; ``requeue`` still has no endpoint.

``ALWAYS_FORWARDED`` names the methods no version serves here (``show_config``,
``admin_level_text``, ``steps``, the reservations, ``topology``, ``cancel_pending``): the
forwarding methods are made from it (tests/test_layout.py checks). A submission with an option outside the pyslurm backend's
table (``pyslurm_backend.submit_fields``, the one sbatch-option reader) goes through sbatch.
Where the Slurm commands are not installed, a forwarded call is the CLI client's one-line
"not found" error, prefixed with why REST could not serve it.

Reads are retried by ``api.retry_read`` (a server error 5xx that is not a "no such job/node"
answer, or no connection); writes are sent once.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hostlist

from clusterops.errors import ClusteropsError, InputError, NotFoundError
from clusterops.slurm import parse
from clusterops.slurm.api import (Nodes, Retry, SlurmError, SlurmUnavailable, check_drain_reason,
                                  check_signal, hostlist_of, pick_node, refuse_foreign, retry_read,
                                  submit_body)
from clusterops.slurm.client import Slurm
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.restd import (DEFAULT_LIFESPAN_S, KEY_ENV, TOKEN_ENV, CommandTokens, Endpoint, KeyTokens,
                                    StaticToken, current_user, error_numbers, error_text, version_key)

log = logging.getLogger(__name__)

# What the server says of a name it does not know: never retried, a NotFoundError.
_NOT_FOUND = re.compile(r"invalid job id|invalid node name|invalid partition name|unable to find|"
                        r"not found|does not exist|job/step already completing or completed", re.IGNORECASE)
_NOT_FOUND_ERRNO = {2017, 2018, 2000}   # ESLURM_INVALID_JOB_ID, _NODE_NAME, _PARTITION_NAME


class Unserved(Exception):
    """This server's plugin version cannot do what was asked: the CLI client does it."""


# ---------------------------------------------------------------------------- adapters
@dataclass(frozen=True)
class Adapter:
    """How one OpenAPI plugin version spells requests, and what it can do."""

    version: str
    node_update: bool        # POST /slurm/V/node/{name}
    signal_flags: bool       # DELETE /slurm/V/job/{id}?signal=&flags=
    job_exclude: bool        # excluded_nodes / required_nodes in a job description

    def path(self, *parts: str) -> str:
        return "/".join(["/slurm", self.version, *parts])

    @property
    def legacy(self) -> bool:
        """v0.0.38: environment as an object, open_mode and signal as text."""
        return self.version == "v0.0.38"

    def job_description(self, fields: Dict[str, Any], env: Dict[str, str], cwd: str) -> Dict[str, Any]:
        """A job description from ``pyslurm_backend.submit_fields``' names; ``Unserved``
        for a field this version cannot carry."""
        d: Dict[str, Any] = {"current_working_directory": fields.pop("working_directory", cwd)}
        d["environment"] = dict(env) if self.legacy else [f"{k}={v}" for k, v in env.items()]
        simple = {"name": "name", "ntasks": "tasks", "ntasks_per_node": "tasks_per_node",
                  "cpus_per_task": "cpus_per_task", "account": "account", "qos": "qos",
                  "constraints": "constraints", "standard_output": "standard_output",
                  "standard_error": "standard_error", "array": "array", "comment": "comment",
                  "dependencies": "dependency", "is_requeueable": "requeue"}
        for key, value in fields.items():
            if key in simple:
                d[simple[key]] = value
            elif key == "nodes":
                d["nodes"] = str(value) if not self.legacy else _node_count(value)
            elif key == "time_limit":
                minutes = value if isinstance(value, int) else parse.parse_time_limit(str(value))
                if minutes is None:
                    raise Unserved(f"time limit {value!r}")
                d["time_limit"] = int(minutes)
            elif key == "partitions":
                d["partition"] = ",".join(value)
            elif key in ("excluded_nodes", "required_nodes"):
                if not self.job_exclude:
                    raise Unserved(f"{key} on {self.version}")
                d[key] = list(value)
            elif key == "log_files_open_mode":
                mode = str(value).lower()
                if mode not in ("append", "truncate"):
                    raise Unserved(f"--open-mode={value}")
                d["open_mode"] = mode if self.legacy else [mode.upper()]
            elif key == "signal":
                if self.legacy:
                    # 22.05's v0.0.38 refuses the "B:" prefix its own schema names ("Invalid
                    # SIGNAL specification"): a batch-only warning signal goes through sbatch.
                    if value.get("batch_only") or value.get("allow_reservation_overlap"):
                        raise Unserved("--signal=B:... on v0.0.38")
                    d["signal"] = f"{value['signal']}@{value['time']}"
                else:
                    d["kill_warning_signal"] = str(value["signal"])
                    d["kill_warning_delay"] = int(value["time"])
                    d["kill_warning_flags"] = ["BATCH_JOB"] if value.get("batch_only") else []
            elif key == "resource_sharing" and value == "no":      # --exclusive
                if self.legacy:
                    d["exclusive"] = "true"
                else:
                    d["shared"] = ["none"]
            elif key == "priority" and value == 0:
                d["hold"] = True
            elif key == "kill_on_node_fail":
                if self.legacy:
                    # 22.05's v0.0.38 refuses every value of its no_kill ("Invalid no kill
                    # specification"): --no-kill goes through sbatch there.
                    raise Unserved("--no-kill on v0.0.38")
                d["kill_on_node_fail"] = bool(value)
            elif key == "memory_per_node" and str(value).isdigit():
                d["memory_per_node"] = int(value)
            else:
                raise Unserved(f"{key}={value!r} on {self.version}")
        return d

    def submit_request(self, script: str, desc: Dict[str, Any]) -> Dict[str, Any]:
        return {"script": script, "job": desc}

    def job_update(self, fields: Dict[str, Any]) -> Dict[str, Any]:
        """``scontrol update`` keys (``TimeLimit``, ``ExcNodeList``...) as this version's job
        fields; ``Unserved`` for one it does not map."""
        out: Dict[str, Any] = {}
        for key, value in fields.items():
            k = key.lower()
            if k == "timelimit":
                minutes = parse.parse_time_limit(str(value))
                if minutes is None:
                    raise Unserved(f"TimeLimit={value}")
                out["time_limit"] = int(minutes)
            elif k == "excnodelist" and self.job_exclude:
                out["excluded_nodes"] = hostlist.expand_hostlist(str(value)) if str(value) else []
            elif k == "comment":
                out["comment"] = str(value)
            elif k in ("name", "jobname"):
                out["name"] = str(value)
            else:
                raise Unserved(f"{key}= on {self.version}")
        return out

    def hold_update(self, hold: bool) -> Dict[str, Any]:
        return {"hold": hold}

    def node_change(self, state: str, reason: Optional[str]) -> Dict[str, Any]:
        if not self.node_update:
            raise Unserved(f"node update on {self.version}")
        body: Dict[str, Any] = {"state": [state]}
        if reason is not None:
            body["reason"] = reason
        return body

    def signal_query(self, sig: Optional[str], batch: bool, full: bool) -> Dict[str, str]:
        """The DELETE query of a cancel (``sig`` None) or a signal."""
        if sig is None and not batch and not full:
            return {}
        if not self.signal_flags:
            raise Unserved(f"signal flags on {self.version}")
        flags = "BATCH_JOB" if batch else "FULL_JOB" if full else "FULL_STEPS_ONLY"
        if sig is None:
            return {"flags": flags}
        return {"signal": sig if sig.isdigit() else f"SIG{sig}", "flags": flags}


def _node_count(value: Any) -> Any:
    text = str(value)
    return int(text) if text.isdigit() else text


ADAPTERS: Dict[str, Adapter] = {
    "v0.0.38": Adapter("v0.0.38", node_update=False, signal_flags=False, job_exclude=False),
    # Written from the v0.0.4x data parsers (Slurm 25.11's src/plugins/data_parser/); the same
    # job description, node update and kill flags in all three.
    "v0.0.40": Adapter("v0.0.40", node_update=True, signal_flags=True, job_exclude=True),
    "v0.0.41": Adapter("v0.0.41", node_update=True, signal_flags=True, job_exclude=True),
    "v0.0.42": Adapter("v0.0.42", node_update=True, signal_flags=True, job_exclude=True),
}


def pick_adapter(served: Sequence[str], shown: str) -> Adapter:
    """The newest served version with an adapter; ``InputError`` naming the URL otherwise."""
    known = [v for v in sorted(served, key=version_key, reverse=True) if v in ADAPTERS]
    if not known:
        have = ", ".join(served) or "no slurm API"
        raise InputError(f"slurmrestd at {shown} serves {have}; clusterops knows "
                         f"{', '.join(ADAPTERS)}")
    return ADAPTERS[known[0]]


# ----------------------------------------------------------------------------- choosing
_served_cache: Dict[str, List[str]] = {}


def tokens_for(cli: Slurm, settings_key: Optional[str], lifespan_s: int = DEFAULT_LIFESPAN_S):
    """Where the JWT comes from: the key file (settings or ``$CLUSTEROPS_SLURM_JWT_KEY``),
    else ``$SLURM_JWT``, else ``scontrol token`` through the CLI client."""
    key = settings_key or os.environ.get(KEY_ENV, "").strip()
    if key:
        return KeyTokens(key, current_user(), lifespan_s)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return StaticToken(token, os.environ.get("CLUSTEROPS_SLURM_USER") or None)
    return CommandTokens(cli.jwt_token, current_user(), lifespan_s)


def served_versions(cli: Slurm, url: str, *, jwt_key: Optional[str] = None,
                    ca_file: Optional[str] = None) -> List[str]:
    """The plugin versions the server at ``url`` serves that have an adapter here, oldest first."""
    connect_rest(cli, url, jwt_key=jwt_key, ca_file=ca_file)
    endpoint = Endpoint(url, tokens_for(cli, jwt_key), timeout_s=cli.timeout_s, ca_file=ca_file)
    return [v for v in _served_cache[f"{endpoint.shown} {endpoint.tokens.user}"] if v in ADAPTERS]


def connect_rest(cli: Slurm, url: str, *, jwt_key: Optional[str] = None,
                 version: Optional[str] = None, ca_file: Optional[str] = None) -> "RestSlurm":
    """A ``RestSlurm`` on ``url``. Once per process, URL and user: the plugin version is
    chosen by asking the server (``GET /openapi/v3``), and the token is tried (the version
    from ``ping``, then the partitions: 24.11 answers a ping for a token it refuses), so
    a server that cannot serve us is one ``InputError`` here, naming the URL, not a failure
    in the middle of a sweep. ``version``: that plugin version rather than the newest (it
    must be served and known). ``ca_file``: an https server's certificate is checked against
    that CA bundle (else the system's)."""
    endpoint = Endpoint(url, tokens_for(cli, jwt_key), timeout_s=cli.timeout_s, ca_file=ca_file)
    key = f"{endpoint.shown} {endpoint.tokens.user}"
    if key not in _served_cache:
        def attempt():
            try:
                return endpoint.served_versions()
            except SlurmUnavailable as e:
                raise Retry(e) from None

        try:
            served = retry_read(attempt, cli.backoff, what="slurmrestd discovery", sleep=cli.sleep,
                                label=f"slurmrestd at {endpoint.shown}")
        except SlurmError as e:
            text = str(e) if endpoint.shown in str(e) else f"slurmrestd at {endpoint.shown}: {e}"
            raise InputError(text) from None
        client = RestSlurm(cli, endpoint, pick_adapter(served, endpoint.shown))
        try:
            client.version()
            client._read(client.adapter.path("partitions"))
        except ClusteropsError as e:
            raise InputError(f"{e} (user {endpoint.tokens.user}: is the token accepted?)") from None
        _served_cache[key] = served
    served = _served_cache[key]
    if version is not None:
        if version not in served or version not in ADAPTERS:
            raise InputError(f"slurmrestd at {endpoint.shown}: plugin version {version} is not both served "
                             f"({', '.join(served)}) and known ({', '.join(ADAPTERS)})")
        served = [version]
    return RestSlurm(cli, endpoint, pick_adapter(served, endpoint.shown))


# -------------------------------------------------------------------------------- client
# What no plugin version serves here: the CLI client's.
ALWAYS_FORWARDED = (
    "show_config", "admin_level_text",   # text only scontrol/sacctmgr print
    "steps",                             # the job records carry no steps
    "create_reservation",                # v0.0.43+ only; one spelling (scontrol's flag words)
    "delete_reservation",
    "topology",                          # scontrol show topology's blocks and switches
    "cancel_pending",                    # scancel --state=PENDING: no state filter on the API's cancel
)


class RestSlurm:
    """The Slurm layer through slurmrestd, composing the CLI client ``cli`` for
    ``ALWAYS_FORWARDED`` and for what the chosen ``Adapter`` cannot do."""

    backend = "rest"

    def __init__(self, cli: Slurm, endpoint: Endpoint, adapter: Adapter):
        self.cli = cli
        self.endpoint = endpoint
        self.adapter = adapter
        self.runner, self.settings, self.tools, self.sleep = cli.runner, cli.settings, cli.tools, cli.sleep
        self.timeout_s, self.read_attempts, self.backoff_s = cli.timeout_s, cli.read_attempts, cli.backoff_s

    @property
    def url(self) -> str:
        return self.endpoint.shown

    # -- plumbing -------------------------------------------------------------------------
    def _failure(self, method: str, path: str, status: int, body: Dict[str, Any]) -> ClusteropsError:
        text = error_text(body) or f"HTTP {status}"
        msg = f"slurmrestd at {self.url}: {method} {path}: {text}"
        if _NOT_FOUND.search(text) or set(error_numbers(body)) & _NOT_FOUND_ERRNO:
            return NotFoundError(msg)
        return SlurmError(msg)

    def _read(self, path: str, **query: str) -> Dict[str, Any]:
        def attempt():
            try:
                reply = self.endpoint.request("GET", path, query=query or None)
            except SlurmUnavailable as e:
                raise Retry(e) from None
            if reply.status == 200 and not error_text(reply.body):
                return reply.body
            err = self._failure("GET", path, reply.status, reply.body)
            if isinstance(err, NotFoundError) or reply.status in (400, 401, 403, 404):
                raise err
            raise Retry(err)

        # No label: every failure's text already names the URL.
        return retry_read(attempt, self.cli.backoff, what=f"GET {path}", sleep=self.sleep)

    def _write(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
               query: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        reply = self.endpoint.request(method, path, body=body, query=query)
        if reply.status == 200 and not error_text(reply.body):
            return reply.body
        raise self._failure(method, path, reply.status, reply.body)

    def _cli(self, why: str, name: str, *args, **kwargs):
        log.debug("rest backend: %s; %s goes to the CLI client", why, name)
        try:
            return getattr(self.cli, name)(*args, **kwargs)
        except SlurmError as e:
            if " not found: install the Slurm client" in str(e):
                raise SlurmError(f"slurmrestd at {self.url} ({self.adapter.version}) cannot {name} "
                                 f"({why}), and {e}") from None
            raise

    # -- versions -------------------------------------------------------------------------
    def version(self) -> Tuple[int, ...]:
        """The Slurm version slurmrestd reports (its ``meta``): the client side of this backend."""
        meta = self._read(self.adapter.path("ping")).get("meta") or {}
        release = (meta.get("Slurm") or meta.get("slurm") or {}).get("release")
        if not release:
            raise SlurmError(f"slurmrestd at {self.url}: no Slurm release in the reply's meta")
        return parse.parse_version(str(release))

    def controller_version(self) -> Tuple[int, ...]:
        """slurmctld's version, as slurmrestd (built with the same libslurm) reports it."""
        return self.version()

    # -- jobs -----------------------------------------------------------------------------
    def _jobs_of(self, body: Dict[str, Any]) -> List[JobInfo]:
        return [parse.job_from_json(j) for j in body.get("jobs") or []]

    def jobs(self, job_ids=None) -> List[JobInfo]:
        """Every job slurmctld still holds (finished ones included); unknown ids are absent."""
        if job_ids is not None:
            wanted = {int(j) for j in job_ids}
            if not wanted:
                return []
        found = self._jobs_of(self._read(self.adapter.path("jobs")))
        if job_ids is None:
            return found
        return [j for j in found if j.job_id in wanted or j.array_job_id in wanted]

    def job(self, job_id) -> JobInfo:
        jid = str(job_id)
        if not jid.replace("_", "").isdigit() or jid.count("_") > 1:
            raise InputError(f"job id must be a number, got {job_id!r}")
        base, _, task = jid.partition("_")
        found = self._jobs_of(self._read(self.adapter.path("job", base)))
        if task:
            found = [j for j in found if j.array_task_id == int(task)]
        else:
            found = [j for j in found if j.job_id == int(base)] or found[:1]
        if not found:
            raise NotFoundError(f"job {jid} not found")
        return found[0]

    def job_tasks(self, job_id) -> List[JobInfo]:
        base = str(job_id).split("_")[0]
        if not base.isdigit():
            raise InputError(f"job id must be a number, got {job_id!r}")
        return self._jobs_of(self._read(self.adapter.path("job", base)))

    def submit(self, script=None, args: Sequence[str] = (), *, text: Optional[str] = None,
               workdir: Optional[str] = None) -> int:
        from clusterops.slurm import pyslurm_backend as sbatch_options   # the one sbatch-option reader

        path = submit_body(script, text)
        body = path.read_text() if path is not None else text or ""
        sbatch_env = sorted(k for k in os.environ if k.startswith("SBATCH_"))
        try:
            if sbatch_env:
                raise Unserved(f"input variables {', '.join(sbatch_env)}")
            fields = sbatch_options.submit_fields(body, args, workdir)
            # sbatch exports the submitter's environment (--export=ALL) with its own extras.
            env = {**os.environ, **dict(self.runner.env or {}), **self.tools.env(), **sbatch_options._sbatch_env()}
            desc = self.adapter.job_description(fields, env, os.getcwd())
        except (Unserved, sbatch_options.Unmapped) as e:
            return self._cli(f"{e} is not mapped", "submit", script, args, text=text, workdir=workdir)
        path = self.adapter.path("job", "submit")
        reply = self.endpoint.request("POST", path, body=self.adapter.submit_request(body, desc))
        jid = parse.number(reply.body.get("job_id"))
        if reply.status != 200 or jid is None:
            raise self._failure("POST", path, reply.status, reply.body)
        # A job id with "errors" is a submitted job with a remark ("Job is in held state").
        if error_text(reply.body):
            log.debug("slurmrestd: job %d submitted: %s", jid, error_text(reply.body))
        return int(jid)

    def requeue(self, job_id, *, hold: bool = False) -> None:
        self._cli("no requeue endpoint", "requeue", job_id, hold=hold)

    def _update(self, job_id, fields: Dict[str, Any]) -> None:
        jid = str(job_id)
        if not jid.replace("_", "").isdigit():
            raise InputError(f"job id must be a number, got {job_id!r}")
        self._write("POST", self.adapter.path("job", jid), fields)

    def hold(self, job_id) -> None:
        self._update(job_id, self.adapter.hold_update(True))

    def release(self, job_id) -> None:
        self._update(job_id, self.adapter.hold_update(False))

    def update_job(self, job_id, **fields: object) -> None:
        if not fields:
            raise InputError("update_job needs at least one field")
        for key in fields:
            if not key.replace("_", "").isalnum():
                raise InputError(f"bad job field name {key!r}")
        try:
            body = self.adapter.job_update(dict(fields))
        except Unserved as e:
            return self._cli(str(e), "update_job", job_id, **fields)
        self._update(job_id, body)

    def cancel(self, job_id, *, signal=None, batch: bool = False, full: bool = False,
               step: Optional[int] = None) -> None:
        self.job(job_id)   # as on the CLI backend: an unknown id is an error
        sig = check_signal(signal) if signal is not None else None
        if step is not None:
            return self._cli("no step endpoint", "cancel", job_id, signal=signal, batch=batch, full=full, step=step)
        try:
            query = self.adapter.signal_query(sig, batch, full)
        except Unserved as e:
            return self._cli(str(e), "cancel", job_id, signal=signal, batch=batch, full=full, step=step)
        self._write("DELETE", self.adapter.path("job", str(job_id)), query=query or None)

    def signal(self, job_id, sig, *, batch: bool = False, full: bool = False,
               step: Optional[int] = None) -> None:
        """As on the CLI backend: a signal without ending the job, through ``cancel``."""
        self.cancel(job_id, signal=sig, batch=batch, full=full, step=step)

    # -- nodes ----------------------------------------------------------------------------
    def _all_nodes(self) -> List[Dict[str, Any]]:
        return list(self._read(self.adapter.path("nodes")).get("nodes") or [])

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        found = [parse.node_from_json(n) for n in self._all_nodes()]
        if names is None:
            return found
        wanted = hostlist.expand_hostlist(hostlist_of(names))
        by_name = {n.name: n for n in found}
        missing = [w for w in wanted if w not in by_name]
        if missing:
            raise NotFoundError(f"node {hostlist.collect_hostlist(missing)} not found")
        return [by_name[w] for w in wanted]

    def node(self, name: str) -> NodeInfo:
        return pick_node(self.nodes(name), name)

    def node_states(self) -> Dict[str, str]:
        """Every node's state word as sinfo prints it (``idle``, ``drained``, ``down*``...)."""
        return {n.name: parse.sinfo_state_word(n) for n in self.nodes()}

    def node_address(self, name: str) -> str:
        """The name when it resolves, else the node's address as slurmctld has it."""
        import socket

        try:
            socket.gethostbyname(name)
            return name
        except OSError:
            pass
        try:
            raw = self._read(self.adapter.path("node", name)).get("nodes") or []
        except ClusteropsError:
            return name
        return str(raw[0].get("address") or name) if raw else name

    def drain(self, nodes: Nodes, reason: str) -> None:
        check_drain_reason(reason)
        names = hostlist_of(nodes)
        try:
            body = self.adapter.node_change("DRAIN", reason)
        except Unserved as e:
            return self._cli(str(e), "drain", names, reason)
        for name in hostlist.expand_hostlist(names):
            self._write("POST", self.adapter.path("node", name), body)

    def resume(self, nodes: Nodes) -> None:
        names = hostlist_of(nodes)
        try:
            body = self.adapter.node_change("RESUME", None)
        except Unserved as e:
            return self._cli(str(e), "resume", names)
        # Read, then write, as on the CLI backend: the window is one round trip per node.
        refuse_foreign(self.nodes(names))
        for name in hostlist.expand_hostlist(names):
            self._write("POST", self.adapter.path("node", name), body)

    def partition_nodes(self, partition: str) -> List[str]:
        if not partition.replace("-", "").replace("_", "").isalnum():
            raise InputError(f"bad partition name {partition!r}")
        try:
            parts = self._read(self.adapter.path("partition", partition)).get("partitions") or []
        except NotFoundError:
            parts = []
        nodes = parts[0].get("nodes") if parts else None
        if isinstance(nodes, dict):                # v0.0.40+: {"configured": "node[1-4]", ...}
            nodes = nodes.get("configured")
        names = parse.expand(nodes) if nodes else []
        if not names:
            raise NotFoundError(f"partition {partition} has no nodes (or does not exist)")
        return names


def _forward(name: str):
    cli_method = getattr(Slurm, name)

    @functools.wraps(cli_method)   # the CLI's signature and docstring
    def method(self, *args, **kwargs):
        return self._cli("not served by slurmrestd here", name, *args, **kwargs)

    return method


for _name in ALWAYS_FORWARDED:
    setattr(RestSlurm, _name, _forward(_name))
del _name
