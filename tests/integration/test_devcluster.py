"""The dev cluster itself: GPUs counted, scratch dirs, a 4-node torchrun gloo job, a node killed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.wait import wait_for

from clusterops.slurm import Slurm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]




def test_up_is_idempotent_and_status(cluster):
    before = cluster.daemon_pids()
    info = cluster.up(cluster.config())
    assert cluster.daemon_pids() == before           # nothing restarted
    assert info["running"] and set(info["nodes"].values()) == {"idle"}
    out = subprocess.run([sys.executable, "-m", "clusterops", "devcluster", "status", "--json",
                          "--state-dir", str(cluster.state)], capture_output=True, text=True)
    assert out.returncode == 0
    data = json.loads(out.stdout)
    assert data["running"] and data["config"]["nodes"] == 4 and len(data["nodes"]) == 4


def test_daemons_and_tools_come_from_the_configured_slurm(cluster):
    """With CLUSTEROPS_SLURM_PREFIX (the 25.11 tier) every daemon runs from PREFIX/sbin and the
    layer's tools from PREFIX/bin; without it, whatever PATH finds."""
    import os
    import shutil

    prefix = cluster.config().slurm_prefix
    for key, pid in cluster.daemon_pids().items():
        daemon = key.split(":")[0]
        if daemon == "munged":
            continue
        exe = os.path.realpath(f"/proc/{pid}/exe")
        want = os.path.join(prefix, "sbin", daemon) if prefix else shutil.which(daemon)
        assert exe == os.path.realpath(want), key
    slurm = Slurm.from_environment()
    assert slurm.tools.prefix == (Path(prefix) if prefix else None)
    ctld = subprocess.run([os.path.realpath(f"/proc/{cluster.daemon_pids()['slurmctld']}/exe"), "-V"],
                          capture_output=True, text=True, check=True).stdout
    assert slurm.controller_version() == slurm.version() == tuple(int(x) for x in ctld.split()[-1].split("."))


def test_counted_gpus_and_scratch(cluster):
    out = subprocess.run(
        ["srun", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=2", "bash", "-c",
         'echo "$SLURMD_NODENAME $SLURM_GPUS_ON_NODE $CLUSTEROPS_NODE_SCRATCH"'],
        capture_output=True, text=True, timeout=60, check=True)
    rows = sorted(line.split() for line in out.stdout.splitlines())
    assert [r[0] for r in rows] == ["node1", "node2", "node3", "node4"]
    assert all(r[1] == "2" for r in rows)
    assert all(r[2] == str(cluster.scratch_dir(r[0])) for r in rows)


def test_torchrun_gloo_allreduce_on_4_nodes(cluster, tmp_path):
    """A real 4-node torchrun (gloo) job through clusterops' Slurm layer; the all-reduce is checked."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from allreduce_job import render_allreduce_job

    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    text = render_allreduce_job(python=sys.executable, out_dir=str(out_dir), nodes=4)
    slurm = Slurm.from_environment()
    jid = slurm.submit(text=text, args=[f"--output={tmp_path}/job-%j.out"], workdir=str(tmp_path))
    job = wait_for(lambda: (j := slurm.job(jid)).category in ("done", "failed") and j, timeout_s=180,
                   what="torchrun job ends")
    log = next(tmp_path.glob("job-*.out")).read_text()
    assert job.category == "done", log
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert len(results) == 4, log
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world_size"] for r in results} == {4}
    assert {r["hostname"] for r in results} == {"node1", "node2", "node3", "node4"}
    assert len({(r["master_addr"], r["master_port"]) for r in results}) == 1
    # sum over ranks of (rank + 1) = 10
    assert all(r["allreduce"] == 10.0 for r in results)


def test_kill_node_is_seen_and_node_comes_back(cluster):
    slurm = Slurm.from_environment()
    cluster.kill_node("node4")
    n = wait_for(lambda: (x := slurm.node("node4")).is_down and x, timeout_s=60, what="node4 down")
    assert not n.responding
    cluster.start_node("node4")
    wait_for(lambda: slurm.node("node4").is_idle, timeout_s=60, what="node4 back (ReturnToService=2)")


def test_bad_input_exits_2():
    for args in (["--nodes", "0"], ["--nodes", "abc"], ["--nodes", "-3"]):
        out = subprocess.run([sys.executable, "-m", "clusterops", "devcluster", "up", *args,
                              "--state-dir", "/tmp/clusterops-never-used"], capture_output=True, text=True)
        assert out.returncode == 2, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error:") and "--nodes" in lines[0]
    assert not Path("/tmp/clusterops-never-used").exists()


def test_down_leaves_no_step_daemons(tmp_path):
    """`down` stops the slurmstepds of running steps too: from 24.11 on they carry no
    environment, and are found by the sockets they hold in the cluster's spool."""
    import os
    import shutil

    from conftest import pick_port_base

    from clusterops.devcluster import DevCluster, DevClusterConfig, _comm, _stepds_with_sockets_under
    from clusterops.runner import Runner, pid_alive

    dc = DevCluster(tmp_path / "dc")
    cfg = DevClusterConfig(nodes=2, port_base=pick_port_base(2),
                           slurm_prefix=os.environ.get("CLUSTEROPS_SLURM_PREFIX") or None)
    try:
        dc.up(cfg)
        slurm = Slurm(Runner(env=dc.env()), tools=cfg.tools)
        jid = slurm.submit(text="#!/bin/bash\nsrun --nodes=2 --ntasks-per-node=1 sleep 300\n",
                           args=["--nodes=2", f"--output={tmp_path}/step.out"], workdir=str(tmp_path))
        wait_for(lambda: ("0", "sleep") in slurm.steps(jid), what="the step runs")
        # A process forked from a slurmstepd (a task before it execs) holds the step's socket
        # and reads `slurmstepd` for a moment: a scan then names it, and a check a moment later
        # reads another name (697fb04's suite run). The daemons are what stays: two scans that
        # agree, all slurmstepd.
        def settled():
            first = _stepds_with_sockets_under(str(dc.state / "spool"))
            again = _stepds_with_sockets_under(str(dc.state / "spool"))
            return first if first and first == again and all(_comm(p) == "slurmstepd" for p in first) else None

        stepds = wait_for(settled, what="the steps' slurmstepds, seen alike twice")
        assert len(stepds) >= 2, stepds          # one for each node of the step at least
        stopped = dc.down()
        assert set(stepds) <= set(stopped)
        wait_for(lambda: not any(pid_alive(p) for p in stepds), timeout_s=20, what="slurmstepds gone")
    finally:
        dc.down()
        shutil.rmtree(tmp_path / "dc", ignore_errors=True)
