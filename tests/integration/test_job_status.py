"""Supervised jobs by their Slurm job id on the real dev cluster (issue 31, part 1):
``clusterops job ls | status JOBID | watch JOBID`` against a running job that loses a rank
(SIGKILL) and finishes, a job an administrator requeues, a job that fails for good, and as
a second user (who sees their own jobs only)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from support import faultkit as fk
from support import users
from support.wait import wait_for
from clusterops.runner import Runner

pytestmark = pytest.mark.integration


def clusterops(*args, runner=None, timeout_s=60):
    return (runner or Runner()).run([sys.executable, "-m", "clusterops", *args], timeout_s=timeout_s, check=False,
                                    cwd="/")


def status(job_id, runner=None) -> dict:
    p = clusterops("job", "status", str(job_id), "--json", runner=runner)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.timeout(600)
def test_status_ls_and_watch_of_a_job_that_loses_a_rank_and_finishes(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    job = fk.TrainJob(root=tmp_path / "js", name="js", nodes=2, steps=80, ckpt_every=10, step_sleep=0.2)
    jid = job.submit()
    watch_log = tmp_path / "watch.log"
    with open(watch_log, "w") as out:    # piped: plain lines, one per event, until the job ends
        watcher = subprocess.Popen([sys.executable, "-m", "clusterops", "job", "watch", str(jid), "--interval", "0.5"],
                                   stdout=out, stderr=subprocess.STDOUT)
    job.wait_step(15, timeout_s=240)
    time.sleep(3)                         # two progress samples at least: a rate
    st = status(jid)
    assert st["state"] == "RUNNING" and st["step"] >= 10 and st["steps_per_s"] > 0, st
    assert 0 < st["time_left_s"] <= 600 and st["steps_by_end"] > st["step"], st
    assert st["job_dir"] == str(job.job_dir) and st["restarts"] == 0, st
    listed = json.loads(clusterops("job", "ls", "--json").stdout)["jobs"]
    assert str(jid) in [j["job_id"] for j in listed]
    job.signal_rank(1, signal.SIGKILL)
    info = job.wait_end(connect(), timeout_s=400)
    assert info.state == "COMPLETED"
    st = status(jid)
    assert st["state"] == "COMPLETED" and st["finished"] and st["outcome"] == "done", st
    assert st["restarts"] == 1 and any("rank" in c for c in st["causes"]), st
    assert st["latest_checkpoint"]["step"] == 80 and st["goodput"] > 0, st
    rc = watcher.wait(timeout=60)
    text = watch_log.read_text()
    assert rc == 0, text
    assert "restart" in text and f"job {jid} ended: COMPLETED" in text, text
    human = clusterops("job", "status", str(jid))
    assert human.returncode == 0 and "latest good checkpoint" in human.stdout and "1 restart(s)" in human.stdout


@pytest.mark.timeout(600)
def test_a_requeued_job_a_failed_job_and_a_second_user(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    job = fk.TrainJob(root=tmp_path / "rq", name="rq", nodes=2, steps=60, ckpt_every=10, step_sleep=0.2,
                      spec_extra={"requeue": True})
    jid = job.submit()
    bad = fk.TrainJob(root=tmp_path / "bad", name="bad", nodes=2, steps=10, train_args=["--no-such-flag"],
                      supervise={"max_restarts": 1})
    bad_id = bad.submit()
    job.wait_step(8, timeout_s=240)
    # As a second user: neither job is theirs, and `job ls` does not list them.
    pw = users.ensure_user()
    with users.python_reachable(pw.pw_name):
        as_user = Runner(env=cluster.env(), as_user=pw.pw_name)
        p = clusterops("job", "status", str(jid), runner=as_user)
        assert p.returncode == 2 and "is root's: only its owner or an administrator" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
        mine = json.loads(clusterops("job", "ls", "--json", runner=as_user).stdout)["jobs"]
        assert str(jid) not in [j["job_id"] for j in mine]
        p = clusterops("job", "ls", "--all", runner=as_user)
        assert p.returncode == 2, p.stdout
    # An administrator requeues the running job: the next incarnation resumes.
    Runner(env=cluster.env()).run(["scontrol", "requeue", str(jid)], timeout_s=30)
    wait_for(lambda: slurm.job(jid).restart_count >= 1, 60, "the requeue to be counted", interval_s=0.5)
    st = status(jid)
    assert st["slurm_restarts"] >= 1 and not st["finished"], st
    info = job.wait_end(slurm, timeout_s=400)
    st = status(jid)
    assert info.state == "COMPLETED" and st["state"] == "COMPLETED" and st["slurm_restarts"] >= 1, st
    assert st["launches"] >= 2, st
    # The failed one: given up for good.
    binfo = bad.wait_end(slurm, timeout_s=300)
    bst = status(bad_id)
    assert binfo.state == "FAILED" and bst["state"] == "FAILED" and bst["outcome"] == "give_up", bst
    p = clusterops("job", "watch", str(bad_id))
    assert p.returncode == 1 and f"job {bad_id} ended: FAILED" in p.stdout, p.stdout
    # A job id that is no supervised job: one line, exit 2.
    plain = slurm.submit(text="#!/bin/sh\nsleep 1\n", args=["--nodes=1", f"--output={tmp_path}/plain.out"])
    p = clusterops("job", "status", str(plain))
    assert p.returncode == 2 and "not a supervised clusterops job" in p.stderr, p.stderr
