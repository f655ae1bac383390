"""A real multi-node Slurm cluster on one machine, for tests, demos and trying things.

One private ``munged`` (own key and socket), one ``slurmctld`` and one
``slurmd -N nodeK`` per node, all on 127.0.0.1 with distinct ports, every file in
one state directory. The settings are the ones verified on this machine (see
DESIGN.md): ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres``, counted
GPUs through gres files, ``SlurmdTimeout=10`` so a lost node is seen in seconds,
and ``AuthInfo=cred_expire=10`` so a requeued job restarts in ~25 s, not ~2 min.

It serves every local user, as a real site does, and opens nothing outside its state
directory to do so (``_prepare`` sets these modes on every ``up``):

- the state directory itself gains r-x for everyone (no bit is taken away), and
  ``slurm.conf``, ``gres.conf`` and the TaskProlog are readable (0644/0755): every Slurm
  client and every job step reads them;
- ``munge/`` (the key, 0400, and munged's seed) stays root-only (0700), like
  ``/etc/munge``; munged's socket lives apart in ``run/munge/`` (0755; munged makes the
  socket itself world-writable), like ``/run/munge``. With the socket under the key's
  0700 directory any other user's Slurm command fails with "Protocol authentication
  error";
- ``scratch/<node>`` and its ``tmp`` (each job step's ``TMPDIR``) are 1777, like
  ``/tmp``: slurmstepd refuses to start a step whose TMPDIR the job's user cannot write;
- ``ctld/`` (slurmctld's saved state: job scripts and environments) stays root-only
  (0700), like a site's ``StateSaveLocation``.

With ``restd=True`` (``clusterops devcluster up --restd``) it also runs ``slurmrestd`` with
JWT auth (``AuthAltTypes=auth/jwt``; the key root-only under ``jwt/``) as the local user
``slurm`` on a UNIX socket in ``run/restd/`` and on 127.0.0.1 at the port after the last
slurmd's (``restd_urls``): the REST backend's server (docs/slurmrestd.md).

Every process the cluster starts, and every task of every job (through the
TaskProlog), carries ``CLUSTEROPS_DEVCLUSTER_DIR=<state dir>`` in its
environment; ``down`` uses that marker to leave nothing behind.

The daemons (``munged``, ``slurmctld``, ``slurmd``) are started here, by path through
``SlurmTools`` (starting a cluster is this module's job); every query of the running
cluster (node states) goes through the Slurm client, ``clusterops.slurm``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import hostlist

from clusterops.errors import ClusteropsError, InputError
from clusterops.runner import Runner, pid_alive, process_start
from clusterops.slurm.factory import connect
from clusterops.slurm.settings import DEFAULT_DEVCLUSTER_DIR, DEVCLUSTER_INFO, SlurmSettings
from clusterops.slurm.tools import SlurmTools, check_prefix

MARKER_ENV = "CLUSTEROPS_DEVCLUSTER_DIR"
SCRATCH_ENV = "CLUSTEROPS_NODE_SCRATCH"
DEFAULT_STATE_DIR = DEFAULT_DEVCLUSTER_DIR
DEFAULT_PORT_BASE = 17000
# Where free_port_base looks: below the rendezvous ports runner.free_port hands out
# (10000+) and far below the kernel's ephemeral range (32768+).
PORT_BASE_WINDOW = (3000, 9900)


def free_port_base(nodes: int, window: tuple = PORT_BASE_WINDOW, tries: int = 50) -> int:
    """A port base whose nodes + 1 ports (slurmctld, one per slurmd) are free on 127.0.0.1
    now, picked at random in ``window`` (a multiple of 100)."""
    import random

    lo, hi = window
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(lo, max(lo + 1, hi - nodes - 1), 100)
        if all(DevCluster._port_free(p) for p in range(base, base + nodes + 1)):
            return base
    raise DevClusterError(f"no {nodes + 1} free ports in a row on 127.0.0.1 in {lo}-{hi}: pass --port-base")
# munged always comes from the system (PATH); the Slurm programs from PATH or the prefix.
REQUIRED_BINARIES = {
    "munged": "munge",
    "slurmctld": "slurmctld (slurm-wlm)",
    "slurmd": "slurmd (slurm-wlm)",
    "sbatch": "slurm-client (slurm-wlm)",
    "sinfo": "slurm-client (slurm-wlm)",
    "scontrol": "slurm-client (slurm-wlm)",
}
MAX_NODES = 1024
# A gres type as slurm.conf and gres.conf take it (no ':' ',' '(' or spaces to split on).
GPU_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}")
# Under the state dir: the key (root-only) and the socket (every user's) in separate folders,
# as /etc/munge and /run/munge are on a real node.
MUNGE_KEY_DIR = "munge"
MUNGE_SOCKET = "run/munge/munge.socket"
# Modes `up` sets under the state dir (and on the state dir itself): see the module docstring.
DIR_MODES = {"munge": 0o700, "run": 0o755, "run/munge": 0o755, "log": 0o755,
             "ctld": 0o700, "spool": 0o755, "dev": 0o755, "scratch": 0o755}
SCRATCH_MODE = 0o1777   # scratch/<node> and scratch/<node>/tmp: every user's, sticky like /tmp
# slurmrestd (``restd=True``): JWT as the alternative auth, the HS256 key root-only (the
# SlurmUser's, 0600) under jwt/; the daemon itself runs as RESTD_USER, because it refuses
# root, nobody and the SlurmUser (Slurm 25.11's src/slurmrestd/slurmrestd.c; 22.05 refuses
# root), and listens on a UNIX socket in run/restd/ (owned by that user) and on 127.0.0.1 at
# the port after the last slurmd's.
RESTD_USER = "slurm"
JWT_KEY = "jwt/jwt_hs256.key"
RESTD_SOCKET = "run/restd/slurmrestd.socket"


class DevClusterError(ClusteropsError):
    pass


@dataclass(frozen=True)
class DevClusterConfig:
    nodes: int = 4
    gpus_per_node: int = 0
    gpu_type: Optional[str] = None       # typed gres (gpu:<type>:N, gres.conf Type=), e.g. "mi300x"
    cpus_per_node: int = 2
    memory_mb_per_node: int = 4096
    port_base: int = DEFAULT_PORT_BASE
    preempt_grace_s: int = 20
    cred_expire_s: int = 10
    slurmd_timeout_s: int = 10
    slurm_prefix: Optional[str] = None   # run Slurm from PREFIX/bin and PREFIX/sbin (None: PATH)
    restd: bool = False                  # also run slurmrestd with JWT auth (see RESTD_* below)
    # A Slurm topology (topology.conf): "block" (topology/block, Slurm >= 23.11) or "tree"
    # (topology/tree: one leaf switch per domain under a top switch), with the domains as
    # hostlists (default: consecutive pairs of nodes). None: no topology plugin.
    topology: Optional[str] = None
    domains: Tuple[str, ...] = ()
    # SlurmctldParameters=enable_expedited_requeue (Slurm 25.11+): jobs may ask for
    # --requeue=expedite (clusterops.launch.submit gives it to supervised jobs).
    expedited_requeue: bool = False

    def validate(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise InputError(f"--nodes: must be an integer from 1 to {MAX_NODES}, got {self.nodes!r}")
        if not isinstance(self.gpus_per_node, int) or not 0 <= self.gpus_per_node <= 64:
            raise InputError(f"--gpus-per-node: must be an integer from 0 to 64, got {self.gpus_per_node!r}")
        if self.gpu_type is not None:
            if not isinstance(self.gpu_type, str) or not GPU_TYPE.fullmatch(self.gpu_type):
                raise InputError(f"--gpu-type: letters, digits, '_', '.' and '-' only (1-32, a letter first), "
                                 f"got {self.gpu_type!r}")
            if not self.gpus_per_node:
                raise InputError("--gpu-type: needs --gpus-per-node (a type names counted GPUs)")
        if not 1 <= self.cpus_per_node <= 1024:
            raise InputError(f"--cpus-per-node: must be from 1 to 1024, got {self.cpus_per_node!r}")
        if not 1024 <= self.port_base <= 65535 - self.nodes - 2:
            raise InputError(f"--port-base: {self.port_base} leaves no room for {self.nodes} node ports")
        if self.slurm_prefix is not None:
            check_prefix(self.slurm_prefix)
        if self.topology not in (None, "tree", "block"):
            raise InputError(f"--topology: 'tree' or 'block', got {self.topology!r}")
        if self.domains:
            if self.topology is None:
                raise InputError("--domain: needs --topology (a domain is a block or a leaf switch)")
            seen: List[str] = []
            for d in self.domains:
                try:
                    members = hostlist.expand_hostlist(d)
                except hostlist.BadHostlist:
                    raise InputError(f"--domain: bad node list {d!r}") from None
                unknown = [n for n in members if n not in self.node_names]
                if unknown or not members:
                    raise InputError(f"--domain {d}: no such node(s) {', '.join(unknown) or '(none)'} "
                                     f"in {self.hostlist}")
                if set(members) & set(seen):
                    raise InputError(f"--domain {d}: a node in two domains")
                seen += members
            if self.topology == "block" and len({len(hostlist.expand_hostlist(d)) for d in self.domains}) > 1:
                raise InputError("--domain: topology/block wants blocks of one size")

    def domain_lists(self) -> List[List[str]]:
        """The topology's domains as node lists (the given ones, else consecutive pairs)."""
        if self.domains:
            return [hostlist.expand_hostlist(d) for d in self.domains]
        names = list(self.node_names)
        return [names[i:i + 2] for i in range(0, len(names), 2)]

    @property
    def tools(self) -> SlurmTools:
        return SlurmTools.for_prefix(self.slurm_prefix)

    @property
    def node_names(self) -> List[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def restd_port(self) -> int:
        """slurmrestd's TCP port (``restd``): the one after the last slurmd's."""
        return self.port_base + self.nodes + 1

    @property
    def hostlist(self) -> str:
        return "node1" if self.nodes == 1 else f"node[1-{self.nodes}]"


def render_slurm_conf(cfg: DevClusterConfig, state: Path, hostname: str) -> str:
    """slurm.conf text for the dev cluster (pure)."""
    s = str(state)
    typed = f"{cfg.gpu_type}:" if cfg.gpu_type else ""
    gres = f" Gres=gpu:{typed}{cfg.gpus_per_node}" if cfg.gpus_per_node else ""
    last_port = cfg.port_base + cfg.nodes
    ports = f"{cfg.port_base + 1}" if cfg.nodes == 1 else f"{cfg.port_base + 1}-{last_port}"
    lines = [
        "# Written by clusterops devcluster; regenerated on every `up`.",
        "ClusterName=clusterops-dev",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={cfg.port_base}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire is also the requeue delay; the default 120 s makes tests crawl.
        f"AuthInfo=socket={s}/{MUNGE_SOCKET},cred_expire={cfg.cred_expire_s}",
        f"StateSaveLocation={s}/ctld",
        f"SlurmdSpoolDir={s}/spool/%n",
        f"SlurmctldPidFile={s}/run/slurmctld.pid",
        f"SlurmdPidFile={s}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={s}/log/slurmctld.log",
        f"SlurmdLogFile={s}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        f"TaskProlog={s}/task_prolog.sh",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # Nodes declare more CPUs/GPUs than this machine has; trust the config.
        "SlurmdParameters=config_overrides",
        "GresTypes=gpu",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobRequeue=1",
        "MinJobAge=600",
        "MessageTimeout=10",
        "KillWait=5",
        "InactiveLimit=0",
        "WaitTime=0",
        f"SlurmdTimeout={cfg.slurmd_timeout_s}",
        "SlurmctldTimeout=30",
        "ReturnToService=2",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        *(["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={s}/{JWT_KEY}"] if cfg.restd else []),
        *([f"TopologyPlugin=topology/{cfg.topology}"] if cfg.topology else []),
        *(["SlurmctldParameters=enable_expedited_requeue"] if cfg.expedited_requeue else []),
        f"NodeName={cfg.hostlist} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={ports} "
        f"CPUs={cfg.cpus_per_node} RealMemory={cfg.memory_mb_per_node}{gres} State=UNKNOWN",
        f"PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
        f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={cfg.preempt_grace_s}",
        "PartitionName=urgent Nodes=ALL Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF",
        "",
    ]
    return "\n".join(lines)


def render_topology_conf(cfg: DevClusterConfig) -> str:
    """topology.conf for ``cfg.topology`` (pure): blocks, or leaf switches under one top switch."""
    if cfg.topology is None:
        return "# no topology\n"
    doms = cfg.domain_lists()
    lines = ["# Written by clusterops devcluster; regenerated on every `up`."]
    if cfg.topology == "block":
        lines += [f"BlockName=b{i} Nodes={hostlist.collect_hostlist(d)}" for i, d in enumerate(doms, 1)]
    else:
        lines += [f"SwitchName=s{i} Nodes={hostlist.collect_hostlist(d)}" for i, d in enumerate(doms, 1)]
        lines.append(f"SwitchName=top Switches=s[1-{len(doms)}]" if len(doms) > 1 else "SwitchName=top Switches=s1")
    return "\n".join(lines) + "\n"


def render_gres_conf(cfg: DevClusterConfig, state: Path) -> str:
    if not cfg.gpus_per_node:
        return "# no counted GPUs\n"
    last = cfg.gpus_per_node - 1
    files = f"{state}/dev/gpu0" if last == 0 else f"{state}/dev/gpu[0-{last}]"
    typed = f" Type={cfg.gpu_type}" if cfg.gpu_type else ""
    return f"NodeName={cfg.hostlist} Name=gpu{typed} File={files}\n"


def restd_plugins(listing: str) -> List[str]:
    """The OpenAPI plugins to load from ``slurmrestd -s list``'s text: all but the accounting
    ones (``openapi/dbv0.0.38`` on 22.05, ``openapi/slurmdbd`` from 23.11), which make
    slurmrestd exit at start without slurmdbd ("slurm not configured with slurmdbd")."""
    names = re.findall(r"\bopenapi/([A-Za-z0-9_.]+)", listing)
    return [f"openapi/{n}" for n in dict.fromkeys(names) if not (n.startswith("db") or "slurmdbd" in n)]


TASK_PROLOG = """#!/bin/sh
# Runs before every task (the batch script included); lines printed as
# "export NAME=value" land in the task's environment.
echo "export {marker}={state}"
echo "export {scratch}={state}/scratch/$SLURMD_NODENAME"
echo "export TMPDIR={state}/scratch/$SLURMD_NODENAME/tmp"
"""


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {path})"
    return " | ".join(text[-lines:]) if text else f"(empty log {path})"


