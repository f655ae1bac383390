"""Ordinary users on the dev cluster: their jobs, their files, and what Slurm refuses them.

The suite runs as root; these tests create an ordinary user (``support.users``), let it
start this Python for the length of the module (o+x on the interpreter's path, shared by
every test process of the machine and undone by the last one to leave:
``users.traversable``), and act as that user through ``Runner(as_user=...)``
(``runuser -u USER --``):

- the dev cluster serves every user: the key stays root-only, the munge socket and the
  node scratch (each step's TMPDIR) are the users' too;
- a supervised training job submitted by the user through ``clusterops launch submit``
  runs, checkpoints and heals with the user's permissions only (every file in the user's
  directory is the user's), and when a node is lost the supervisor's drain, refused by
  Slurm (the user is no admin), is recorded in the timeline while the node still stays
  out of the job's steps;
- ``clusterops sweep`` and ``clusterops health check --drain-on-fail`` run by the user fail
  at once with one line and change nothing; a self-drain Slurm refuses is reported
  (``refused``, exit 3), never a crash.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from support import faultkit as fk
from support import users
from support.wait import wait_for
from clusterops.runner import Runner
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 60
CKPT_EVERY = 10


@pytest.fixture(scope="module")
def user():
    """An ordinary user that can start this Python (for this module only)."""
    pw = users.ensure_user()
    with users.python_reachable(pw.pw_name):
        yield pw


@pytest.fixture
def as_user(user, cluster):
    """A runner acting as the user against the test cluster; the user's jobs are cancelled
    after the test (the shared fixture cancels root's only)."""
    runner = Runner(env=cluster.env(), as_user=user.pw_name)
    yield runner
    Runner(env=cluster.env()).run(["scancel", "--full", f"--user={user.pw_name}"], timeout_s=30, check=False)


@pytest.fixture
def home(user):
    with users.user_dir(user.pw_name) as d:
        yield d


def _slurm(runner):
    from clusterops.slurm.factory import connect

    return connect(runner=runner)


def test_devcluster_modes_open_only_what_users_need(cluster):
    st = cluster.state
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(st / "munge") == 0o700 and mode(st / "munge" / "munge.key") == 0o400
    assert mode(st / "ctld") == 0o700
    sock = st / "run" / "munge" / "munge.socket"
    assert stat.S_ISSOCK(os.stat(sock).st_mode) and mode(sock.parent) == 0o755
    assert f"socket={sock}" in cluster.conf_path.read_text()
    for node in cluster.config().node_names:
        assert mode(cluster.scratch_dir(node)) == 0o1777 and mode(cluster.scratch_dir(node) / "tmp") == 0o1777
    assert mode(st) == 0o755 and mode(cluster.conf_path) == 0o644


def test_user_batch_job_runs_as_the_user_with_a_writable_tmpdir(as_user, home, user):
    slurm = _slurm(as_user)
    from clusterops.slurm import privilege

    assert privilege.caller_level(slurm) == privilege.Level.USER
    assert privilege.caller_level(_slurm(Runner(env=as_user.env))) == privilege.Level.SLURM_USER
    out = home / "out.txt"
    jid = slurm.submit(text="#!/bin/sh\nid -un\necho \"$TMPDIR\"\ntouch \"$TMPDIR/probe.$SLURM_JOB_ID\" && echo tmp-ok\n",
                       args=["--nodes=2", f"--output={out}"], workdir=str(home))
    info = wait_for(lambda: (lambda j: j if j.category in ("done", "failed") else None)(slurm.job(jid)),
                    60, f"job {jid} to end", interval_s=0.5)
    text = out.read_text()
    assert info.state == "COMPLETED", f"{info.state}: {text}"
    lines = text.split()
    assert lines[0] == user.pw_name and "tmp-ok" in lines, text
    assert "/scratch/node" in lines[1], text
    assert users.owned_by_others(home, user.pw_uid) == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("users-ref-w3")
    out = d / "final.pt"
    fk.run_local(3, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0",
                     "--out", str(out)], workdir=d)
    return out


