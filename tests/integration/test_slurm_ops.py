"""Every Slurm operation of the access layer, against the real dev cluster."""


import hostlist
import pytest
from support.wait import wait_for

from clusterops.errors import InputError, NotFoundError
from clusterops.slurm import Slurm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]




@pytest.fixture
def slurm(cluster):
    return Slurm.from_environment()


def script(tmp_path, body, name="job.sh"):
    p = tmp_path / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    return p


def test_version(slurm):
    # No version is hard-coded: the client tools and the running controller must agree,
    # and it must be a Slurm the layer supports (21.08 on).
    client = slurm.version()
    assert len(client) == 3 and client >= (21, 8, 0)
    assert slurm.controller_version() == client


def test_submit_query_and_exit_codes(slurm, tmp_path):
    ok = slurm.submit(script(tmp_path, "echo hello from $SLURMD_NODENAME", "ok.sh"),
                      ["--job-name=ok", f"--output={tmp_path}/ok.out"])
    bad = slurm.submit(text="#!/bin/bash\nexit 7\n", args=["--job-name=bad", f"--output={tmp_path}/bad.out"],
                       workdir=str(tmp_path))
    assert isinstance(ok, int) and bad == ok + 1
    done = wait_for(lambda: (j := slurm.job(ok)).category == "done" and j, what="ok job done")
    assert done.exit_code == 0 and done.batch_host in ("node1", "node2", "node3", "node4")
    assert "hello from node" in (tmp_path / "ok.out").read_text()
    failed = wait_for(lambda: (j := slurm.job(bad)).category == "failed" and j, what="bad job failed")
    assert failed.state == "FAILED" and failed.exit_code == 7
    listed = {j.job_id: j for j in slurm.jobs([ok, bad])}
    assert listed[bad].exit_code == 7 and listed[ok].state == "COMPLETED"
    # Finished jobs are listed without naming them too (squeue's default filter drops them on 23.02+).
    everything = {j.job_id: j for j in slurm.jobs()}
    assert everything[ok].category == "done" and everything[bad].category == "failed"


def test_unknown_job_and_node_are_clear_errors(slurm):
    with pytest.raises(NotFoundError):
        slurm.job(999999)
    with pytest.raises(NotFoundError):
        slurm.cancel(999999)
    with pytest.raises(NotFoundError):
        slurm.node("nosuchnode")
    with pytest.raises(InputError):
        slurm.job("12; rm -rf /")
    assert slurm.jobs([999999]) == []


def test_requeue_grows_restart_count(slurm, tmp_path):
    out = tmp_path / "rq.out"
    jid = slurm.submit(script(tmp_path, 'echo "restart=${SLURM_RESTART_COUNT:-0}"; sleep 300'),
                       ["--requeue", f"--output={out}", "--open-mode=append"])
    wait_for(lambda: slurm.job(jid).category == "running", what="running")
    wait_for(lambda: out.exists() and "restart=0" in out.read_text(), what="first run output")
    slurm.requeue(jid)
    info = slurm.job(jid)
    assert info.restart_count == 1 and info.category in ("pending", "running")
    # The requeue delay is cred_expire (10 s on the dev cluster), then it runs again.
    wait_for(lambda: "restart=1" in out.read_text(), timeout_s=90, what="second run")
    assert slurm.job(jid).restart_count == 1
    slurm.cancel(jid)


def test_hold_release_and_update(slurm, tmp_path):
    jid = slurm.submit(script(tmp_path, "sleep 300"), ["--hold", "--nodes=1", "--time=10", f"--output={tmp_path}/held.out"])
    info = slurm.job(jid)
    assert info.category == "pending" and info.reason == "JobHeldUser"
    slurm.update_job(jid, ExcNodeList="node1,node2", TimeLimit="5")
    info = slurm.job(jid)
    assert hostlist.expand_hostlist(info.excluded_nodes) == ["node1", "node2"]
    assert info.time_limit_min == 5
    slurm.release(jid)
    info = wait_for(lambda: (j := slurm.job(jid)).category == "running" and j, what="released job runs")
    assert info.node_names[0] in ("node3", "node4")
    slurm.cancel(jid)
    wait_for(lambda: slurm.job(jid).state == "CANCELLED", what="cancelled")


def test_drain_and_resume(slurm):
    slurm.drain("node2", "clusterops: test: drained by the test")
    n = slurm.node("node2")
    assert n.drained and n.reason == "clusterops: test: drained by the test" and n.reason_user == "root"
    assert not n.is_idle
    slurm.resume(["node2"])
    n = wait_for(lambda: (x := slurm.node("node2")).is_idle and x, what="resumed")
    assert n.reason is None and not n.drained
    with pytest.raises(InputError):
        slurm.drain("node2", "two\nlines")


def test_signal_reaches_the_batch_script(slurm, tmp_path):
    out = tmp_path / "sig.out"
    body = (
        'trap \'echo "got USR1"; exit 0\' USR1\n'
        'echo ready\n'
        'sleep 300 & wait $!\n'
    )
    jid = slurm.submit(script(tmp_path, body), [f"--output={out}"])
    wait_for(lambda: out.exists() and "ready" in out.read_text(), what="script ready")
    slurm.signal(jid, "USR1", batch=True)
    wait_for(lambda: "got USR1" in out.read_text(), what="USR1 in the batch script")
    done = wait_for(lambda: (j := slurm.job(jid)).category == "done" and j, what="job ends")
    assert done.exit_code == 0


def test_cancel_a_step_only(slurm, tmp_path):
    out = tmp_path / "step.out"
    body = 'srun --ntasks=1 sleep 300; echo "step ended rc=$?"; sleep 300'
    jid = slurm.submit(script(tmp_path, body), [f"--output={out}"])
    wait_for(lambda: slurm.job(jid).category == "running", what="running")
    # squeue lists the batch step ("N.batch") before the srun step: wait for step 0 itself
    # (cancelling 0 before slurmctld has it answers "Invalid job id specified").
    wait_for(lambda: any(s == "0" for s, _ in slurm.steps(jid)), what="step 0 to start")
    slurm.cancel(jid, step=0)
    wait_for(lambda: out.exists() and "step ended" in out.read_text(), what="step ends, job goes on")
    assert slurm.job(jid).category == "running"
    slurm.cancel(jid)


def test_partition_nodes(slurm):
    assert slurm.partition_nodes("debug") == ["node1", "node2", "node3", "node4"]
    with pytest.raises(NotFoundError):
        slurm.partition_nodes("nosuchpartition")
