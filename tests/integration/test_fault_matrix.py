"""The supervisor's fault matrix, on the real dev cluster with real faults.

Each test submits examples/train.py (gloo/CPU, one rank per node) through
`clusterops launch submit` with a `supervise:` section, injects one fault for real, and
checks that the job ends done (or cleanly given up, for the crash loop), that the final
weights are bitwise identical to an uninterrupted run of the same world size, that no
committed checkpoint is damaged, and that the timeline tells the story.

Runs are short (60 steps, 0.1 s a step) so the whole matrix fits in minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support import faultkit as fk
from support.wait import wait_for
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 60
CKPT_EVERY = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of uninterrupted runs, per (world size, steps), computed once."""
    cache = {}

    def get(world: int, steps: int = STEPS) -> Path:
        key = (world, steps)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref-w{world}-s{steps}")
            out = d / "final.pt"
            fk.run_local(world, ["--steps", str(steps), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0",
                                 "--out", str(out)], workdir=d)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.fixture(params=["cli", "pyslurm"])
def backend(request, slurm):
    """The Slurm backend the submission and the job's supervisor use (CLUSTEROPS_SLURM_BACKEND,
    exported into the job by sbatch). Asked for explicitly, so a pyslurm that cannot be used
    fails the run (exit 2) rather than quietly falling back. The pyslurm half runs on the
    tier whose Slurm pyslurm was built for (scripts/test-slurm-25.11.sh)."""
    if request.param == "pyslurm":
        from clusterops.slurm.pyslurm_backend import mismatch

        why = mismatch(slurm.controller_version())
        if why and os.environ.get("CLUSTEROPS_TEST_REQUIRE_PYSLURM"):
            pytest.fail(f"the pyslurm backend must run on this tier: {why}")
        if why:
            pytest.skip(why)
    return {"CLUSTEROPS_SLURM_BACKEND": request.param}


def make_job(tmp_path, name, **kw) -> fk.TrainJob:
    kw.setdefault("steps", STEPS)
    kw.setdefault("ckpt_every", CKPT_EVERY)
    return fk.TrainJob(root=tmp_path / name, name=name, **kw)


events = fk.events


def assert_healed(job, slurm, reference, world, *, steps=STEPS, ignore_ckpts=()):
    return fk.assert_healed(job, slurm, reference(world, steps), ignore_ckpts=ignore_ckpts)


def first_progress_after(job, t):
    for r in job.timeline():
        if r["event"] == "progress" and r["t"] > t:
            return r
    return None


# ----------------------------------------------------------------------------- (a) kill -9
@pytest.mark.timeout(240)
def test_a_kill9_rank_restarts_in_allocation(cluster, slurm, reference, tmp_path, backend):
    job = make_job(tmp_path, "fm-a", nodes=4)
    job.submit(env=backend)
    job.wait_step(25)
    victim = job.signal_rank(2, signal.SIGKILL)
    assert victim
    info, story = assert_healed(job, slurm, reference, 4)
    exits = events(job, "step_exit")
    assert exits[0]["cause"] == "rank_killed" and exits[0]["blamed"] == ["node3"], story
    assert exits[0]["failures"][0]["rank"] == 2
    launches = events(job, "launch")
    assert len(launches) == 2 and launches[1]["nodes"] == ["node1", "node2", "node3", "node4"], story
    assert launches[1]["resume_step"] >= 20
    assert info.restart_count == 0 and not events(job, "requeue")   # healed inside the allocation


# ----------------------------------------------------------------------------- (b) SIGSTOP
@pytest.mark.timeout(240)
def test_b_stopped_rank_is_a_hang_stacks_then_restart(cluster, slurm, reference, tmp_path):
    job = make_job(tmp_path, "fm-b", nodes=4, supervise={"hang_timeout_s": 10})
    job.submit()
    job.wait_step(25)
    job.signal_rank(1, signal.SIGSTOP)
    info, story = assert_healed(job, slurm, reference, 4)
    lost = events(job, "heartbeat_lost")
    # The stopped rank is stale, or (on a loaded machine another rank's beat went stale first,
    # the others blocking in the collective a moment later) it is the one that sent no dump.
    named = events(job, "hang_named")
    assert lost and (1 in lost[0]["ranks"] or (named and 1 in named[0]["silent"])), story
    stacks = events(job, "stacks")
    assert stacks, story
    dumps = "".join(p.read_text() for p in Path(stacks[0]["dir"]).glob("node*.txt"))
    assert re.search(r"=== rank 1 pid \d+ state T \(stopped\) ===", dumps), dumps
    exits = events(job, "step_exit")
    assert exits[0]["cause"] == "hang", story
    assert len(events(job, "launch")) == 2 and not events(job, "requeue")