@pytest.mark.timeout(300)
def test_supervised_training_as_user_heals_and_records_a_refused_drain(cluster, as_user, home, user, reference):
    slurm = _slurm(Runner(env=cluster.env()))     # root's view, for checking
    job = fk.TrainJob(root=home / "train", name="users-c", nodes=3, steps=STEPS, ckpt_every=CKPT_EVERY,
                      supervise={"spare_nodes": 1, "drain_bad_nodes": True}, user=user.pw_name)
    job.submit()
    job.wait_step(20)
    cluster.kill_node("node3")
    info = job.wait_end(slurm)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    events = lambda kind: [r for r in job.timeline() if r["event"] == kind]  # noqa: E731
    assert events("done"), story
    # The node was bad, Slurm refused the user's drain, and the node still stayed out.
    assert events("node_bad")[0]["node"] == "node3", story
    refused = events("drain_refused")
    assert refused and refused[0]["node"] == "node3", story
    assert "Slurm refused the drain" in refused[0]["why"] and user.pw_name in refused[0]["why"], story
    assert not events("drain"), story
    assert events("spare_used")[0]["nodes"] == ["node4"], story
    assert events("launch")[-1]["nodes"] == ["node1", "node2", "node4"], story
    assert not (slurm.node("node3").reason or "").startswith("clusterops:"), "the user's drain went through"
    # Checkpoints and weights: the same as an uninterrupted run, nothing damaged.
    assert fk.same_weights(job.out, reference), story
    assert fk.damaged_checkpoints(job.ckpt_dir) == []
    assert len(list(job.ckpt_dir.iterdir())) >= 1
    # Everything the job, the supervisor and the checkpoints wrote belongs to the user.
    assert users.owned_by_others(home, user.pw_uid) == []


def _clusterops(runner, *args, timeout_s=120):
    return runner.run([sys.executable, "-m", "clusterops", *args], timeout_s=timeout_s, check=False, cwd="/")


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_sweep_by_a_non_admin_fails_at_once_and_changes_nothing(cluster, as_user, home):
    before = cluster.node_states()
    p = _clusterops(as_user, "sweep", "--partition", "debug", "--db", str(home / "sweep.db"), "--quiet")
    assert p.returncode == 2, p.stdout + p.stderr
    line = _one_line(p.stderr)
    assert "clusterops sweep" in line and "needs a Slurm admin" in line and "nothing was run" in line
    assert cluster.node_states() == before
    assert Runner(env=cluster.env()).run(["squeue", "--noheader", "--user", as_user.as_user]).stdout.strip() == ""
    assert not (home / "sweep.db").exists()


def test_health_drain_on_fail_by_a_non_admin_fails_at_once(cluster, as_user):
    p = _clusterops(as_user, "health", "check", "--drain-on-fail", "--node", "node2", "--json")
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    line = _one_line(p.stderr)
    assert "--drain-on-fail" in line and "needs a Slurm admin" in line
    assert cluster.node_states()["node2"] == "idle"


def test_self_drain_that_slurm_refuses_is_reported_not_a_crash(cluster, as_user):
    from clusterops import drains
    from clusterops.health import exit_code, self_drain

    report = {"node": "node2", "profile": "fast", "status": "fail",
              "results": [{"name": "disk", "probe": "disk", "status": "fail", "detail": "no space left"}]}
    box = self_drain(report, "node2", timeout_s=20, slurm=_slurm(as_user),
                     guard=drains.GuardSettings(max_drained_fraction=1.0))
    assert box["action"] == "refused" and box["ok"], box
    assert "Slurm refused the drain" in box["why"], box
    assert exit_code("fail", box) == 3
    assert cluster.node_states()["node2"] == "idle"
