"""Supervised jobs by their Slurm job id: where each one's directory is, and what a person asks first.

``clusterops launch submit`` returns a job id; everything the supervisor knows lives in the job
directory (``timeline.jsonl``, the checkpoints). This module finds that directory from the id
and sums the job up:

- **Where** (:func:`locate`): first what the submission recorded
  (:func:`clusterops.launch.submit.record_submission`: one private file per job in the
  submitting user's registry, :func:`clusterops.launch.submit.registry_dir`), else the
  job itself as Slurm shows it: its batch script (``Command``) has the resolved spec file beside
  it (``<script>.supervise.json``, written by the submission), and the directory follows from that
  spec and the job id by the supervisor's own rule
  (:func:`clusterops.protocol.job_dir_for`). A job id that leads to neither is no
  supervised job: a one-line error. Another user's job is refused unless the caller is root or a
  Slurm administrator (Slurm's own view decides whose it is).
- **What** (:func:`status`): Slurm's state, the step and steps per second (from the timeline's
  progress samples), time left and the end (Slurm's end time) with the steps expected by then at
  the current rate, restarts and requeues and why, goodput, the latest good checkpoint, the
  nodes dropped. Pure over the timeline records and Slurm's job record (:func:`summarize`).
- **Which** (:func:`list_jobs`): the caller's supervised jobs Slurm still knows and those in
  the registry; everyone's with ``all_users`` (an administrator).
"""

from __future__ import annotations

import json
import os
import pwd
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from clusterops.errors import ClusteropsError, InputError, NotFoundError
from clusterops.launch.submit import REGISTRY_ENV, record_submission, registry_dir  # noqa: F401 (re-exported)

#: progress samples further back than this do not count for the current rate
RATE_WINDOW_S = 120.0


@dataclass(frozen=True)
class Located:
    job_id: str
    job_dir: Path
    ckpt_dir: Path
    spec_file: Optional[str]
    script: Optional[str]
    source: str                  # "registry" or "slurm": how the directory was found


def _dirs_of(spec: Mapping, job_id: str) -> tuple:
    from clusterops import protocol

    jd = protocol.job_dir_for(spec, job_id)
    return jd, protocol.ckpt_dir_for(spec, jd)


def _recorded(job_id: str) -> Optional[dict]:
    try:
        body = json.loads((registry_dir() / f"{int(job_id)}.json").read_text())
        return body if isinstance(body, dict) and body.get("job_dir") else None
    except (OSError, ValueError):
        return None


def _check_id(job_id: Any) -> str:
    jid = str(job_id).strip()
    if not jid.isdigit():
        raise InputError(f"JOBID: must be a Slurm job id (digits), got {jid!r}")
    return jid


def _is_admin(slurm) -> bool:
    from clusterops.slurm import privilege

    if os.getuid() == 0:
        return True
    try:
        level = privilege.caller_level(slurm)
    except ClusteropsError:
        return False
    return level is not None and level >= privilege.Level.OPERATOR


#: Whether the caller may read every user's jobs (root, or a Slurm operator or administrator).
is_admin = _is_admin


def locate(job_id: Any, slurm=None) -> Located:
    """Where supervised job ``job_id``'s directory is (see the module). InputError (one line)
    when it is no supervised job, or another user's and the caller no administrator."""
    jid = _check_id(job_id)
    rec = _recorded(jid)
    if rec is not None:
        return Located(jid, Path(rec["job_dir"]), Path(rec.get("ckpt_dir") or Path(rec["job_dir"]) / "ckpt"),
                       rec.get("spec_file"), rec.get("script"), "registry")
    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    try:
        info = slurm.job(jid)
    except NotFoundError:
        raise InputError(f"job {jid}: not a supervised clusterops job (no record of its submission in "
                         f"{registry_dir()}, and Slurm no longer knows it)") from None
    me = pwd.getpwuid(os.getuid()).pw_name
    if info.user and info.user != me and not _is_admin(slurm):
        raise InputError(f"job {jid} is {info.user}'s: only its owner or an administrator may read it")
    from clusterops.launch.render import spec_file_for

    spec_file = spec_file_for(info.command) if info.command and os.path.isabs(info.command) else None
    try:
        spec = json.loads(Path(spec_file).read_text()) if spec_file else None
    except (OSError, ValueError):
        spec = None
    if not isinstance(spec, dict) or not isinstance(spec.get("supervise"), dict):
        raise InputError(f"job {jid}: not a supervised clusterops job (its script {info.command or '?'} has no "
                         f"readable clusterops spec beside it)")
    if info.array_job_id is not None and int(spec.get("chain") or 1) > 1:
        jid = str(info.array_job_id)   # a generation of a chain: the chain's directory and id
    jd, cd = _dirs_of(spec, jid)
    return Located(jid, jd, cd, spec_file, info.command, "slurm")