# ----------------------------------------------------------------------------- (c) node lost, spare
@pytest.mark.timeout(240)
def test_c_lost_node_replaced_by_spare(cluster, slurm, reference, tmp_path):
    job = make_job(tmp_path, "fm-c", nodes=3, supervise={"spare_nodes": 1})
    job.submit()
    job.wait_step(20)
    cluster.kill_node("node3")
    info, story = assert_healed(job, slurm, reference, 3)
    bad = events(job, "node_bad")
    assert bad and bad[0]["node"] == "node3", story
    assert events(job, "spare_used")[0]["nodes"] == ["node4"], story
    assert events(job, "launch")[-1]["nodes"] == ["node1", "node2", "node4"]
    assert info.restart_count == 0 and not events(job, "requeue")


# ----------------------------------------------------------------------------- (d) node lost, no spare
@pytest.mark.timeout(300)
def test_d_lost_node_without_spare_requeues_excluding_it(cluster, slurm, reference, tmp_path, backend):
    job = make_job(tmp_path, "fm-d", nodes=3, supervise={"drain_bad_nodes": True})
    job.submit(env=backend)
    job.wait_step(20)
    cluster.kill_node("node3")
    info, story = assert_healed(job, slurm, reference, 3)
    rq = events(job, "requeue")
    assert len(rq) == 1 and rq[0]["exclude"] == ["node3"], story
    assert info.restart_count == 1
    second = [r for r in events(job, "launch") if r["incarnation"] == 1]
    assert second and "node3" not in second[0]["nodes"], story
    node3 = slurm.node("node3")
    assert node3.drained and (node3.reason or "").startswith("clusterops:supervisor: ")


# ----------------------------------------------------------------------------- (m) batch host lost
@pytest.mark.timeout(300)
def test_m_batch_host_lost_ranks_requeue_resumed_bitwise(cluster, slurm, reference, tmp_path):
    """A power cut of the batch host (slurmd, slurmstepds, supervisor, rank 0 at once):
    the surviving ranks hear no beacon, one of them requeues the job, and the next
    incarnation resumes from the latest checkpoint on healthy nodes, bitwise."""
    job = make_job(tmp_path, "fm-m", nodes=3)
    job.submit(env={"CLUSTEROPS_SUPERVISOR_LOST_S": "3"})
    job.wait_step(20)
    host = slurm.job(job.job_id).batch_host
    assert host == "node1"
    from clusterops.devcluster import _stepds_with_sockets_under
    from clusterops.runner import pid_alive

    stepds = _stepds_with_sockets_under(str(cluster.state / "spool" / host))
    t_cut = time.time()
    victims = cluster.kill_node(host, power_cut=True)
    # slurmd, the node's slurmstepds (batch step and training step), the supervisor, rank 0.
    assert stepds and set(stepds) <= set(victims) and len(victims) >= 4, (stepds, victims)
    wait_for(lambda: not any(pid_alive(p) for p in victims), 5, "the node's processes gone")
    # The latest checkpoint at the cut (the supervisor may not have lived to record it).
    at_cut = max(int(p.name.split("_")[1]) for p in job.ckpt_dir.glob("step_*") if p.name.split("_")[1].isdigit())
    info, story = assert_healed(job, slurm, reference, 3)
    lost, take = events(job, "supervisor_lost"), events(job, "takeover")
    assert len(lost) == 1 and lost[0]["batch_host"] == host and lost[0]["incarnation"] == 0, story
    asked = [r for r in take if r.get("asked")]
    # Asked once, by a surviving rank (normally the lowest: see clusterops.watchdog).
    assert len(asked) == 1 and asked[0]["rank"] in (1, 2) and not [r for r in take if r.get("failed")], story
    assert info.restart_count == 1, story
    second = [r for r in events(job, "launch") if r["incarnation"] == 1]
    assert second and host not in second[0]["nodes"], story
    resumed = [r for r in events(job, "resume") if r["incarnation"] == 1]
    assert resumed and resumed[0]["step"] == at_cut >= 10, story
    # Within 2 x SlurmdTimeout + 30 s the next incarnation runs and resumes from the latest
    # checkpoint (its supervisor's launch, resuming from it); its first step is reported.
    start = next(r for r in events(job, "start") if r["incarnation"] == 1)
    first = next(r for r in events(job, "progress") if r["incarnation"] == 1 and r["t"] > t_cut)
    bound = 2 * cluster.config().slurmd_timeout_s + 30
    print(f"power cut -> requeue asked {asked[0]['t'] - t_cut:.1f} s, next incarnation started "
          f"{start['t'] - t_cut:.1f} s, resumed (launch) {resumed[0]['t'] - t_cut:.1f} s, "
          f"first step {first['t'] - t_cut:.1f} s (bound {bound} s)")
    assert resumed[0]["t"] - t_cut <= bound, story


