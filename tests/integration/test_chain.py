"""A chain of generations on the real dev cluster (chain: 3 with supervise:).

examples/train.py (gloo/CPU, one rank per node) runs as one singleton job array of three
generations. Each test checks how the chain ended, that nothing of it is left in the queue,
and (where it trained to the end) that the final weights equal an uninterrupted run's,
bitwise. The time-limit test needs Slurm's minute granularity: a 2-minute generation whose
lead signal comes 40-70 s in (see test_fault_matrix.test_e).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from support import faultkit as fk
from support.wait import wait_for
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

CKPT_EVERY = 20


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(world: int, steps: int) -> Path:
        if (world, steps) not in cache:
            d = tmp_path_factory.mktemp(f"ref-w{world}-s{steps}")
            out = d / "final.pt"
            fk.run_local(world, ["--steps", str(steps), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0",
                                 "--out", str(out)], workdir=d)
            cache[(world, steps)] = out
        return cache[(world, steps)]

    return get


class NoJobDir(fk.TrainJob):
    """A job whose spec names no job_dir: the supervisor's own rule names it."""

    def spec(self) -> dict:
        spec = super().spec()
        spec["supervise"].pop("job_dir")
        return spec


def chain_job(tmp_path, name, cls=fk.TrainJob, **kw) -> fk.TrainJob:
    kw.setdefault("ckpt_every", CKPT_EVERY)
    extra = dict(kw.pop("spec_extra", {}))
    extra.setdefault("chain", 3)
    return cls(root=tmp_path / name, name=name, spec_extra=extra, **kw)


def tasks(slurm, array_id) -> dict:
    """generation -> JobInfo of the chain's tasks Slurm knows (pending ones may share a record)."""
    from clusterops.supervisor.chain import tasks_by_generation

    return tasks_by_generation(slurm.job_tasks(array_id), 3)


def wait_chain_end(job, slurm, timeout_s=300.0) -> dict:
    """Until no task of the chain is pending or running -> generation -> JobInfo."""
    from clusterops.errors import ClusteropsError

    last = [None]

    def ended():
        try:
            infos = slurm.job_tasks(job.job_id)
        except ClusteropsError:
            return None
        last[0] = [(t.array_tasks, t.state) for t in infos]
        if infos and all(t.category in ("done", "failed") for t in infos):
            from clusterops.supervisor.chain import tasks_by_generation

            return tasks_by_generation(infos, 3)
        return None

    return wait_for(ended, timeout_s, f"{job.name}: chain {job.job_id} to end", interval_s=1,
                    detail=lambda: f"{last[0]}; timeline tail: "
                                   + " | ".join(r.get("event", "") for r in job.timeline()[-8:]))


def queue_of(job, slurm) -> List[str]:
    """What squeue still lists of the chain (pending or running)."""
    from clusterops.runner import Runner

    p = Runner().run(["squeue", "--noheader", "--array", f"--jobs={job.job_id}", "--format=%i %T"],
                     timeout_s=30, check=False)
    return [line for line in p.stdout.splitlines() if line.strip()]


def kill_supervisor(job, task) -> None:
    """SIGKILL the supervisor of one task of the chain (``task``: its JobInfo): the batch
    script dies with it, as a generation dies between any two of its steps."""
    procs = fk.job_processes(job.slurm_conf, {"SLURM_JOB_ID": str(task.job_id)})
    sup = [pid for pid, argv in procs.items() if "supervise" in argv and any("clusterops" in a for a in argv)]
    assert sup, procs
    for pid in sup:
        os.kill(pid, signal.SIGKILL)


def generations(job) -> List[dict]:
    return fk.events(job, "generation")


def story(job, slurm) -> str:
    return (f"{job.slurm_says(slurm)}\n{tl.format_text(job.timeline())}\n{job.failed_step_logs()}"
            f"\nbatch log tail:\n{job.batch_log()[-2500:]}")


