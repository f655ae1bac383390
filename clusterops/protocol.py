"""The contract between a training process and the supervisor that runs it.

``clusterops supervise`` (:mod:`clusterops.supervisor.run`) starts the training step
and watches it; the training script talks back through :mod:`clusterops.sdk`. Both
sides spell the contract only through this module. It is environment variables the
supervisor sets for every rank, and files in the job directory:

=============================  ===============================================================
variable                       meaning for the training process
=============================  ===============================================================
``CLUSTEROPS_CKPT_DIR``        the checkpoint root (``sdk.save``/``sdk.resume`` use it)
``CLUSTEROPS_RESUME_FROM``     the checkpoint to resume from, hash-checked by the supervisor
                               just before the launch; empty: the latest good one
``CLUSTEROPS_HEARTBEAT_DIR``   where each rank writes its heartbeat file, and rank 0 the
                               stopped marker
``CLUSTEROPS_STOP_FILE``       a path whose existence asks the ranks to save and stop
                               (SIGUSR2 and SIGTERM ask the same)
``CLUSTEROPS_RESTART_COUNT``   restarts before this attempt (in the allocation and across
                               requeues)
``CLUSTEROPS_HEARTBEAT_ADDR``  the heartbeat channel: ``HOST:PORT/TOKEN`` (UDP datagrams to the
                               supervisor, one per node and interval, see
                               :mod:`clusterops.heartbeat`: per rank the step, its age, the
                               mean step time and, optionally, the mean busy time per step
                               -- time in ``sdk.compute()`` -- for straggler detection),
                               ``file/TOKEN`` (one file per node in the heartbeat directory), or
                               empty/unset (one file per rank)
``CLUSTEROPS_RESUME_HINT``     what the supervisor decided for this resume (JSON: ``from_step``,
                               ``skip_batches``, ``lr_factor``, ``reason``, ``anomaly_step``,
                               ``rollback``; :class:`clusterops.supervisor.stability.ResumeHint`),
                               set only when the attempt resumes from a stability rollback's
                               checkpoint; ``sdk.resume().hint``
``CLUSTEROPS_RDZV_ADDR``       in-process recovery (``supervise: inprocess:``): the rendezvous
                               store the supervisor hosts, ``HOST:PORT/TOKEN`` (a
                               ``torch.distributed.TCPStore``; TOKEN is the attempt's secret:
                               every value is sealed with it, see :func:`rdzv_key` and
                               :mod:`clusterops.rdzvstore`; keep it as private as the
                               heartbeat token); empty or unset: no in-process recovery
``CLUSTEROPS_REPLAY``          a replay of an anomaly (``on_nan``/``on_spike: replay``): JSON
                               ``{"from_step", "until"}``; the SDK saves nothing, records each
                               step's loss, writes its replay report at step ``until`` and ends
                               the process (exit 0); empty or unset: an ordinary attempt
=============================  ===============================================================

All are optional for the training script: without them it trains, saves where told
and never hears a stop file. :data:`CONTRACT_ENV` is exactly this set (a test checks
that no other module of ``clusterops/`` spells these names). Other ``CLUSTEROPS_*``
variables (``CLUSTEROPS_SLURM_*``, ``CLUSTEROPS_HEALTH_SITE``, ``CLUSTEROPS_CKPT_FAULT``,
...) are settings of one part, not this contract.

Files, per attempt of the training step (``<job_dir>/attempt-<N>/``)::

    heartbeat/rank<R>   rank R's last step, as text ("12\\n"); its mtime is the rank's last
                        progress. Written atomically (a hidden temporary, then rename),
                        at most about once a second. Only without a heartbeat address.
    heartbeat/node-<N>  node N's heartbeat datagram (the same bytes the network channel
                        sends; its mtime is the send time), written atomically by one rank
                        of the node per interval: the file fallback of the node channel.
                        Mode 0600, as every file that may hold the token (:func:`write_private`).
    heartbeat/stopped   the stopped marker: one JSON object {"step", "path", "reason"},
                        written atomically by rank 0 when the script says it stops on a
                        request before its end (``sdk.mark_stopped``, after the save
                        that honours the stop).
    stop                created by the supervisor to request a stop.
    heartbeat/nonfinite/rank<R>.json
                        rank R's first non-finite loss or grad norm of the attempt
                        (``{"step", "node", "value"}``), written once by the SDK when it
                        sees it: which node's ranks went non-finite first.
    heartbeat/replay/rank<R>.json
                        a replay's report from rank R (:data:`ENV_REPLAY`): ``{"reached",
                        "first_nonfinite", "node", "losses": {step: loss}}``.

The supervisor reads a step that exits 0 as "stopped on request", not "finished", when
the stopped marker exists; a rank-0 output line ``stopped step=N ...`` (what
``examples/train.py`` prints, :func:`stopped_line`) counts as a fallback for scripts
that do not call ``sdk.mark_stopped``.

Standard library only: both the SDK and the supervisor import it at start.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

# ------------------------------------------------------------------------ environment

ENV_CKPT_DIR = "CLUSTEROPS_CKPT_DIR"
ENV_RESUME_FROM = "CLUSTEROPS_RESUME_FROM"
ENV_HEARTBEAT_DIR = "CLUSTEROPS_HEARTBEAT_DIR"
ENV_STOP_FILE = "CLUSTEROPS_STOP_FILE"
ENV_RESTART_COUNT = "CLUSTEROPS_RESTART_COUNT"
ENV_HEARTBEAT_ADDR = "CLUSTEROPS_HEARTBEAT_ADDR"
ENV_RESUME_HINT = "CLUSTEROPS_RESUME_HINT"
ENV_RDZV_ADDR = "CLUSTEROPS_RDZV_ADDR"
ENV_REPLICA_CHECK_EVERY = "CLUSTEROPS_REPLICA_CHECK_EVERY"
ENV_REPLAY = "CLUSTEROPS_REPLAY"

#: Every variable of the contract, and nothing else.
CONTRACT_ENV = (ENV_CKPT_DIR, ENV_RESUME_FROM, ENV_HEARTBEAT_DIR, ENV_STOP_FILE, ENV_RESTART_COUNT,
                ENV_HEARTBEAT_ADDR, ENV_RESUME_HINT, ENV_RDZV_ADDR, ENV_REPLICA_CHECK_EVERY, ENV_REPLAY)

#: ENV_HEARTBEAT_ADDR's value that selects the per-node file channel (the forced fallback):
#: ``file/TOKEN`` (the supervisor's, a fresh token per attempt, so that the node-local
#: beats of two attempts never share a directory, and nobody without the token can predict
#: that directory). Plain ``file``, without a token, is refused by the node channel
#: (clusterops.heartbeat): the ranks write their per-rank files instead.
HEARTBEAT_ADDR_FILE = "file"


def is_file_addr(addr: str) -> bool:
    """Whether a heartbeat address selects the per-node file channel."""
    return addr == HEARTBEAT_ADDR_FILE or addr.startswith(HEARTBEAT_ADDR_FILE + "/")

# ------------------------------------------------------------------------ resume hint


@dataclass(frozen=True)
class ResumeHint:
    """What the supervisor decided for the script, handed over with the resume (JSON in
    :data:`ENV_RESUME_HINT`; the stability guard's rollback, clusterops.supervisor.stability): continue from checkpoint step ``from_step``, skip the
    next ``skip_batches`` batches of the data position saved in it, and multiply the
    learning rate by ``lr_factor``."""

    from_step: int
    skip_batches: int
    lr_factor: float
    reason: str = "rollback"
    anomaly_step: Optional[int] = None
    rollback: int = 1                # the how-many-th rollback of this job

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Optional["ResumeHint"]:
        """The hint in ``text``; None for an empty or unreadable one (never raises)."""
        try:
            d = json.loads(text) if text else None
            if not isinstance(d, dict):
                return None
            return cls(from_step=int(d["from_step"]), skip_batches=max(0, int(d.get("skip_batches", 0))),
                       lr_factor=float(d.get("lr_factor", 1.0)), reason=str(d.get("reason", "rollback")),
                       anomaly_step=None if d.get("anomaly_step") is None else int(d["anomaly_step"]),
                       rollback=int(d.get("rollback", 1)))
        except (ValueError, TypeError, KeyError):
            return None


# ------------------------------------------------------------------------ rendezvous
# The keys of the in-process rendezvous (clusterops.supervisor.rendezvous hosts the store,
# clusterops.recover is the ranks' side; clusterops.supervisor.membership decides). Every
# value is sealed with the attempt's secret (clusterops.rdzvstore); a value that does not
# open is a stranger's and counts as absent. Keys live under a prefix derived from the secret.
#   rep/n            a counter (a hint, not sealed); a process adds 1 and writes its report as
#                    rep/<n> (JSON {"kind", "uid", ...}: the kinds are membership.Report's)
#   join/<G>         survivors asking for generation G: each appends one sealed line
#                    "UID RANK STEP" (one round trip; the host reads the key from where it
#                    had read it, and takes a line only from the plan's holder of RANK)
#   fail/<G>         the first rank whose collective failed in generation G (compare_set):
#                    only it sends its report (rep/n, with the error)
#   plan/<G>         generation G (JSON, membership.Plan.to_json), written once
#   pg/<G>/...       generation G's process group (init_process_group on the sealed store)
#   kill/<uid>       the standbys of the process's node SIGKILL it (a hung rank), if it is a
#                    process of their own job step named by the current plan
#   abort/<G>        set by the host when generation G begins to be formed (a fault heard):
#                    on NCCL every rank's watcher thread aborts its process group, so a
#                    collective blocked on a lost peer (a hung kernel) returns
#   beat/<node>      a time stamp every process of the node sets at hello and its standbys
#                    renew every RDZV_BEAT_S while they wait: a node whose stamp stops moving
#                    during a recovery is lost whole (the host's RDZV_SILENT_S)
#   finish           the training finished: the standbys exit
RDZV_REPORTS = "rep/n"
RDZV_FINISH = "finish"
RDZV_BEAT_S = 0.25
RDZV_SILENT_S = 3.0


def rdzv_key(kind: str, *parts: object) -> str:
    """A key of the rendezvous store: ``rdzv_key("plan", 3)`` is ``plan/3``."""
    return "/".join([kind, *map(str, parts)])


def rdzv_join_line(uid: str, rank: int, step: int) -> str:
    """A survivor's join record (``join/<G>``, sealed as one line): ``"UID RANK STEP"``."""
    return f"{uid} {int(rank)} {int(step)}"


def parse_rdzv_joins(records: List[str]) -> List[Tuple[str, int, int]]:
    """The (uid, rank, step) of each join record that reads as one (the rest is left out)."""
    out = []
    for rec in records:
        parts = rec.split(" ")
        if len(parts) == 3 and parts[0] and parts[1].isdigit() and parts[2].isdigit():
            out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def rdzv_beat(now: float) -> str:
    """A node's beat value (``beat/<node>``): the time stamp it was set at."""
    return f"{now:.6f}"


def parse_rdzv_beat(value: Optional[bytes]) -> float:
    """The time stamp of a beat value; 0.0 for one that is missing or does not read."""
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0


def parse_rdzv_addr(value: str) -> Tuple[str, int, str]:
    """(host, port, token) of a ``HOST:PORT/TOKEN`` rendezvous address; ValueError otherwise."""
    where, sep, token = value.partition("/")
    host, _, port = where.rpartition(":")
    if not sep or not token or not host or not port.isdigit():
        # the value is not echoed: its TOKEN is the attempt's secret
        raise ValueError(f"{ENV_RDZV_ADDR}: not HOST:PORT/TOKEN")
    return host, int(port), token



# ------------------------------------------------------------------------ layout

def job_dir_for(spec: Mapping, job_id: str) -> Path:
    """The job directory of a job with resolved spec ``spec`` (the JSON ``clusterops launch``
    writes beside the script) and Slurm id ``job_id``: ``supervise.job_dir``, else
    ``<log_dir or workdir>/<name>-<job id>``. The one rule: the supervisor makes the directory
    by it, ``clusterops job status JOBID`` finds it by it."""
    sup = spec.get("supervise") or {}
    base = spec.get("log_dir") or spec.get("workdir") or os.getcwd()
    return Path(sup.get("job_dir") or Path(base) / f"{spec.get('name') or 'job'}-{job_id}")


def ckpt_dir_for(spec: Mapping, job_dir: os.PathLike) -> Path:
    """``supervise.ckpt_dir``, else ``<job dir>/ckpt``."""
    return Path((spec.get("supervise") or {}).get("ckpt_dir") or Path(job_dir) / "ckpt")


ATTEMPT_PREFIX = "attempt-"
HEARTBEAT_DIR = "heartbeat"
HEARTBEAT_PREFIX = "rank"
NODE_HEARTBEAT_PREFIX = "node-"
STOP_FILE = "stop"
STOPPED_MARKER = "stopped"
#: The largest heartbeat datagram (and node file: reading stops past it); clusterops.heartbeat.
MAX_DATAGRAM_BYTES = 60_000

# The fallback: a rank-0 line of the step's output (``srun --label`` prefixes "0: ").
STOPPED_LINE = re.compile(r"^(?:0: )?stopped step=\d+", re.MULTILINE)


def attempt_dir(job_dir: os.PathLike, attempt: int) -> Path:
    """``<job_dir>/attempt-<N>``: everything of one attempt of the training step."""
    return Path(job_dir) / f"{ATTEMPT_PREFIX}{int(attempt)}"


def attempt_number(path: os.PathLike) -> Optional[int]:
    """N of an ``attempt-<N>`` directory, or None for any other name."""
    name = Path(path).name
    digits = name[len(ATTEMPT_PREFIX):]
    return int(digits) if name.startswith(ATTEMPT_PREFIX) and digits.isdigit() else None


def heartbeat_dir(attempt: os.PathLike) -> Path:
    """The heartbeat directory of an attempt directory."""
    return Path(attempt) / HEARTBEAT_DIR


def stop_file(attempt: os.PathLike) -> Path:
    """The stop file of an attempt directory."""
    return Path(attempt) / STOP_FILE


def heartbeat_path(job_dir: os.PathLike, attempt: int, rank: int) -> Path:
    """``<job_dir>/attempt-<N>/heartbeat/rank<R>``."""
    return heartbeat_dir(attempt_dir(job_dir, attempt)) / f"{HEARTBEAT_PREFIX}{int(rank)}"


def rank_env(*, ckpt_dir: os.PathLike, resume_from: str, attempt: os.PathLike, restart_count: int,
             heartbeat_addr: str = "", resume_hint: str = "", rdzv_addr: str = "",
             replica_check_every: int = 0, replay: str = "") -> Dict[str, str]:
    """The contract variables for every rank of an attempt (directory ``attempt``)."""
    return {
        ENV_REPLAY: replay,
        ENV_REPLICA_CHECK_EVERY: str(int(replica_check_every)),
        ENV_RESUME_HINT: resume_hint,
        ENV_CKPT_DIR: str(ckpt_dir),
        ENV_RESUME_FROM: resume_from,
        ENV_HEARTBEAT_DIR: str(heartbeat_dir(attempt)),
        ENV_STOP_FILE: str(stop_file(attempt)),
        ENV_RESTART_COUNT: str(int(restart_count)),
        ENV_HEARTBEAT_ADDR: heartbeat_addr,
        ENV_RDZV_ADDR: rdzv_addr,
    }


# ------------------------------------------------------------------------ heartbeats


#: Mode of every file of the channel (it may carry the attempt's token): the user's alone.
PRIVATE_FILE_MODE = 0o600


def write_private(final: os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``final`` atomically, mode 0600: a temporary of an unpredictable
    name created exclusively (``O_EXCL``, never through a symlink: ``O_NOFOLLOW``), then a
    rename over ``final`` (which replaces a link there rather than following it). OSError
    when it cannot; no temporary is left behind then."""
    final = os.fspath(final)
    head, name = os.path.split(final)
    tmp = os.path.join(head, f".{name}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return Path(final)


def write_heartbeat(hb_dir: os.PathLike, rank: int, step: int) -> Path:
    """Write rank's heartbeat (the step) atomically, mode 0600; OSError when it cannot."""
    return write_private(os.path.join(hb_dir, f"{HEARTBEAT_PREFIX}{int(rank)}"), f"{int(step)}\n".encode())


def write_node_heartbeat(hb_dir: os.PathLike, node: str, payload: bytes) -> Path:
    """Write a node's heartbeat datagram (it carries the attempt's token) as ``node-<node>``
    atomically, mode 0600; OSError when it cannot."""
    return write_private(os.path.join(hb_dir, f"{NODE_HEARTBEAT_PREFIX}{node}"), payload)


def read_heartbeat_files(hb_dir: os.PathLike) -> Tuple[Dict[int, Tuple[int, float]], Dict[str, Tuple[bytes, float]]]:
    """One scan of a heartbeat directory: rank -> (step, mtime) of the ``rank<R>`` files and
    node -> (datagram bytes, mtime) of the ``node-<N>`` files; unreadable ones are absent."""
    beats: Dict[int, Tuple[int, float]] = {}
    nodes: Dict[str, Tuple[bytes, float]] = {}
    try:
        entries = list(os.scandir(hb_dir))
    except FileNotFoundError:
        return beats, nodes
    n, nn = len(HEARTBEAT_PREFIX), len(NODE_HEARTBEAT_PREFIX)
    for e in entries:
        if e.name.startswith(NODE_HEARTBEAT_PREFIX):
            try:     # never through a link; never more than a datagram's size
                fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    mtime = os.fstat(fd).st_mtime
                    nodes[e.name[nn:]] = (os.read(fd, MAX_DATAGRAM_BYTES + 1), mtime)
                finally:
                    os.close(fd)
            except OSError:
                pass
            continue
        if not e.name.startswith(HEARTBEAT_PREFIX) or not e.name[n:].isdigit():
            continue
        try:
            mtime = e.stat().st_mtime
            with open(e.path) as f:
                step = int((f.read().strip() or "0").split()[0])
        except (OSError, ValueError):
            continue
        beats[int(e.name[n:])] = (step, mtime)
    return beats, nodes


def read_heartbeats(hb_dir: os.PathLike) -> Dict[int, Tuple[int, float]]:
    """rank -> (step, mtime) of the per-rank heartbeat files; a rank without one is absent."""
    return read_heartbeat_files(hb_dir)[0]


# ------------------------------------------------------------------------ stopping


def request_stop(path: os.PathLike) -> None:
    """Ask the ranks to stop (create the stop file)."""
    Path(path).touch()


def stop_requested(path: Optional[os.PathLike]) -> bool:
    """Has a stop been requested through the stop file at path (None: no stop file)?"""
    return bool(path) and os.path.exists(path)


def write_stopped(hb_dir: os.PathLike, *, step: Optional[int], path: Optional[os.PathLike], reason: str) -> Path:
    """Write the stopped marker atomically; OSError when it cannot."""
    final = os.path.join(hb_dir, STOPPED_MARKER)
    tmp = os.path.join(hb_dir, f".{STOPPED_MARKER}.tmp")
    body = {"step": None if step is None else int(step), "path": None if path is None else str(path),
            "reason": str(reason)}
    with open(tmp, "w") as f:
        f.write(json.dumps(body) + "\n")
    os.replace(tmp, final)
    return Path(final)


def read_stopped(hb_dir: os.PathLike) -> Optional[dict]:
    """The stopped marker of a heartbeat directory, or None when there is none.

    A marker that exists but cannot be parsed still says "stopped" (an empty dict).
    """
    try:
        with open(os.path.join(hb_dir, STOPPED_MARKER)) as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return {}
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


#: The replica check's latest word (``sdk.check_replicas``), in the heartbeat directory.
REPLICAS_FILE = "replicas"


def write_replicas(hb_dir: os.PathLike, report: Mapping[str, object]) -> Path:
    """The replica check's latest result, atomically and private to the user (0600):
    ``{"step", "agree", "suspects": [rank...], "ambiguous", "ranks", "digests": {digest: [rank...]}}``.
    OSError when it cannot be written."""
    return write_private(os.path.join(hb_dir, REPLICAS_FILE), (json.dumps(dict(report)) + "\n").encode())


def read_replicas(hb_dir: os.PathLike) -> Optional[dict]:
    """The replica check's latest result (None: none yet, or unreadable: a word that cannot be
    read is no evidence of anything)."""
    try:
        with open(os.path.join(hb_dir, REPLICAS_FILE)) as f:
            body = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("step"), int) or not isinstance(body.get("agree"), bool):
        return None
    sus = body.get("suspects")
    if not isinstance(sus, list) or not all(isinstance(r, int) for r in sus):
        return None
    return body


#: A rank's own last words (``sdk``'s exception hook): the last line of the traceback it died
#: of, one small file per rank. srun can drop a dying task's last stderr when it ends the
#: step; the process's own record cannot be dropped that way.
ERRORS_DIR = "errors"


def write_error(hb_dir: os.PathLike, rank: int, line: str) -> Path:
    d = os.path.join(hb_dir, ERRORS_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    return write_private(os.path.join(d, f"rank{int(rank)}"), " ".join(str(line).split())[:300].encode())


def _rank_files(hb_dir: os.PathLike, sub: str, suffix: str, limit: int) -> List[Tuple[int, bytes]]:
    """(rank, first ``limit`` bytes) of each ``rank<R><suffix>`` file in ``hb_dir/sub`` that
    can be read (the per-rank reports below)."""
    d = os.path.join(hb_dir, sub)
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        m = re.fullmatch(r"rank(\d+)" + re.escape(suffix), name)
        if not m:
            continue
        try:
            with open(os.path.join(d, name), "rb") as f:
                out.append((int(m.group(1)), f.read(limit)))
        except OSError:
            continue
    return out


def read_errors(hb_dir: os.PathLike) -> Dict[int, str]:
    """rank -> the last line of the traceback it reported (unreadable files left out)."""
    out: Dict[int, str] = {}
    for rank, data in _rank_files(hb_dir, ERRORS_DIR, "", 400):
        text = data.decode("utf-8", "replace").strip()
        if text:
            out[rank] = text
    return out


#: What a script names as suspect before an exit it maps to ``relaunch_without_suspects``
#: (``sdk.report_suspects``): one JSON file per reporting rank in this directory.
SUSPECTS_DIR = "suspects"


def write_suspects(hb_dir: os.PathLike, rank: int, nodes: List[str], ranks: List[int], why: str) -> Path:
    d = os.path.join(hb_dir, SUSPECTS_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    return write_private(os.path.join(d, f"rank{int(rank)}.json"),
                         json.dumps({"nodes": list(nodes), "ranks": list(ranks), "why": str(why)[:300]}).encode())


def read_suspects(hb_dir: os.PathLike) -> Dict[str, list]:
    """Every reporting rank's suspects, merged: ``{"nodes": [...], "ranks": [...], "why": [...]}``;
    what cannot be read (or is not a name or a rank) is left out."""
    nodes: List[str] = []
    ranks: List[int] = []
    whys: List[str] = []
    for _, data in sorted(_rank_files(hb_dir, SUSPECTS_DIR, ".json", 1 << 16)):
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        nodes += [n for n in doc.get("nodes") or [] if isinstance(n, str) and re.fullmatch(r"[\w.\-]{1,200}", n)
                  and n not in nodes]
        ranks += [r for r in doc.get("ranks") or [] if isinstance(r, int) and not isinstance(r, bool) and r >= 0
                  and r not in ranks]
        if doc.get("why"):
            whys.append(str(doc["why"])[:300])
    return {"nodes": nodes, "ranks": ranks, "why": whys}


#: The ranks' flight-recorder dumps for a hang (one JSON file a rank, in the heartbeat directory).
FLIGHTREC_DIR = "flightrec"


def write_flightrec(hb_dir: os.PathLike, rank: int, doc: Mapping[str, object]) -> Path:
    """One rank's answer to dump request ``doc["request"]`` (0600); OSError when it cannot."""
    d = os.path.join(hb_dir, FLIGHTREC_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    return write_private(os.path.join(d, f"rank{int(rank)}.json"), json.dumps(dict(doc)).encode())


def read_flightrecs(hb_dir: os.PathLike, request: int) -> Dict[int, dict]:
    """rank -> its dump for request ``request`` (older answers and unreadable files left out)."""
    out: Dict[int, dict] = {}
    for rank, data in _rank_files(hb_dir, FLIGHTREC_DIR, ".json", 1 << 22):
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("request") == request:
            out[rank] = doc
    return out


def stopped_line(step: int, path: Optional[os.PathLike], reason: str) -> str:
    """The output line by which a script without the marker says it stopped on request."""
    return f"stopped step={int(step)} path={path} reason={reason}"


def training_stopped(attempt: Optional[os.PathLike], step_log: str = "") -> Optional[str]:
    """How the training said it stopped on request: "marker", "line", or None.

    The marker in the attempt's heartbeat directory is preferred; the ``stopped step=N``
    line in the step's output is the fallback.
    """
    if attempt is not None and read_stopped(heartbeat_dir(attempt)) is not None:
        return "marker"
    if STOPPED_LINE.search(step_log or ""):
        return "line"
    return None


# ------------------------------------------------------------------------ anomaly replay


@dataclass(frozen=True)
class ReplayOrder:
    """What :data:`ENV_REPLAY` tells the ranks: the attempt replays from checkpoint
    ``from_step`` up to step ``until`` (then reports and ends), saving nothing."""

    from_step: int
    until: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Optional[str]) -> Optional["ReplayOrder"]:
        """The order in ``text``; None for an empty one. A malformed one raises ValueError:
        a rank must not train on, saving, when it was told to replay."""
        if not text:
            return None
        try:
            d = json.loads(text)
            order = cls(from_step=int(d["from_step"]), until=int(d["until"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{ENV_REPLAY}={text[:80]!r}: not a replay order ({e})") from None
        return order


NONFINITE_DIR = "nonfinite"
REPLAY_DIR = "replay"


def _value_text(v: float):
    return v if v == v and v not in (float("inf"), float("-inf")) else str(v)


def write_nonfinite(hb_dir: os.PathLike, rank: int, step: int, node: str, value: float) -> Path:
    """Rank ``rank``'s first non-finite loss or grad norm of the attempt (once per process)."""
    d = os.path.join(hb_dir, NONFINITE_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    body = {"step": int(step), "node": str(node)[:200], "value": _value_text(float(value))}
    return write_private(os.path.join(d, f"rank{int(rank)}.json"), json.dumps(body).encode())


def read_nonfinite(hb_dir: os.PathLike) -> Dict[int, Tuple[int, str]]:
    """rank -> (its first non-finite step, its node) of every readable report."""
    out: Dict[int, Tuple[int, str]] = {}
    for rank, data in _rank_files(hb_dir, NONFINITE_DIR, ".json", 4096):
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        step = doc.get("step") if isinstance(doc, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            node = doc.get("node")
            out[rank] = (step, node if isinstance(node, str) else "")
    return out


def write_replay_report(hb_dir: os.PathLike, rank: int, *, reached: int, first_nonfinite: Optional[int],
                        node: str, losses: Mapping[int, float]) -> Path:
    """A replay's report from one rank (:data:`ENV_REPLAY`)."""
    d = os.path.join(hb_dir, REPLAY_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    body = {"reached": int(reached), "first_nonfinite": first_nonfinite, "node": str(node)[:200],
            "losses": {str(int(k)): _value_text(float(v)) for k, v in losses.items()}}
    return write_private(os.path.join(d, f"rank{int(rank)}.json"), json.dumps(body).encode())


def read_replay_reports(hb_dir: os.PathLike) -> Dict[int, dict]:
    """rank -> its replay report (``reached`` an int, ``first_nonfinite`` an int or None,
    ``losses`` a mapping); reports that cannot be read or are not that shape are left out."""
    out: Dict[int, dict] = {}
    for rank, data in _rank_files(hb_dir, REPLAY_DIR, ".json", 1 << 20):
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        reached, first = doc.get("reached"), doc.get("first_nonfinite")
        if not isinstance(reached, int) or isinstance(reached, bool):
            continue
        if first is not None and (not isinstance(first, int) or isinstance(first, bool)):
            continue
        if not isinstance(doc.get("losses", {}), dict):
            continue
        out[rank] = doc
    return out
