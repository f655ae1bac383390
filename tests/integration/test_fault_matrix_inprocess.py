"""The fault matrix on the in-process path, on the real dev cluster with real faults.

examples/train_recoverable.py (``clusterops.recover.run``) under ``supervise: inprocess:
{standbys_per_node: 1}``: every node runs its rank and one warm standby. The cases of
tests/integration/test_fault_matrix.py that test_inprocess.py does not already cover
(kill -9, SIGSTOP, the same rank twice, the refill, a node lost with a spare), each ending
as the relaunch path's case does (done, or given up for the crash loop), the final weights
bitwise equal to an uninterrupted run, no committed checkpoint damaged, and the timeline
saying which path healed the fault:

- (d) a node lost without a spare: healed in-process (its rank to another node's standby)
  or, when the step ends first, requeued excluding the node;
- (e) the time limit and (f) preemption: the ranks stop, save the step reached and exit,
  the standbys end with them, the job is requeued and resumes there (0 steps lost);
- (g) a corrupted latest checkpoint before a restart: the second loss of a rank (gated on
  the corruption) falls back to the relaunch, which skips the broken checkpoint;
- (i) a script that always fails at start: given up, no loop;
- (j) a node failing preflight: excluded, the spare used, and a kill -9 there healed in-process;
- a second fault during the recovery itself: the process that takes the lost rank over
  dies once it has the state; the rendezvous falls back to the relaunch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support import faultkit as fk
from support.wait import wait_for
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 60
CKPT_EVERY = 10
SCRIPT = fk.REPO / "examples" / "train_recoverable.py"
INPROC = {"inprocess": {"standbys_per_node": 1}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of uninterrupted runs, per (world size, steps), computed once."""
    cache = {}

    def get(world: int, steps: int = STEPS) -> Path:
        if (world, steps) not in cache:
            d = tmp_path_factory.mktemp(f"ref-w{world}-s{steps}")
            out = d / "final.pt"
            fk.run_local(world, ["--steps", str(steps), "--ckpt-every", str(CKPT_EVERY), "--out", str(out)],
                         workdir=d, script=SCRIPT)
            cache[(world, steps)] = out
        return cache[(world, steps)]

    return get


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


def make_job(tmp_path, name, *, supervise=None, **kw) -> fk.TrainJob:
    kw.setdefault("steps", STEPS)
    kw.setdefault("ckpt_every", CKPT_EVERY)
    kw.setdefault("step_sleep", 0.1)
    return fk.TrainJob(root=tmp_path / name, name=name, script=SCRIPT, supervise={**INPROC, **(supervise or {})},
                       **kw)


events = fk.events


def assert_healed(job, slurm, reference, world, *, steps=STEPS, ignore_ckpts=(), timeout_s=300):
    return fk.assert_healed(job, slurm, reference(world, steps), timeout_s=timeout_s, ignore_ckpts=ignore_ckpts)


def step_logs(job) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(job.job_dir.glob("attempt-*/*.log")))


# ----------------------------------------------------------------------------- (d) node lost, no spare
@pytest.mark.timeout(420)
def test_d_lost_node_without_spare_in_process(cluster, slurm, reference, tmp_path):
    """The dev cluster's node kill of node3 (slurmd and every process of it: rank 2 and
    node3's standby) with no spare. Either right outcome: the lost rank goes to another
    node's standby and the step finishes (healed in-process: one launch; node3 drained if Slurm
    marked it down before the end, else left to Slurm's own down state),
    or the step is ended first (Slurm marks node3 down, or the rendezvous falls back) and,
    with no spare, the job is requeued excluding node3 and resumes from its checkpoint."""
    job = make_job(tmp_path, "ip-d", nodes=3, supervise={"drain_bad_nodes": True})
    job.submit()
    job.wait_step(20)
    cluster.kill_node("node3")
    info, story = assert_healed(job, slurm, reference, 3, timeout_s=400)
    healed_inproc = bool(events(job, "inproc_first_step")) and len(events(job, "launch")) == 1
    if healed_inproc:
        plans = [r for r in events(job, "inproc_rendezvous") if r.get("replaced")]
        assert plans and all(m["from"] == "node3" and m["to"] != "node3" for m in plans[-1]["replaced"]), story
        assert info.restart_count == 0, story
    else:
        rq = events(job, "requeue")
        assert len(rq) == 1 and rq[0]["exclude"] == ["node3"], story
        assert info.restart_count == 1, story
        second = [r for r in events(job, "launch") if r["incarnation"] == 1]
        assert second and "node3" not in second[0]["nodes"], story
        resumed = [r for r in events(job, "resume") if r["incarnation"] == 1]
        assert resumed and resumed[0]["step"] >= 20, story
    print(f"(d) healed {'in-process' if healed_inproc else 'by requeue excluding node3'}")
    node3 = slurm.node("node3")
    if not healed_inproc or events(job, "node_down"):
        # Drained on Slurm's word (node_down) or a failed liveness check, never on the
        # rendezvous's alone: healed in-process before Slurm marked node3 down, the job ends
        # without draining it (Slurm marks it down itself).
        assert node3.drained and (node3.reason or "").startswith("clusterops:supervisor: "), story
    else:
        assert not node3.drained and node3.is_down, story


