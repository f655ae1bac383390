"""Run supervised training jobs on a dev cluster and inject real faults into them.

Used by the fault-matrix tests, the demo (examples/demo.py) and the supervisor
benchmark: write a job spec for examples/train.py with a ``supervise:`` section, submit
it through ``clusterops launch submit``, watch its heartbeats, kill -9 / SIGSTOP a rank,
corrupt a checkpoint, wait for the job to end, and compare the final weights bitwise
with an uninterrupted run of the same world size. Test tooling, not a product API.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from clusterops import heartbeat as hbc
from clusterops import protocol
from clusterops.errors import ClusteropsError
from clusterops.runner import Runner, free_port, kill_group, wait_exit
from support.wait import WaitTimeout, wait_for

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "examples" / "train.py"


@dataclass
class TrainJob:
    """One supervised run of examples/train.py in its own directory."""

    root: Path
    name: str
    nodes: int = 4
    steps: int = 60
    ckpt_every: int = 10
    step_sleep: float = 0.1
    supervise: Dict[str, object] = field(default_factory=dict)
    spec_extra: Dict[str, object] = field(default_factory=dict)
    train_args: List[str] = field(default_factory=list)
    script: Path = TRAIN_SCRIPT
    python: str = sys.executable
    job_id: Optional[int] = None
    user: Optional[str] = None     # submit as this local user (root runs `runuser -u USER --`)
    # The Slurm the job went to (SLURM_CONF at submit): job ids are per cluster, and the
    # pytest-xdist workers' dev clusters all count from the same first id on one host.
    slurm_conf: Optional[str] = None

    @property
    def job_dir(self) -> Path:
        return self.root / "job"

    @property
    def ckpt_dir(self) -> Path:
        return Path(str(self.supervise.get("ckpt_dir", self.root / "ckpt")))

    @property
    def out(self) -> Path:
        return self.root / "final.pt"

    @property
    def spec_path(self) -> Path:
        return self.root / f"{self.name}.yaml"

    def args(self) -> List[str]:
        return ["--steps", str(self.steps), "--ckpt-every", str(self.ckpt_every),
                "--step-sleep", str(self.step_sleep), "--out", str(self.out), *self.train_args]

    def spec(self) -> dict:
        sup = {"ckpt_dir": str(self.ckpt_dir), "job_dir": str(self.job_dir), "preflight": False,
               "hang_timeout_s": 20, "startup_timeout_s": 120}
        sup.update(self.supervise)
        spec = {
            "name": self.name, "launcher": "srun", "nodes": self.nodes, "time": "0:10:00",
            "script": str(self.script), "python": self.python, "args": self.args(),
            "workdir": str(self.root), "log_dir": str(self.root / "logs"),
            "env": {"OMP_NUM_THREADS": "1"},
            # The batch shell must find the same clusterops (`exec clusterops supervise`).
            "setup": [f"export PATH={Path(self.python).parent}:$PATH"],
            "signal_lead_s": 0,
            "supervise": sup,
        }
        spec.update(self.spec_extra)
        return spec

    def write_spec(self) -> Path:
        import yaml

        self.root.mkdir(parents=True, exist_ok=True)
        self.spec_path.write_text(yaml.safe_dump(self.spec(), sort_keys=False))
        if self.user:
            # The spec is the user's own input: hand it (and the job's root) over, so that
            # nothing in the user's directory belongs to root.
            import pwd

            pw = pwd.getpwnam(self.user)
            for path in (self.root, self.spec_path):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        return self.spec_path

    def submit(self, env: Optional[Dict[str, str]] = None) -> int:
        """`clusterops launch submit SPEC --json` -> job id."""
        self.write_spec()
        # ``env`` is an overlay on this process's environment (the runner's rule), so the
        # cluster the job goes to is this process's SLURM_CONF unless ``env`` names another:
        # reading ``env`` alone lost it for ``env={"CLUSTEROPS_SLURM_BACKEND": ...}``, and the
        # rank lookup then killed another worker's rank with the same job id (D13 tier).
        self.slurm_conf = {**os.environ, **(env or {})}.get("SLURM_CONF") or None
        p = Runner(as_user=self.user).run(
            [self.python, "-m", "clusterops", "launch", "submit", str(self.spec_path), "--json"],
            timeout_s=60, env=env, check=False, cwd=str(self.root) if self.user else None)
        if p.returncode != 0:
            raise ClusteropsError(f"launch submit failed ({p.returncode}): {p.stderr.strip()[-500:]}")
        self.job_id = int(json.loads(p.stdout)["job_id"])
        return self.job_id

    # -- watching -------------------------------------------------------------------
    def latest_attempt(self) -> Optional[Path]:
        attempts = sorted(self.job_dir.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
        return attempts[-1] if attempts else None

    def progress(self) -> Optional[int]:
        """Lowest step over the ranks of the latest attempt (None before the first beat)."""
        att = self.latest_attempt()
        steps = self.rank_steps(att) if att is not None else []
        return min(steps) if steps else None

    @staticmethod
    def rank_steps(att: Path) -> List[int]:
        """The ranks' last reported steps in attempt directory ``att``: the per-rank heartbeat
        files, or on the node channel the ranks' node-local beats (every dev-cluster node is
        this host)."""
        steps = []
        for f in (att / "heartbeat").glob("rank*"):
            try:
                steps.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        if steps:
            return steps
        env = {}
        try:
            for line in (att / "command.txt").read_text().splitlines()[1:]:
                k, _, v = line.partition("=")
                env[k] = v
        except OSError:
            return []
        addr = env.get(protocol.ENV_HEARTBEAT_ADDR)
        if not addr:
            return []
        return list(hbc.read_local_steps(addr, env.get(protocol.ENV_HEARTBEAT_DIR, "")).values())

    def wait_step(self, step: int, timeout_s: float = 120.0, attempt: Optional[int] = None) -> int:
        def reached() -> Optional[int]:
            att = self.latest_attempt()
            if attempt is None or (att is not None and int(att.name.split("-")[1]) >= attempt):
                got = self.progress()
                if got is not None and got >= step:
                    return got + 1     # truthy even for step 0; undone below
            if self.timeline_events("done", "give_up"):
                raise ClusteropsError(f"{self.name}: job ended before step {step}")
            return None

        try:
            return wait_for(reached, timeout_s, f"{self.name}: step {step}",
                            detail=lambda: f"at {self.progress()}") - 1
        except WaitTimeout as e:
            raise ClusteropsError(str(e)) from None

    def rank_pids(self, rank: int) -> List[int]:
        """PIDs of the training process(es) of a rank of this job (read from /proc), on this
        job's cluster only (``job_processes``)."""
        return [pid for pid, argv in job_processes(self.slurm_conf, {"SLURM_JOB_ID": str(self.job_id),
                                                                     "SLURM_PROCID": str(rank)}).items()
                if str(self.script) in argv and "srun" not in Path(argv[0]).name]

    def signal_rank(self, rank: int, sig: int) -> List[int]:
        pids = self.rank_pids(rank)
        if not pids:
            raise ClusteropsError(f"{self.name}: no process for rank {rank} of job {self.job_id}")
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def timeline(self) -> List[dict]:
        from clusterops.supervisor import timeline as tl

        try:
            return tl.read(self.job_dir)
        except ClusteropsError:
            return []

    def timeline_events(self, *kinds: str) -> List[dict]:
        return [r for r in self.timeline() if r.get("event") in kinds]

    def wait_end(self, slurm, timeout_s: float = 300.0):
        """Wait until Slurm says the job has ended for good (not requeued) -> JobInfo."""
        last = [None]

        def ended():
            try:
                info = last[0] = slurm.job(self.job_id)
            except ClusteropsError:
                return None      # a flaky controller: ask again
            if info.category in ("done", "failed") and info.state not in ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"):
                return info
            return None

        try:
            return wait_for(ended, timeout_s, f"{self.name}: job {self.job_id} to end", interval_s=0.5)
        except WaitTimeout:
            raise ClusteropsError(f"{self.name}: job {self.job_id} still {last[0].state if last[0] else '?'} after "
                                  f"{timeout_s:g}s; timeline tail: "
                                  + " | ".join(r.get("event", "") for r in self.timeline()[-8:])) from None

    def wait_running(self, slurm, timeout_s: float = 180.0):
        """Wait until Slurm has started the job (left PENDING) -> JobInfo.

        A test that times what the job does counts from its start: on a loaded machine a
        slurmd slow to answer a ping is marked not responding for a while, and the job pends
        until it is back. That is the controller's time, not the supervisor's."""
        last = [None]

        def started():
            try:
                info = last[0] = slurm.job(self.job_id)
            except ClusteropsError:
                return None
            return info if info.category != "pending" else None

        try:
            return wait_for(started, timeout_s, f"{self.name}: job {self.job_id} to start", interval_s=0.5)
        except WaitTimeout:
            info = last[0]
            raise ClusteropsError(f"{self.name}: job {self.job_id} still pending after {timeout_s:g}s "
                                  f"(state {info.state if info else '?'}, reason {info.reason if info else '?'})"
                                  ) from None

    def slurm_says(self, slurm) -> str:
        """One line of what Slurm says of the job now (for a failure's message)."""
        try:
            info = slurm.job(self.job_id)
        except ClusteropsError as e:
            return f"job {self.job_id}: Slurm did not answer ({e.message})"
        return (f"job {self.job_id}: {info.state} (reason {info.reason}, exit {info.exit_code}, "
                f"restarts {info.restart_count})")

    def batch_log(self) -> str:
        logs = sorted((self.root / "logs").glob(f"*-{self.job_id}*.out"))
        return "\n".join(p.read_text(errors="replace") for p in logs)

    def failed_step_logs(self, tail: int = 1500) -> str:
        """The end of each attempt's step log but the last (the attempts that failed), so a
        failing assertion shows what the ranks printed, not only the timeline."""
        logs = sorted(self.job_dir.glob("**/step.log"), key=lambda p: p.stat().st_mtime)[:-1]
        return "".join(f"\n--- {p.relative_to(self.job_dir)} (end)\n{p.read_text(errors='replace')[-tail:]}"
                       for p in logs)


