"""``SupervisorRun``'s plumbing driven through its main paths in milliseconds.

A fake Slurm (tests/support/fakes.py ``StepSlurm``: job, steps, nodes, cancel/signal,
requeue, drain, every call recorded), a fake runner whose ``spawn`` returns scripted processes, and a fake clock whose ``sleep``
moves simulated ranks forward: they beat into the real heartbeat directory (mtimes set
to the fake time), commit real checkpoints (``clusterops.checkpoint``), honour the stop
file and USR2, crash, hang or stop the way the ranks of examples/train.py do under srun,
and write what srun would print. Everything the supervisor writes (timeline, state file,
attempt directories, command.txt) is real and read back.

The same paths run for real on the dev cluster in tests/integration/test_fault_matrix.py;
these tests pin the plumbing between the state machine and Slurm, fast.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from clusterops.errors import ClusteropsError
from clusterops import checkpoint as ck
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl
from clusterops.supervisor.run import STATE_FILE, RunConfig, SupervisorRun
from support.fakes import ScriptedRunner, StepSlurm
from support.fakes import opt as _opt

# Far above any pid_max (at most 2**22): a group kill aimed at a fake process finds nothing.
FAKE_PID = 2 ** 22 + 1000
T0 = 1_700_000_000.0
JOB = "4242"
NODES = ["n1", "n2"]


class EndedBySlurm(BaseException):
    """What a requeue does to the batch script: Slurm ends it (here: unwinds the run)."""




class FakeProcess:
    def __init__(self, world: "World", argv: List[str], log_path: str):
        world.spawned += 1
        self.world, self.argv, self.log = world, list(argv), Path(log_path)
        self.pid = FAKE_PID + world.spawned
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout=None) -> Optional[int]:
        return self.returncode

    def tick(self, now: float) -> None:
        pass

    def _exit(self, rc: int, text: str = "") -> None:
        with open(self.log, "a") as f:
            f.write(text)
        self.returncode = rc


class FakeCheck(FakeProcess):
    """A preflight/postmortem health check or a liveness check: answers at once."""

    def __init__(self, world, argv, log_path):
        super().__init__(world, argv, log_path)
        nodes = _opt(argv, "nodelist").split(",")
        out = _opt(argv, "output")
        for i, node in enumerate(nodes):
            if "printenv" in argv:
                text = node + "\n"
            else:
                text = json.dumps({"node": node, "status": "pass", "results": []})
            Path(out.replace("%t", str(i))).write_text(text)
        self._exit(0)


class FakeStacks(FakeProcess):
    def __init__(self, world, argv, log_path):
        super().__init__(world, argv, log_path)
        ranks = argv[argv.index("--ranks") + 1]
        Path(_opt(argv, "output")).write_text(f"=== rank {ranks} ===\nThread 1 (idle)\n  allreduce (train.py:42)\n")
        self._exit(0)


class FakeStep(FakeProcess):
    """The training step: srun with one simulated rank per task."""

    def __init__(self, world, argv, log_path, env):
        super().__init__(world, argv, log_path)
        self.env = dict(env)
        self.nodes = _opt(argv, "nodelist").split(",")
        self.ranks = len(self.nodes) * int(_opt(argv, "ntasks-per-node"))
        resume = env["CLUSTEROPS_RESUME_FROM"]
        start = ck.parse_step(Path(resume).name) if resume else 0
        self.steps = {r: start for r in range(self.ranks)}
        self.hb_dir = Path(env["CLUSTEROPS_HEARTBEAT_DIR"])
        self.stop_file = Path(env["CLUSTEROPS_STOP_FILE"])
        self.usr2 = False
        self.frozen: Dict[int, float] = {}      # rank -> fake time it stopped moving
        self.attempt = int(_opt(argv, "job-name").rsplit("-", 1)[1])

    def tick(self, now: float) -> None:
        w = self.world
        if self.returncode is not None:
            return
        if self.usr2 or self.stop_file.exists():
            # What examples/train.py does on a stop request: save where it is, exit 0.
            step = min(self.steps.values())
            w.commit(step)
            return self._exit(0, f"0: stopped step={step}\n")
        for r in range(self.ranks):
            if r in self.frozen:
                continue
            self.steps[r] += 1
            beat = self.hb_dir / f"rank{r}"
            beat.write_text(f"{self.steps[r]}\n")
            os.utime(beat, (now, now))
        step = min(self.steps.values())
        if step % w.ckpt_every == 0 and not self.frozen:
            w.commit(step)
        w.fault(self, now, step)
        if self.returncode is None and step >= w.total_steps:
            self._exit(0, f"0: done step={step}\n")

    def killed(self) -> None:
        """scancel --signal=KILL of the step: srun reports every task killed."""
        lines = "".join(f"srun: error: {self.nodes[r // (self.ranks // len(self.nodes))]}: task {r}: Killed\n"
                        for r in range(self.ranks))
        self._exit(137, lines)


class FakeRunner(ScriptedRunner):
    """``spawn`` returns the scripted processes; the supervisor runs nothing synchronously."""

    def __init__(self, world: "World"):
        super().__init__()
        self.world = world
        self.spawns: List[dict] = []

    def spawn(self, argv, *, log_path, env=None, cwd=None, unset=()):
        argv = list(argv)
        self.spawns.append({"argv": argv, "env": dict(env or {}), "unset": tuple(unset), "cwd": cwd})
        name = _opt(argv, "job-name") or ""
        assert argv[0] == "srun", argv
        if name.startswith("clusterops-train-"):
            proc = FakeStep(self.world, argv, log_path, env or {})
            self.world.step = proc
        elif name == "clusterops-stacks":
            proc = FakeStacks(self.world, argv, log_path)
        else:
            proc = FakeCheck(self.world, argv, log_path)
        return proc


class World:
    """Fake time and the simulated ranks; ``fault(step_proc, now, step)`` is the scenario."""

    def __init__(self, tmp_path: Path, *, total_steps: int = 40, ckpt_every: int = 10):
        self.now = T0
        self.ckpt_dir = tmp_path / "ckpt"
        self.total_steps, self.ckpt_every = total_steps, ckpt_every
        self.spawned = 0
        self.step: Optional[FakeStep] = None
        self.requeued = False
        self.sleeps = 0
        self.hooks: List = []
        self.slurm = StepSlurm(self, NODES)
        self.runner = FakeRunner(self)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        assert self.sleeps < 5000, "the supervisor loop did not end"
        if self.requeued:
            raise EndedBySlurm()
        self.now += seconds
        for hook in self.hooks:
            hook(self.now)
        if self.step is not None:
            self.step.tick(self.now)

    def commit(self, step: int) -> None:
        if step in {s for s, _ in ck.committed_steps(self.ckpt_dir)}:
            return
        pc = ck.PendingCheckpoint(self.ckpt_dir, step)
        w = pc.open_file("model.bin")
        w.write(step.to_bytes(8, "little") * 16)
        pc.finish_file("model.bin", w)
        pc.commit(world_size=2)

    def fault(self, proc: FakeStep, now: float, step: int) -> None:
        pass


@pytest.fixture
def world(tmp_path):
    # SupervisorRun installs real handlers for USR1/TERM/INT: put pytest's back afterwards.
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    yield World(tmp_path)
    for s, h in saved.items():
        signal.signal(s, h)


def make_run(world: World, tmp_path: Path, **policy) -> SupervisorRun:
    pol = dict(nodes=2, hang_timeout_s=20, startup_timeout_s=30, stop_timeout_s=30, kill_timeout_s=10,
               progress_interval_s=5)
    pol.update(policy)
    cfg = RunConfig(command=["python", "train.py"], job_dir=tmp_path / "job", ckpt_dir=world.ckpt_dir,
                    policy=sv.Policy(**pol), nodes=list(NODES), job_id=JOB, python="python3",
                    env={"RANK": "9", "OMP_NUM_THREADS": "1"}, poll_s=1.0, node_poll_s=10.0)
    lines: List[str] = []
    run = SupervisorRun(cfg, slurm=world.slurm, runner=world.runner, clock=world.clock, sleep=world.sleep,
                        echo=lines.append)
    run.lines = lines
    return run


def events(tmp_path: Path, *kinds: str) -> List[dict]:
    return [r for r in tl.read(tmp_path / "job") if not kinds or r["event"] in kinds]


def kinds(tmp_path: Path) -> List[str]:
    return [r["event"] for r in events(tmp_path)]


def train_spawns(world: World) -> List[dict]:
    return [s for s in world.runner.spawns if (_opt(s["argv"], "job-name") or "").startswith("clusterops-train-")]


# ------------------------------------------------------------------------------ tests
def test_every_action_and_event_class_has_its_handler(world, tmp_path):
    run = make_run(world, tmp_path)
    actions = {c for c in vars(sv.machine).values() if isinstance(c, type) and issubclass(c, sv.Action)
               and c is not sv.Action}
    events_ = {c for c in vars(sv.machine).values() if isinstance(c, type) and issubclass(c, sv.Event)
               and c is not sv.Event}
    assert set(run._handlers) == actions
    assert set(sv.Supervisor.HANDLERS) == events_


def test_clean_run_preflight_launch_finish(world, tmp_path):
    run = make_run(world, tmp_path)
    assert run.run() == sv.EXIT_DONE
    assert kinds(tmp_path)[:4] == ["start", "preflight_start", "preflight", "launch"]
    assert kinds(tmp_path)[-2:] == ["step_exit", "done"]
    pre, train = world.runner.spawns[0], world.runner.spawns[1]
    assert pre["argv"][:2] == ["srun", "--job-name=clusterops-preflight"]
    assert pre["argv"][-8:] == ["python3", "-m", "clusterops", "health", "check", "--profile", "preflight", "--json"]
    assert "--kill-on-bad-exit=0" in pre["argv"] and "--nodelist=n1,n2" in pre["argv"]
    argv = train["argv"]
    assert argv[0] == "srun" and argv[-2:] == ["python", "train.py"]
    for opt in ("--job-name=clusterops-train-0", "--nodes=2", "--nodelist=n1,n2", "--ntasks=2",
                "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--wait=60", "--label"):
        assert opt in argv, (opt, argv)
    env = train["env"]
    # The contract variables, the rendezvous on the first node, and no torchrun leftovers:
    # not from the job's env: (RANK=9 above) and not inherited (unset for the child).
    assert env["MASTER_ADDR"] == "10.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
    assert env["CLUSTEROPS_RESUME_FROM"] == "" and env["CLUSTEROPS_RESTART_COUNT"] == "0"
    assert "RANK" not in env and env["OMP_NUM_THREADS"] == "1"
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= set(train["unset"])
    assert (tmp_path / "job" / "attempt-0" / "command.txt").read_text().startswith("srun --job-name=clusterops-train-0")
    assert json.loads((tmp_path / "job" / STATE_FILE).read_text())["last_ckpt_step"] == 40
    assert not any(c[0] in ("requeue", "cancel", "drain") for c in world.slurm.calls)


def test_rank_crash_restarts_from_the_latest_checkpoint(world, tmp_path):
    def crash(proc, now, step):
        if proc.attempt == 0 and step == 25:
            proc._exit(137, "0: step 25\nsrun: error: n2: task 1: Killed\n"
                            "srun: error: n1: task 0: Terminated\nsrun: Force Terminated StepId=4242.0\n")
    world.fault = crash
    run = make_run(world, tmp_path, preflight=None)
    assert run.run() == sv.EXIT_DONE
    exit0 = events(tmp_path, "step_exit")[0]
    assert exit0["cause"] == "rank_killed" and exit0["blamed"] == ["n2"] and exit0["returncode"] == 137
    assert exit0["failures"][0] == {"node": "n2", "rank": 1, "reason": "Killed"}
    # Liveness check on both nodes (srun --overlap printenv), then the restart from step 20.
    live = [s for s in world.runner.spawns if _opt(s["argv"], "job-name") == "clusterops-liveness"]
    assert len(live) == 1 and "--overlap" in live[0]["argv"] and live[0]["argv"][-2:] == ["printenv", "SLURMD_NODENAME"]
    second = train_spawns(world)[1]["env"]
    assert second["CLUSTEROPS_RESUME_FROM"].endswith("step_00000020")
    assert second["CLUSTEROPS_RESTART_COUNT"] == "1"
    assert [r["step"] for r in events(tmp_path, "resume")] == [None, 20]
    assert [r["cause"] for r in events(tmp_path, "restart")] == ["rank_killed"]
    assert not any(c[0] == "requeue" for c in world.slurm.calls)


def test_hang_captures_stacks_kills_the_step_and_restarts(world, tmp_path):
    def hang(proc, now, step):
        if proc.attempt != 0:
            return
        if step == 15 and 1 not in proc.frozen:
            proc.frozen[1] = now            # rank 1 stops (a SIGSTOP, a deadlock)
        if 1 in proc.frozen and now - proc.frozen[1] >= 8:
            proc.frozen[0] = now            # rank 0 reaches the next collective and blocks there
    world.fault = hang
    run = make_run(world, tmp_path, preflight=None)
    assert run.run() == sv.EXIT_DONE
    lost = events(tmp_path, "heartbeat_lost")[0]
    assert lost["culprits"] == [1] and 1 in lost["ranks"]
    stacks = [s["argv"] for s in world.runner.spawns if _opt(s["argv"], "job-name") == "clusterops-stacks"]
    assert stacks, world.runner.spawns
    for argv in stacks:
        assert "--overlap" in argv and f"--jobid={JOB}" in argv and "--ntasks=1" in argv
        assert argv[argv.index("-m") + 1] == "clusterops.supervisor.stacks"
        assert argv[argv.index("--step") + 1] == "0"
    rec = events(tmp_path, "stacks")[0]
    assert rec["complete"] and Path(rec["dir"], "n2.txt").read_text().startswith("=== rank")
    # The kill goes to the step through Slurm (scancel --signal=KILL JOB.0), not to srun.
    assert ("cancel", JOB, "KILL", 0) in world.slurm.calls
    exit0 = events(tmp_path, "step_exit")[0]
    assert exit0["cause"] == "hang" and exit0["blamed"] == ["n2"]
    assert train_spawns(world)[1]["env"]["CLUSTEROPS_RESUME_FROM"].endswith("step_00000010")
    assert kinds(tmp_path)[-1] == "done"


@pytest.mark.parametrize("ranks_see_sigterm", [False, True])
def test_preemption_seen_via_preempt_time_stops_saves_and_requeues(world, tmp_path, ranks_see_sigterm):
    def preempt(proc, now, step):
        if step == 17 and world.slurm.preempt_time is None:
            world.slurm.preempt_time = now
            if ranks_see_sigterm:
                proc.usr2 = True   # Slurm SIGTERMs the tasks: they save and exit 0 on their own
    world.fault = preempt
    run = make_run(world, tmp_path, preflight=None)
    with pytest.raises(EndedBySlurm):
        run.run()
    stop = events(tmp_path, "stop_requested")[0]
    assert stop["reason"] == "preemption"
    stopped = events(tmp_path, "stopped")[0]
    assert stopped["ckpt_step"] is not None and stopped["ckpt_step"] >= 17
    assert ("requeue", JOB) in world.slurm.calls
    req = events(tmp_path, "requeue")[0]
    assert req["restart_count"] == 1 and "preemption" in req["reason"]
    if not ranks_see_sigterm:
        # Seen on a node poll: the stop file and USR2 to the step (never to srun itself).
        assert (tmp_path / "job" / "attempt-0" / "stop").exists()
        assert ("cancel", JOB, "USR2", 0) in world.slurm.calls
    # The state file written before the requeue carries the progress to the next incarnation.
    memory = json.loads((tmp_path / "job" / STATE_FILE).read_text())
    assert memory["last_ckpt_step"] == stopped["ckpt_step"] and memory["attempts"] == 1


def test_time_limit_signal_stops_saves_and_requeues(world, tmp_path):
    sent = []

    def usr1(now):
        # Slurm's --signal=USR1@lead to the batch script: the real signal, the real handler.
        if world.step is not None and min(world.step.steps.values()) >= 12 and not sent:
            sent.append(now)
            os.kill(os.getpid(), signal.SIGUSR1)
    world.hooks.append(usr1)
    run = make_run(world, tmp_path, preflight=None)
    with pytest.raises(EndedBySlurm):
        run.run()
    assert sent
    assert [r["reason"] for r in events(tmp_path, "stop_requested")] == ["time_limit"]
    stopped = events(tmp_path, "stopped")[0]
    assert stopped["reason"] == "time_limit" and stopped["ckpt_step"] >= 12
    assert ("cancel", JOB, "USR2", 0) in world.slurm.calls and ("requeue", JOB) in world.slurm.calls
    assert kinds(tmp_path).index("stopped") < kinds(tmp_path).index("requeue")


def test_stop_signal_before_the_run_requeues_before_any_step(world, tmp_path):
    # The batch script noted a USR1 while its setup ran (or `clusterops supervise` caught one
    # before the run existed): nothing trained in this incarnation, nothing to save.
    cfg_run = make_run(world, tmp_path, preflight="quick")
    cfg_run.early_signals = [signal.SIGUSR1]
    with pytest.raises(EndedBySlurm):
        cfg_run.run()
    assert kinds(tmp_path)[:3] == ["start", "stop_requested", "requeue"]
    stop = events(tmp_path, "stop_requested")[0]
    assert stop["reason"] == "time_limit" and stop["state"] == "starting"
    assert "before the first step" in events(tmp_path, "requeue")[0]["reason"]
    assert world.runner.spawns == [] and ("requeue", JOB) in world.slurm.calls   # no preflight, no step


def test_requeue_whose_scontrol_slurm_killed_counts_when_slurm_took_it(world, tmp_path):
    # Slurm 24.11: the requeue ends the batch step, the scontrol inside it too, after the
    # controller took the requeue. That is a requeue, not a give-up.
    world.slurm.requeue_error = ClusteropsError("scontrol requeue 4242 exited with -15")
    run = make_run(world, tmp_path, preflight=None)
    run.early_signals = [signal.SIGUSR1]
    with pytest.raises(EndedBySlurm):
        run.run()
    assert not events(tmp_path, "give_up") and run.exit_code is None
    warn = [r["what"] for r in events(tmp_path, "warning")]
    assert any("Slurm has requeued the job" in w for w in warn), warn


def test_requeue_that_slurm_did_not_take_still_gives_up(world, tmp_path):
    world.slurm.requeue_error = ClusteropsError("scontrol requeue 4242 exited with 1")
    world.slurm.requeue_taken = False
    run = make_run(world, tmp_path, preflight=None)
    run.early_signals = [signal.SIGUSR1]
    run.run()
    gave = events(tmp_path, "give_up")
    assert gave and "requeue failed" in gave[0]["reason"] and world.slurm.restart_count == 0


def test_lead_signal_lost_before_the_handlers_is_made_up_by_the_end_time(world, tmp_path):
    # USR1 came while the batch script ignored it (Python starting): Slurm sends it once. The
    # end time says the lead has passed; the run requeues before launching anything.
    world.slurm.end_time = T0 + 25
    run = make_run(world, tmp_path, preflight=None)
    run.cfg.signal_lead_s = 30
    with pytest.raises(EndedBySlurm):
        run.run()
    assert [r["reason"] for r in events(tmp_path, "stop_requested")] == ["time_limit"]
    warn = [r["what"] for r in events(tmp_path, "warning")]
    assert any("no lead signal reached the supervisor" in w for w in warn), warn
    assert train_spawns(world) == [] and ("requeue", JOB) in world.slurm.calls


def test_lead_passed_while_training_stops_saves_once(world, tmp_path):
    # The end time comes within the lead during training and no USR1 arrives: the node poll
    # stops the ranks as the signal would have; a USR1 after that is no second stop.
    world.slurm.end_time = T0 + 10_000
    sent = []

    def shorten(now):
        if world.step is not None and min(world.step.steps.values()) >= 12 and world.slurm.end_time > now + 100:
            world.slurm.end_time = now + 40      # an administrator cut the time limit
        if events_ready() and not sent:
            sent.append(now)
            os.kill(os.getpid(), signal.SIGUSR1)

    def events_ready():
        try:
            return bool(events(tmp_path, "stop_requested"))
        except Exception:
            return False
    world.hooks.append(shorten)
    run = make_run(world, tmp_path, preflight=None)
    run.cfg.signal_lead_s = 60
    with pytest.raises(EndedBySlurm):
        run.run()
    assert [r["reason"] for r in events(tmp_path, "stop_requested")][:1] == ["time_limit"]
    assert len([w for w in events(tmp_path, "warning") if "no lead signal" in w["what"]]) == 1
    stopped = events(tmp_path, "stopped")[0]
    assert stopped["reason"] == "time_limit" and stopped["ckpt_step"] >= 12
    assert len(events(tmp_path, "requeue")) == 1


def test_no_lead_asked_no_end_time_query_at_start(world, tmp_path):
    world.slurm.end_time = T0 + 5      # the time limit is near, but no lead signal was asked for
    run = make_run(world, tmp_path, preflight=None)
    assert run.cfg.signal_lead_s == 0
    run.run()
    assert "stop_requested" not in kinds(tmp_path) and "done" in kinds(tmp_path)


def test_requeue_budget_spent_gives_up_without_requeue(world, tmp_path):
    def preempt(proc, now, step):
        if step == 12:
            proc.usr2 = True
            world.slurm.preempt_time = now
    world.fault = preempt
    run = make_run(world, tmp_path, preflight=None, max_requeues=1)
    run.cfg.slurm_restart_count = 1
    assert run.run() == sv.EXIT_REQUEUE_BUDGET
    assert not any(c[0] == "requeue" for c in world.slurm.calls)
    assert kinds(tmp_path)[-1] == "give_up"


def test_ranks_stopped_behind_our_back_is_not_finished(world, tmp_path):
    # Someone signalled the tasks (no PreemptTime): the ranks save, print "stopped step=N"
    # and exit 0. That is a stop to requeue from, not the end of training.
    def term(proc, now, step):
        if proc.attempt == 0 and step == 14:
            proc.usr2 = True
    world.fault = term
    run = make_run(world, tmp_path, preflight=None)
    with pytest.raises(EndedBySlurm):
        run.run()
    assert [r["reason"] for r in events(tmp_path, "stop_requested")] == ["signal"]
    assert events(tmp_path, "stopped")[0]["ckpt_step"] == 14
    assert ("requeue", JOB) in world.slurm.calls and "done" not in kinds(tmp_path)


def test_give_up_and_requeue_tell_the_site_webhooks(world, tmp_path, monkeypatch):
    """The site config's notify: webhooks hear of a requeue and of a job given up, with the
    exit code and the timeline's summary; a webhook that is down only leaves a warning."""
    from support.webhook import Hook

    hook = Hook()
    try:
        site = tmp_path / "site.yaml"
        site.write_text(f"notify:\n  - url: {hook.url}\n  - url: http://127.0.0.1:9/down\n    retries: 0\n")
        monkeypatch.setenv("CLUSTEROPS_HEALTH_SITE", str(site))

        def preempt(proc, now, step):
            if step == 12:
                proc.usr2 = True
                world.slurm.preempt_time = now
        world.fault = preempt
        run = make_run(world, tmp_path, preflight=None, max_requeues=1)
        run.cfg.slurm_restart_count = 1
        assert run.run() == sv.EXIT_REQUEUE_BUDGET
        got = [d for _, _, d in hook.got]
        assert [d["event"] for d in got] == ["job_given_up"]
        assert got[0]["details"]["exit_code"] == sv.EXIT_REQUEUE_BUDGET
        assert got[0]["details"]["timeline"]["restarts"] == 0
        assert any("notify job_given_up" in str(r.get("what")) for r in events(tmp_path, "warning"))

        hook.got.clear()
        again = tmp_path / "again"
        again.mkdir()
        world2 = World(again)
        world2.fault = preempt
        run = make_run(world2, again, preflight=None)
        run.cfg.notify_urls = [hook.url + "/from-the-job-spec"]   # the job spec's notify: URLs too
        with pytest.raises(EndedBySlurm):
            run.run()
        got = sorted((path.rsplit("/", 1)[-1], d["event"]) for path, _, d in hook.got)
        assert got == [("SECRET-TOKEN", "job_requeued"), ("from-the-job-spec", "job_requeued")]
    finally:
        hook.close()