@dataclass
class JobStatus:
    job_id: str
    job_dir: str
    state: str                       # Slurm's, else the timeline's outcome
    name: str = ""
    user: str = ""
    step: Optional[int] = None
    steps_per_s: Optional[float] = None
    time_left_s: Optional[float] = None
    end_time: Optional[float] = None
    steps_by_end: Optional[int] = None     # at the current rate, when Slurm ends the job
    launches: int = 0
    restarts: int = 0
    requeues: int = 0
    slurm_restarts: int = 0          # Slurm's count: requeues by anyone (a preemption, an administrator)
    causes: List[str] = field(default_factory=list)   # why each restart or requeue came
    goodput: Optional[float] = None
    latest_checkpoint: Optional[dict] = None
    nodes_dropped: List[str] = field(default_factory=list)
    outcome: Optional[str] = None
    exit_code: Optional[int] = None
    finished: bool = False
    last_event: Optional[str] = None
    # A chain of generations (chain: N; clusterops.supervisor.chain): its length, each
    # generation's job id, Slurm state and how it ended, and whether and why the chain ended.
    chain: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(records: List[Mapping], now: float) -> Optional[float]:
    """Steps per second over the latest run of progress samples (the current incarnation's, the
    last RATE_WINDOW_S): None with fewer than two."""
    from clusterops.supervisor.timeline import E

    samples: List[tuple] = []
    for r in records:
        e = r.get("event")
        if e in (E.LAUNCH, E.RESTART, E.REQUEUE, E.START):
            samples = []          # a new run: the rate is this one's
        elif e == E.PROGRESS and isinstance(r.get("step"), int) and isinstance(r.get("t"), (int, float)):
            samples.append((float(r["t"]), int(r["step"])))
    recent = [s for s in samples if s[0] >= samples[-1][0] - RATE_WINDOW_S] if samples else []
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return None
    return max(0.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]))


def summarize(loc: Located, records: List[Mapping], info=None, *, now: Optional[float] = None,
              latest: Optional[dict] = None) -> JobStatus:
    """The status of a job from its timeline records and Slurm's record (None: Slurm forgot it)."""
    from clusterops.supervisor import timeline as tl
    from clusterops.supervisor.timeline import E

    now = time.time() if now is None else now
    s = tl.summary(records)
    st = JobStatus(job_id=loc.job_id, job_dir=str(loc.job_dir), state="UNKNOWN")
    st.launches, st.restarts, st.requeues = s["launches"], s["restarts"], s["requeues"]
    st.step, st.outcome, st.exit_code = s["last_step"], s["outcome"], s["exit_code"]
    st.causes = [str(c) for c in s["faults"]]
    st.steps_per_s = _rate(records, now)
    gp = tl.goodput_report(records)
    st.goodput = gp.get("goodput") if isinstance(gp, dict) else None
    dropped: List[str] = []
    for r in records:
        if r.get("event") in (E.NODE_BAD, E.NODE_DOWN, E.SPARE_USED, E.INPROC_NODE_LOST, E.DRAIN):
            node = r.get("node") or r.get("lost") or r.get("from")
            for n in (node if isinstance(node, list) else [node]):
                if isinstance(n, str) and n and n not in dropped:
                    dropped.append(n)
    st.nodes_dropped = dropped
    st.last_event = records[-1].get("event") if records else None
    if info is not None:
        st.state, st.name, st.user = info.state, info.name, info.user
        st.slurm_restarts = info.restart_count
        st.end_time = info.end_time
        if info.category == "running" and info.end_time:
            st.time_left_s = max(0.0, info.end_time - now)
            if st.steps_per_s is not None and st.step is not None:
                st.steps_by_end = int(st.step + st.steps_per_s * st.time_left_s)
        st.finished = info.category in ("done", "failed")
    else:
        st.state = {E.DONE: "COMPLETED", E.GIVE_UP: "FAILED"}.get(s["outcome"] or "", "UNKNOWN")
        st.finished = s["outcome"] is not None
    st.latest_checkpoint = latest
    return st