# ----------------------------------------------------------------------------- (e) time limit
# The budget holds the dev cluster's start when this is a worker's first test, the wait
# for the lead signal (up to 150 s), the requeue delay and the second incarnation's steps:
# at 300 s pytest-timeout ended the test under load and its teardown's scancel reached the
# supervisor as a SIGTERM (taken, rightly, for a preemption).
@pytest.mark.timeout(600)
def test_e_time_limit_stops_saves_requeues_zero_steps_lost(cluster, slurm, reference, tmp_path):
    steps = 900
    ref = reference(4, steps)
    # USR1@80 of a 2-minute job arrives 40-70 s in (Slurm checks every 30 s), after the ranks
    # run even on a loaded machine: with a 1-minute job and a 30 s lead it came 10-30 s in,
    # and a full suite run once saw it before the supervisor itself had started. 900 steps of
    # 0.1 s outlast it; the second incarnation finishes the rest.
    job = make_job(tmp_path, "fm-e", nodes=4, steps=steps, ckpt_every=100,
                   spec_extra={"time": "2", "signal_lead_s": 80}, supervise={"stop_timeout_s": 40})
    job.submit()
    fk.time_limit_requeue(job, slurm, ref, requeue_within_s=150)


def _setup(job: fk.TrainJob, *lines: str) -> list:
    """The job's setup lines (the PATH line make_job writes) with ``lines`` after it."""
    return [*job.spec()["setup"], *lines]