# ---------------------------------------------------------------- time limit -> next generation -> finish
@pytest.mark.timeout(600)
def test_first_generation_ends_at_its_time_limit_second_resumes_bitwise_and_finish_cancels_third(
        cluster, slurm, reference, tmp_path):
    steps = 900
    ref = reference(2, steps)
    job = chain_job(tmp_path, "ch-tl", nodes=2, steps=steps, ckpt_every=100,
                    spec_extra={"time": "10", "signal_lead_s": 80}, supervise={"stop_timeout_s": 40})
    job.submit()
    # (not job.wait_running: for an array id Slurm lists the pending tasks' record first)
    # Generation 1 alone gets a 2-minute limit, the later ones keep 10 minutes to finish in (an
    # update of the array's pending tasks raced their start: "1_3: No error" on 22.05).
    first = wait_for(lambda: (lambda t: t if t is not None and t.category == "running" and t.array_task_id == 1
                              else None)(tasks(slurm, job.job_id).get(1)), 240, "generation 1 running", interval_s=0.5)
    slurm.update_job(first.job_id, TimeLimit="2")
    assert slurm.job(first.job_id).time_limit_min == 2, job.slurm_says(slurm)
    wait_for(lambda: fk.events(job, "stop_requested"), 150, "generation 1's time-limit stop", interval_s=1,
             detail=lambda: story(job, slurm))
    ended = wait_chain_end(job, slurm, timeout_s=400)
    s = story(job, slurm)
    assert sorted(ended) == [1, 2, 3], (ended, s)
    assert ended[1].exit_code == sv.EXIT_GENERATION_END, s
    assert ended[2].state == "COMPLETED" and ended[2].exit_code == 0, s
    assert ended[3].state == "CANCELLED", s
    assert queue_of(job, slurm) == [], s
    gens = generations(job)
    assert [g["generation"] for g in gens] == [1, 2] and all(g["of"] == 3 for g in gens), s
    stop = fk.events(job, "stop_requested")[0]
    assert stop["reason"] == "time_limit", s
    handed = fk.events(job, "generation_end")
    assert len(handed) == 1 and handed[0]["code"] == sv.EXIT_GENERATION_END, s
    stopped = fk.events(job, "stopped")[0]
    gen2 = str(ended[2].job_id)
    resumed = [r for r in fk.events(job, "resume") if r["job_id"] == gen2]
    # Zero steps lost: generation 2 resumes at exactly the step generation 1 saved at its stop.
    assert stopped["ckpt_step"] and resumed and resumed[0]["step"] == stopped["ckpt_step"], s
    assert fk.same_weights(job.out, ref), f"final weights differ from an uninterrupted run\n{s}"
    assert fk.damaged_checkpoints(job.ckpt_dir) == [], s
    end = fk.events(job, "chain_end")
    assert len(end) == 1 and end[0]["cancelled"] is True and end[0]["ended_in"] == 2 and end[0]["code"] == 0, s
    first = next(r for r in fk.events(job, "progress") if r["job_id"] == gen2)
    start2 = next(g for g in gens if g["generation"] == 2)
    print(f"generation 1 ended -> generation 2 started {start2['t'] - handed[0]['t']:.1f} s, "
          f"first step {first['t'] - handed[0]['t']:.1f} s")


