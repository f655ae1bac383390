"""Run Slurm's commands and parse what they print.

``Slurm`` is the CLI backend of ``api.SlurmAPI``. Reads (squeue, scontrol show, sinfo)
are idempotent and retried with backoff (``api.retry_read``), so a controller that
restarts or is briefly slow is ridden out; after ``read_attempts`` failures a
``SlurmUnavailable`` names the command and the last error. Writes (sbatch, scontrol update/requeue, scancel) run once: a
blind retry could submit a job twice.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from clusterops.errors import ClusteropsError, InputError, NotFoundError
from clusterops.runner import CommandError, CommandNotFound, CommandTimeout, Runner
from clusterops.slurm import parse
from clusterops.slurm.api import (Backoff, Nodes, Retry, SlurmConfigError, SlurmError,
                                  SlurmUnavailable, check_drain_reason, check_signal, hostlist_of, pick_node,
                                  refuse_foreign, retry_read, submit_body)
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.settings import (DEVCLUSTER_INFO, PREFIX_ENV, SlurmSettings, devcluster_conf,
                                        recorded_prefix)
from clusterops.slurm.tools import SlurmTools

log = logging.getLogger(__name__)

# stderr fragments that mean "the thing you named does not exist": never retried.
_NOT_FOUND = re.compile(r"invalid job id|invalid node name|invalid job array|node \S+ not found|"
                        r"job \S+ not found|unrecognized job|invalid partition name")


class Slurm:
    """Slurm through its command-line tools. All commands go through ``runner``."""

    backend = "cli"   # pyslurm_backend.PyslurmSlurm says "pyslurm"

    def __init__(self, runner: Optional[Runner] = None, *, settings: Optional[SlurmSettings] = None,
                 timeout_s: Optional[float] = None, read_attempts: Optional[int] = None,
                 backoff_s: Optional[float] = None,
                 sleep: Callable[[float], None] = time.sleep, tools: Optional[SlurmTools] = None):
        """``settings`` are the site's (default: built-in defaults, not the environment:
        ``from_environment`` and ``factory.connect`` read that); the keyword knobs
        override single values, for tests and for callers that build a client by hand."""
        self.runner = runner or Runner()
        s = settings or SlurmSettings()
        s = replace(s, **{k: v for k, v in (("timeout_s", timeout_s), ("read_attempts", read_attempts),
                                             ("backoff_s", backoff_s)) if v is not None})
        self.settings = s
        # Where sinfo & co. live: given, the settings' prefix, or CLUSTEROPS_SLURM_PREFIX
        # (the runner's env first).
        if tools is None:
            tools = (SlurmTools.for_prefix(s.prefix, PREFIX_ENV) if s.prefix else SlurmTools.from_environment(
                {**os.environ, **dict(getattr(self.runner, "env", {}) or {})}))
        self.tools = tools
        self.timeout_s = s.timeout_s
        self.read_attempts = s.read_attempts
        self.backoff_s = s.backoff_s
        self.sleep = sleep

    @property
    def backoff(self) -> Backoff:
        """The reads' retry rule, from the settings (``read_attempts``, ``backoff_s``)."""
        return Backoff(self.backoff_s, self.read_attempts)

    @classmethod
    def from_environment(cls, settings: Optional[SlurmSettings] = None, **kwargs) -> "Slurm":
        """The client for this environment: ``settings`` (default: read from the
        environment, see ``clusterops.slurm.settings``), SLURM_CONF honoured; with no system
        slurm.conf and no SLURM_CONF, the default dev cluster's config if one exists (so
        `clusterops` just works after `devcluster up`)."""
        settings = settings or SlurmSettings.from_environment()
        env = {}
        conf = os.environ.get("SLURM_CONF")
        if not conf and not Path("/etc/slurm/slurm.conf").exists():
            dev = devcluster_conf()
            if dev.exists():
                env["SLURM_CONF"] = conf = str(dev)
        if "tools" not in kwargs and not settings.prefix:
            tools = SlurmTools.from_environment()
            if tools.prefix is None and conf:
                # A dev cluster started with --slurm-prefix answers only to that Slurm's tools.
                prefix = recorded_prefix(conf)
                if prefix:
                    tools = SlurmTools.for_prefix(prefix, f"{Path(conf).parent / DEVCLUSTER_INFO}: slurm_prefix")
            kwargs["tools"] = tools
        return cls(Runner(env=env), settings=settings, **kwargs)

    # -- plumbing ---------------------------------------------------------------
    def _check_config(self) -> None:
        # Slurm's tools wait up to 60 s for a slurm.conf that is not there; say so at once.
        conf = self.runner.env.get("SLURM_CONF") or os.environ.get("SLURM_CONF")
        if conf and not Path(conf).is_file():
            raise SlurmConfigError(f"SLURM_CONF={conf}: no such file")

    def _not_installed(self, name: str) -> SlurmError:
        return SlurmError(f"{name} not found: install the Slurm client (apt-get install slurm-client), "
                          f"or name where Slurm is installed with CLUSTEROPS_SLURM_PREFIX")

    def _classify(self, err: CommandError) -> ClusteropsError:
        text = (err.stderr or "").lower()
        if "could not establish a configuration source" in text or "unable to process configuration file" in text:
            return SlurmConfigError(
                f"{os.path.basename(err.argv[0])}: no Slurm configuration found: set SLURM_CONF, or run `clusterops devcluster up`")
        if _NOT_FOUND.search(text):
            return NotFoundError(f"{os.path.basename(err.argv[0])}: {err.stderr.strip().splitlines()[-1]}")
        return SlurmError(str(err))

    def _read(self, argv: Sequence[str]) -> str:
        self._check_config()
        run_argv = self.tools.argv(argv)

        def attempt() -> str:
            try:
                return self.runner.run(run_argv, timeout_s=self.timeout_s, env=self.tools.env()).stdout
            except CommandNotFound:
                raise self._not_installed(argv[0]) from None
            except CommandTimeout as e:
                raise Retry(e) from None
            except CommandError as e:
                classified = self._classify(e)
                if isinstance(classified, (NotFoundError, SlurmConfigError)):
                    raise classified from None
                raise Retry(e) from None

        return retry_read(attempt, self.backoff, what=argv[0], sleep=self.sleep)

    def _write(self, argv: Sequence[str], *, input: Optional[str] = None) -> str:
        self._check_config()
        try:
            return self.runner.run(self.tools.argv(argv), timeout_s=self.timeout_s, input=input,
                                   env=self.tools.env()).stdout
        except CommandNotFound:
            raise self._not_installed(argv[0])
        except CommandTimeout as e:
            raise SlurmUnavailable(f"{e} (the controller may be down or overloaded)") from None
        except CommandError as e:
            raise self._classify(e) from None

    # -- version ------------------------------------------------------------------
    def version(self) -> Tuple[int, ...]:
        """The client tools' version, e.g. (22, 5, 8)."""
        return parse.parse_version(self._read(["sinfo", "--version"]))

    def show_config(self) -> str:
        """``scontrol show config``'s text (the running controller's settings)."""
        return self._read(["scontrol", "show", "config"])

    def admin_level_text(self, user: str) -> str:
        """What the accounting database says of ``user``'s AdminLevel (``sacctmgr``; only
        where ``AccountingStorageType`` is slurmdbd): see ``clusterops.slurm.privilege``."""
        if not user or not user.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InputError(f"bad user name {user!r}")
        return self._read(["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "format=AdminLevel"])

    def jwt_token(self, lifespan_s: int) -> str:
        """A JWT for this user from ``scontrol token`` (slurmrestd's auth/jwt; not retried:
        each call mints a token)."""
        if not 1 <= int(lifespan_s) <= 86400 * 365:
            raise InputError(f"token lifespan: must be 1 s to a year, got {lifespan_s!r}")
        out = self._write(["scontrol", "token", f"lifespan={int(lifespan_s)}"])
        try:
            return parse.parse_jwt_token(out)
        except ValueError as e:
            raise SlurmError(f"scontrol token: {e} (is AuthAltTypes=auth/jwt set in slurm.conf?)") from None

    def topology(self) -> Dict[str, str]:
        """{node: topology domain} (``scontrol show topology``: the block, or the leaf switch);
        {} where the cluster has no topology plugin."""
        try:
            text = self._read(["scontrol", "show", "topology"])
        except SlurmError as e:
            if "no topology" in str(e).lower():
                return {}
            raise
        return parse.parse_topology(text)

    def controller_version(self) -> Tuple[int, ...]:
        """The running slurmctld's version (``scontrol show config``: SLURM_VERSION)."""
        return parse.parse_config_version(self._read(["scontrol", "show", "config"]))

    # -- jobs ---------------------------------------------------------------------
    def submit(self, script: Union[str, os.PathLike, None] = None, args: Sequence[str] = (), *,
               text: Optional[str] = None, workdir: Optional[str] = None) -> int:
        """Submit a batch script (a file path, or its text) -> job id."""
        path = submit_body(script, text)
        argv = ["sbatch", "--parsable", *args]
        if workdir:
            argv.append(f"--chdir={workdir}")
        if path is not None:
            argv.append(str(path))
        return parse.parse_sbatch_parsable(self._write(argv, input=text))

    def jobs(self, job_ids: Optional[Iterable[int]] = None) -> List[JobInfo]:
        """Jobs Slurm still knows, finished ones included (squeue --json). Unknown ids are absent.

        ``--states=all``: 22.05 ignores filters under --json and lists finished jobs anyway;
        from 23.02 on the filters apply, and squeue's default (pending, running, completing)
        would drop a job that just ended (seen on 24.11). A named id that squeue still leaves
        out is asked of ``scontrol show job``; only when that too has no record is it absent.
        """
        argv = ["squeue", "--json", "--all", "--states=all"]
        ids = [str(int(j)) for j in job_ids] if job_ids is not None else None
        if ids is not None:
            if not ids:
                return []
            argv.append(f"--jobs={','.join(ids)}")
        try:
            found = parse.parse_squeue_json(self._read(argv))
        except NotFoundError:
            found = []
        if ids is None:
            return found
        # Slurm 22.05's --json output ignores the --jobs filter: apply it here as well.
        wanted = {int(i) for i in ids}
        found = [j for j in found if j.job_id in wanted or j.array_job_id in wanted]
        seen = {j.job_id for j in found} | {j.array_job_id for j in found if j.array_job_id}
        for jid in sorted(wanted - seen):
            try:
                found.extend(self.job_tasks(jid))
            except NotFoundError:
                pass
        return found

    def job(self, job_id: Union[int, str]) -> JobInfo:
        """One job in detail (scontrol show job); NotFoundError when Slurm no longer knows it."""
        jid = str(job_id)
        if not jid.replace("_", "").isdigit():
            raise InputError(f"job id must be a number, got {job_id!r}")
        found = parse.parse_scontrol_jobs(self._read(["scontrol", "show", "job", "--oneliner", jid]))
        if not found:
            raise NotFoundError(f"job {jid} not found")
        return found[0]

    def job_tasks(self, job_id: Union[int, str]) -> List[JobInfo]:
        """All records for a job id (an array job has one per task)."""
        return parse.parse_scontrol_jobs(self._read(["scontrol", "show", "job", "--oneliner", str(job_id)]))

    def requeue(self, job_id: Union[int, str], *, hold: bool = False) -> None:
        self._write(["scontrol", "requeuehold" if hold else "requeue", str(job_id)])

    def hold(self, job_id: Union[int, str]) -> None:
        self._write(["scontrol", "hold", str(job_id)])

    def release(self, job_id: Union[int, str]) -> None:
        self._write(["scontrol", "release", str(job_id)])

    def update_job(self, job_id: Union[int, str], **fields: object) -> None:
        """scontrol update JobId=<id> Key=Value ... (e.g. ExcNodeList=node3, TimeLimit=10)."""
        if not fields:
            raise InputError("update_job needs at least one field")
        argv = ["scontrol", "update", f"JobId={job_id}"]
        for key, value in fields.items():
            if not key.replace("_", "").isalnum():
                raise InputError(f"bad job field name {key!r}")
            argv.append(f"{key}={value}")
        self._write(argv)

    def cancel(self, job_id: Union[int, str], *, signal: Union[str, int, None] = None,
               batch: bool = False, full: bool = False, step: Optional[int] = None) -> None:
        target = f"{job_id}.{step}" if step is not None else str(job_id)
        # scancel exits 0 for a job id Slurm does not know; ask first so a typo is an error.
        self.job(job_id)
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={check_signal(signal)}")
        if batch:
            argv.append("--batch")
        if full:
            argv.append("--full")
        argv.append(target)
        self._write(argv)

    def cancel_pending(self, job_id: Union[int, str]) -> None:
        """Cancel what of ``job_id`` still waits in the queue (an array's pending tasks),
        leaving its running tasks alone: a chain's generation that ends the chain calls it on
        the chain's array id while it itself still runs. A job Slurm no longer knows, or one
        with nothing pending, is no error (scancel exits 0 for both)."""
        jid = str(job_id)
        if not jid.isdigit():
            raise InputError(f"job id must be a number, got {job_id!r}")
        self._write(["scancel", "--state=PENDING", jid])

    def signal(self, job_id: Union[int, str], sig: Union[str, int], *, batch: bool = False,
               full: bool = False, step: Optional[int] = None) -> None:
        """Send a signal without ending the job (``--batch``: the batch shell only;
        ``--full``: the batch shell and every step)."""
        self.cancel(job_id, signal=sig, batch=batch, full=full, step=step)

    def steps(self, job_id: Union[int, str]) -> List[Tuple[str, str]]:
        """The running steps of a job as (step id, step name), e.g. [("batch", "batch"),
        ("0", "train")]: squeue lists the batch step (and an ``extern`` one where the site's
        PrologFlags make it) beside the srun steps, and lists it first."""
        return parse.parse_steps(self._read(["squeue", "--noheader", "--steps", f"--jobs={job_id}",
                                             "--format=%i %j"]))

    # -- nodes ----------------------------------------------------------------------
    def node_address(self, name: str) -> str:
        """An address other nodes reach ``name`` at: the name when it resolves, else Slurm's
        NodeAddr (node names need not be hostnames; the dev cluster's are not)."""
        try:
            socket.gethostbyname(name)
            return name
        except OSError:
            pass
        try:
            out = self._read(["scontrol", "show", "node", "--oneliner", name])
        except ClusteropsError:
            return name
        m = re.search(r"\bNodeAddr=(\S+)", out)
        return m.group(1) if m else name

    def nodes(self, names: Optional[Nodes] = None) -> List[NodeInfo]:
        argv = ["scontrol", "show", "node", "--oneliner"]
        if names is not None:
            argv.append(hostlist_of(names))
        return parse.parse_scontrol_nodes(self._read(argv))

    def node_states(self) -> Dict[str, str]:
        """Every node's state word as sinfo prints it (``idle``, ``drained``, ``down*``...)."""
        return parse.parse_sinfo_node_states(self._read(["sinfo", "--noheader", "--Node", "--format=%N %T"]))

    def node(self, name: str) -> NodeInfo:
        return pick_node(self.nodes(name), name)

    def drain(self, nodes: Nodes, reason: str) -> None:
        """Drain with a clusterops reason (``clusterops.drains.make_reason``); one line."""
        check_drain_reason(reason)
        self._write(["scontrol", "update", f"NodeName={hostlist_of(nodes)}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, nodes: Nodes) -> None:
        """Resume nodes; refuses (ForeignDrainError, nothing resumed) when any of them carries a
        reason clusterops did not write. Who may lift which clusterops drain is decided by the
        caller (``clusterops.drains.may_resume``); this is the last line that never bends."""
        names = hostlist_of(nodes)
        # Read, then write: an administrator who drains one of these nodes in between is not
        # seen (scontrol has no compare-and-set); the window is one scontrol round trip.
        refuse_foreign(self.nodes(names))
        self._write(["scontrol", "update", f"NodeName={names}", "State=RESUME"])

    def partition_nodes(self, partition: str) -> List[str]:
        names = parse.parse_hostlist_lines(
            self._read(["sinfo", "--noheader", f"--partition={partition}", "--format=%N"]))
        if not names:
            raise NotFoundError(f"partition {partition} has no nodes (or does not exist)")
        return names

    # -- reservations -----------------------------------------------------------------
    def create_reservation(self, name: str, nodes: Nodes, *, minutes: int, users: str,
                           flags: str = "MAINT,IGNORE_JOBS") -> None:
        """A reservation starting now (used to hold nodes for maintenance checks)."""
        if not name.replace("-", "").replace("_", "").isalnum():
            raise InputError(f"bad reservation name {name!r}")
        self._write(["scontrol", "create", "reservation", f"ReservationName={name}",
                     f"Nodes={hostlist_of(nodes)}", "StartTime=now", f"Duration={int(minutes)}",
                     f"Users={users}", f"Flags={flags}"])

    def delete_reservation(self, name: str) -> None:
        self._write(["scontrol", "delete", f"ReservationName={name}"])