def chain_summary(records: List[Mapping], tasks: Mapping[int, Any]) -> Optional[dict]:
    """A chain as one run, from its timeline and Slurm's records of its tasks (generation ->
    JobInfo, ``chain.tasks_by_generation``; {} when Slurm forgot them). None for a lone job.
    Each generation: its number, job id, Slurm state and exit code, ``ended`` (the timeline's
    word: generation_end, done, give_up; None when its supervisor did not say, e.g. killed),
    ``why``. The chain: ``ended`` and ``why`` (the ``chain_end`` record's reason)."""
    from clusterops.supervisor.timeline import E

    gens = [r for r in records if r.get("event") == E.GENERATION]
    if not gens and not tasks:
        return None
    length = max([int(r.get("of") or 0) for r in gens] + [max(tasks, default=0)])
    ends = {E.GENERATION_END, E.DONE, E.GIVE_UP}
    out: List[dict] = []
    for g in range(1, length + 1):
        info = tasks.get(g)
        started = [r for r in gens if r.get("generation") == g]
        job_ids = {str(r.get("job_id")) for r in started}
        if info is not None and info.array_task_id is not None:
            job_ids.add(str(info.job_id))
        last = [r for r in records if r.get("event") in ends and str(r.get("job_id")) in job_ids]
        row = {"generation": g, "job_id": (str(info.job_id) if info is not None and info.array_task_id is not None
                                           else (sorted(job_ids)[-1] if job_ids else None)),
               "state": info.state if info is not None else None,
               "exit_code": info.exit_code if info is not None and info.category in ("done", "failed") else None,
               "started": bool(started), "ended": str(last[-1]["event"]) if last else None,
               "why": last[-1].get("reason") if last else None}
        if row["exit_code"] is None and last:
            row["exit_code"] = last[-1].get("code")
        out.append(row)
    end = [r for r in records if r.get("event") == E.CHAIN_END]
    live = [t for t in tasks.values() if t.category in ("pending", "running")]
    return {"length": length, "generations": out, "ended": bool(end) or (bool(tasks) and not live),
            "why": end[-1].get("reason") if end else None}


def _chain_tasks(slurm, info, length: int) -> Dict[int, Any]:
    """Slurm's records of the chain ``info`` belongs to ({} for a lone job, or on no answer)."""
    from clusterops.supervisor.chain import tasks_by_generation

    if info is None or info.array_job_id is None:
        return {}
    try:
        return tasks_by_generation(slurm.job_tasks(info.array_job_id), length)
    except ClusteropsError:
        return {}


def _chain_length(loc: Located, records: List[Mapping]) -> int:
    """The chain's length: its generations' records say it, else the resolved spec."""
    from clusterops.supervisor.timeline import E

    said = [int(r.get("of") or 0) for r in records if r.get("event") == E.GENERATION]
    if said:
        return max(said)
    try:
        return int(json.loads(Path(loc.spec_file).read_text()).get("chain") or 1) if loc.spec_file else 1
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def _latest(ckpt_dir: Path) -> Optional[dict]:
    from clusterops.checkpoint import lookup

    try:
        path = lookup.latest_good(ckpt_dir)
    except (OSError, ClusteropsError):
        return None
    if path is None:
        return None
    step = None
    digits = "".join(ch for ch in path.name if ch.isdigit())
    if digits:
        step = int(digits)
    return {"path": str(path), "step": step}


def _slurm_record(slurm, job_id: str):
    try:
        return slurm.job(job_id)
    except NotFoundError:
        return None


def status(job_id: Any, slurm=None) -> JobStatus:
    """The status of supervised job ``job_id`` (see the module)."""
    from clusterops.supervisor import timeline as tl

    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    loc = locate(job_id, slurm)
    records, _ = tl.load(loc.job_dir) if tl.timeline_path(loc.job_dir).exists() else ([], [])
    info = _slurm_record(slurm, loc.job_id)
    tasks = _chain_tasks(slurm, info, _chain_length(loc, records))
    view = chain_summary(records, tasks)
    if view is not None and tasks:
        # A chain: Slurm's word is the generation that runs (else waits, else ended last).
        order = sorted(tasks.items())
        info = next((t for _, t in order if t.category == "running"), None) or \
            next((t for _, t in order if t.category == "pending"), None) or order[-1][1]
    st = summarize(loc, records, info, latest=_latest(loc.ckpt_dir))
    if view is not None:
        st.chain = view
        st.finished = view["ended"] if tasks else st.finished
    return st