def test_supervisor_writes_the_job_prometheus_textfile(world, tmp_path):
    """At each state change and at exit: the job's gauges, goodput and time lost by cause."""
    from prometheus_client.parser import text_string_to_metric_families

    from clusterops.supervisor import timeline as tl
    from clusterops.supervisor.run import METRICS_FILE_NAME

    def crash(proc, now, step):
        if proc.attempt == 0 and step == 25:
            proc._exit(137, "0: step 25\nsrun: error: n2: task 1: Killed\n")
    world.fault = crash
    run = make_run(world, tmp_path, preflight=None)
    prom = tmp_path / "job" / METRICS_FILE_NAME
    assert run.run() == sv.EXIT_DONE
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    job = (("job", JOB),)
    assert samples[("clusterops_job_finished", job)] == 1
    assert samples[("clusterops_job_restarts", job)] == 1
    rep = tl.goodput_report(tl.load(tmp_path / "job")[0])
    # the file was written at exit: it holds the figures of the whole, final timeline
    assert samples[("clusterops_job_goodput_ratio", job)] == pytest.approx(rep["goodput"])
    assert 0 < rep["goodput"] < 1 and rep["lost_s"]["recomputed"] > 0 and rep["mttr_s"] > 0
    assert samples[("clusterops_job_lost_seconds", (("cause", "recomputed"),) + job)] == pytest.approx(
        rep["lost_s"]["recomputed"])


