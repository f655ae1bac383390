"""NCCL's RAS report on a hang: which rank is missing or behind (NCCL >= 2.24).

NCCL's RAS subsystem (reliability, availability, serviceability) runs a thread in every
NCCL process; the threads watch each other and answer a client on a local TCP port
(``localhost:28028``, or ``NCCL_RAS_ADDR``) with a job-wide view of every communicator:
its ranks, their collective-operation counts, their errors, and the ranks that did not
answer (unresponsive, or considered dead). The supervisor asks it before it kills a hung
step, beside the flight recorder (:mod:`clusterops.supervisor.flightrec`).

- :func:`query` speaks the client protocol (``CLIENT PROTOCOL``, ``TIMEOUT``, ``SET FORMAT
  json``, ``STATUS``; one report, then the server closes) with a bounded wait. A server that
  does not know the JSON format (NCCL before it was added) answers with text: that text is
  kept for a person, and not read.
- :func:`parse` turns the JSON report into :class:`Report` (pure; a malformed report is a
  :class:`ValueError`).
- :func:`name_ranks` names, per communicator of *this job* (one whose ranks' process ids
  include one of the job's ranks': the port is on a shared node, and another user's job can
  hold it), the ranks that are missing from it (no answer: dead or unresponsive) and the
  ranks whose count of some collective is below the others' (they never entered the
  collective the others wait in). A communicator where every rank has the same counts and
  nobody is missing names nobody: the collective itself hangs.

The dev cluster trains with gloo, which has no RAS: the tests drive the parse with reports in
the documented JSON layout and the client against a local server speaking the protocol.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

#: NCCL's default RAS client port (on localhost).
DEFAULT_PORT = 28028
#: How long RAS may wait for its peers' answers (its own default is 5 s): the report must come
#: while the supervisor still holds the hung step.
RAS_TIMEOUT_S = 3.0
#: Reports are a few kB a communicator; more than this is not a RAS report.
MAX_REPORT = 8 << 20


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    pid: int
    counts: Tuple[Tuple[str, int], ...] = ()      # collective -> operations counted
    async_error: int = 0
    missing: bool = False
    dead: bool = False
    unresponsive: bool = False


@dataclass(frozen=True)
class Communicator:
    hash: str
    size: int
    ranks: Tuple[RankInfo, ...]
    missing: Tuple[RankInfo, ...] = ()


@dataclass(frozen=True)
class Report:
    nccl_version: str
    communicators: Tuple[Communicator, ...]
    timeouts: int = 0


@dataclass(frozen=True)
class Naming:
    """What RAS says of this job's hang: the ranks named, one line of why, and the
    communicators read (0: the report was of no communicator of this job)."""

    ranks: Tuple[int, ...] = ()
    why: str = ""
    communicators: int = 0
    foreign: int = 0          # communicators of other processes (not this job's) left out


def _int(v, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _rank(d: Mapping, missing: bool) -> RankInfo:
    if not isinstance(d, Mapping) or _int(d.get("rank")) < 0:
        raise ValueError(f"a rank entry without a rank: {str(d)[:80]}")
    st = d.get("status") if isinstance(d.get("status"), Mapping) else {}
    counts = d.get("collective_counts") if isinstance(d.get("collective_counts"), Mapping) else {}
    return RankInfo(rank=_int(d["rank"]), host=str(d.get("host", "")), pid=_int(d.get("pid")),
                    counts=tuple(sorted((str(k), _int(v, 0)) for k, v in counts.items())),
                    async_error=_int(st.get("async_error"), 0), missing=missing,
                    dead=bool(st.get("considered_dead")), unresponsive=bool(st.get("unresponsive")))


def parse(text: str) -> Report:
    """The JSON report (``SET FORMAT json`` then ``STATUS``) as a :class:`Report`."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not a JSON RAS report: {e}") from None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("communicators"), list):
        raise ValueError("not a RAS report: no communicators list")
    comms = []
    for c in doc["communicators"]:
        if not isinstance(c, Mapping):
            raise ValueError("a communicator that is not an object")
        comms.append(Communicator(hash=str(c.get("hash", "")), size=_int(c.get("size"), 0),
                                  ranks=tuple(_rank(r, False) for r in c.get("ranks") or []),
                                  missing=tuple(_rank(r, True) for r in c.get("missing_ranks") or [])))
    ras = doc.get("ras") if isinstance(doc.get("ras"), Mapping) else {}
    return Report(nccl_version=str(doc.get("nccl_version", "")), communicators=tuple(comms),
                  timeouts=_int(ras.get("timeouts_count"), 0))