# ----------------------------------------------------------------------------- (e) time limit
@pytest.mark.timeout(600)
def test_e_time_limit_stops_saves_requeues_zero_steps_lost(cluster, slurm, reference, tmp_path):
    # Slurm checks time limits periodically: USR1@90 of a 3-minute job arrives 90-110 s in.
    # A 1-minute job (the relaunch path's case) is too short here: the 8 processes took up
    # to 40 s to import torch on the loaded machine, so the lead signal came before the
    # ranks ran and the stop timed out. 900 steps of 0.1 s outlast the signal; the second
    # incarnation finishes the rest.
    steps = 900
    job = make_job(tmp_path, "ip-e", nodes=4, steps=steps, ckpt_every=100,
                   spec_extra={"time": "3", "signal_lead_s": 90}, supervise={"stop_timeout_s": 60})
    job.submit()
    # stop_timeout_s 60 (shorter than the lead, as the spec requires): the 8 interpreters'
    # exit after the save took over 20 s in a full suite run (3 workers on 2 cores), and the
    # step was ended by the stop timeout. A 3-minute job with a 90 s lead: the signal still
    # comes 90-110 s in, after the ranks run.
    info, story, stopped = fk.time_limit_requeue(job, slurm, reference(4, steps), requeue_within_s=240)
    # The first step ended by itself: the ranks stopped, the standbys left with them (rc 0).
    assert stopped["returncode"] == 0 and not [r for r in events(job, "step_exit") if r["incarnation"] == 0], story
    assert not events(job, "inproc_fault") and not events(job, "inproc_fallback"), story


# ----------------------------------------------------------------------------- (f) preemption
@pytest.mark.timeout(300)
def test_f_preemption_sigterm_everywhere_zero_steps_lost(cluster, slurm, reference, tmp_path):
    job = make_job(tmp_path, "ip-f", nodes=4, ckpt_every=25)
    job.submit()
    job.wait_step(18)
    # Slurm's preemption: SIGTERM to the batch shell and every task of every step (the
    # standbys too: they must not die of it, nor outlive the ranks).
    slurm.signal(job.job_id, "TERM", full=True)
    info, story = assert_healed(job, slurm, reference, 4)
    stop = events(job, "stop_requested")
    assert stop and stop[0]["reason"] == "preemption", story
    stopped = events(job, "stopped")[0]
    assert stopped["ckpt_step"] is not None and stopped["ckpt_step"] >= 18, story
    later = [r for r in events(job, "resume") if r["incarnation"] == 1]
    assert later and later[0]["step"] == stopped["ckpt_step"], story
    beats = [r["max_step"] for r in events(job, "progress") if r["incarnation"] == 0]
    assert stopped["ckpt_step"] >= max(beats, default=0), story       # zero steps lost
    assert len(events(job, "requeue")) == 1 and info.restart_count == 1, story
    assert not events(job, "inproc_fault") and not events(job, "inproc_fallback"), story
    assert stopped["returncode"] == 0 and not [r for r in events(job, "step_exit") if r["incarnation"] == 0], story


# ----------------------------------------------------------------------------- (g) corrupt checkpoint
@pytest.mark.timeout(300)
def test_g_corrupted_latest_checkpoint_skipped_by_the_fallback_relaunch(cluster, slurm, reference, tmp_path):
    """Rank 2 SIGKILLs itself at step 15 (healed in-process), then again at step 35, but only
    once the test has corrupted the latest checkpoint (step 30): the rank waits for the
    gate file before dying. The second loss of the same rank falls back to the relaunch,
    which skips the damaged step-30 checkpoint and resumes from step 20, bitwise."""
    gate = tmp_path / "gate"
    c2 = tmp_path / "c2"
    job = make_job(tmp_path, "ip-g", nodes=4,
                   train_args=["--crash-at-step", "15", "--crash-rank", "2", "--crash-marker", str(tmp_path / "c1"),
                               "--second-crash-at-step", "35", "--second-crash-marker", str(c2),
                               "--second-crash-gate", str(gate)])
    job.submit()
    wait_for(c2.exists, 180, "rank 2 at its second fault", interval_s=0.05,
             detail=lambda: tl.format_text(job.timeline()))
    broken = fk.corrupt_latest_checkpoint(job.ckpt_dir)
    gate.write_text("go\n")
    info, story = assert_healed(job, slurm, reference, 4, ignore_ckpts=[broken])
    from clusterops.checkpoint import parse_step

    assert parse_step(broken.name) == 30, story
    assert len(events(job, "inproc_first_step")) == 1, story           # the first loss healed in-process
    fb = events(job, "inproc_fallback")
    assert len(fb) == 1 and "second time" in fb[0]["reason"], story    # the second fell back
    bad = events(job, "checkpoint_bad")
    assert bad and broken.name in [Path(b["path"]).name for b in bad], story
    resumes = events(job, "resume")
    assert [r["step"] for r in resumes] == [None, 20] and str(broken) in resumes[1]["skipped"], story
    assert len(events(job, "launch")) == 2 and events(job, "restart"), story