# ---------------------------------------------------------------- give up -> the rest cancelled
@pytest.mark.timeout(300)
def test_a_give_up_cancels_the_rest_and_job_status_shows_one_run(cluster, slurm, reference, tmp_path):
    # --samples 1: every rank exits 1 right after joining the process group (a crash at start).
    job = chain_job(tmp_path, "ch-gu", nodes=2, steps=60, train_args=["--samples", "1"],
                    supervise={"no_progress_restarts": 1, "max_restarts": 5}, cls=NoJobDir)
    job.submit()
    ended = wait_chain_end(job, slurm, timeout_s=240)
    # No job_dir: the chain's directory is named by the array's id, shared by its generations.
    jd = Path(job.spec()["log_dir"]) / f"{job.name}-{job.job_id}"
    assert (jd / "timeline.jsonl").exists(), f"{ended}\n{sorted(os.listdir(jd.parent))}\n{job.batch_log()[-3000:]}"
    recs = tl.read(jd)
    s = f"{job.slurm_says(slurm)}\n{tl.format_text(recs)}"
    assert ended[1].exit_code == sv.EXIT_NO_PROGRESS, s
    assert {ended[2].state, ended[3].state} == {"CANCELLED"}, (ended, s)
    assert queue_of(job, slurm) == [], s
    assert [r["generation"] for r in recs if r["event"] == "generation"] == [1], s
    end = [r for r in recs if r["event"] == "chain_end"]
    assert len(end) == 1 and end[0]["code"] == sv.EXIT_NO_PROGRESS and end[0]["cancelled"] is True, s
    # `clusterops job status` of the array id: one run, its generations and how each ended.
    p = subprocess.run([sys.executable, "-m", "clusterops", "job", "status", str(job.job_id), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    import json

    st = json.loads(p.stdout)
    assert st["job_dir"] == str(jd), st
    gens = st["chain"]["generations"]
    assert [g["generation"] for g in gens] == [1, 2, 3], st
    assert gens[0]["ended"] == "give_up" and gens[0]["exit_code"] == sv.EXIT_NO_PROGRESS, st
    assert gens[1]["state"] == "CANCELLED" and gens[2]["state"] == "CANCELLED", st
    assert st["chain"]["ended"] and "no progress" in st["chain"]["why"], st
    p = subprocess.run([sys.executable, "-m", "clusterops", "job", "status", str(job.job_id)],
                       capture_output=True, text=True, timeout=60)
    assert "generation 1" in p.stdout and "CANCELLED" in p.stdout, p.stdout


# ---------------------------------------------------------------- a SIGKILLed batch script
@pytest.mark.timeout(420)
def test_a_sigkilled_batch_script_next_generation_resumes_bitwise_nothing_left_queued(
        cluster, slurm, reference, tmp_path):
    steps = 200
    ref = reference(2, steps)
    job = chain_job(tmp_path, "ch-kill", nodes=2, steps=steps)
    job.submit()
    job.wait_step(50)
    first = tasks(slurm, job.job_id)[1]
    kill_supervisor(job, first)
    ended = wait_chain_end(job, slurm, timeout_s=360)
    s = story(job, slurm)
    assert ended[1].state != "COMPLETED", s
    assert ended[2].state == "COMPLETED" and ended[2].exit_code == 0, s
    assert ended[3].state == "CANCELLED", s
    assert queue_of(job, slurm) == [], s
    assert [g["generation"] for g in generations(job)] == [1, 2], s
    assert not fk.events(job, "generation_end"), s     # generation 1 never got to say
    resumed = [r for r in fk.events(job, "resume") if r["job_id"] == str(ended[2].job_id)]
    assert resumed and resumed[0]["step"] >= 40, s
    assert fk.same_weights(job.out, ref), f"final weights differ from an uninterrupted run\n{s}"
    end = fk.events(job, "chain_end")
    assert len(end) == 1 and end[0]["ended_in"] == 2 and end[0]["cancelled"] is True, s


# ---------------------------------------------------------------- the batch host lost mid-chain
@pytest.mark.timeout(480)
def test_a_lost_batch_host_mid_chain_resumes_and_ends_with_nothing_queued(cluster, slurm, reference, tmp_path):
    steps = 200
    ref = reference(3, steps)
    job = chain_job(tmp_path, "ch-host", nodes=3, steps=steps)
    job.submit(env=dict(os.environ, CLUSTEROPS_SUPERVISOR_LOST_S="3"))
    job.wait_step(50)
    first = tasks(slurm, job.job_id)[1]
    host = first.batch_host
    t_cut = time.time()
    cluster.kill_node(host, power_cut=True)
    ended = wait_chain_end(job, slurm, timeout_s=420)
    s = story(job, slurm)
    assert queue_of(job, slurm) == [], s
    done = fk.events(job, "done")
    assert len(done) == 1, s
    assert fk.same_weights(job.out, ref), f"final weights differ from an uninterrupted run\n{s}"
    end = fk.events(job, "chain_end")
    assert len(end) == 1 and end[0]["cancelled"] is True and end[0]["code"] == 0, s
    # The ranks requeued generation 1 (clusterops.watchdog); whichever task ran next resumed.
    later = [g for g in generations(job) if g["t"] > t_cut]
    assert later, s
    resumed = [r for r in fk.events(job, "resume") if r["t"] > t_cut]
    assert resumed and resumed[0]["step"] >= 40, s
    launch = [r for r in fk.events(job, "launch") if r["t"] > t_cut]
    assert launch and host not in launch[0]["nodes"], s
    # Whatever ran, every task of the chain has ended, and one of them finished.
    assert any(t.state == "COMPLETED" for t in ended.values()), (ended, s)


# ---------------------------------------------------------------- a hot spare, then the end marker left behind
@pytest.mark.timeout(420)
def test_a_hot_spare_heals_a_generation_and_a_marker_left_behind_ends_the_chain_at_the_next_start(
        cluster, slurm, reference, tmp_path):
    # Generation 1 holds a hot spare (spare_nodes: 1): a kill -9 of rank 1 leaves its node out
    # (node_fail_threshold: 1) and the spare takes its place inside the allocation. Then the
    # generation dies as one that ended the chain can die: its marker written, its supervisor
    # SIGKILLed before the cancel. Generation 2 finds the marker at its start, cancels
    # generation 3, trains nothing and exits 12; nothing of the chain is left queued.
    job = chain_job(tmp_path, "ch-spare", nodes=2, steps=400, step_sleep=0.1,
                    supervise={"spare_nodes": 1, "node_fail_threshold": 1})
    job.submit()
    job.wait_step(15)
    first = tasks(slurm, job.job_id)[1]
    # The ranks carry the task's own job id (SLURM_JOB_ID), not the array's.
    rank1 = [pid for pid, argv in fk.job_processes(job.slurm_conf, {"SLURM_JOB_ID": str(first.job_id),
                                                                    "SLURM_PROCID": "1"}).items()
             if str(job.script) in argv and "srun" not in Path(argv[0]).name]
    assert rank1, story(job, slurm)
    for pid in rank1:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: fk.events(job, "spare_used"), 120, "the spare taking the lost node's place", interval_s=1,
             detail=lambda: story(job, slurm))
    spare = fk.events(job, "spare_used")[0]
    lost = fk.events(job, "node_bad")[0]["node"]
    launches = fk.events(job, "launch")
    assert spare["nodes"] and lost not in launches[-1]["nodes"] and spare["nodes"][0] in launches[-1]["nodes"], \
        story(job, slurm)
    steps_before = job.progress() or 0
    job.wait_step(steps_before + 10)                       # healed: training goes on
    from clusterops.supervisor import chain

    chain.write_end(job.job_dir, {"code": 0, "reason": "training finished", "generation": 1,
                                  "job_id": str(first.job_id)})
    kill_supervisor(job, first)
    ended = wait_chain_end(job, slurm, timeout_s=300)
    s = story(job, slurm)
    assert ended[2].exit_code == sv.EXIT_CHAIN_ENDED and ended[3].state == "CANCELLED", (ended, s)
    assert queue_of(job, slurm) == [], s
    gen2 = str(ended[2].job_id)
    assert not [r for r in fk.events(job, "launch") if r["job_id"] == gen2], s      # trained nothing
    end = [r for r in fk.events(job, "chain_end") if r["job_id"] == gen2]
    assert len(end) == 1 and end[0]["by"] == "a later generation at its start" and end[0]["ended_in"] == 1, s
    assert end[0]["cancelled"] is True, s
