"""The supervisor's plumbing: signals, srun steps, heartbeats, node polls, Slurm calls.

Runs inside a Slurm allocation (the batch script ``exec``\\ s ``clusterops supervise``,
so this process itself receives the lead-time ``USR1`` and preemption's ``SIGTERM``).
Every decision is made by :class:`clusterops.supervisor.Supervisor`; this module
only turns its actions into job steps and Slurm calls, and what it sees into events
(heartbeats arrive through :class:`clusterops.supervisor.channel.Channel`).
The step argv lists come from :func:`clusterops.slurm.steps.srun_argv`, srun's error
output is read by :func:`clusterops.slurm.parse.parse_srun_failures`, programs start
through :class:`clusterops.runner.Runner`, and queries, signals, requeues and drains go
through the Slurm client (``clusterops.slurm.factory.connect``). Each action class has
its handler in one explicit table (``SupervisorRun._handlers``).

The training step is one ``srun`` with one task per rank ("srun-native ranks": RANK
from ``SLURM_PROCID``, ``MASTER_ADDR``/``MASTER_PORT`` exported here), or, for
``launcher: torchrun``, one task per node running a torchrun agent
(:func:`torchrun_command`). srun-native ranks are the default and deliberate: under
preemption Slurm SIGTERMs every task of every step at once, and a rank that receives
SIGTERM itself can finish its checkpoint (the SDK treats SIGTERM as a stop request),
whereas torchrun's agent answers SIGTERM by killing its workers after its close timeout.

Scripts without the SDK (``supervise: progress/checkpoint_glob/resume_args``, see
:class:`PlainContract`): progress is read from the ranks' output, checkpoints are the
script's own files found by pattern, a stop is the lead-time signal (SIGUSR1) sent
to the step, and a restart adds the script's resume arguments.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops import drains, schema
from clusterops import protocol
from clusterops import supervisor as sv
from clusterops.errors import ClusteropsError, InputError
from clusterops.runner import Process, Runner, current_user, free_port, kill_group, wait_exit
from clusterops.slurm.api import (Backoff, SlurmAPI, UnschedulableExclusion, exclude_from_requeued, own_job_ref,
                                  schedulable_exclusion)
from clusterops.slurm.parse import parse_srun_failures
from clusterops.supervisor.evidence import TaskOutput, read_task_output
from clusterops.slurm.steps import srun_argv, standby_step_argv
from clusterops.supervisor import chain as chainmod
from clusterops.supervisor import channel as hbchannel
from clusterops.supervisor.chain import ChainInfo
from clusterops.supervisor.rendezvous import InprocessSettings, RendezvousHost
from clusterops.supervisor.stability import StabilityConfig
from clusterops.supervisor.timeline import DomainSource, EventKind as E, Timeline

log = logging.getLogger(__name__)

STATE_FILE = "supervisor-state.json"
#: Straggler samples go to the state machine every ``ranks / TIMING_RANKS_PER_S`` seconds
#: (every second up to 2,048 ranks; every 8 s at 16,384).
TIMING_RANKS_PER_S = 2048
# Values torchrun would set. None may leak in from the supervisor's own environment (or the
# job's env:); srun-native ranks get them from their own task's SLURM_* values instead, through
# rank_env_command, and torchrun's workers from their agent.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# In-process: once every rank has told the rendezvous it is done (finished, or stopped on
# request), its heartbeats stop by design; the step's exit (the ranks' and standbys'
# interpreters ending: 15-27 s measured on this 2-core machine under load) is waited for
# this long before the hang detection may see it again.
RDZV_EXIT_GRACE_S = 60.0


# ------------------------------------------------------------------------------ no SDK
# Names that are never a finished checkpoint: temporary and hidden files, editor and
# partial-download leftovers. Anything else the glob matches counts as complete, so a
# script must write under such a name and rename when done (torch.save to x.tmp, then
# os.replace): what a careful script does anyway.
_TEMP_NAME = re.compile(r"(^\.|\.tmp$|\.tmp\.|\.temp$|\.part$|\.partial$|~$|\.incomplete$)", re.IGNORECASE)
_LAST_INT = re.compile(r"(\d+)(?!.*\d)")
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")


@dataclass
class PlainContract:
    """How the supervisor works with a script that does not import the SDK.

    ``progress_regex`` (group 1: the step) is searched in every line the ranks print
    (srun ``--label`` tells the rank); ``checkpoint_glob`` names the script's own
    checkpoints under the checkpoint directory; ``resume_args`` are added to the
    command on a restart, ``{ckpt}`` replaced by the checkpoint chosen.
    """

    progress_regex: Optional[str] = None
    checkpoint_glob: Optional[str] = None
    resume_args: List[str] = field(default_factory=list)
    loss_regex: Optional[str] = None        # group 1: the loss, for the stability guard

    @property
    def active(self) -> bool:
        return bool(self.progress_regex or self.checkpoint_glob)

    def resume_argv(self, ckpt: str, hint=None) -> List[str]:
        """The resume arguments for ``ckpt``; ``{skip_batches}`` and ``{lr_factor}`` are a
        stability rollback's ``hint`` (a ResumeHint), 0 and 1 without one."""
        if not ckpt:
            return []
        skip, lr = (str(hint.skip_batches), repr(float(hint.lr_factor))) if hint is not None else ("0", "1.0")
        return [a.replace("{ckpt}", ckpt).replace("{skip_batches}", skip).replace("{lr_factor}", lr)
                for a in self.resume_args]


def plain_checkpoints(ckpt_dir: Path, pattern: str) -> List[Tuple[int, float, Path]]:
    """The complete checkpoints a glob finds: (step, mtime, path), oldest first.

    Complete: matched by the pattern and not a temporary name (``_TEMP_NAME``). The
    step is the last number in the file or directory name (0 without one); ties are
    broken by modification time.
    """
    found = []
    for p in ckpt_dir.glob(pattern):
        if _TEMP_NAME.search(p.name):
            continue
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        m = _LAST_INT.search(p.name)
        found.append((int(m.group(1)) if m else 0, mtime, p))
    found.sort(key=lambda t: (t[0], t[1]))
    return found


class ProgressReader:
    """Steps from the step log (``N: <line>``), written as heartbeat files.

    A rank's file is rewritten only when its step changes, so its mtime is the time of
    its last progress: the state machine's hang rule (no progress for hang_timeout_s)
    holds unchanged. A rank that prints no progress line of its own (often only rank 0
    prints) follows the newest step any rank printed.
    """

    def __init__(self, regex: str, log_path: Path, hb_dir: Path, ranks: int, loss_regex: Optional[str] = None):
        self.regex = re.compile(regex)
        self.loss_regex = re.compile(loss_regex) if loss_regex else None
        self.signals: Dict[int, Tuple[int, Optional[float], Optional[float]]] = {}   # rank -> (step, loss, None)
        self.log_path, self.hb_dir, self.ranks = log_path, hb_dir, ranks
        self.offset = 0
        self.partial = b""
        self.own: Dict[int, int] = {}
        self.written: Dict[int, int] = {}

    def _loss(self, rank: int, body: str) -> None:
        """A loss in an output line (the stability guard), at the rank's latest step."""
        m = self.loss_regex.search(body)
        if m is None:
            return
        try:
            loss = float(m.group(1))          # "nan" and "inf" read as themselves
        except (IndexError, TypeError, ValueError):
            return
        hit = self.regex.search(body)
        step = self.own.get(rank, 0)
        if hit is not None:
            try:
                step = int(hit.group(1))
            except (IndexError, TypeError, ValueError):
                pass
        self.signals[rank] = (step, loss, None)

    def poll(self) -> None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 22)
        except OSError:
            return
        if not data:
            return
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for raw in lines:
            text = raw.decode("utf-8", "replace")
            m = _LABEL.match(text)
            rank, body = (int(m.group(1)), m.group(2)) if m else (0, text)
            if self.loss_regex is not None:
                self._loss(rank, body)
            hit = self.regex.search(body)
            if hit is None:
                continue
            try:
                step = int(hit.group(1))
            except (IndexError, TypeError, ValueError):
                continue
            self.own[rank] = step
        if not self.own:
            return
        newest = max(self.own.values())
        for r in range(self.ranks):
            step = self.own.get(r, newest)
            if self.written.get(r) != step:
                protocol.write_heartbeat(self.hb_dir, r, step)   # the SDK's own heartbeat format
                self.written[r] = step


METRICS_FILE_NAME = "clusterops_job.prom"
METRICS_FILE_ENV = "CLUSTEROPS_JOB_METRICS_FILE"   # a site's textfile-collector path instead of the job dir