def test_srun_native_task_gets_torch_env_contract_from_its_own_slurm_values(world, tmp_path):
    """Issue 18: the step unsets RANK... (no leftovers) and each task sets them again from its
    own SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID, so a plain init_process_group() (env://) works.
    The task's part of the step's argv is run here with bash, as slurmstepd would run it."""
    import subprocess
    import sys

    run = make_run(world, tmp_path)
    assert run.run() == sv.EXIT_DONE
    argv = world.runner.spawns[1]["argv"]
    assert argv[-2:] == ["python", "train.py"]
    start = argv.index("bash")
    task = argv[start:-2] + [sys.executable, "-c",
                             "import json, os; print(json.dumps(dict(os.environ, pid=str(os.getpid()))))"]
    # (SLURM_NODEID 2: a step on nodes 1 and 3 of the allocation; the node rank is still 1.)
    for procid, localid, nodeid in ((0, 0, 0), (1, 0, 2)):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(procid), SLURM_LOCALID=str(localid), SLURM_NODEID=str(nodeid),
                   LOCAL_WORLD_SIZE="77")
        p = subprocess.Popen(task, env=env, stdout=subprocess.PIPE, text=True)
        out = json.loads(p.communicate()[0])
        assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_RANK"], out["LOCAL_WORLD_SIZE"], out["NODE_RANK"]) == \
            (str(procid), "2", str(localid), "1", str(procid))
        assert out["pid"] == str(p.pid)     # exec'd: the task's process is the training process