def job_processes(slurm_conf: Optional[str], env: Dict[str, str]) -> Dict[int, List[str]]:
    """pid -> argv of the processes whose initial environment holds every ``env`` item and
    whose SLURM_CONF names ``slurm_conf`` (slurmstepd exports it to every task). Several
    dev clusters share this host (one per pytest-xdist worker), with the same node names
    and the same job ids: a job id alone finds another worker's job too. ``slurm_conf``
    None (the job went to the default Slurm): SLURM_CONF is not compared."""
    want = [f"{k}={v}".encode() for k, v in env.items()]
    conf = os.path.realpath(slurm_conf) if slurm_conf else None
    found: Dict[int, List[str]] = {}
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            with open(f"/proc/{e.name}/environ", "rb") as f:
                theirs = f.read().split(b"\0")
            with open(f"/proc/{e.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if not all(w in theirs for w in want):
            continue
        if conf is not None:
            named = [v[len(b"SLURM_CONF="):] for v in theirs if v.startswith(b"SLURM_CONF=")]
            if not named or os.path.realpath(os.fsdecode(named[0])) != conf:
                continue
        found[int(e.name)] = [os.fsdecode(a) for a in argv]
    return found


# ------------------------------------------------------------------------------ faults
def corrupt_latest_checkpoint(ckpt_dir: Path) -> Path:
    """Flip one byte in the biggest file of the newest committed checkpoint (same size, so
    only a hash check catches it)."""
    from clusterops import checkpoint as ck

    steps = ck.committed_steps(ckpt_dir)
    if not steps:
        raise ClusteropsError(f"no checkpoint under {ckpt_dir}")
    path = steps[-1][1]
    files = [p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"]
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return path


def damaged_checkpoints(ckpt_dir: Path, ignore: Sequence[Path] = ()) -> List[str]:
    """Committed checkpoints that fail a deep verify (besides the ones we broke on purpose)."""
    from clusterops import checkpoint as ck

    bad = []
    skip = {Path(p).resolve() for p in ignore}
    for info in ck.list_checkpoints(ckpt_dir, deep=True):
        if not info.ok and info.path.resolve() not in skip:
            bad.append(f"{info.path}: {'; '.join(info.problems)}")
    return bad


# ------------------------------------------------------------------------------ reference runs
# A directory shared by every process of one test session (tests/conftest.py sets it): a
# reference run asked for twice, by two modules or two pytest-xdist workers, runs once.
REF_CACHE_ENV = "CLUSTEROPS_TEST_REF_CACHE"
_W = "<workdir>"


def run_local(world: int, args: Sequence[str], *, workdir: Path, python: str = sys.executable,
              script: Path = TRAIN_SCRIPT, timeout_s: float = 300.0, one_per_node: bool = False) -> str:
    """Run examples/train.py uninterrupted on `world` local gloo ranks (no Slurm); rank 0's output.

    ``one_per_node``: each rank sees itself as torchrun's only worker on its own node
    (GROUP_RANK=rank, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, TORCHELASTIC_RUN_ID set), the
    layout of a ``nodes: N`` job with one rank per node, for frameworks that size
    themselves from it (Lightning's num_nodes/devices).

    With ``$CLUSTEROPS_TEST_REF_CACHE`` set, the same run (world, layout, interpreter, the
    script's bytes, and the arguments with ``workdir`` written as a placeholder) is computed
    once per session under a lock, in the cache's own work directory; a later call gets a
    copy of that directory's files in ``workdir`` and the output with the paths mapped back.
    The run is deterministic (that is what the tests compare against), so a copy is the run.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cache = os.environ.get(REF_CACHE_ENV)
    if not cache:
        return _run_local(world, list(args), workdir, python, script, timeout_s, one_per_node)
    import fcntl
    import hashlib
    import shutil

    here = str(workdir)
    generic = [a.replace(here, _W) for a in args]
    key = hashlib.sha256(json.dumps([world, one_per_node, python, str(script), generic,
                                     hashlib.sha256(Path(script).read_bytes()).hexdigest()]).encode()).hexdigest()[:24]
    root = Path(cache)
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    entry = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (entry / "output.txt").exists():
            shutil.rmtree(entry, ignore_errors=True)       # a run that failed halfway
            work = entry / "work"
            work.mkdir(parents=True)
            out = _run_local(world, [a.replace(_W, str(work)) for a in generic], work, python, script,
                             timeout_s, one_per_node)
            (entry / "output.txt").write_text(out)
    work = entry / "work"
    shutil.copytree(work, workdir, dirs_exist_ok=True)
    return (entry / "output.txt").read_text().replace(str(work), here)


def _run_local(world: int, args: List[str], workdir: Path, python: str, script: Path, timeout_s: float,
               one_per_node: bool) -> str:
    port = free_port("127.0.0.1")
    # No Slurm or supervisor context may leak in: this is a plain local run.
    unset = [k for k in os.environ if k.startswith(("SLURM_", "CLUSTEROPS_"))]
    runner = Runner()
    procs, logs = [], []
    for r in range(world):
        env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), OMP_NUM_THREADS="1", CLUSTEROPS_CKPT_DIR=str(workdir / "ckpt"))
        if one_per_node:
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(r), TORCHELASTIC_RUN_ID="reference")
        log = workdir / f"rank{r}.log"
        log.write_bytes(b"")
        logs.append(log)
        procs.append(runner.spawn([python, str(script), *args], log_path=str(log), env=env, unset=unset,
                                  cwd=str(workdir)))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            if wait_exit(p, max(0.0, deadline - time.monotonic())) is None:
                raise ClusteropsError(f"reference run did not finish in {timeout_s:g}s")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
                p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    for p, out in zip(procs, outs):
        if p.returncode != 0 and not aborted_at_teardown(p.returncode, out):
            raise ClusteropsError(f"reference run failed ({p.returncode}): {out[-800:]}")
    if all(p.returncode != 0 for p in procs):
        raise ClusteropsError(f"reference run failed: every rank aborted: {outs[0][-800:]}")
    return outs[0]


def aborted_at_teardown(returncode: int, output: str) -> bool:
    """A local rank ended by torch 2.13's gloo teardown abort, after its script had finished.

    The C++ runtime's terminate line is the last thing the rank printed, it died of SIGABRT,
    and the interpreter is older than 3.14 (docs/supervisor.md, "A rank that aborts at
    exit": a process-group worker thread asks for the GIL while Python finalizes). The
    caller accepts it only when the other ranks exited 0: a rank that aborted before its
    last collective would have failed its peers in that collective, so its results (written
    before the script's final barrier) are whole."""
    from clusterops.supervisor.evidence import SELF_ABORT

    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return (sys.version_info < (3, 14) and returncode == -signal.SIGABRT and bool(lines)
            and SELF_ABORT.match(lines[-1]) is not None)


def rollback_reference(world: int, workdir: Path, *, steps: int, poison: str, at: Optional[int] = None,
                       skip: int = 30, lr_factor: float = 0.5, args: Sequence[str] = (), script: Path = TRAIN_SCRIPT,
                       one_per_node: bool = False) -> Path:
    """The stability tests' reference: final weights of an uninterrupted run of ``script`` with
    the same poisoned window that, from step ``at`` on, skips ``skip`` batches and scales its
    learning rate by ``lr_factor`` (what a rollback to ``at`` tells the script); without
    ``at``, the run with the poison alone."""
    out = workdir / "final.pt"
    fix = [] if at is None else ["--skip-batches-at", f"{at}:{skip}", "--lr-factor-at", f"{at}:{lr_factor:g}"]
    run_local(world, ["--steps", str(steps), *args, "--out", str(out), "--poison-batches", poison, *fix],
              workdir=workdir, script=script, one_per_node=one_per_node)
    return out


def nan_weights(path: Path) -> bool:
    """Whether any tensor of a saved state dict holds a NaN (a run the poison got through to)."""
    import torch

    return any(torch.isnan(t).any().item() for t in torch.load(path, weights_only=True).values())


def same_weights(a: Path, b: Path) -> bool:
    """Bitwise equality of two saved state dicts (names, dtypes, shapes and bytes); nested
    ones too (fsdp_train.py's ``{"model": ..., "optim": ...}``: every tensor bitwise, every
    other value equal)."""
    import torch

    return _same(torch.load(a, map_location="cpu", weights_only=True),
                 torch.load(b, map_location="cpu", weights_only=True))


def _same(x, y) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape
                and x.contiguous().view(-1).numpy().tobytes() == y.contiguous().view(-1).numpy().tobytes())
    if isinstance(x, dict) or isinstance(y, dict):
        return isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
        return (isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y)
                and all(_same(u, v) for u, v in zip(x, y)))
    return x == y


def events(job: TrainJob, kind: str) -> List[dict]:
    """The job's timeline records of one kind, in order."""
    return [r for r in job.timeline() if r["event"] == kind]


def assert_healed(job: TrainJob, slurm, reference: Path, *, timeout_s: Optional[float] = None,
                  ignore_ckpts: Sequence[Path] = ()):
    """The job ended done (COMPLETED, exit 0), its final weights equal the uninterrupted
    run's at ``reference`` bitwise, and no committed checkpoint is damaged; (info, story)."""
    from clusterops.supervisor import timeline as tl

    info = job.wait_end(slurm, **({"timeout_s": timeout_s} if timeout_s is not None else {}))
    story = tl.format_text(job.timeline()) + job.failed_step_logs()
    assert info.state == "COMPLETED" and info.exit_code == 0, \
        f"{info.state} {info.exit_code}\n{story}\n{job.batch_log()[-3000:]}"
    assert events(job, "done"), story
    assert job.out.exists(), story
    assert same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"
    assert damaged_checkpoints(job.ckpt_dir, ignore=ignore_ckpts) == [], story
    return info, story


def time_limit_requeue(job: TrainJob, slurm, reference: Path, *, requeue_within_s: float):
    """Fault (e) on a submitted job: the time limit's lead signal stops the ranks, they save,
    the job is requeued (then given room to finish), and the next incarnation resumes at
    exactly the saved step: 0 steps lost, bitwise. Returns (info, story, the stopped record)."""
    from clusterops.supervisor import timeline as tl

    def requeued():
        assert not events(job, "give_up"), tl.format_text(job.timeline())
        return events(job, "requeue")

    def story() -> str:
        return (f"{job.slurm_says(slurm)}\n{tl.format_text(job.timeline())}\n"
                f"batch log tail:\n{job.batch_log()[-2000:]}")

    # The time limit counts from the job's start, and so does the wait for the requeue.
    job.wait_running(slurm)
    wait_for(requeued, requeue_within_s, "the requeue", interval_s=1, detail=story)
    slurm.update_job(job.job_id, TimeLimit="10")
    info, story = assert_healed(job, slurm, reference)
    stop = events(job, "stop_requested")
    assert stop and stop[0]["reason"] == "time_limit", story
    stopped = events(job, "stopped")[0]
    later = [r for r in events(job, "resume") if r["incarnation"] == 1]
    # Zero steps lost: the stop saved the step the ranks had reached, and the next
    # incarnation resumes exactly there.
    assert stopped["ckpt_step"] is not None and later[0]["step"] == stopped["ckpt_step"], story
    beats = [r["max_step"] for r in events(job, "progress") if r["incarnation"] == 0]
    assert stopped["ckpt_step"] >= max(beats, default=0), story
    assert info.restart_count == 1, story
    return info, story, stopped