@dataclass
class RunConfig:
    command: List[str]                      # the training command (one per rank)
    job_dir: Path
    ckpt_dir: Path
    policy: sv.Policy
    nodes: List[str]                        # the allocation, batch host first
    job_id: Optional[str] = None
    slurm_restart_count: int = 0
    env: Dict[str, str] = field(default_factory=dict)   # extra env for every rank
    workdir: Optional[str] = None
    cpus_per_task: Optional[int] = None
    # The supervisor shares the nodes' CPUs with the ranks: poll gently. A 1 s reaction
    # is nothing next to a restart; Slurm itself needs SlurmdTimeout to see a node go.
    poll_s: float = 1.0
    node_poll_s: float = 10.0
    deep_verify: bool = True                # hash-check the checkpoint a restart resumes from
    step_wait_s: int = 60                   # srun --wait: how long ranks outlive a finished one
    python: str = sys.executable
    stacks_timeout_s: float = 15.0
    srun_args: List[str] = field(default_factory=list)   # extra srun arguments for the training step
    notify_urls: List[str] = field(default_factory=list)  # the job spec's notify: webhooks
    plain: PlainContract = field(default_factory=PlainContract)   # a script without the SDK
    launcher: str = "srun"      # "srun": one task per rank; "torchrun": one torchrun agent per node
    # The job's Prometheus textfile (node_exporter's textfile collector can read it),
    # rewritten at each state change and at exit; None: <job_dir>/clusterops_job.prom.
    metrics_file: Optional[Path] = None
    heartbeat: str = field(default_factory=hbchannel.mode_from_env)   # channel mode, see channel.py
    supervisor_lost_s: float = field(default_factory=hbchannel.lost_from_env)  # beacons' silence: gone
    stability: Optional[StabilityConfig] = None   # supervise: stability: (None: no guard)
    #: supervise: exit_codes: merged over the defaults (code -> action, schema.EXIT_ACTIONS)
    exit_codes: Mapping[int, str] = field(default_factory=lambda: dict(schema.DEFAULT_EXIT_CODES))
    job_dir_mode: int = 0o700               # mode of a job directory the supervisor creates
    inprocess: Optional[InprocessSettings] = None   # supervise: inprocess: (rendezvous.py); None: off
    # The spec's signal_lead_s (0: none asked): a lead signal lost before the handlers were
    # in is made up for by Slurm's end time (``_lead_passed``).
    signal_lead_s: int = 0
    trackers: List = field(default_factory=list)   # supervise: trackers: (clusterops.trackers.TrackerSpec)
    job_name: Optional[str] = None          # the spec's name (the trackers' project, experiment, run)
    # A generation of a chain (chain: N; clusterops.supervisor.chain); None: a lone job.
    chain: Optional["ChainInfo"] = None
    # The job was submitted with Slurm 25.11's --requeue=expedite (the spec's requeue:
    # expedite): a non-zero exit of the batch script is requeued by Slurm itself, held, unless
    # the job's Requeue is off (_final_exit_no_requeue).
    expedited_requeue: bool = False
    # How Slurm commands name this job (slurm.api.own_job_ref): job_id, or <array>_<task> for
    # the chain's task that holds the array's own id. None: job_id.
    slurm_ref: Optional[str] = None

    @property
    def slurm_job(self) -> Optional[str]:
        """This job as Slurm's commands are to name it (requeue, update, show)."""
        return self.slurm_ref or self.job_id

    @classmethod
    def from_environment(cls, command: Sequence[str], job_dir: Path, ckpt_dir: Path, policy: sv.Policy,
                         **kwargs) -> "RunConfig":
        """Fill allocation facts from the SLURM_* environment of the batch script."""
        import hostlist

        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise InputError("clusterops supervise must run inside a Slurm allocation "
                             "(SLURM_JOB_NODELIST is not set)")
        nodes = hostlist.expand_hostlist(nodelist)
        batch = os.environ.get("SLURMD_NODENAME")
        if batch in nodes:
            nodes = [batch] + [n for n in nodes if n != batch]
        return cls(command=list(command), job_dir=Path(job_dir), ckpt_dir=Path(ckpt_dir), policy=policy,
                   nodes=nodes, job_id=os.environ.get("SLURM_JOB_ID"), slurm_ref=own_job_ref() or None,
                   slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                   **dict({"metrics_file": Path(os.environ[METRICS_FILE_ENV])} if os.environ.get(METRICS_FILE_ENV)
                          else {}, **kwargs))


# ------------------------------------------------------------------------------ checks
#: The check result that names a node's NVLink domain (``FABRIC_RESULT`` of
#: clusterops.health.probes.nvml, not imported: the health package would slow every start).
FABRIC_RESULT = "nvml.fabric"


def fabric_of(results: object) -> Optional[str]:
    """The NVLink domain a node's health report names (``nvml.fabric``'s ``data.fabric``);
    None without one. The report is another process's JSON: its shape is not trusted."""
    if not isinstance(results, list):
        return None
    for r in results:
        if isinstance(r, dict) and r.get("name") == FABRIC_RESULT:
            data = r.get("data")
            domain = data.get("fabric") if isinstance(data, dict) else None
            return domain if isinstance(domain, str) and domain else None
    return None


# ------------------------------------------------------------------------------ torchrun
#: How long a hang's kill waits for the ranks' flight-recorder dumps (each rank's watch
#: thread answers the next beacon, about one heartbeat interval).
FLIGHTREC_WAIT_S = 8.0
#: The flight recorder's ring buffer, set for the ranks unless the job's env sets one.
FLIGHTREC_BUFFER = "2000"
STEP_LOG_TAIL_CHARS = 1 << 20   # how much of a failed step's log is read for the ranks' own words
REQUEUE_SIGTERM_WAIT_S = 1.0   # after `scontrol requeue`: how long the ExcNodeList update waits for the batch SIGTERM
FINISHED_STEP_GRACE_S = 3.0   # in-process: srun's own end, after every rank finished, a node lost

# One torchrun agent per node (srun task), static rendezvous on the step's first node
# (MASTER_ADDR/MASTER_PORT, set per launch), node rank = the task's index in the step.
# The agent ignores the lead-time USR1 and the supervisor's USR2 (it would die of
# them; the ignored state is inherited, and the SDK's handlers replace it in the
# workers); no restarts inside torchrun: the supervisor restarts.
# A replay's rotation (Launch.rotate) shifts the node rank: node rank (i - rotate) mod nodes runs on
# the step's i-th node, so node rank k runs where node rank k + rotate ran.
_TORCHRUN_BODY = ('trap "" USR1 USR2; exec "$0" -m torch.distributed.run --nnodes="$1" --nproc-per-node="$2" '
                  '--node-rank="$(( (SLURM_PROCID + $1 - $3) % $1 ))" --master-addr="$MASTER_ADDR" '
                  '--master-port="$MASTER_PORT" --max-restarts=0 "${@:4}"')


def torchrun_command(command: Sequence[str], python: str, nodes: int, nproc_per_node: int,
                     rotate: int = 0) -> List[str]:
    """The per-node command that starts ``command`` (``python script args`` or a program) under torchrun."""
    command = list(command)
    if command and command[0] == python:
        target = command[1:]
    else:
        target = ["--no-python", *command]
    return ["bash", "-c", _TORCHRUN_BODY, python, str(nodes), str(nproc_per_node), str(int(rotate) % max(nodes, 1)),
            *target]


# ------------------------------------------------------------------------------ srun-native ranks
# torch's env:// contract for one srun task, from that task's own Slurm values (the same as
# templates/srun.sh.j2 exports for an unsupervised job): a plain script that calls
# init_process_group() with no arguments finds RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/
# NODE_RANK here and MASTER_ADDR/MASTER_PORT in the step's environment. The rank differs per
# task, so it cannot go into srun's --export: each task runs this tiny wrapper, which execs
# the command (the wrapper is gone; the task's process is the training process itself).
# NODE_RANK is the rank's node in srun's block layout (as Supervisor.rank_node counts it),
# whatever SLURM_NODEID says on a step that runs on some nodes of the allocation. A replay's
# rotation ($3 ranks, rotate x ranks per node) moves every node's ranks to the next node:
# the task with SLURM_PROCID p is rank (p - $3) mod WORLD_SIZE.
_RANK_ENV_BODY = ('export RANK="$(( (SLURM_PROCID + $1 - $3) % $1 ))" WORLD_SIZE="$1" LOCAL_RANK="$SLURM_LOCALID" '
                  'LOCAL_WORLD_SIZE="$2"; export NODE_RANK="$(( RANK / $2 ))"; shift 3; exec "$@"')


def rank_env_command(command: Sequence[str], world_size: int, ranks_per_node: int, rotate: int = 0) -> List[str]:
    """The per-task command that gives ``command`` torch's rank environment, then execs it;
    ``rotate``: rank r runs on the node ``rotate`` nodes after its place in srun's block layout."""
    shift = (int(rotate) * ranks_per_node) % max(world_size, 1)
    return ["bash", "-c", _RANK_ENV_BODY, "clusterops-rank", str(world_size), str(ranks_per_node), str(shift),
            *command]


# ------------------------------------------------------------------------------ helpers


_STATE_COUNTS = ("attempts", "restarts", "no_progress")   # the restart budgets spent so far
_STATE_FIX = "; fix it, or remove it to start over with a fresh restart budget and no remembered bad nodes"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_memory(text: str, where: str) -> sv.Memory:
    """The supervisor's memory from the text of its state file; InputError (one line naming
    the file and the field) for anything that is not what :func:`save_memory` writes: a
    corrupt file must never silently reset the restart budget, nor end in a traceback."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InputError(f"{where}: not JSON ({str(e)[:80]}){_STATE_FIX}") from None
    if not isinstance(body, dict):
        raise InputError(f"{where}: must be a JSON object, got {type(body).__name__}{_STATE_FIX}")
    for key in _STATE_COUNTS:
        v = body.get(key)
        if key not in body or not isinstance(v, int) or isinstance(v, bool) or v < 0:
            got = "nothing" if key not in body else _short(v)
            raise InputError(f"{where}: {key}: must be a whole number >= 0, got {got}{_STATE_FIX}")
    last = body.get("last_ckpt_step")
    if last is not None and (not isinstance(last, int) or isinstance(last, bool) or last < 0):
        raise InputError(f"{where}: last_ckpt_step: must be a whole number >= 0 or null, got {_short(last)}"
                         f"{_STATE_FIX}")
    bad = body.get("bad_nodes", {})
    if not isinstance(bad, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in bad.items()):
        raise InputError(f"{where}: bad_nodes: must map node names to reasons (strings), got {_short(bad)}"
                         f"{_STATE_FIX}")
    rollbacks = body.get("rollbacks", [])
    if not isinstance(rollbacks, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in rollbacks):
        raise InputError(f"{where}: rollbacks: must be a list of step numbers, got {_short(rollbacks)}{_STATE_FIX}")
    hint = body.get("hint")
    parsed = None if hint is None else protocol.ResumeHint.from_json(json.dumps(hint))
    if hint is not None and (not isinstance(hint, dict) or parsed is None):
        raise InputError(f"{where}: hint: must be a resume hint (from_step, skip_batches, lr_factor) or null, "
                         f"got {_short(hint)}{_STATE_FIX}")
    return sv.Memory(bad_nodes=dict(bad), attempts=body["attempts"], restarts=body["restarts"],
                     no_progress=body["no_progress"], last_ckpt_step=last, rollbacks=list(rollbacks), hint=parsed)


def load_memory(job_dir: Path) -> sv.Memory:
    """What earlier incarnations left in ``<job_dir>/supervisor-state.json``; a fresh memory
    when there is no such file (the first incarnation); InputError when it cannot be read
    or is not a state file (:func:`parse_memory`)."""
    path = job_dir / STATE_FILE
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return sv.Memory()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text{_STATE_FIX}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read the supervisor state: {e.strerror or e}") from None
    return parse_memory(text, str(path))


def make_job_dir(path: Path, mode: int = 0o700) -> None:
    """Create the job directory (its parents as usual) with ``mode`` (0700 by default: the
    attempts' files carry the heartbeat token); one that exists is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        return
    os.chmod(path, mode)   # exactly the mode asked for, whatever the umask


def save_memory(job_dir: Path, memory: sv.Memory) -> None:
    path = job_dir / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(memory.to_dict(), indent=1))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ the run