@pytest.mark.timeout(300)
def test_e_lead_signal_during_setup_requeues_before_any_step(cluster, slurm, reference, tmp_path):
    # The lead-time USR1 reaches the batch shell while its setup runs (a short job, a slow
    # setup): the script notes it instead of dying of it, the supervisor requeues before
    # launching anything (nothing trained, nothing to save), and the next incarnation trains.
    ref = reference(4, STEPS)
    job = make_job(tmp_path, "fm-e-setup", nodes=4, supervise={"stop_timeout_s": 20})
    marker = job.root / "in-setup"
    job.spec_extra = {"signal_lead_s": 30,
                      "setup": _setup(job, f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then touch {marker}; sleep 6; fi')}
    job.submit()
    wait_for(marker.exists, 120, "the batch script's setup", interval_s=0.2)
    slurm.signal(job.job_id, "USR1", batch=True)
    info, story = fk.assert_healed(job, slurm, ref)
    stop = events(job, "stop_requested")
    assert [(r["reason"], r["state"], r["incarnation"]) for r in stop] == [("time_limit", "starting", 0)], story
    assert not [r for r in events(job, "launch") if r["incarnation"] == 0], story
    assert len(events(job, "requeue")) == 1 and info.restart_count == 1, story


@pytest.mark.timeout(300)
def test_e_lead_signal_lost_before_the_supervisor_is_made_up_by_the_end_time(cluster, slurm, reference, tmp_path):
    # The lead signal is lost (the setup ignores USR1, as the script does from just before
    # `exec clusterops supervise` until its handlers are in). The supervisor reads Slurm's
    # end time, sees the lead passed, and requeues before launching: the job is not run
    # into its time limit unsaved. USR1@115 of a 2-minute job is sent 5-35 s in, during the
    # 45 s setup.
    ref = reference(4, STEPS)
    job = make_job(tmp_path, "fm-e-lost", nodes=4, supervise={"stop_timeout_s": 20})
    job.spec_extra = {"time": "2", "signal_lead_s": 115,
                      "setup": _setup(job, "trap '' USR1",
                                      'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 45; fi')}
    job.submit()

    def requeued():
        assert not events(job, "give_up"), tl.format_text(job.timeline())
        return events(job, "requeue")

    job.wait_running(slurm)
    wait_for(requeued, 150, "the requeue", interval_s=1,
             detail=lambda: f"{job.slurm_says(slurm)}\n{tl.format_text(job.timeline())}")
    slurm.update_job(job.job_id, TimeLimit="10")     # room for the next incarnation
    info, story = fk.assert_healed(job, slurm, ref)
    warn = [r["what"] for r in events(job, "warning") if r["incarnation"] == 0]
    assert any("no lead signal reached the supervisor" in w for w in warn), story
    stop = events(job, "stop_requested")
    assert [(r["reason"], r["state"]) for r in stop] == [("time_limit", "starting")], story
    assert not [r for r in events(job, "launch") if r["incarnation"] == 0], story
    assert info.restart_count == 1, story


# ----------------------------------------------------------------------------- (f) preemption
@pytest.mark.timeout(240)
def test_f_preemption_sigterm_everywhere_zero_steps_lost(cluster, slurm, reference, tmp_path):
    job = make_job(tmp_path, "fm-f", nodes=4, ckpt_every=25)
    job.submit()
    job.wait_step(18)
    # What Slurm's preemption does: SIGTERM to the batch shell and every task of every step.
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
    assert len(events(job, "requeue")) == 1 and info.restart_count == 1


# ----------------------------------------------------------------------------- (g) corrupt checkpoint
@pytest.mark.timeout(240)
def test_g_corrupted_latest_checkpoint_is_skipped_on_restart(cluster, slurm, reference, tmp_path):
    job = make_job(tmp_path, "fm-g", nodes=4)
    job.submit()
    job.wait_step(33)
    job.signal_rank(3, signal.SIGSTOP)          # freeze training so "latest" stays latest
    time.sleep(0.5)
    broken = fk.corrupt_latest_checkpoint(job.ckpt_dir)
    # Malformed step directories newer than everything: the supervisor and the ranks'
    # resume() must skip them with a reason, never hang on the FIFO or follow the '..'.
    odd = [job.ckpt_dir / f"step_9000000{i}" for i in range(3)]
    odd[0].mkdir()
    os.mkfifo(odd[0] / "manifest.json")
    os.mkfifo(odd[1])
    odd[2].mkdir()
    (odd[2] / "manifest.json").write_text(json.dumps({
        "format": "clusterops-checkpoint", "version": 1, "step": 90000002, "time": 1.0, "world_size": 4,
        "kind": "dcp", "hash_algo": "crc32", "files": {"../" + broken.name + "/manifest.json": {"size": 1, "hash": "0"}}}))
    job.signal_rank(3, signal.SIGKILL)
    info, story = assert_healed(job, slurm, reference, 4, ignore_ckpts=[broken] + odd)
    bad = events(job, "checkpoint_bad")
    assert bad and broken.name in [Path(b["path"]).name for b in bad], story
    assert {p.name for p in odd} <= {Path(b["path"]).name for b in bad}, story
    from clusterops.checkpoint import parse_step

    broken_step = parse_step(broken.name)
    resumes = events(job, "resume")
    assert resumes[1]["step"] == broken_step - CKPT_EVERY, story   # the one before the broken one
    assert str(broken) in resumes[1]["skipped"]
    resumed = [line for line in (job.latest_attempt() / "step.log").read_text().splitlines() if "resume step=" in line]
    assert resumed and f"step={broken_step - CKPT_EVERY} " in resumed[0] + " ", resumed


# ----------------------------------------------------------------------------- (h) disk full
@pytest.mark.timeout(240)
def test_h_disk_full_during_save_training_goes_on(cluster, slurm, reference, tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the disk-full case needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], check=True)
    try:
        job = make_job(tmp_path, "fm-h", nodes=4, supervise={"ckpt_dir": str(mnt)})
        job.submit()
        job.wait_step(45)
        job.signal_rank(0, signal.SIGKILL)
        info, story = assert_healed(job, slurm, reference, 4)
        log = "\n".join(p.read_text() for p in job.job_dir.glob("attempt-*/step.log"))
        assert "ckpt-failed" in log, "the tmpfs never filled up: make it smaller"
        assert events(job, "launch")[1]["resume_step"] is not None
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ----------------------------------------------------------------------------- (i) crash loop
@pytest.mark.timeout(180)
def test_i_crash_at_start_gives_up_without_looping(cluster, slurm, reference, tmp_path):
    # --samples 1: every rank exits 1 right after joining the process group.
    job = make_job(tmp_path, "fm-i", nodes=4, train_args=["--samples", "1"],
                   supervise={"no_progress_restarts": 1, "max_restarts": 5, "max_requeues": 3})
    job.submit()
    info = job.wait_end(slurm)
    story = tl.format_text(job.timeline())
    assert info.exit_code == sv.EXIT_NO_PROGRESS, f"{info.state} {info.exit_code}\n{story}"
    assert info.restart_count == 0 and not events(job, "requeue"), story
    assert len(events(job, "launch")) == 2, story                     # first try + K=1 restart
    # The ranks' own exit codes: the program, not a signal, a hang or a lost node.
    assert all(e["cause"] in ("program_error", "rank_exit") for e in events(job, "step_exit")), story
    assert events(job, "step_exit")[-1]["failures"][0]["reason"] == "Exited with exit code 1"
    give_up = events(job, "give_up")
    assert give_up and give_up[0]["code"] == sv.EXIT_NO_PROGRESS
    assert not events(job, "node_bad")                                 # the program, not the nodes


# ----------------------------------------------------------------------------- (j) preflight
@pytest.mark.timeout(240)
def test_j_node_failing_preflight_is_excluded_and_spare_used(cluster, slurm, reference, tmp_path):
    profile = tmp_path / "needs-scratch.yaml"
    profile.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                       "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}\", min_free_gb: 0.001}\n")
    scratch = cluster.scratch_dir("node3")
    hidden = scratch.with_name("node3.hidden")
    shutil.move(str(scratch), str(hidden))
    try:
        job = make_job(tmp_path, "fm-j", nodes=3,
                       supervise={"spare_nodes": 1, "preflight": str(profile), "drain_bad_nodes": True})
        job.submit()
        info, story = assert_healed(job, slurm, reference, 3)
        pf = events(job, "preflight")[0]
        assert pf["statuses"]["node3"] == "fail" and pf["statuses"]["node1"] in ("pass", "warn"), story
        assert events(job, "launch")[0]["nodes"] == ["node1", "node2", "node4"], story
        node3 = slurm.node("node3")
        assert node3.drained and node3.reason.startswith("clusterops:supervisor: preflight fail: "), node3
    finally:
        if hidden.exists():
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.move(str(hidden), str(scratch))