def list_jobs(slurm=None, *, all_users: bool = False) -> List[JobStatus]:
    """The supervised jobs of the caller (everyone's with ``all_users``: an administrator's
    view) that Slurm still knows, and the caller's recorded ones it forgot."""
    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    if all_users and not _is_admin(slurm):
        raise InputError("--all: only root or a Slurm administrator sees other users' jobs")
    me = pwd.getpwuid(os.getuid()).pw_name
    seen: Dict[str, JobStatus] = {}
    for info in slurm.jobs():
        if not all_users and info.user and info.user != me:
            continue
        if str(info.array_job_id or "") in seen:
            continue        # another generation of a chain listed already
        try:
            st = status(info.job_id, slurm)
        except InputError:
            continue        # not a supervised job, or not ours to read
        seen[st.job_id] = st
    try:
        recorded = sorted(registry_dir().glob("*.json"))
    except OSError:
        recorded = []
    for p in recorded:
        jid = p.stem
        if jid.isdigit() and jid not in seen:
            try:
                seen[jid] = status(jid, slurm)
            except InputError:
                continue
    return [seen[k] for k in sorted(seen, key=int)]


def new_events(job_dir: os.PathLike, offset: int) -> tuple:
    """Timeline records written since byte ``offset`` (whole lines), and the new offset: what
    ``clusterops job watch`` prints as they come."""
    from clusterops.supervisor import timeline as tl

    path = tl.timeline_path(job_dir)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        rec, _ = tl._record(line)
        if rec is not None:
            out.append(rec)
    return out, offset + end


def watch(job_id: Any, emit, *, slurm=None, poll_s: float = 1.0, sleep=time.sleep,
          max_polls: Optional[int] = None) -> JobStatus:
    """Follow a job until it ends: ``emit(kind, value)`` with ``("event", record)`` for each new
    timeline record and ``("status", JobStatus)`` once a poll; returns the final status."""
    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    loc = locate(job_id, slurm)
    offset, polls = 0, 0
    while True:
        recs, offset = new_events(loc.job_dir, offset)
        for r in recs:
            emit("event", r)
        st = status(loc.job_id, slurm)
        emit("status", st)
        polls += 1
        if st.finished or (max_polls is not None and polls >= max_polls):
            recs, offset = new_events(loc.job_dir, offset)
            for r in recs:
                emit("event", r)
            return st
        sleep(poll_s)


def describe_status(st: JobStatus, now: Optional[float] = None) -> List[str]:
    """The lines ``clusterops job status`` prints."""
    now = time.time() if now is None else now

    def dur(s: Optional[float]) -> str:
        if s is None:
            return "?"
        s = int(s)
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

    rate = f"{st.steps_per_s:.2f} steps/s" if st.steps_per_s is not None else "rate unknown"
    lines = [f"job {st.job_id} {st.name} ({st.user or '?'}): {st.state}" + (f", outcome {st.outcome}"
             + (f" (exit {st.exit_code})" if st.exit_code is not None else "") if st.outcome else ""),
             f"  step {st.step if st.step is not None else '?'}, {rate}"]
    if st.time_left_s is not None:
        lines.append(f"  time left {dur(st.time_left_s)} (ends {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.end_time))})"
                     + (f", about step {st.steps_by_end} by then" if st.steps_by_end is not None else ""))
    lines.append(f"  {st.launches} launch(es), {st.restarts} restart(s), {st.requeues} requeue(s)"
                 + (f" (Slurm: {st.slurm_restarts})" if st.slurm_restarts != st.requeues else "")
                 + (f": {', '.join(st.causes)}" if st.causes else ""))
    if st.goodput is not None:
        lines.append(f"  goodput {st.goodput:.1%}")
    ck = st.latest_checkpoint
    lines.append(f"  latest good checkpoint: {ck['path']} (step {ck['step']})" if ck else "  latest good checkpoint: none")
    if st.nodes_dropped:
        lines.append(f"  nodes dropped: {', '.join(st.nodes_dropped)}")
    if st.chain:
        c = st.chain
        lines.append(f"  chain of {c['length']} generation(s)" + (f": ended ({c['why']})" if c["why"] else
                                                                 ": ended" if c["ended"] else ""))
        for g in c["generations"]:
            how = g["ended"] or ("no word from its supervisor" if g["started"] else "never started")
            lines.append(f"    generation {g['generation']}: job {g['job_id'] or '?'} {g['state'] or '?'}"
                         + (f" exit {g['exit_code']}" if g["exit_code"] is not None else "") + f", {how}"
                         + (f": {g['why']}" if g["why"] else ""))
    lines.append(f"  job dir: {st.job_dir}")
    return lines