class SupervisorRun:
    def __init__(self, cfg: RunConfig, *, slurm: Optional[SlurmAPI] = None, runner: Optional[Runner] = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 echo: Callable[[str], None] = print, early_signals: Optional[List[int]] = None):
        self.cfg = cfg
        # Signal numbers caught before this run existed (``clusterops supervise``'s first
        # handlers, and those the batch script noted): taken over by install_signals.
        self.early_signals = early_signals if early_signals is not None else []
        self.runner = runner or Runner()
        if slurm is None:
            from clusterops.slurm.factory import connect

            # Polls must not block the loop for long: one attempt each, short timeouts; the
            # loop retries on its own schedule (``_poll_nodes``: one budget, no nested retries).
            slurm = connect(runner=self.runner, timeout_s=15.0, read_attempts=1)
        self.slurm = slurm
        self.clock = clock
        self.sleep = sleep
        self.echo = echo
        self.timeline = Timeline(cfg.job_dir, job_id=cfg.job_id, incarnation=cfg.slurm_restart_count,
                                 clock=clock)
        self.sup: Optional[sv.Supervisor] = None
        self.signals: List[str] = []
        self.train: Optional[Process] = None
        self.train_log: Optional[Path] = None
        self.attempt_dir: Optional[Path] = None
        self.replicas_stat: Optional[Tuple[str, int, int]] = None   # the replica report last read
        self.step_name: Optional[str] = None
        self.step_id: Optional[str] = None
        self.stop_file: Optional[Path] = None
        self.channel: Optional[hbchannel.Channel] = None   # this attempt's heartbeat channel
        self.revive_failed = False   # the receiver ended and could not be restarted (said once)
        self.preflight: Optional[Process] = None
        self.requeue_asked = False        # this process asked Slurm to requeue the job
        self.preflight_action: Optional[sv.RunPreflight] = None
        self.preflight_dir: Optional[Path] = None
        self.preflight_deadline = 0.0
        self.exit_code: Optional[int] = None
        self.seen_ckpt: Optional[int] = None
        self.next_node_poll = 0.0
        self.next_timing = 0.0
        self.node_poll_failures = 0
        self.launched_at: Optional[float] = None
        self.preempt_seen = False
        self.lead_seen = False     # the time limit's stop was asked for (the signal, or Slurm's end time)
        self.guard: Optional[drains.GuardSettings] = None
        self.n_checks = 0
        self.notifier = None   # webhooks from the site config's notify: (made when first needed)
        self.trackers = None   # clusterops.trackers.TrackerSink when supervise: trackers: names some
        self.progress_reader: Optional[ProgressReader] = None
        self.rdzv: Optional[RendezvousHost] = None   # this attempt's in-process rendezvous
        self.rdzv_log_at = 0     # how far the step log was read for srun's task failures
        self.rdzv_done_at: Optional[float] = None   # when every rank had finished, a node being lost
        self.rdzv_ended = False  # the step ended by us: its tasks on a lost node never end
        self.rdzv_launch: Optional[Tuple[List[str], Dict[str, str]]] = None   # the step's command and env
        self.standby_steps: List[Process] = []   # standbys started in used ones' places (their own steps)
        self.rdzv_done: Tuple[Optional[RendezvousHost], float] = (None, 0.0)   # (host, when all its ranks were done)
        # One handler per action class, spelled out so that grep finds them.
        self._handlers: Dict[type, Callable[[sv.Action], None]] = {
            sv.Record: self._act_record,
            sv.RunPreflight: self._act_run_preflight,
            sv.Launch: self._act_launch,
            sv.KillStep: self._act_kill_step,
            sv.CaptureStacks: self._act_capture_stacks,
            sv.RequestStop: self._act_request_stop,
            sv.DrainNodes: self._act_drain_nodes,
            sv.Requeue: self._act_requeue,
            sv.Exit: self._act_exit,
            sv.SetAside: self._act_set_aside,
            sv.PickRollback: self._act_pick_rollback,
            sv.HoldCheckpoint: self._act_hold,
        }

    # -- signals ---------------------------------------------------------------------
    def _stop_reason(self, signum: int) -> str:
        if signum == signal.SIGUSR1:
            self.lead_seen = True
            return sv.StopReason.TIME_LIMIT
        return sv.StopReason.PREEMPTION if signum == signal.SIGTERM else sv.StopReason.USER

    def install_signals(self) -> None:
        def on_signal(signum, frame):
            self.signals.append(self._stop_reason(signum))

        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        # Only now: one that comes meanwhile lands in self.signals, after these.
        early, self.early_signals = list(self.early_signals), []
        self.signals[:0] = [self._stop_reason(s) for s in early]

    # -- main loop -------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        if cfg.policy.drain_bad_nodes:
            self._guard_settings()   # a bad drain: setting is a usage error now, not mid-run
        make_job_dir(cfg.job_dir, cfg.job_dir_mode)
        cfg.ckpt_dir.mkdir(parents=True, exist_ok=True)
        try:
            memory = load_memory(cfg.job_dir)
        except InputError as e:
            self._record(E.STATE_INVALID, {"error": e.message})   # nothing launched: stop here
            raise
        self.install_signals()
        if cfg.chain is not None and self._chain_start():
            self._final_exit_no_requeue()
            return self.exit_code
        self._start_trackers()
        latest = self._latest_ckpt(deep=False)
        self.seen_ckpt = latest
        self.sup = sv.Supervisor(cfg.policy, cfg.nodes, slurm_restart_count=cfg.slurm_restart_count,
                                 memory=memory, ckpt_step=latest, stability=cfg.stability,
                                 exit_codes=cfg.exit_codes, domains=self._domains(),
                                 chain_next=cfg.chain is not None and cfg.chain.has_next)
        if self.sup.stability is not None:      # the checkpoints a rollback may go back to
            for step in self._ckpt_steps():
                self.sup.stability.checkpoint(step)
        try:
            # A stop that came before this run (caught early, or the lead's moment already
            # passed by Slurm's end time): requeue before launching anything.
            if not self.signals and self.cfg.signal_lead_s and self._lead_passed(self._job_info(), self.clock()):
                self.signals.append(self._missed_lead())
            self._do(self.sup.start(self.clock(), stop=self.signals.pop(0) if self.signals else None))
            while self.exit_code is None:
                self._wait(cfg.poll_s)
                for ev in self._observe():
                    self._do(self.sup.handle(ev))
                    if self.exit_code is not None:
                        break
        except BaseException as e:
            # A bug or an interrupt in the plumbing: say so in the timeline and take the
            # step down with us rather than leave ranks running unsupervised.
            self._record(E.SUPERVISOR_ERROR, {"error": f"{type(e).__name__}: {e}"})
            for p in (self.train, self.preflight):
                if p is not None and p.poll() is None:
                    kill_group(p)
            raise
        finally:
            if self.channel is not None:
                self.channel.close()
            self._close_rdzv()
            self._close_trackers("done" if self.exit_code == sv.EXIT_DONE else
                                 "give_up" if self.exit_code is not None else "stopped")
            self._final_exit_no_requeue()
        return self.exit_code

    # -- a chain of generations (clusterops.supervisor.chain) ----------------------------
    def _chain_start(self) -> bool:
        """Record this generation; True (and exit_code set) when an earlier one ended the
        chain: then the queued generations are cancelled and nothing trains."""
        c = self.cfg.chain
        self._record(E.GENERATION, {"generation": c.generation, "of": c.length, "array_id": c.array_id})
        ended = chainmod.read_end(self.cfg.job_dir)
        if ended is None:
            return False
        self.echo(f"[clusterops supervise] the chain ended in generation {ended.get('generation')} "
                  f"({ended.get('reason')}): cancelling the rest")
        self._chain_cancel({"code": ended.get("code"), "reason": ended.get("reason"),
                            "ended_in": ended.get("generation"), "by": "a later generation at its start"})
        self.exit_code = sv.EXIT_CHAIN_ENDED
        return True

    def _chain_end(self, code: int, reason: str) -> None:
        """A final exit of a generation: the marker first (so that a later generation knows,
        should this process die now), then the cancel of the queued generations."""
        c = self.cfg.chain
        doc = {"code": int(code), "reason": reason, "generation": c.generation, "job_id": self.cfg.job_id,
               "t": self.clock()}
        try:
            chainmod.write_end(self.cfg.job_dir, doc)
        except OSError as e:
            self._record(E.WARNING, {"what": f"chain end marker not written: {e}"})
        self._chain_cancel({"code": int(code), "reason": reason, "ended_in": c.generation,
                            "by": "the generation that ended it"})

    def _chain_cancel(self, data: dict) -> None:
        c = self.cfg.chain
        try:
            self.slurm.cancel_pending(c.array_id)
            data["cancelled"] = True
        except ClusteropsError as e:
            data.update(cancelled=False, error=e.message)
        self._record(E.CHAIN_END, data)

    def _wait(self, seconds: float) -> None:
        """Sleep until the next poll, waking at once when the training step exits."""
        if self.train is not None and self.sleep is time.sleep:
            wait_exit(self.train, seconds)
        else:
            self.sleep(seconds)

    def _observe(self) -> List[sv.Event]:
        now = self.clock()
        events: List[sv.Event] = []
        while self.signals:
            events.append(sv.StopRequested(now, self.signals.pop(0)))
        if self.preflight is not None:
            ev = self._poll_preflight(now)
            if ev:
                events.append(ev)
        if self.rdzv is not None:
            self._poll_rdzv()
        if self.train is not None:
            step = self._latest_ckpt(deep=False)
            if step is not None and (self.seen_ckpt is None or step > self.seen_ckpt):
                self.seen_ckpt = step
                events.append(sv.CheckpointCommitted(now, step, self._ckpt_path(step)))
            if self.progress_reader is not None:
                self.progress_reader.poll()   # a script without the SDK: its output is its heartbeat
            if self.channel is not None and not self._ranks_done(now):
                self._revive_receiver()
                # Straggler samples at most once per TIMING_RANKS_PER_S ranks a second: the
                # detector's pass over every rank stays a small share of a core at 16k ranks.
                # No detector (detect_stragglers: false): no samples to build.
                timing = {}
                if self.sup.detector is not None and now >= self.next_timing:
                    timing = self.channel.timings()
                    self.next_timing = now + max(1.0, self.sup.expected_ranks / TIMING_RANKS_PER_S)
                signals = self._signals()
                events.append(sv.Heartbeats(now, self.channel.snapshot(self.sup.expected_ranks), timing=timing,
                                            signals=signals, replicas=self._replica_reports(),
                                            nonfinite=self._nonfinite(signals)))
            rc = self.train.poll()
            if rc is not None:
                events.append(self._step_exited(now, rc))
        if now >= self.next_node_poll and self.cfg.job_id:
            ev = self._poll_nodes(now)
            if ev:
                events.append(ev)
        events.append(sv.Tick(now))
        return events

    def _ranks_done(self, now: float) -> bool:
        """In-process: every rank reported done to the rendezvous (the training finished or
        stopped) less than RDZV_EXIT_GRACE_S ago. Their silence since is no hang: no
        heartbeats go to the state machine meanwhile (a step still there after the grace is
        judged on its heartbeats again)."""
        if self.rdzv is None or not self.rdzv.finished:
            return False
        if self.rdzv_done[0] is not self.rdzv:
            self.rdzv_done = (self.rdzv, now)
        return now - self.rdzv_done[1] < RDZV_EXIT_GRACE_S

    def _revive_receiver(self) -> None:
        """A receiver thread that ended (it should not: no datagram can end it) is an error
        said in the timeline and restarted on the same port, before the watch loop reads
        heartbeats that would otherwise stop arriving and read as a hang."""
        try:
            why = self.channel.revive()
        except OSError as e:
            if not self.revive_failed:      # said once; tried again every poll
                self._record(E.WARNING, {"what": f"heartbeat receiver ended and cannot be restarted: {e}"})
            self.revive_failed = True
            return
        self.revive_failed = False
        if why is not None:
            self._record(E.HEARTBEAT_RECEIVER_RESTARTED, {"error": why, "port": self.channel.receiver.port,
                                                          "restarts": self.channel.receiver.restarts})

    # -- actions ---------------------------------------------------------------------
    def _do(self, actions: List[sv.Action]) -> None:
        for a in actions:
            if self.exit_code is not None:
                return
            handler = self._handlers.get(type(a))
            if handler is None:
                raise TypeError(f"no handler for action {a!r}")
            try:
                handler(a)
            except ClusteropsError as e:
                self._record(E.WARNING, {"what": f"{type(a).__name__} failed: {e.message}"})
                if isinstance(a, sv.Requeue):
                    if self.trackers is not None and self.trackers.closed.is_set():
                        self._start_trackers()   # closed for the requeue that did not happen: resumed
                    self._do(self.sup.handle(sv.RequeueFailed(self.clock(), e.message,
                                                              unschedulable=isinstance(e, UnschedulableExclusion))))
                elif isinstance(a, sv.Launch):
                    # Could not even start srun: count it as a failed attempt.
                    self.train = None
                    self._do(self.sup.handle(sv.StepExited(self.clock(), returncode=127)))

    def _record(self, kind: str, data: Optional[dict] = None) -> None:
        from clusterops.supervisor.timeline import describe

        rec = self.timeline.append(kind, data or {})
        self.echo(f"[clusterops supervise] {time.strftime('%H:%M:%S', time.gmtime(rec['t']))} {describe(rec)}")
        if self.trackers is not None:
            self.trackers.feed(rec)
        if kind not in (E.PROGRESS, E.WARNING):
            self._write_metrics()

    def _start_trackers(self) -> None:
        """The experiment trackers (``supervise: trackers:``), fed every record from here on;
        the timeline so far is replayed to them (a requeued job's earlier incarnations)."""
        if not self.cfg.trackers:
            return
        from clusterops.supervisor.timeline import load
        from clusterops.trackers import TrackerSink

        def warn(text: str) -> None:   # from the trackers' thread: the timeline line alone
            rec = self.timeline.append(E.WARNING, {"what": text})
            self.echo(f"[clusterops supervise] {time.strftime('%H:%M:%S', time.gmtime(rec['t']))} warning: {text}")

        try:
            history = load(self.cfg.job_dir)[0]
        except InputError:
            history = []
        self.trackers = TrackerSink(self.cfg.trackers, self.cfg.job_dir, job_name=self.cfg.job_name or
                                    self.cfg.job_dir.name, job_id=self.cfg.job_id, warn=warn)
        self.trackers.start(history)

    def _close_trackers(self, outcome: str, wait_s: float = 30.0) -> None:
        if self.trackers is not None:
            self.trackers.close(outcome, wait_s)

    def _write_metrics(self) -> None:
        """The job's Prometheus textfile from the whole timeline (all incarnations); a
        failure is said on the console, never a reason to stop supervising."""
        from clusterops.supervisor.timeline import job_metrics, load

        path = self.cfg.metrics_file or self.cfg.job_dir / METRICS_FILE_NAME
        try:
            job_metrics(load(self.cfg.job_dir)[0], str(self.cfg.job_id or self.cfg.job_dir.name)).write_textfile(path)
        except Exception as e:
            self.echo(f"[clusterops supervise] metrics textfile {path}: {type(e).__name__}: {e}")

    def _act_record(self, a: sv.Record) -> None:
        self._record(a.kind, dict(a.data))
        if a.kind == E.NODE_BAD:   # a blame in the fleet history ($CLUSTEROPS_HISTORY_DB): clusterops.quarantine
            from clusterops.quarantine import blame_bad_node

            note = blame_bad_node(str(a.data.get("node")), str(a.data.get("why") or ""), self.cfg.job_id)
            if note:
                self.echo(f"[clusterops supervise] {note}")
        if a.kind == E.NODE_DRAINED and a.data.get("action") != "spare dropped":
            self._notify("job_node_drained", f"job {self.cfg.job_id}: node {a.data.get('node')} drained by someone "
                                             f"else ({a.data.get('action')})", dict(a.data), wait_s=2.0)
        if a.kind == E.ROLLBACK:
            self._notify("job_rolled_back", f"job {self.cfg.job_id} rolled back to step {a.data.get('to_step')}",
                         dict(a.data), wait_s=2.0)

    def _act_run_preflight(self, a: sv.RunPreflight) -> None:
        liveness = a.profile == sv.LIVENESS
        kind = "liveness" if liveness else ("postmortem" if a.postmortem else "preflight")
        self.n_checks += 1
        d = self.cfg.job_dir / f"{kind}-{self.cfg.slurm_restart_count}-{self.n_checks}"
        d.mkdir(parents=True, exist_ok=True)
        if liveness:
            # Does each node still run a task?
            command = ["printenv", "SLURMD_NODENAME"]
        else:
            command = [self.cfg.python, "-m", "clusterops", "health", "check", "--profile", a.profile, "--json"]
        # Per-task files (%t): srun's %N is the host name, which need not be the Slurm
        # node name; each report names its node itself. --overlap for liveness: a dead
        # step's leftovers must not make it wait for resources.
        argv = srun_argv(command, job_name=f"clusterops-{kind}", nodes=a.nodes, ntasks_per_node=1,
                         cpus_per_task=self.cfg.cpus_per_task, kill_on_bad_exit=False,
                         output=f"{d}/%t.out", error=f"{d}/%t.err", overlap=liveness)
        self.preflight = self.runner.spawn(argv, log_path=str(d / "srun.log"), cwd=self.cfg.workdir)
        self.preflight_action = a
        self.preflight_dir = d
        self.preflight_deadline = self.clock() + a.timeout_s

    def _poll_preflight(self, now: float) -> Optional[sv.Event]:
        a, d, p = self.preflight_action, self.preflight_dir, self.preflight
        if p.poll() is None and now < self.preflight_deadline:
            if a.profile != sv.LIVENESS or not self._liveness_all_in(a, d):
                return None
        if p.poll() is None:
            kill_group(p)
            p.wait()
        statuses, details, fabric = {}, {}, {}
        for i in range(len(a.nodes)):
            try:
                text = (d / f"{i}.out").read_text()
            except OSError:
                text = ""
            if a.profile == sv.LIVENESS:
                name = text.strip()
                if name:
                    statuses[name] = "pass"
                continue
            try:
                rep = json.loads(text)
                name = rep.get("node")
                statuses[name] = rep.get("status", "error")
                bad = [r for r in rep.get("results", []) if r.get("status") in ("fail", "error")]
                details[name] = "; ".join(f"{r.get('name')}: {r.get('detail')}" for r in bad[:3])
                domain = fabric_of(rep.get("results"))
                if domain:
                    fabric[name] = domain
            except (ValueError, AttributeError):
                continue
        srun_log = ""
        try:
            srun_log = " ".join((d / "srun.log").read_text().split())[-200:]
        except OSError:
            pass
        for node in a.nodes:
            if node not in statuses:
                statuses[node] = "missing"
                details[node] = srun_log or "no report (timed out or could not run)"
        statuses = {n: st for n, st in statuses.items() if n in a.nodes}
        self.preflight = None
        return sv.PreflightDone(now, statuses, details, postmortem=a.postmortem,
                                fabric={n: dom for n, dom in fabric.items() if n in a.nodes})

    @staticmethod
    def _liveness_all_in(a: sv.RunPreflight, d: Path) -> bool:
        """Every node answered the liveness check (srun may still wait on a dead one's peer)."""
        for i in range(len(a.nodes)):
            try:
                if not (d / f"{i}.out").read_text().strip():
                    return False
            except OSError:
                return False
        return True

    def _replica_reports(self) -> Tuple[Tuple[str, dict], ...]:
        """The replica check's latest word in this attempt (``sdk.check_replicas`` writes it),
        read again only when the file changed (one stat a poll otherwise)."""
        if self.attempt_dir is None or not self.cfg.policy.replica_check_every:
            return ()
        path = protocol.heartbeat_dir(self.attempt_dir) / protocol.REPLICAS_FILE
        try:
            st = path.stat()
        except OSError:
            return ()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key == self.replicas_stat:
            return ()
        report = protocol.read_replicas(path.parent)
        if report is None:
            return ()
        self.replicas_stat = key
        return ((protocol.REPLICAS_FILE, report),)

    def _nonfinite(self, signals) -> Dict[int, Tuple[int, str]]:
        """The ranks' first non-finite steps (sdk), for a replay's verdict: read only when the
        guard replays and a rank's signals are not finite (no I/O otherwise)."""
        from clusterops.supervisor import stability as stb

        st = self.sup.stability
        if (st is None or self.attempt_dir is None or stb.Action.REPLAY.value not in (st.cfg.on_nan, st.cfg.on_spike)
                or all(stb.finite(lo) and stb.finite(g) for _, lo, g in signals.values())):
            return {}
        return protocol.read_nonfinite(protocol.heartbeat_dir(self.attempt_dir))

    def _signals(self) -> Dict[int, Tuple[int, Optional[float], Optional[float]]]:
        """The ranks' loss and grad norm for the stability guard (none without one)."""
        if not self.sup.watch_loss:
            return {}
        if self.progress_reader is not None and self.progress_reader.loss_regex is not None:
            return dict(self.progress_reader.signals)
        return self.channel.signals() if self.channel is not None else {}

    def _ckpt_steps(self) -> List[int]:
        """The steps of the checkpoints on disk (not verified: a rollback's resume verifies)."""
        from clusterops import checkpoint as ck

        if self.cfg.plain.checkpoint_glob:
            return sorted({s for s, _, _ in plain_checkpoints(self.cfg.ckpt_dir, self.cfg.plain.checkpoint_glob)})
        try:
            return [s for s, _ in ck.committed_steps(self.cfg.ckpt_dir)]
        except ClusteropsError:
            return []

    def _act_hold(self, a: sv.HoldCheckpoint) -> None:
        """Retention's hold on a checkpoint (clusterops.checkpoint.retention.hold); the
        script's own checkpoints (no SDK) are not clusterops's to prune, so not held."""
        from clusterops import checkpoint as ck

        if self.cfg.plain.checkpoint_glob:
            return
        try:
            ck.hold(self.cfg.ckpt_dir, a.step, a.reason)
        except OSError as e:
            self._record(E.WARNING, {"what": f"hold on checkpoint step {a.step}: {e.strerror or e}"})

    def _act_set_aside(self, a: sv.SetAside) -> None:
        """Move the checkpoints after ``a.after_step`` into ``<ckpt_dir>/rolled-back-<N>/``
        (kept for a look, never resumed from: no lookup reads below the root)."""
        from clusterops import checkpoint as ck

        cfg = self.cfg
        if cfg.plain.checkpoint_glob:
            victims = [p for s, _, p in plain_checkpoints(cfg.ckpt_dir, cfg.plain.checkpoint_glob) if s > a.after_step]
        else:
            victims = [p for s, p in ck.committed_steps(cfg.ckpt_dir) if s > a.after_step]
        if not victims:
            return
        n = 1
        while (cfg.ckpt_dir / f"rolled-back-{n}").exists():
            n += 1
        dest = cfg.ckpt_dir / f"rolled-back-{n}"
        dest.mkdir()
        moved = []
        for p in victims:
            try:
                os.replace(p, dest / p.name)
                moved.append(p.name)
            except OSError as e:
                self._record(E.WARNING, {"what": f"setting aside {p}: {e.strerror or e}"})
        self.seen_ckpt = self._latest_ckpt(deep=False)
        self._record(E.CHECKPOINT_SET_ASIDE, {"after_step": a.after_step, "into": str(dest), "moved": moved,
                                              "reason": a.reason})

    def _act_pick_rollback(self, a: sv.PickRollback) -> None:
        """The checkpoint a rollback really goes back to, told to the machine at once: the
        newest at or before ``a.before`` that exists and verifies (hashes too with
        ``deep_verify``, as the resume will check it); the guard's ``a.planned`` may have
        been pruned since, or damaged. Nothing is moved here."""
        from clusterops import checkpoint as ck

        cfg = self.cfg
        bad: List[Tuple[int, str, Tuple[str, ...]]] = []
        found: Optional[Tuple[int, str]] = None
        if cfg.plain.checkpoint_glob:
            # The script's own format: "complete" is all there is to check (see plain_checkpoints).
            ok = [(s, str(p)) for s, _, p in plain_checkpoints(cfg.ckpt_dir, cfg.plain.checkpoint_glob)
                  if s <= a.before]
            found = ok[-1] if ok else None
            if a.planned not in {s for s, _ in ok}:
                bad.append((a.planned, str(cfg.ckpt_dir), ("does not exist (pruned or moved since it was saved)",)))
        else:
            try:
                steps = ck.committed_steps(cfg.ckpt_dir)
                if a.planned not in {s for s, _ in steps}:
                    bad.append((a.planned, str(cfg.ckpt_dir / ck.step_dir_name(a.planned)),
                                ("does not exist (pruned or moved since it was saved)",)))
                lookup = ck.find_latest_good(cfg.ckpt_dir, deep=cfg.deep_verify,
                                             exclude={p for s, p in steps if s > a.before})
            except ClusteropsError as e:   # the root unreadable: no target (the machine gives up)
                bad.append((a.planned, str(cfg.ckpt_dir), (e.message,)))
                lookup = ck.Lookup(None, [])
            bad += [(b.step, str(b.path), tuple(b.problems)) for b in lookup.skipped]
            found = (lookup.latest.step, str(lookup.latest.path)) if lookup.latest else None
        self._do(self.sup.handle(sv.RollbackPicked(self.clock(), found[0] if found else None,
                                                   found[1] if found else "", tuple(bad))))

    def _ckpt_path(self, step: int) -> str:
        if self.cfg.plain.checkpoint_glob:
            found = [p for s, _, p in plain_checkpoints(self.cfg.ckpt_dir, self.cfg.plain.checkpoint_glob)
                     if s == step]
            return str(found[-1]) if found else ""
        return str(self.cfg.ckpt_dir / f"step_{step}")

    def _latest_ckpt(self, *, deep: bool) -> Optional[int]:
        from clusterops import checkpoint as ck

        if self.cfg.plain.checkpoint_glob:
            found = plain_checkpoints(self.cfg.ckpt_dir, self.cfg.plain.checkpoint_glob)
            return found[-1][0] if found else None
        try:
            found = ck.find_latest_good(self.cfg.ckpt_dir, deep=deep).latest
        except ClusteropsError:
            return None
        return found.step if found else None

    def _act_launch(self, a: sv.Launch) -> None:
        from clusterops import checkpoint as ck

        cfg = self.cfg
        d = protocol.attempt_dir(cfg.job_dir, a.attempt)
        d.mkdir(mode=0o700, exist_ok=True)           # its files carry the heartbeat token
        protocol.heartbeat_dir(d).mkdir(mode=0o700, exist_ok=True)
        self.attempt_dir = d
        self.stop_file = protocol.stop_file(d)
        if self.channel is not None:
            self.channel.close()
        self.channel = hbchannel.Channel(cfg.heartbeat, protocol.heartbeat_dir(d), clock=self.clock,
                                         advertise_host=self.slurm.node_address(cfg.nodes[0]),
                                         lost_after_s=cfg.supervisor_lost_s)
        if self.channel.bind_fallback:
            self._record(E.HEARTBEAT_BIND, {"listening": "every interface", "why": self.channel.bind_fallback})
        # Resume from a checkpoint verified now (hashes too): a newest checkpoint that was
        # damaged since it was written is skipped and said so, not loaded.
        resume = ""
        try:
            if cfg.plain.checkpoint_glob:
                # The script's own format: nothing to verify beyond "complete" (see plain_checkpoints).
                found = plain_checkpoints(cfg.ckpt_dir, cfg.plain.checkpoint_glob)
                lookup = ck.Lookup(ck.CheckpointInfo(path=found[-1][2], step=found[-1][0], ok=True) if found else None, [])
            else:
                lookup = ck.find_latest_good(cfg.ckpt_dir, deep=cfg.deep_verify)
        except ClusteropsError as e:  # the root itself unreadable: start without one, say why
            self._record(E.CHECKPOINT_BAD, {"step": None, "path": str(cfg.ckpt_dir), "problems": [e.message]})
            lookup = ck.Lookup(None, [])
        for bad in lookup.skipped:
            self._record(E.CHECKPOINT_BAD, {"step": bad.step, "path": str(bad.path), "problems": bad.problems[:3]})
        if lookup.latest is not None:
            resume = str(lookup.latest.path)
        self.seen_ckpt = lookup.latest.step if lookup.latest else None
        # A stability rollback's decision goes with the checkpoint it was made for only.
        hint = a.hint if a.hint is not None and self.seen_ckpt == a.hint.from_step else None
        if a.hint is not None and hint is None:
            self._record(E.WARNING, {"what": f"rollback checkpoint step {a.hint.from_step} is not the one resumed "
                                             f"from ({self.seen_ckpt}): no skip, no LR factor"})
        self._do(self.sup.handle(sv.ResumeChosen(self.clock(), self.seen_ckpt, resume,
                                                 tuple(str(b.path) for b in lookup.skipped))))
        nodes = list(a.nodes)
        ppn = cfg.policy.ranks_per_node
        env = dict(cfg.env)
        env.update({
            **protocol.rank_env(ckpt_dir=cfg.ckpt_dir, resume_from=resume, attempt=d, restart_count=a.restart_count,
                                heartbeat_addr=self.channel.env_value,
                                resume_hint=hint.to_json() if hint is not None else "",
                                replica_check_every=cfg.policy.replica_check_every, replay=a.replay),
            # Rank 0 hosts the store: its node is the first one, or the one a rotation put it on.
            "MASTER_ADDR": self.slurm.node_address(nodes[a.rotate % len(nodes)]),
            "MASTER_PORT": str(free_port()),
        })
        for var in TORCHRUN_VARS:   # not from the job's env: either, see TORCHRUN_VARS
            env.pop(var, None)
        if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
            env["TORCH_FR_BUFFER_SIZE"] = FLIGHTREC_BUFFER    # a hang's name (flightrec)
        self._close_rdzv()
        if cfg.inprocess is not None and cfg.launcher != "torchrun":
            spares = [n for n in self.sup.spares if n not in nodes] if cfg.inprocess.standbys_per_node else []
            self.rdzv = RendezvousHost.for_attempt(cfg.inprocess, nodes, ppn, self.slurm.node_address(nodes[0]),
                                                   clock=self.clock, spares=spares)
            env[protocol.ENV_RDZV_ADDR] = self.rdzv.addr
            self.rdzv_log_at = 0
            self.rdzv_done_at, self.rdzv_ended = None, False
        self.step_name = f"clusterops-train-{a.attempt}"
        self.step_id = None
        command = list(cfg.command) + cfg.plain.resume_argv(resume, hint)
        tasks_per_node = ppn
        if a.rotate and self.rdzv is not None:
            self._record(E.WARNING, {"what": "replay: in-process recovery places the ranks itself; not rotated"})
        if cfg.launcher == "torchrun":
            command, tasks_per_node = torchrun_command(command, cfg.python, len(nodes), ppn, a.rotate), 1
        elif self.rdzv is None:   # one task per rank: each task sets its own RANK... (see rank_env_command)
            command = rank_env_command(command, len(nodes) * ppn, ppn, a.rotate)
        else:   # ranks and standbys; the rendezvous gives the ranks; the step outlives a lost task
            tasks_per_node += cfg.inprocess.standbys_per_node
            self.rdzv_launch = (list(command), dict(env))
        # In-process, the step outlives a lost task (no --kill-on-bad-exit, no --wait) and a lost
        # node (--no-kill: else Slurm ends it everywhere once it marks the node down).
        argv = srun_argv(command, job_name=self.step_name, nodes=nodes, ntasks_per_node=tasks_per_node,
                         cpus_per_task=cfg.cpus_per_task, kill_on_bad_exit=self.rdzv is None,
                         wait_s=cfg.step_wait_s if self.rdzv is None else None, label=True, extra=cfg.srun_args,
                         no_kill=self.rdzv is not None)
        self.train_log = d / "step.log"
        self.progress_reader = (ProgressReader(cfg.plain.progress_regex, self.train_log, d / "heartbeat",
                                               len(nodes) * ppn, cfg.plain.loss_regex)
                                if cfg.plain.progress_regex else None)
        self.train = self.runner.spawn(argv, log_path=str(self.train_log), env=env, cwd=cfg.workdir,
                                       unset=TORCHRUN_VARS)
        self.launched_at = self.clock()
        if self.rdzv is not None:
            self._start_spare_standbys(self.rdzv.membership.spares)
        save_memory(cfg.job_dir, self.sup.memory)   # attempts survive even a lost batch host
        # Mode 0600: the heartbeat address in it carries the attempt's token.
        protocol.write_private(d / "command.txt", (shlex.join(argv) + "\n" + "".join(
            f"{k}={env[k]}\n" for k in sorted(env) if k.startswith("CLUSTEROPS_") or k.startswith("MASTER_"))).encode())
        self._do(self.sup.handle(sv.StepLaunched(self.clock(), None)))

    def _step_exited(self, now: float, rc: int) -> sv.StepExited:
        text = ""
        try:
            text = self.train_log.read_text(errors="replace")
        except OSError:
            pass
        tasks, lost = parse_srun_failures(text)
        failures = [sv.RankFailure(node=t.node, rank=t.rank, reason=t.reason) for t in tasks]
        # What the ranks said themselves (srun --label: "RANK: text"): a traceback's last line,
        # a CUDA/NCCL error. A dying rank's words are at the end of a long log: read its tail.
        said = read_task_output(text[-STEP_LOG_TAIL_CHARS:])
        if self.attempt_dir is not None:
            # The SDK's exception hook wrote the error line itself: it counts when srun
            # dropped the dying task's last stderr as it ended the step.
            for rank, line in protocol.read_errors(protocol.heartbeat_dir(self.attempt_dir)).items():
                got = said.get(rank)
                if got is None or not got.error:
                    said[rank] = TaskOutput(line, got.sign if got is not None else None)
        if self.rdzv is not None:
            self._poll_rdzv()
            healed = self.rdzv.membership.lost_tasks()
            gone = self.rdzv.membership.gone_nodes()  # nodes with no process left, their ranks healed
            if self.rdzv.finished and (self.rdzv_ended or set(lost) <= gone and all(
                    f.rank in healed or f.node in gone for f in failures)):
                # Every rank finished; the only tasks (or nodes) that failed were lost on the
                # way and healed.
                rc, failures, lost = 0, [], []
            self._close_rdzv()
        self.train = None
        self.step_id = None
        ckpt = self._latest_ckpt(deep=False)
        self.seen_ckpt = ckpt
        stopped_by = None
        if rc == 0 and not failures:
            stopped_by = self._external_stop(text)
        named = protocol.read_suspects(protocol.heartbeat_dir(self.attempt_dir)) if self.attempt_dir else {}
        replay = (protocol.read_replay_reports(protocol.heartbeat_dir(self.attempt_dir))
                  if self.attempt_dir and self.sup.replay is not None else {})
        return sv.StepExited(now, returncode=rc, failures=tuple(failures), ckpt_step=ckpt, replay=replay,
                             node_failure=tuple(lost), stopped_by=stopped_by,
                             task_output={t: o for t, o in said.items() if t in {f.rank for f in failures}},
                             suspect_nodes=tuple(named.get("nodes") or ()),
                             suspect_ranks=tuple(named.get("ranks") or ()))

    def _poll_rdzv(self) -> None:
        """The in-process rendezvous's records into the timeline; its fallback kills the step
        (the state machine then relaunches it as after any failure)."""
        try:   # srun names a task that ended as soon as it ends: the death of a rank, for every node
            with open(self.train_log, "rb") as f:
                f.seek(self.rdzv_log_at)
                chunk = f.read()
        except OSError:
            chunk = b""
        if b"\n" in chunk:
            chunk = chunk[:chunk.rindex(b"\n") + 1]
            self.rdzv_log_at += len(chunk)
            tasks, _ = parse_srun_failures(chunk.decode(errors="replace"))
            for t in tasks:
                self.rdzv.task_ended(t.rank, t.node, t.reason)
        for note in self.rdzv.drain_notes():
            self._record(E(note.kind) if note.kind in E._value2member_map_ else E.WARNING, note.data)
            moved = tuple((int(m["rank"]), str(m["from"]), str(m["to"])) for m in note.data.get("replaced", ())
                          if note.kind == E.INPROC_RENDEZVOUS and m["from"] != m["to"])
            if moved:   # ranks went to other nodes: the state machine's picture of the step follows
                plan = self.rdzv.membership.plan
                holding = sorted({self.rdzv.membership.procs[u].node for u in plan.ranks} if plan else ())
                self._do(self.sup.handle(sv.RanksMoved(self.clock(), moved, tuple(holding))))
        for want in self.rdzv.drain_refills():
            self._start_standby(want.node, want.used)
        self._end_finished_step()
        if self.rdzv.fallback and not self.rdzv.fallback_acted and self.train is not None:
            self.rdzv.fallback_acted = True
            self._act_kill_step(sv.KillStep(f"in-process recovery fell back: {self.rdzv.fallback}"))

    def _start_standby(self, node: str, used: str) -> None:
        """A new warm standby on ``node`` in the used one's place: the training step's command
        and environment, as one task of a step of its own that overlaps the training step
        (the training step's task count is fixed once it runs). It says hello to the
        rendezvous like any standby and joins the pool; it ends when the training does."""
        if self.rdzv_launch is None or self.attempt_dir is None or node not in self.sup.active:
            return
        command, env = self.rdzv_launch
        k = len(self.standby_steps) + 1
        argv = standby_step_argv(command, node, job_name=f"{self.step_name}-standby-{k}", jobid=self.cfg.job_id,
                                 cpus_per_task=self.cfg.cpus_per_task, extra=self.cfg.srun_args)
        log_path = self.attempt_dir / f"standby-{k}.log"
        try:
            self.standby_steps.append(self.runner.spawn(argv, log_path=str(log_path), env=env, cwd=self.cfg.workdir,
                                                        unset=TORCHRUN_VARS))
        except ClusteropsError as e:
            self._record(E.WARNING, {"what": f"in-process: no new standby on {node}: {e}"})
            return
        self._record(E.INPROC_REFILL, {"node": node, "used": used, "step_name": f"{self.step_name}-standby-{k}",
                                       "log": log_path.name})

    def _end_finished_step(self) -> None:
        """Every rank finished, but a node of the step was lost whole: srun (``--no-kill``)
        waits for that node's tasks, which never end. Give it FINISHED_STEP_GRACE_S to end by
        itself, then end it; the step reads as finished (``_step_exited``)."""
        m = self.rdzv.membership
        if not m.finished or self.train is None or self.rdzv_ended:
            return
        gone = m.gone_nodes()
        if not gone:
            return
        now = self.clock()
        if self.rdzv_done_at is None:
            self.rdzv_done_at = now
        elif now - self.rdzv_done_at >= FINISHED_STEP_GRACE_S and self.train.poll() is None:
            self.rdzv_ended = True
            self._record(E.WARNING, {"what": f"in-process: every rank finished; the step's tasks on lost "
                                             f"node(s) {', '.join(sorted(gone))} never end (srun "
                                             f"--no-kill): step ended"})
            kill_group(self.train, signal.SIGTERM)

    def _start_spare_standbys(self, spares: Sequence[str]) -> None:
        """Warm standbys on the spare nodes (``standbys_per_node`` each, a step a node): a rank
        lost with its node goes to one of them in-process."""
        if not spares or self.rdzv_launch is None or self.attempt_dir is None:
            return
        command, env = self.rdzv_launch
        started = []
        for node in spares:
            name = f"{self.step_name}-spare-{node}"
            argv = standby_step_argv(command, node, job_name=name, jobid=self.cfg.job_id,
                                     cpus_per_task=self.cfg.cpus_per_task, extra=self.cfg.srun_args,
                                     ntasks=self.cfg.inprocess.standbys_per_node)
            try:
                self.standby_steps.append(self.runner.spawn(argv, log_path=str(self.attempt_dir / f"spare-{node}.log"),
                                                            env=env, cwd=self.cfg.workdir, unset=TORCHRUN_VARS))
            except ClusteropsError as e:
                self._record(E.WARNING, {"what": f"in-process: no standby on spare {node}: {e}"})
                continue
            started.append(node)
        if started:
            self._record(E.INPROC_SPARES, {"nodes": started, "per_node": self.cfg.inprocess.standbys_per_node})

    def _close_rdzv(self) -> None:
        if self.rdzv is not None:
            self.rdzv.close()
            self.rdzv = None
        # The standbys of their own steps see the training end (or the store go) and exit;
        # one that has not is ended with its srun.
        for p in self.standby_steps:
            if p.poll() is None:
                kill_group(p, signal.SIGTERM)
        self.standby_steps = []
        self.rdzv_launch = None

    def _external_stop(self, step_log: str) -> Optional[str]:
        """Did the ranks stop on a request that did not come through us?

        Slurm's preemption SIGTERMs the steps' tasks but not the batch script (seen on
        22.05): the ranks save and exit 0, which must not read as "finished". Slurm marks
        such a job with a PreemptTime; the SDK's stopped marker (or, from a script without
        it, rank 0's "stopped" output line; see clusterops.protocol) is the training's own word.
        """
        if getattr(self._job_info(), "preempt_time", None):
            return sv.StopReason.PREEMPTION
        if protocol.training_stopped(self.attempt_dir, step_log):
            return sv.StopReason.SIGNAL
        return None

    def _job_info(self):
        """Slurm's record of this job, or None (no job id, or the controller did not answer)."""
        if not self.cfg.job_id:
            return None
        try:
            return self.slurm.job(self.cfg.slurm_job)
        except ClusteropsError:
            return None

    def _lead_passed(self, info, now: float) -> bool:
        """The time limit is ``signal_lead_s`` or less away by Slurm's end time, and no lead
        signal came. Slurm sends it once: one that came before any handler was in (while
        ``clusterops supervise`` started, with the batch script's ignoring it meanwhile) is
        lost, and without this the job would run into its time limit unsaved."""
        end = getattr(info, "end_time", None)
        lead = self.cfg.signal_lead_s
        return bool(lead and not self.lead_seen and isinstance(end, (int, float)) and end - now <= lead)

    def _missed_lead(self) -> str:
        self.lead_seen = True
        self._record(E.WARNING, {"what": f"the time limit is {self.cfg.signal_lead_s} s or less away by Slurm's "
                                         "end time and no lead signal reached the supervisor: stopping as if it had"})
        return sv.StopReason.TIME_LIMIT

    def _find_step_id(self) -> Optional[str]:
        if self.step_id or not self.cfg.job_id or not self.step_name:
            return self.step_id
        try:
            steps = self.slurm.steps(self.cfg.job_id)
        except ClusteropsError:
            return None
        for step_id, name in steps:
            if name == self.step_name:
                self.step_id = step_id
        return self.step_id

    def _signal_step(self, sig: str) -> bool:
        step = self._find_step_id()
        if step is None:
            return False
        try:
            self.slurm.cancel(self.cfg.job_id, signal=sig, step=int(step))
            return True
        except ClusteropsError as e:
            self._record(E.WARNING, {"what": f"scancel --signal={sig} {self.cfg.job_id}.{step}: {e}"})
            return False

    def _act_kill_step(self, a: sv.KillStep) -> None:
        if self.train is None:
            return
        if a.force or not self._signal_step("KILL"):
            # No step id (outside Slurm, or the controller is unreachable): kill srun;
            # its tasks go with it (srun's exit ends the step).
            kill_group(self.train)

    def _name_the_hang(self) -> Tuple[int, ...]:
        """Ask every rank for its flight recorder (a dump request in the beacons, answered by
        each rank's watch thread), wait for the answers (bounded), and tell the machine which
        rank never entered the collective the others wait in (clusterops.supervisor.flightrec).
        Returns the ranks named and the ranks that sent no dump (their stacks are taken too)."""
        from clusterops.supervisor.flightrec import name_hang

        if self.channel is None or self.attempt_dir is None:
            return ()
        request = self.channel.request_dump()
        if request is None:
            return ()
        hb = protocol.heartbeat_dir(self.attempt_dir)
        ranks = list(range(self.sup.expected_ranks))
        deadline = self.clock() + min(FLIGHTREC_WAIT_S, self.cfg.stacks_timeout_s)
        dumps = protocol.read_flightrecs(hb, request)
        while len(dumps) < len(ranks) and self.clock() < deadline:
            self.sleep(0.25)
            dumps = protocol.read_flightrecs(hb, request)
        n = name_hang(dumps, ranks)
        named, why, source, ras = n.ranks, n.why, "flight_recorder", ""
        r = self._ask_nccl_ras(dumps)
        if r is not None:
            ras = f"{', '.join(map(str, r.ranks)) or 'nobody'}: {r.why}"
            if not named and r.ranks:
                named, why, source = r.ranks, r.why, "nccl_ras"
        self._do(self.sup.handle(sv.HangNamed(self.clock(), named, why, n.silent, source=source, ras=ras)))
        return tuple(named) + tuple(n.silent)

    def _domains(self) -> Dict[str, str]:
        """The allocation's nodes -> topology domain (Slurm's block or leaf switch), read once
        at start; a replacement comes from the lost node's domain first. {} without a
        topology, when there is no Slurm job, or when the read fails (said in the timeline:
        replacements then go in allocation order). A node whose check later names its NVLink
        domain (``fabric_of``) takes that one instead (the machine's ``_take_fabric``)."""
        if not self.cfg.job_id or len(self.cfg.nodes) < 2:
            return {}
        try:
            topo = self.slurm.topology()
        except (ClusteropsError, ValueError) as e:
            self._record(E.WARNING, {"what": f"scontrol show topology: {e}; spares in allocation order"})
            return {}
        doms = {n: topo[n] for n in self.cfg.nodes if n in topo}
        if doms:
            self._record(E.TOPOLOGY, {"domains": doms, "source": DomainSource.SLURM})
        return doms

    def _ask_nccl_ras(self, dumps: Mapping[int, Mapping]):
        """NCCL's RAS report on the hang (clusterops.supervisor.ncclras), matched to this job by
        the process ids in the ranks' dumps; None without a JSON report from a RAS listener
        (gloo, NCCL before 2.24 or RAS off: the port refuses at once). The raw answer goes to
        the attempt's directory for a person."""
        from clusterops.supervisor import ncclras

        pids = [int(d["pid"]) for d in dumps.values() if isinstance(d.get("pid"), int)]
        naming, raw = ncclras.ask(os.environ, pids)
        if raw is not None and self.attempt_dir is not None:
            try:
                (self.attempt_dir / "ncclras.txt").write_text(raw)
            except OSError:
                pass
        return naming

    def _act_capture_stacks(self, a: sv.CaptureStacks) -> None:
        """The hung ranks' flight recorders (who never entered the collective), then py-spy
        dumps of the stuck ranks, all nodes at once, bounded in time (then the kill)."""
        if self.attempt_dir is None or not self.cfg.job_id:
            return
        extra: Tuple[int, ...] = ()
        try:
            extra = self._name_the_hang()
        except (OSError, ClusteropsError) as e:
            self._record(E.WARNING, {"what": f"flight-recorder dumps: {e}"})
        step = self._find_step_id()
        out = self.attempt_dir / "stacks"
        out.mkdir(exist_ok=True)
        procs = {}
        # The stale ranks, and those the dumps named or that sent none (a stopped process
        # answers nothing: often the one that hangs the rest, though not the first gone stale).
        wanted = sorted(set(a.ranks) | set(extra))
        nodes = sorted({self.sup.rank_node(r) for r in wanted if self.sup.rank_node(r)})
        for node in nodes:
            ranks = [r for r in wanted if self.sup.rank_node(r) == node]
            command = [self.cfg.python, "-m", "clusterops.supervisor.stacks", "--job", self.cfg.job_id,
                       "--step", str(step if step is not None else ""), "--ranks", ",".join(map(str, ranks))]
            argv = srun_argv(command, job_name="clusterops-stacks", jobid=self.cfg.job_id, overlap=True,
                             nodes=[node], ntasks=1, output=f"{out}/{node}.txt")
            try:
                procs[node] = (self.runner.spawn(argv, log_path=str(out / f"{node}.srun.log")), ranks)
            except ClusteropsError as e:
                self._record(E.WARNING, {"what": f"stack capture on {node}: {e.message}"})
        deadline = self.clock() + self.cfg.stacks_timeout_s
        while any(p.poll() is None for p, _ in procs.values()) and self.clock() < deadline:
            self.sleep(0.2)
        for node, (p, ranks) in procs.items():
            if p.poll() is None:
                kill_group(p)
                p.wait()
        self._record(E.STACKS, {"nodes": nodes, "dir": str(out),
                                "complete": all(p.returncode == 0 for p, _ in procs.values())})

    def _act_request_stop(self, a: sv.RequestStop) -> None:
        if self.cfg.plain.active:
            # No SDK: the stop is the launcher's lead-time signal, which such a script
            # handles (save, exit 0) as it would without a supervisor. Sent to the step
            # (the ranks), never to srun, and only once every rank has shown progress:
            # before that a rank may not have its handler yet (USR1's default kills).
            beats = protocol.read_heartbeats(protocol.heartbeat_dir(self.attempt_dir)) if self.attempt_dir else {}
            if len(beats) >= self.sup.expected_ranks:
                self._signal_step("USR1")
            return
        if self.stop_file is not None:
            self.stop_file.touch()
        # SIGUSR2 (a signal NCCL does not use; the SDK treats it as a stop request) only
        # once every rank has beaten: before that a rank may not have its handler yet and
        # USR2's default action would kill it. The stop file reaches those ranks anyway.
        beats = self.channel.snapshot(self.sup.expected_ranks) if self.channel is not None else {}
        if len(beats) < self.sup.expected_ranks:
            return
        # Never signal srun itself: srun 22.05 dies of a USR2 it does not forward, and a dead
        # srun takes the step with it before the ranks have saved. The stop file remains.
        self._signal_step("USR2")

    def _act_drain_nodes(self, a: sv.DrainNodes) -> None:
        """Drain through ``drain_apply.apply_drain``, as every drain path does: a node drained
        or down with someone else's reason, or already carrying a clusterops drain, keeps its
        reason (``drain_skipped``: the reason decides who may lift it); past the site's
        max_drained_fraction of a partition the drain is refused, or lifted again when many
        nodes drained at once (``drain_refused``). The node stays out of this job's steps
        either way (the supervisor marked it bad before asking)."""
        from clusterops import drain_apply as da

        for node in a.nodes:
            try:
                out = da.apply_drain(self.slurm, node, a.reason, self._guard_settings(), sleep=self.sleep)
            except ClusteropsError as e:
                self._record(E.WARNING, {"what": f"drain {node} failed: {e.message}"})
                continue
            if out.action == da.KEPT:
                self._record(E.DRAIN_SKIPPED, {"node": node, "why": out.why})
            elif out.action in (da.REFUSED, da.UNDONE):
                why = out.why
                if "Slurm refused" in why:
                    why = f"user {current_user()}: {why}"
                self._record(E.DRAIN_REFUSED, {"node": node, "reason": a.reason, "why": why})
            elif out.action == da.DRAINED:
                self._record(E.DRAIN, {"node": node, "reason": a.reason})
                if not out.ok:
                    self._record(E.WARNING, {"what": f"drain {node}: {out.why}"})
            else:
                self._record(E.WARNING, {"what": out.why})

    def _guard_settings(self) -> drains.GuardSettings:
        if self.guard is None:
            from clusterops.health import drain_settings

            self.guard = drain_settings(None)   # $CLUSTEROPS_HEALTH_SITE, $CLUSTEROPS_MAX_DRAINED_FRACTION
        return self.guard

    def _notify(self, event: str, summary: str, details: Dict[str, object], wait_s: float) -> None:
        """Tell the webhooks (the health site config's ``notify:`` and the job spec's
        ``notify:`` URLs); never blocks the job for longer than ``wait_s`` and never fails
        it: a broken webhook is a warning in the timeline."""
        try:
            from clusterops import notify
            from clusterops.health.profiles import SITE_ENV

            if self.notifier is None:
                targets = notify.load_config(os.environ.get(SITE_ENV))   # the site's webhooks
                targets += notify.parse_targets(list(self.cfg.notify_urls), "job spec: notify")
                self.notifier = notify.Notifier(targets)
            if not self.notifier.targets:
                return
            from clusterops.supervisor.timeline import load, summary as tl_summary

            details = dict(details, job_id=self.cfg.job_id, job_dir=str(self.cfg.job_dir),
                           timeline=tl_summary(load(self.cfg.job_dir)[0]))
            self.notifier.send(event, summary, details)
            for d in self.notifier.close(max_wait_s=wait_s):
                if not d.ok:
                    self._record(E.WARNING, {"what": f"notify {event}: {d.error}"})
            self.notifier = None
        except Exception as e:  # noqa: BLE001 - a notification must never take the job down
            self._record(E.WARNING, {"what": f"notify {event}: {type(e).__name__}: {e}"})

    def _act_requeue(self, a: sv.Requeue) -> None:
        save_memory(self.cfg.job_dir, self.sup.memory)
        if not self.cfg.job_id:
            raise ClusteropsError("not in a Slurm job: nothing to requeue")
        # ExcNodeList is read now, while nothing is ending, so that only the update is left
        # for the short window after the requeue; and the exclusion is checked against the
        # partition first: a requeued job kept off too many of its nodes would pend for ever.
        current = None
        exclude = tuple(a.exclude)
        if exclude:
            current, exclude = self._schedulable(a)
        self._notify("job_requeued", f"job {self.cfg.job_id} requeued: {a.reason}",
                     {"reason": a.reason, "exclude": list(exclude)}, wait_s=5.0)
        # ExcNodeList cannot be changed on a running job (Slurm: "Job is no longer pending
        # execution"), but it can once the requeue has made the job pending again, in the
        # seconds (KillWait) before Slurm ends this process: set it then (see
        # slurm.api.exclude_from_requeued), so Slurm itself keeps the next incarnation off the
        # bad nodes without draining them. The bad nodes are also remembered in the job
        # directory (the next incarnation keeps them out of its steps should the update be
        # lost) and drained when the policy says so.
        signals_before = len(self.signals)
        self.requeue_asked = True
        # Slurm ends this process soon after the requeue: the trackers' runs are closed first.
        self._close_trackers("requeue", wait_s=30.0)
        try:
            self.slurm.requeue(self.cfg.slurm_job)
        except ClusteropsError as e:
            # Slurm ends the batch step as it requeues, scontrol with it: seen on 24.11,
            # `scontrol requeue` killed by SIGTERM after the controller had taken the requeue
            # (and a controller that answers late may time a requeue out that it then does).
            # Ask Slurm whether the job was requeued before calling it a failure.
            if not self._requeue_taken():
                raise
            self._record(E.WARNING, {"what": f"scontrol requeue reported {e.message}, "
                                             "but Slurm has requeued the job"})
        if exclude and current is not None:
            try:
                # Let the requeue's SIGTERM come first (it is caught: self.signals), so that it
                # does not kill the update itself; the update is retried should it still do.
                waited = 0.0
                while len(self.signals) == signals_before and waited < REQUEUE_SIGTERM_WAIT_S:
                    self.sleep(0.05)
                    waited += 0.05
                set_to = exclude_from_requeued(self.slurm, self.cfg.slurm_job, exclude, current, sleep=self.sleep)
                if set_to is not None:
                    self.echo(f"[clusterops supervise] requeued job's ExcNodeList set to {set_to}")
            except ClusteropsError as e:
                self._record(E.WARNING, {"what": f"ExcNodeList={','.join(exclude)} not set on the requeued "
                                                 f"job ({e.message}); the next incarnation keeps them out of "
                                                 "its steps"})
        # Slurm now ends this batch script; wait for it rather than racing it.
        deadline = self.clock() + 120
        while self.clock() < deadline:
            self.sleep(1)
        raise ClusteropsError("the job was requeued but this process was not ended by Slurm")

    def _schedulable(self, a: sv.Requeue) -> Tuple[Optional[str], Tuple[str, ...]]:
        """(the job's ExcNodeList now, the nodes to add to it) for the requeue ``a``: its
        exclusion, less the nodes only Slurm lost when the partition could not start the job
        without them (schedulable_exclusion). Raises UnschedulableExclusion when even that is
        too many: the job is not requeued (exit 6). A controller that cannot be read does not
        stop the requeue: a job that cannot be read gives None, and the ExcNodeList update is
        then skipped (the next incarnation keeps the nodes out of its steps); a partition that
        cannot be read leaves the exclusion unchecked."""
        try:
            info = self.slurm.job(self.cfg.slurm_job)
        except ClusteropsError as e:
            self._record(E.WARNING, {"what": f"reading ExcNodeList before the requeue: {e.message}"})
            return None, tuple(a.exclude)
        parts = [p for p in (info.partition or "").split(",") if p]
        members: set = set()
        try:
            for part in parts:
                members.update(self.slurm.partition_nodes(part))
        except ClusteropsError as e:
            self._record(E.WARNING, {"what": f"reading partition {info.partition} before the requeue: {e.message}; "
                                             "the exclusion is not checked against it"})
            return info.excluded_nodes, tuple(a.exclude)
        if not members:
            return info.excluded_nodes, tuple(a.exclude)
        exclude, dropped = schedulable_exclusion(members, info.excluded_nodes, a.exclude, a.lost,
                                                 len(self.cfg.nodes), info.partition)
        if dropped:
            self._record(E.WARNING, {"what": f"{', '.join(dropped)} not excluded from the requeued job: only Slurm "
                                             f"lost them (it keeps them out while they are down), and partition "
                                             f"{info.partition} could not start the job without them",
                                     "nodes": list(dropped)})
        return info.excluded_nodes, exclude

    def _final_exit_no_requeue(self) -> None:
        """Before a non-zero exit that ends this job (a give-up, a chain's end, a crash of the
        supervisor itself): with --requeue=expedite, Slurm 25.11 requeues a batch script that
        exits non-zero, held ("job requeued in held state", slurmctld's job_mgr.c), unless the
        job's Requeue is off; a lone job would then sit held in the queue, and a chain's
        generation would come back after the chain ended. So Requeue=0 first (a job's owner
        may change it while it runs). Not after this process asked for the requeue itself, nor
        for an exit 0 (the job completes either way). A failed update is said and left: the
        job is then held, not run."""
        if not (self.cfg.expedited_requeue and self.cfg.job_id) or self.exit_code == sv.EXIT_DONE \
                or self.requeue_asked:
            return
        try:
            self.slurm.update_job(self.cfg.slurm_job, Requeue=0)
            self._record(E.REQUEUE_OFF, {"exit_code": self.exit_code})
        except ClusteropsError as e:
            self._record(E.WARNING, {"what": f"Requeue=0 before the final exit failed ({e.message}): Slurm's "
                                             f"expedited requeue will hold job {self.cfg.job_id}; scancel it"})

    def _requeue_taken(self) -> bool:
        """Whether Slurm has requeued this job: its restart count has moved past this
        incarnation's, or it is pending again or flagged REQUEUED. False when it cannot be
        read (then the requeue counts as failed, as before)."""
        try:
            info = self.slurm.job(self.cfg.slurm_job)
        except ClusteropsError:
            return False
        return (info.restart_count > self.cfg.slurm_restart_count or info.state.startswith("PENDING")
                or any(f.startswith("REQUEUE") for f in (info.state, *info.state_flags)))

    def _act_exit(self, a: sv.Exit) -> None:
        save_memory(self.cfg.job_dir, self.sup.memory)
        if a.code in (sv.EXIT_DIVERGED, sv.EXIT_ROLLBACK_BUDGET):
            self._notify("job_diverged", f"job {self.cfg.job_id} diverged (exit {a.code}): {a.reason}",
                         {"exit_code": a.code, "reason": a.reason}, wait_s=10.0)
        elif a.code != sv.EXIT_DONE:
            self._notify("job_given_up", f"job {self.cfg.job_id} gave up (exit {a.code}): {a.reason}",
                         {"exit_code": a.code, "reason": a.reason, **({"error": a.error} if a.error else {})},
                         wait_s=10.0)
        if self.cfg.chain is not None and chainmod.is_final(a.code):
            self._chain_end(a.code, a.reason)
        self._write_metrics()
        self.exit_code = a.code

    def _poll_nodes(self, now: float) -> Optional[sv.Event]:
        try:
            infos = self.slurm.nodes(self.cfg.nodes)
        except ClusteropsError as e:
            # A flaky controller is normal: back off, and say so after a few misses.
            self.node_poll_failures += 1
            self.next_node_poll = now + Backoff(self.cfg.node_poll_s, cap_s=60.0).delay(self.node_poll_failures)
            if self.node_poll_failures in (3, 10):
                self._record("warning", {"what": f"node poll failed {self.node_poll_failures} times: {e.message}"})
            return None
        self.node_poll_failures = 0
        self.next_node_poll = now + self.cfg.node_poll_s
        if self.train is not None and not (self.preempt_seen and self.lead_seen):
            info = self._job_info()
            if not self.preempt_seen and getattr(info, "preempt_time", None):
                # Selected for preemption: the ranks have SIGTERM already; make it our stop.
                self.preempt_seen = True
                self.signals.append("preemption")
            if self._lead_passed(info, now):
                self.signals.append(self._missed_lead())
        down = {n.name: (n.state + ("+" + "+".join(sorted(n.flags)) if n.flags else ""))
                for n in infos if n.is_down}
        # Drained by someone else (a reason clusterops did not write): the same read, no other.
        drained = {n.name: n.reason or "" for n in infos
                   if n.drained and not n.is_down and drains.is_foreign(n.reason)}
        return sv.NodesDown(now, down, drained) if down or drained else None