def _processes_with_env(key: str, value: str) -> List[int]:
    """PIDs whose initial environment holds key=value (read from /proc)."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return found


def _stepds_with_sockets_under(directory: str) -> List[int]:
    """slurmstepd processes holding a unix socket bound under ``directory`` (the cluster's
    spool: every step listens on ``<spool>/<node>/<node>_<job>.<step>``). From Slurm 24.11
    on slurmstepd clears its environment, so the SLURM_CONF test alone misses them."""
    inodes = set()
    prefix = directory.rstrip("/") + "/"
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith(prefix):
                    inodes.add(f"socket:[{parts[6]}]")
    except OSError:
        return []
    if not inodes:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or _comm(int(entry.name)) != "slurmstepd":
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry.name}/fd/{fd}") in inodes:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return found


def _children(pid: int) -> List[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _live_daemons(info: dict) -> Dict[str, Optional[int]]:
    """The state file's daemons: pid while it is still the process started (same start time),
    else None. A state file written before start times were kept is read by pid alone."""
    starts = info.get("starts")
    live: Dict[str, Optional[int]] = {}
    for key, pid in info.get("pids", {}).items():
        if starts is None:
            live[key] = pid if pid_alive(pid) else None
        else:
            start = starts.get(key)
            live[key] = pid if start is not None and pid_alive(pid, start) else None
    return live


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ancestors() -> set:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return pids


class DevCluster:
    """Handle on a dev cluster living in ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike = DEFAULT_STATE_DIR, runner: Optional[Runner] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.state = Path(state_dir).absolute()
        self.runner = runner or Runner()
        self.clock = clock
        self.sleep = sleep

    # -- paths -------------------------------------------------------------
    @property
    def conf_path(self) -> Path:
        return self.state / "slurm.conf"

    @property
    def info_path(self) -> Path:
        return self.state / DEVCLUSTER_INFO

    def tools(self) -> SlurmTools:
        """Where this cluster's Slurm programs live (the prefix it was started with)."""
        cfg = self.config()
        return cfg.tools if cfg else SlurmTools()

    def env(self) -> Dict[str, str]:
        """Environment a client needs to talk to this cluster (and its prefix's tools)."""
        return {"SLURM_CONF": str(self.conf_path), **self.tools().env()}

    def scratch_dir(self, node: str) -> Path:
        return self.state / "scratch" / node

    def ensure_scratch(self, node: str) -> Path:
        """(Re)create ``node``'s scratch folder and its ``tmp`` (the steps' TMPDIR) with the
        mode every user needs (1777): after a test removed it to break the node, say."""
        d = self.scratch_dir(node)
        for p in (d, d / "tmp"):
            p.mkdir(parents=True, exist_ok=True)
            os.chmod(p, SCRATCH_MODE)
        return d

    # -- state file ----------------------------------------------------------
    def _read_info(self) -> Optional[dict]:
        try:
            return json.loads(self.info_path.read_text())
        except (OSError, ValueError):
            return None

    def _write_info(self, info: dict) -> None:
        tmp = self.info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, self.info_path)

    def config(self) -> Optional[DevClusterConfig]:
        info = self._read_info()
        if not info:
            return None
        return DevClusterConfig(**dict(info["config"], domains=tuple(info["config"].get("domains") or ())))

    def _require_version(self, tools: SlurmTools, since: Tuple[int, int], what: str) -> None:
        """``what`` came with Slurm ``since``: an older slurmctld would refuse (or ignore) it."""
        from clusterops.slurm.parse import parse_version

        try:
            version = parse_version(self.runner.run(tools.argv(["slurmctld", "-V"]), timeout_s=30).stdout)
        except (ClusteropsError, ValueError):
            return                      # unknown: slurmctld itself will say
        if version < since:
            raise InputError(f"{what}: Slurm {version[0]}.{version[1]:02d} is older than {since[0]}.{since[1]:02d}")

    def daemon_pids(self) -> Dict[str, Optional[int]]:
        """Each daemon's pid while that daemon runs; None once it is gone. The state file keeps
        each daemon's pid with its start time (``starts``): a dead daemon's pid soon names
        another process (pids are reused), which must never be taken for the daemon, let alone
        signalled by ``kill_node`` or ``down``."""
        return _live_daemons(self._read_info() or {})

    def running(self) -> bool:
        pids = self.daemon_pids()
        return bool(pids) and all(p is not None for p in pids.values())

    # -- up ------------------------------------------------------------------
    @staticmethod
    def check_binaries(tools: Optional[SlurmTools] = None) -> None:
        tools = tools or SlurmTools()
        if tools.prefix is not None:
            missing = tools.missing([n for n in REQUIRED_BINARIES if n != "munged"])
            if missing:
                raise InputError(f"--slurm-prefix: {tools.prefix} lacks {', '.join(missing)} "
                                 f"(expected in {tools.prefix}/bin and {tools.prefix}/sbin)")
            if not shutil.which("munged"):
                raise DevClusterError("missing munged: install with `apt-get install -y munge`")
            return
        missing = [name for name in REQUIRED_BINARIES if not shutil.which(name)]
        if missing:
            pkgs = sorted({REQUIRED_BINARIES[m].split(" ")[0] for m in missing})
            raise DevClusterError(
                f"missing {', '.join(missing)}: install with `apt-get install -y slurm-wlm munge` ({', '.join(pkgs)})"
            )

    def up(self, cfg: DevClusterConfig, timeout_s: float = 60.0) -> dict:
        """Bring the cluster up and wait until every node is idle. Idempotent."""
        cfg.validate()
        tools = cfg.tools
        self.check_binaries(tools)
        if cfg.topology == "block":
            self._require_version(tools, (23, 11), "--topology block (topology/block; use --topology tree)")
        if cfg.expedited_requeue:
            self._require_version(tools, (25, 11), "--expedited-requeue (SlurmctldParameters=enable_expedited_requeue)")
        previous = self.config()
        if self.running():
            if previous == cfg:
                self.wait_idle(cfg.node_names, timeout_s)
                return self.status()
            self.down()  # a different shape: start afresh
        else:
            self.down()  # clear whatever a crashed cluster left
        if previous is not None and previous.slurm_prefix != cfg.slurm_prefix:
            # Another Slurm: a 25.11 slurmctld refuses state written by 22.05 ("Can not recover
            # assoc_usage state, incompatible version"), so its state starts empty.
            for sub in ("ctld", "spool"):
                shutil.rmtree(self.state / sub, ignore_errors=True)
        start = self.clock()
        last_port = cfg.restd_port if cfg.restd else cfg.port_base + cfg.nodes
        busy = [p for p in range(cfg.port_base, last_port + 1) if not self._port_free(p)]
        if busy:
            raise DevClusterError(f"ports {busy[:5]} on 127.0.0.1 are in use (another cluster?): "
                                  f"pick another --port-base")
        self._prepare(cfg)
        env = {MARKER_ENV: str(self.state), "SLURM_CONF": str(self.conf_path), **tools.env()}
        pids: Dict[str, Optional[int]] = {}
        logdir = self.state / "log"

        def record() -> dict:
            starts = {k: process_start(p) for k, p in pids.items()}
            return {"config": asdict(cfg), "pids": pids, "starts": starts, "started": time.time()}

        munged = self.runner.spawn(
            ["munged", "--foreground", "--force", f"--socket={self.state}/{MUNGE_SOCKET}",
             f"--key-file={self.state}/munge/munge.key", f"--pid-file={self.state}/run/munged.pid",
             f"--seed-file={self.state}/munge/munged.seed", f"--log-file={logdir}/munged.log",
             "--num-threads=4"],
            log_path=str(logdir / "munged.out"), env=env,
        )
        pids["munged"] = munged.pid
        self._wait_for(lambda: (self.state / MUNGE_SOCKET).exists(), 10,
                       "munged", logdir / "munged.log", munged)

        ctld = self.runner.spawn(tools.argv(["slurmctld", "-D", "-c", "-f", str(self.conf_path)]),
                                 log_path=str(logdir / "slurmctld.out"), env=env)
        pids["slurmctld"] = ctld.pid
        self._wait_for(lambda: self._port_open(cfg.port_base), 20, "slurmctld", logdir / "slurmctld.log", ctld)

        procs = {}
        for name in cfg.node_names:
            p = self.runner.spawn(tools.argv(["slurmd", "-D", "-N", name, "-f", str(self.conf_path)]),
                                  log_path=str(logdir / f"slurmd-{name}.out"), env=env)
            pids[f"slurmd:{name}"] = p.pid
            procs[name] = p
        self._write_info(record())
        try:
            self.wait_idle(cfg.node_names, timeout_s, procs=procs)
        except DevClusterError:
            self.down()
            raise
        if cfg.restd:
            pids["slurmrestd"] = self._start_restd(cfg, env)
            self._write_info(record())
        info = self.status()
        info["up_seconds"] = round(self.clock() - start, 3)
        return info

    @property
    def restd_socket(self) -> Path:
        return self.state / RESTD_SOCKET

    def restd_urls(self) -> Dict[str, str]:
        """Where this cluster's slurmrestd answers (``restd=True``): {"unix": "unix://...",
        "http": "http://127.0.0.1:PORT"}; empty when it runs none."""
        cfg = self.config()
        if not cfg or not cfg.restd:
            return {}
        return {"unix": f"unix://{self.restd_socket}", "http": f"http://127.0.0.1:{cfg.restd_port}"}

    def _start_restd(self, cfg: DevClusterConfig, env: Dict[str, str]) -> int:
        """slurmrestd as RESTD_USER, on the UNIX socket and 127.0.0.1:restd_port, JWT only
        (``SLURM_JWT=daemon``: the daemon itself holds no credential; each request brings its
        user's token)."""
        sock = self.restd_socket
        sock.unlink(missing_ok=True)
        logdir = self.state / "log"
        runner = Runner(env=self.runner.env, as_user=RESTD_USER)
        listed = runner.run(cfg.tools.argv(["slurmrestd", "-f", str(self.conf_path), "-s", "list"]),
                            timeout_s=30, env=env, check=False)
        plugins = restd_plugins(listed.stdout + listed.stderr)
        if not plugins:
            raise DevClusterError(f"slurmrestd -s list named no OpenAPI plugin: {listed.stderr.strip()[-300:]}")
        proc = runner.spawn(
            cfg.tools.argv(["slurmrestd", "-f", str(self.conf_path), "-a", "rest_auth/jwt",
                            "-s", ",".join(plugins), f"unix:{sock}", f"127.0.0.1:{cfg.restd_port}"]),
            log_path=str(logdir / "slurmrestd.out"), env={**env, "SLURM_JWT": "daemon"})
        self._wait_for(lambda: sock.exists() and self._port_open(cfg.restd_port), 20, "slurmrestd",
                       logdir / "slurmrestd.out", proc)
        # The runner started it behind runuser: record slurmrestd itself (runuser ends with it).
        return next(iter(_children(proc.pid)), proc.pid)

    def _prepare(self, cfg: DevClusterConfig) -> None:
        st = self.state
        st.mkdir(parents=True, exist_ok=True)
        # The state dir itself only gains r-x for everyone (a mkdtemp dir is 0700); no bit is
        # taken away, so a shared parent given as --state-dir (say /tmp, 1777) stays as it was.
        os.chmod(st, stat.S_IMODE(os.stat(st).st_mode) | 0o755)
        for sub, mode in DIR_MODES.items():
            (st / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(st / sub, mode)   # explicit: the umask and an older state dir do not decide
        key = st / MUNGE_KEY_DIR / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        for name in cfg.node_names:
            (st / "spool" / name).mkdir(exist_ok=True)
            self.ensure_scratch(name)
        for i in range(cfg.gpus_per_node):
            (st / "dev" / f"gpu{i}").touch()
        if cfg.restd:
            self._prepare_restd(cfg)
        hostname = socket.gethostname().split(".")[0]
        self.conf_path.write_text(render_slurm_conf(cfg, st, hostname))
        (st / "gres.conf").write_text(render_gres_conf(cfg, st))
        (st / "topology.conf").write_text(render_topology_conf(cfg))
        for f in (self.conf_path, st / "gres.conf", st / "topology.conf"):
            f.chmod(0o644)
        prolog = st / "task_prolog.sh"
        prolog.write_text(TASK_PROLOG.format(marker=MARKER_ENV, scratch=SCRATCH_ENV, state=st))
        prolog.chmod(0o755)

    def _prepare_restd(self, cfg: DevClusterConfig) -> None:
        """The JWT key (root-only, as slurmctld reads it) and slurmrestd's socket folder
        (RESTD_USER's, world-readable: any local user may connect, the token decides)."""
        import pwd

        try:
            user = pwd.getpwnam(RESTD_USER)
        except KeyError:
            raise DevClusterError(f"--restd: no local user {RESTD_USER!r} to run slurmrestd as "
                                  f"(Debian's slurm-wlm packages create it)") from None
        if cfg.tools.missing(["slurmrestd"]):
            raise DevClusterError("--restd: missing slurmrestd: install with `apt-get install -y slurmrestd`")
        key = self.state / JWT_KEY
        key.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(key.parent, 0o700)
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(64))
        os.chmod(key, 0o600)
        rundir = self.state / RESTD_SOCKET
        rundir.parent.mkdir(parents=True, exist_ok=True)
        os.chown(rundir.parent, user.pw_uid, user.pw_gid)
        os.chmod(rundir.parent, 0o755)

    @property
    def jwt_key(self) -> Path:
        """The dev cluster's JWT signing key (``restd=True``; root-only)."""
        return self.state / JWT_KEY

    @staticmethod
    def _port_free(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    @staticmethod
    def _port_open(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _wait_for(self, ready: Callable[[], bool], timeout_s: float, what: str, log: Path, proc) -> None:
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            if ready():
                return
            if proc.poll() is not None:
                self.down()
                raise DevClusterError(f"{what} exited with {proc.returncode} at start: {_tail(log)}")
            self.sleep(0.05)
        self.down()
        raise DevClusterError(f"{what} did not become ready in {timeout_s:g}s: {_tail(log)}")

    def slurm(self, **overrides):
        """A Slurm client for this cluster (its slurm.conf, the Slurm prefix it was started
        with), through ``clusterops.slurm.factory.connect``; one attempt, 15 s unless
        ``overrides`` say otherwise."""
        cfg = self.config()
        prefix = cfg.slurm_prefix if cfg else None
        kw = {"timeout_s": 15.0, "read_attempts": 1, **overrides}
        return connect(SlurmSettings(prefix=str(prefix) if prefix else None),
                       runner=Runner(env=self.env()), **kw)

    def node_states(self) -> Dict[str, str]:
        """Node name -> sinfo's state word (``idle``, ``drained``, ``down*``...)."""
        return self.slurm().node_states()

    def wait_idle(self, nodes: List[str], timeout_s: float, procs: Optional[dict] = None) -> None:
        deadline = self.clock() + timeout_s
        last: Dict[str, str] = {}
        while True:
            for name, p in (procs or {}).items():
                if p.poll() is not None:
                    raise DevClusterError(
                        f"slurmd -N {name} exited with {p.returncode}: "
                        f"{_tail(self.state / 'log' / f'slurmd-{name}.log')}")
            try:
                last = self.node_states()
            except ClusteropsError:   # slurmctld still starting: ask again
                last = {}
            if last and all(last.get(n, "").rstrip("*") in ("idle", "mixed", "allocated") for n in nodes):
                return
            if self.clock() > deadline:
                bad = {n: last.get(n, "unknown") for n in nodes if last.get(n, "") != "idle"}
                raise DevClusterError(
                    f"nodes not idle after {timeout_s:g}s: {bad}; slurmctld log: "
                    f"{_tail(self.state / 'log' / 'slurmctld.log')}")
            self.sleep(0.1)

    # -- down ----------------------------------------------------------------
    def down(self, timeout_s: float = 15.0) -> List[int]:
        """Stop every daemon and every job process of this cluster. Returns the pids signalled."""
        mine = _ancestors()
        pids = [p for p in self.daemon_pids().values() if p]
        pids += [p for p in _processes_with_env(MARKER_ENV, str(self.state)) if p not in pids]
        # slurmd hands slurmstepd a trimmed environment (no marker), but SLURM_CONF stays.
        pids += [p for p in _processes_with_env("SLURM_CONF", str(self.conf_path))
                 if p not in pids and _comm(p) == "slurmstepd"]
        pids += [p for p in _stepds_with_sockets_under(str(self.state / "spool")) if p not in pids]
        pids = [p for p in pids if p not in mine]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = self.clock() + (timeout_s / 2)
            while self.clock() < deadline and any(pid_alive(p) for p in pids):
                self.sleep(0.05)
            if not any(pid_alive(p) for p in pids):
                break
        info = self._read_info()
        if info:
            info["pids"], info["starts"] = {}, {}
            self._write_info(info)
        return pids

    # -- fault injection (tests, demos) ----------------------------------------
    def kill_node(self, name: str, *, power_cut: bool = False) -> List[int]:
        """Take a node away for real: stop its slurmd and kill its job processes
        (``SLURMD_NODENAME``); the node's slurmstepds live on and report their steps' end.

        ``power_cut=True`` takes it away as a power cut does: its slurmstepds too (found by
        their sockets under the node's spool directory: slurmd hands them a trimmed
        environment), all at once: every one is stopped first (SIGSTOP), then killed, so
        none of them sees another die and reports it (a slurmstepd that outlives its batch
        script tells slurmctld the script was killed: the job ends FAILED instead of losing
        a node). Returns the pids."""
        pids = self.daemon_pids()
        key = f"slurmd:{name}"
        if key not in pids:
            raise InputError(f"unknown dev-cluster node {name!r}")
        victims = [pids[key]] if pids[key] else []
        if power_cut:
            victims += [p for p in _stepds_with_sockets_under(str(self.state / "spool" / name)) if p not in victims]
        victims += [p for p in _processes_with_env("SLURMD_NODENAME", name)
                    if p in _processes_with_env(MARKER_ENV, str(self.state)) and p not in victims]
        mine = _ancestors()
        victims = [p for p in victims if p not in mine]
        for sig in ((signal.SIGSTOP, signal.SIGKILL) if power_cut else (signal.SIGKILL,)):
            for pid in victims:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return victims

    def start_node(self, name: str) -> int:
        info = self._read_info()
        if not info or f"slurmd:{name}" not in info.get("pids", {}):
            raise InputError(f"unknown dev-cluster node {name!r}")
        tools = self.tools()
        env = {MARKER_ENV: str(self.state), "SLURM_CONF": str(self.conf_path), **tools.env()}
        p = self.runner.spawn(tools.argv(["slurmd", "-D", "-N", name, "-f", str(self.conf_path)]),
                              log_path=str(self.state / "log" / f"slurmd-{name}.out"), env=env)
        info["pids"][f"slurmd:{name}"] = p.pid
        info.setdefault("starts", {})[f"slurmd:{name}"] = process_start(p.pid)
        self._write_info(info)
        return p.pid

    # -- status --------------------------------------------------------------
    def status(self) -> dict:
        info = self._read_info()
        if not info:
            return {"state_dir": str(self.state), "running": False, "daemons": {}, "nodes": {}}
        live = _live_daemons(info)
        daemons = {k: {"pid": v, "alive": live.get(k) is not None} for k, v in info.get("pids", {}).items()}
        running = bool(daemons) and all(d["alive"] for d in daemons.values())
        nodes: Dict[str, str] = {}
        if daemons.get("slurmctld", {}).get("alive"):
            try:
                nodes = self.node_states()
            except ClusteropsError:
                nodes = {}
        return {
            "state_dir": str(self.state),
            "slurm_conf": str(self.conf_path),
            "slurm_prefix": (info.get("config") or {}).get("slurm_prefix"),
            "running": running,
            "config": info.get("config"),
            "daemons": daemons,
            "nodes": nodes,
        }
