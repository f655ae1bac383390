"""The Slurm layer's contract, run against each backend on the real dev cluster.

Every test takes ``slurm``, parametrized over the CLI backend, the pyslurm one and the
REST one (slurmrestd, which the dev cluster runs beside slurmctld wherever slurmrestd is
installed: scripts/setup.sh installs it); all must behave the same. The REST half talks to
the dev cluster's slurmrestd over its UNIX socket with tokens signed with the cluster's JWT
key, and is skipped only where slurmrestd is not installed (CLUSTEROPS_TEST_REQUIRE_RESTD
turns that into a failure). The pyslurm half runs where the dev cluster's Slurm is the one
pyslurm was built for (the 25.11 tier: ``scripts/test-slurm-25.11.sh``) and is skipped,
saying why, only when pyslurm is not installed or the controller is another major.minor
(the default 22.05 tier).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import replace

import hostlist
import pytest
from support.wait import wait_for

from clusterops.errors import InputError, NotFoundError
from clusterops.runner import Runner
from clusterops.slurm import ForeignDrainError, SlurmError
from clusterops.slurm.factory import connect
from clusterops.slurm.settings import SlurmSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _pyslurm_skip_reason(cli) -> str | None:
    from clusterops.slurm.pyslurm_backend import mismatch

    return mismatch(cli.controller_version())


@pytest.fixture(params=["cli", "pyslurm", "rest"])
def slurm(request, cluster):
    base = SlurmSettings.from_environment()
    cli = connect(replace(base, backend="cli"))
    if request.param == "rest":
        urls = cluster.restd_urls()
        if not urls:
            why = "slurmrestd is not installed here (apt-get install slurmrestd)"
            if os.environ.get("CLUSTEROPS_TEST_REQUIRE_RESTD"):
                pytest.fail(f"the REST backend must run on this tier: {why}")
            pytest.skip(why)
        client = connect(replace(base, backend="rest", url=urls["unix"], jwt_key=str(cluster.jwt_key)))
        assert client.backend == "rest"
        return client
    if request.param == "pyslurm":
        why = _pyslurm_skip_reason(cli)
        if why and os.environ.get("CLUSTEROPS_TEST_REQUIRE_PYSLURM"):
            pytest.fail(f"the pyslurm backend must run on this tier: {why}")
        if why:
            pytest.skip(why)
    client = connect(replace(base, backend=request.param))
    assert client.backend == request.param
    return client


def script(tmp_path, body, name="job.sh"):
    p = tmp_path / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    return p


def test_version(slurm):
    client = slurm.version()
    assert len(client) == 3 and client >= (21, 8, 0)
    assert slurm.controller_version() == client


def test_submit_query_jobs_and_exit_codes(slurm, tmp_path):
    ok = slurm.submit(script(tmp_path, "#SBATCH --job-name=fromheader\necho hello from $SLURMD_NODENAME $MARK",
                             "ok.sh"),
                      ["--job-name=ok", f"--output={tmp_path}/ok.out", "--time=5", "--signal=B:USR1@30",
                       "--requeue", "--open-mode=append"])
    bad = slurm.submit(text="#!/bin/bash\nexit 7\n", args=["--job-name=bad", f"--output={tmp_path}/bad.out"],
                       workdir=str(tmp_path))
    assert isinstance(ok, int) and bad == ok + 1
    done = wait_for(lambda: (j := slurm.job(ok)).category == "done" and j, what="ok job done")
    assert done.exit_code == 0 and done.batch_host in ("node1", "node2", "node3", "node4")
    assert done.name == "ok" and done.time_limit_min == 5 and done.node_names == (done.batch_host,)
    assert "hello from node" in (tmp_path / "ok.out").read_text()
    failed = wait_for(lambda: (j := slurm.job(bad)).category == "failed" and j, what="bad job failed")
    assert failed.state == "FAILED" and failed.exit_code == 7
    listed = {j.job_id: j for j in slurm.jobs([ok, bad])}
    assert listed[bad].exit_code == 7 and listed[ok].state == "COMPLETED"
    everything = {j.job_id: j for j in slurm.jobs()}
    assert everything[ok].category == "done" and everything[bad].category == "failed"


def test_submit_exports_the_environment_and_multi_node(slurm, tmp_path, monkeypatch):
    mark = uuid.uuid4().hex
    monkeypatch.setenv("CONTRACT_MARK", mark)
    out = tmp_path / "env.out"
    body = ("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
            'echo "mark=$CONTRACT_MARK nodes=$SLURM_JOB_NUM_NODES"; srun hostname >/dev/null && echo srun-ok\n'
            'echo "submitdir=$SLURM_SUBMIT_DIR umask=$(umask)"')
    jid = slurm.submit(script(tmp_path, body), [f"--output={out}"])
    info = wait_for(lambda: (j := slurm.job(jid)).category == "done" and j, what="2-node job done")
    assert len(info.node_names) == 2
    text = out.read_text()
    mask = os.umask(0)
    os.umask(mask)
    assert f"mark={mark} nodes=2" in text and "srun-ok" in text, text
    assert f"submitdir={os.getcwd()} umask={mask:04o}" in text, text


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


def test_nodes_query(slurm):
    nodes = slurm.nodes()
    assert [n.name for n in nodes] == ["node1", "node2", "node3", "node4"]
    for n in nodes:
        assert n.state == "idle" and n.is_idle and n.cpus == 2 and "debug" in n.partitions
        assert n.reason is None and "gpu" in n.gres
    assert [n.name for n in slurm.nodes("node[2-3]")] == ["node2", "node3"]
    assert slurm.node("node4").name == "node4"


def test_requeue_grows_restart_count(slurm, tmp_path):
    out = tmp_path / "rq.out"
    jid = slurm.submit(script(tmp_path, 'echo "restart=${SLURM_RESTART_COUNT:-0}"; sleep 300'),
                       ["--requeue", f"--output={out}", "--open-mode=append"])
    wait_for(lambda: slurm.job(jid).category == "running", what="running")
    wait_for(lambda: out.exists() and "restart=0" in out.read_text(), what="first run output")
    slurm.requeue(jid)
    info = slurm.job(jid)
    assert info.restart_count == 1 and info.category in ("pending", "running")
    wait_for(lambda: "restart=1" in out.read_text(), timeout_s=90, what="second run")
    assert slurm.job(jid).restart_count == 1
    slurm.cancel(jid)
    wait_for(lambda: slurm.job(jid).state == "CANCELLED", what="cancelled")


def test_hold_release_and_update(slurm, tmp_path):
    # A begin time an hour ahead keeps the job pending once released: a released job on an
    # idle cluster may otherwise start before the hold below reaches the controller.
    jid = slurm.submit(script(tmp_path, "sleep 300"), ["--nodes=1", "--time=10", "--hold", "--begin=now+3600",
                                                        f"--output={tmp_path}/held.out"])
    info = slurm.job(jid)
    assert info.category == "pending" and info.reason in ("JobHeldUser", "JobHeldAdmin")
    slurm.release(jid)
    info = slurm.job(jid)
    assert info.category == "pending" and info.reason not in ("JobHeldUser", "JobHeldAdmin")
    slurm.hold(jid)
    info = slurm.job(jid)
    assert info.category == "pending" and info.reason in ("JobHeldUser", "JobHeldAdmin")
    slurm.update_job(jid, ExcNodeList="node1,node2", TimeLimit="5")
    info = slurm.job(jid)
    assert hostlist.expand_hostlist(info.excluded_nodes) == ["node1", "node2"]
    assert info.time_limit_min == 5
    slurm.release(jid)
    slurm.update_job(jid, StartTime="now")
    info = wait_for(lambda: (j := slurm.job(jid)).category == "running" and j, what="released job runs")
    assert info.node_names[0] in ("node3", "node4")
    slurm.cancel(jid)
    wait_for(lambda: slurm.job(jid).state == "CANCELLED", what="cancelled")


def test_drain_resume_and_the_foreign_reason_refusal(slurm, cluster):
    slurm.drain("node2", "clusterops: test: drained by the test")
    n = slurm.node("node2")
    assert n.drained and n.reason == "clusterops: test: drained by the test" and n.reason_user == "root"
    assert not n.is_idle
    slurm.resume(["node2"])
    n = wait_for(lambda: (x := slurm.node("node2")).is_idle and x, what="resumed")
    assert n.reason is None and not n.drained
    with pytest.raises(InputError):
        slurm.drain("node2", "two\nlines")
    with pytest.raises(InputError):
        slurm.drain("node2", "not ours")
    # An administrator's drain: neither backend lifts it, and nothing else is resumed either.
    slurm.drain("node3", "clusterops: test: ours")
    Runner(env=cluster.env()).run(["scontrol", "update", "NodeName=node4", "State=DRAIN",
                                   "Reason=admin: bad fan"], timeout_s=30)
    with pytest.raises(ForeignDrainError, match="node4"):
        slurm.resume("node[3-4]")
    assert slurm.node("node3").drained and slurm.node("node4").reason == "admin: bad fan"


def test_signal_reaches_the_batch_script(slurm, tmp_path):
    out = tmp_path / "sig.out"
    body = ('trap \'echo "got USR1"; exit 0\' USR1\n'
            'echo ready\n'
            'sleep 300 & wait $!\n')
    jid = slurm.submit(script(tmp_path, body), [f"--output={out}"])
    wait_for(lambda: out.exists() and "ready" in out.read_text(), what="script ready")
    slurm.signal(jid, "USR1", batch=True)
    wait_for(lambda: "got USR1" in out.read_text(), what="USR1 in the batch script")
    done = wait_for(lambda: (j := slurm.job(jid)).category == "done" and j, what="job ends")
    assert done.exit_code == 0


def test_steps_and_cancel_a_step_only(slurm, tmp_path):
    out = tmp_path / "step.out"
    body = 'srun --ntasks=1 --job-name=worker sleep 300; echo "step ended rc=$?"; sleep 300'
    jid = slurm.submit(script(tmp_path, body), [f"--output={out}"])
    wait_for(lambda: slurm.job(jid).category == "running", what="running")
    steps = wait_for(lambda: [s for s in slurm.steps(jid) if s[1] == "worker"], what="the step to start")
    assert steps == [("0", "worker")]
    slurm.cancel(jid, step=0)
    wait_for(lambda: out.exists() and "step ended" in out.read_text(), what="step ends, job goes on")
    assert slurm.job(jid).category == "running"
    slurm.cancel(jid)
    wait_for(lambda: slurm.job(jid).state == "CANCELLED", what="cancelled")


def test_reservations(slurm, cluster):
    name = f"contract-{os.getpid()}"
    show = ["scontrol", "show", "reservation", name]
    run = Runner(env=cluster.env()).run
    slurm.create_reservation(name, "node[1-2]", minutes=5, users="root")
    try:
        text = run(show, timeout_s=30).stdout
        assert "Nodes=node[1-2]" in text and "MAINT" in text
        with pytest.raises(SlurmError):
            slurm.create_reservation(name, "node[1-2]", minutes=5, users="root")
    finally:
        slurm.delete_reservation(name)
    assert run(show, timeout_s=30, check=False).returncode != 0
    with pytest.raises(InputError):
        slurm.create_reservation("bad name;", "node1", minutes=5, users="root")


def test_partition_nodes(slurm):
    assert slurm.partition_nodes("debug") == ["node1", "node2", "node3", "node4"]
    with pytest.raises(NotFoundError):
        slurm.partition_nodes("nosuchpartition")