# ----------------------------------------------------------------------------- (k) drain guard
@pytest.mark.timeout(240)
def test_k_drain_refused_by_fleet_guard_node_still_excluded(cluster, slurm, reference, tmp_path):
    from clusterops import drains

    profile = tmp_path / "needs-scratch.yaml"
    profile.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                       "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}\", min_free_gb: 0.001}\n")
    # node4 already carries a clusterops drain: with 4 nodes and the default
    # max_drained_fraction 0.1, no second node of the partition may be drained.
    slurm.drain("node4", drains.make_reason(drains.SWEEP, "host.paths", "drained by an earlier sweep"))
    scratch = cluster.scratch_dir("node3")
    hidden = scratch.with_name("node3.hidden")
    shutil.move(str(scratch), str(hidden))
    try:
        job = make_job(tmp_path, "fm-k", nodes=2,
                       supervise={"spare_nodes": 1, "preflight": str(profile), "drain_bad_nodes": True})
        job.submit()
        info, story = assert_healed(job, slurm, reference, 2)
        assert events(job, "preflight")[0]["statuses"]["node3"] == "fail", story
        assert [r["node"] for r in events(job, "node_bad")] == ["node3"], story
        refused = events(job, "drain_refused")
        assert refused and refused[0]["node"] == "node3" and "fleet guard" in refused[0]["why"], story
        assert not events(job, "drain"), story
        assert all(r["nodes"] == ["node1", "node2"] for r in events(job, "launch")), story
        node3 = slurm.node("node3")
        assert not node3.drained, node3
    finally:
        if hidden.exists():
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.move(str(hidden), str(scratch))


# ----------------------------------------------------------------------------- (l) broken preflight
@pytest.mark.timeout(240)
def test_l_preflight_failing_on_every_node_is_a_broken_check(cluster, slurm, reference, tmp_path):
    profile = tmp_path / "broken.yaml"
    profile.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                       "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}/typo-nowhere\", min_free_gb: 0.001}\n")
    job = make_job(tmp_path, "fm-l", nodes=3, supervise={"preflight": str(profile), "drain_bad_nodes": True})
    job.submit()
    info, story = assert_healed(job, slurm, reference, 3)
    pf = events(job, "preflight")[0]
    assert set(pf["statuses"].values()) == {"fail"}, story
    broken = events(job, "check_broken")
    assert broken and broken[0]["check"] == "preflight" and "broken check" in broken[0]["what"], story
    assert not events(job, "node_bad") and not events(job, "drain") and not events(job, "drain_refused"), story
    assert events(job, "launch")[0]["nodes"] == ["node1", "node2", "node3"], story
    assert not any(n.drained for n in slurm.nodes()), [(n.name, n.reason) for n in slurm.nodes()]