# ----------------------------------------------------------------------------- (i) crash loop
@pytest.mark.timeout(240)
def test_i_crash_at_start_gives_up_without_looping(cluster, slurm, reference, tmp_path):
    # --samples 1: every rank exits 1 as its generation 0 starts (the standbys wait on).
    job = make_job(tmp_path, "ip-i", nodes=4, train_args=["--samples", "1"],
                   supervise={"no_progress_restarts": 1, "max_restarts": 5, "max_requeues": 3})
    job.submit()
    info = job.wait_end(slurm)
    story = tl.format_text(job.timeline())
    assert info.exit_code == sv.EXIT_NO_PROGRESS, f"{info.state} {info.exit_code}\n{story}"
    assert info.restart_count == 0 and not events(job, "requeue"), story
    assert len(events(job, "launch")) == 2, story                     # first try + K=1 restart
    assert all(e["cause"] in ("program_error", "rank_exit") for e in events(job, "step_exit")), story
    give_up = events(job, "give_up")
    assert give_up and give_up[0]["code"] == sv.EXIT_NO_PROGRESS, story
    assert not events(job, "node_bad") and not events(job, "inproc_first_step"), story
    assert "too small" in step_logs(job), story


# ----------------------------------------------------------------------------- (j) preflight
@pytest.mark.timeout(300)
def test_j_node_failing_preflight_is_excluded_spare_used_heals_in_process(cluster, slurm, reference, tmp_path):
    profile = tmp_path / "needs-scratch.yaml"
    profile.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                       "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}\", min_free_gb: 0.001}\n")
    scratch = cluster.scratch_dir("node3")
    hidden = scratch.with_name("node3.hidden")
    shutil.move(str(scratch), str(hidden))
    try:
        # On the nodes preflight chose, the in-process path heals a kill -9 of the rank
        # that runs on the spare (rank 2, node4).
        job = make_job(tmp_path, "ip-j", nodes=3,
                       supervise={"spare_nodes": 1, "preflight": str(profile), "drain_bad_nodes": True},
                       train_args=["--crash-at-step", "23", "--crash-rank", "2",
                                   "--crash-marker", str(tmp_path / "crashed")])
        job.submit()
        info, story = assert_healed(job, slurm, reference, 3)
        pf = events(job, "preflight")[0]
        assert pf["statuses"]["node3"] == "fail" and pf["statuses"]["node1"] in ("pass", "warn"), story
        assert [r["nodes"] for r in events(job, "launch")] == [["node1", "node2", "node4"]], story
        rdzv = events(job, "inproc_rendezvous")
        assert len(rdzv) == 1 and [(m["rank"], m["from"], m["to"]) for m in rdzv[0]["replaced"]] == \
            [(2, "node4", "node4")], story
        assert rdzv[0]["step"] == 23 and events(job, "inproc_first_step") and not events(job, "restart"), story
        node3 = slurm.node("node3")
        assert node3.drained and node3.reason.startswith("clusterops:supervisor: preflight fail: "), node3
    finally:
        if hidden.exists():
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.move(str(hidden), str(scratch))


# ----------------------------------------------------------------------------- a fault in the recovery
@pytest.mark.timeout(300)
def test_fault_during_recovery_falls_back_to_relaunch_bitwise(cluster, slurm, reference, tmp_path):
    """Rank 2 SIGKILLs itself at step 15; node3's standby takes rank 2 over, receives the
    state and SIGKILLs itself before its first step. The recovery to generation 1 cannot
    finish: the rendezvous falls back, the supervisor relaunches the step, which resumes
    from the step-10 checkpoint and ends bitwise equal."""
    c1, c2 = tmp_path / "c1", tmp_path / "c2"
    job = make_job(tmp_path, "ip-r", nodes=4,
                   train_args=["--crash-at-step", "15", "--crash-rank", "2", "--crash-marker", str(c1),
                               "--crash-when-restored", str(c2)])
    job.submit()
    info, story = assert_healed(job, slurm, reference, 4)
    assert c1.exists() and c2.exists(), story
    rdzv = events(job, "inproc_rendezvous")
    assert len(rdzv) == 1 and rdzv[0]["step"] == 15 and [m["rank"] for m in rdzv[0]["replaced"]] == [2], story
    assert not events(job, "inproc_first_step"), story                 # generation 1 never trained
    fb = events(job, "inproc_fallback")
    assert len(fb) == 1 and "during the recovery to generation 1" in fb[0]["reason"], story
    assert len(events(job, "launch")) == 2 and events(job, "restart"), story
    resumes = events(job, "resume")
    assert resumes[-1]["step"] == 10, story
    rep = tl.goodput_report(job.timeline())
    assert rep["restarts"] == 1 and rep["inprocess"]["recoveries"] == 0, story