def test_node_poll_retries_once_on_its_own_schedule(world, tmp_path, monkeypatch):
    """One retry rule, one budget: the client the run connects asks the controller once per
    poll (no client-side retries, no pause in the loop), and the poll backs off itself."""
    from clusterops.runner import CommandError
    from clusterops.slurm.settings import SlurmSettings

    monkeypatch.setenv("CLUSTEROPS_SLURM_BACKEND", "cli")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    down = CommandError(["scontrol"], 1, "slurm_load_node error: Unable to contact slurm controller")
    runner = ScriptedRunner([down, down, down])
    cfg = make_run(world, tmp_path).cfg
    run = SupervisorRun(cfg, runner=runner, clock=world.clock, sleep=world.sleep, echo=lambda _: None)
    assert isinstance(run.slurm.settings, SlurmSettings) and run.slurm.read_attempts == 1
    sleeps = world.sleeps
    assert run._poll_nodes(T0) is None
    assert len(runner.calls) == 1 and world.sleeps == sleeps      # one scontrol, no pause
    assert run.next_node_poll == T0 + 20.0                          # node_poll_s * 2
    assert run._poll_nodes(T0 + 20.0) is None
    assert len(runner.calls) == 2 and run.next_node_poll == T0 + 20.0 + 40.0


class _DoneRendezvous:
    """The in-process rendezvous as the supervisor's loop sees it once every rank has told
    it "done" (``finished``), or not yet (a step whose ranks went quiet without a word)."""

    def __init__(self, finished: bool):
        self.finished = finished
        self.fallback = None
        self.fallback_acted = False

        class _M:
            lost_nodes: set = set()      # no node lost whole: nothing for _end_finished_step
            plan = None

            @staticmethod
            def lost_tasks():
                return set()

            @staticmethod
            def gone_nodes():
                return set()

        self.membership = _M()
        self.membership.finished = finished

    def task_ended(self, task, node, reason):
        pass

    def drain_notes(self):
        return []

    def drain_refills(self):
        return []

    def close(self):
        pass


@pytest.mark.parametrize("finished,exit_after_s,hang", [(True, 40, False), (False, 40, True), (True, 90, True)])
def test_in_process_ranks_done_their_exit_is_not_a_hang(world, tmp_path, finished, exit_after_s, hang):
    """Every rank said done to the rendezvous, then the step takes 40 s to exit (the
    interpreters ending on a loaded node) with no heartbeat: within the grace it is waited
    for (done, no hang); a step whose ranks went quiet without saying so, or one still there
    after the grace, is a hang as before."""
    run = make_run(world, tmp_path, preflight=None)
    quiet = {}

    def finish(proc, now, step):
        if proc.attempt != 0:
            return
        if step == 30 and not quiet:
            quiet["at"] = now
            proc.frozen.update({r: now for r in range(proc.ranks)})
            run.rdzv = _DoneRendezvous(finished)
        if quiet and now - quiet["at"] >= exit_after_s:
            proc._exit(0, "0: done step=30\n")
    world.fault = finish
    world.total_steps = 31       # never reached: the ranks go quiet at 30
    assert run.run() == sv.EXIT_DONE
    assert bool(events(tmp_path, "heartbeat_lost")) == hang
    assert len(events(tmp_path, "launch")) == (2 if hang else 1)