def _behind(c: Communicator) -> Dict[int, str]:
    """rank -> why, for the ranks of ``c`` whose count of some collective is below the
    highest count of that collective among the others."""
    out: Dict[int, str] = {}
    kinds = sorted({k for r in c.ranks for k, _ in r.counts})
    for k in kinds:
        per = {r.rank: dict(r.counts).get(k, 0) for r in c.ranks}
        top = max(per.values(), default=0)
        for rank, n in per.items():
            if n < top and rank not in out:
                out[rank] = f"{k} {n} of {top}"
    return out


def name_ranks(report: Report, job_pids: Iterable[int]) -> Naming:
    """The ranks RAS names in the communicators of the job whose ranks have ``job_pids``."""
    pids = {p for p in job_pids if p and p > 0}
    ours = [c for c in report.communicators if pids & {r.pid for r in (*c.ranks, *c.missing)}]
    foreign = len(report.communicators) - len(ours)
    named: Dict[int, str] = {}
    for c in ours:
        for r in c.missing:
            named.setdefault(r.rank, "dead" if r.dead else ("unresponsive" if r.unresponsive else "missing"))
        for r in c.ranks:
            if r.async_error:
                named.setdefault(r.rank, f"async error {r.async_error}")
        if not any(r.rank in named for r in c.ranks) and not c.missing:
            for rank, why in _behind(c).items():
                named.setdefault(rank, f"behind: {why}")
    if not ours:
        return Naming(why="the RAS report is of no communicator of this job", foreign=foreign)
    if not named:
        return Naming(why=f"{len(ours)} communicator(s): every rank answered with the same counts",
                      communicators=len(ours), foreign=foreign)
    ranks = tuple(sorted(named))
    why = "; ".join(f"rank {r}: {named[r]}" for r in ranks[:8]) + ("; ..." if len(ranks) > 8 else "")
    return Naming(ranks=ranks, why=why, communicators=len(ours), foreign=foreign)


def address(env: Mapping[str, str]) -> Tuple[str, int]:
    """(host, port) of the RAS client listener: ``NCCL_RAS_ADDR`` (host:port) or localhost's
    default port. A malformed value is the default (NCCL itself would not listen there)."""
    v = (env.get("NCCL_RAS_ADDR") or "").strip()
    if v:
        host, _, port = v.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return host.strip("[]"), int(port)
    return "127.0.0.1", DEFAULT_PORT


def query(host: str, port: int, *, timeout_s: float = RAS_TIMEOUT_S + 2.0,
          ras_timeout_s: float = RAS_TIMEOUT_S) -> Tuple[Optional[str], Optional[str]]:
    """Ask the RAS listener at ``host:port`` for its report: (the JSON text, or None when the
    answer is not JSON; the answer as received, or None when no RAS server answered). Never
    raises for a network fault or a stranger at the port: (None, None)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            f = s.makefile("rwb")
            f.write(b"CLIENT PROTOCOL 2\n")
            f.flush()
            if not f.readline(256).startswith(b"SERVER PROTOCOL"):
                return None, None
            f.write(f"TIMEOUT {ras_timeout_s:g}\n".encode())
            f.flush()
            f.readline(256)
            f.write(b"SET FORMAT json\n")
            f.flush()
            json_ok = f.readline(256).startswith(b"OK")
            f.write(b"STATUS\n")
            f.flush()
            body = f.read(MAX_REPORT + 1)
    except OSError:
        return None, None
    if len(body) > MAX_REPORT:
        return None, None
    text = body.decode("utf-8", "replace")
    return (text if json_ok and text.lstrip().startswith("{") else None), text


def ask(env: Mapping[str, str], job_pids: Sequence[int]) -> Tuple[Optional[Naming], Optional[str]]:
    """Query and read: (the naming, or None without a usable JSON report; the server's answer
    for the attempt's directory, or None when no RAS server answered)."""
    host, port = address(env)
    js, raw = query(host, port)
    if js is None:
        return None, raw
    try:
        return name_ranks(parse(js), job_pids), raw
    except ValueError as e:
        return None, f"{raw}\n(unread: {e})"
