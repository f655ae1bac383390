"""Spares in the same topology domain, on a real Slurm topology (issue 30, part 5).

A separate 4-node dev cluster with topology/tree (topology/block needs Slurm 23.11+; this
tier's Slurm decides): leaf switch s1 holds node1 and node3, s2 node2 and node4. A supervised
run on 2 nodes with 2 spares starts on node1 and node2; rank 1 (node2) is killed with
``kill -9`` and, with ``node_fail_threshold: 1``, node2 is left out. The replacement is
node4, node2's own domain, not node3, the next in allocation order; the run ends bitwise
equal to an uninterrupted one. The session's shared cluster (no topology) stays untouched.
"""

from __future__ import annotations

import signal

import pytest

from support import faultkit as fk

pytestmark = pytest.mark.integration

STEPS = 50


@pytest.fixture
def topo_cluster(monkeypatch):
    from clusterops.devcluster import DevClusterConfig
    from clusterops.slurm.parse import parse_version
    from conftest import own_dev_cluster, pick_port_base
    import subprocess

    version = parse_version(subprocess.run(["slurmctld", "-V"], capture_output=True, text=True).stdout)
    kind = "block" if version >= (23, 11) else "tree"
    with own_dev_cluster("topo") as dc:
        dc.up(DevClusterConfig(nodes=4, gpus_per_node=4, port_base=pick_port_base(4), topology=kind,
                               domains=("node[1,3]", "node[2,4]")))
        monkeypatch.setenv("SLURM_CONF", str(dc.conf_path))
        yield dc, kind


@pytest.mark.timeout(300)
def test_the_lost_nodes_replacement_comes_from_its_own_domain(topo_cluster, tmp_path):
    from clusterops.slurm.factory import connect

    dc, kind = topo_cluster
    slurm = connect()
    assert slurm.topology() == {"node1": "s1" if kind == "tree" else "b1", "node3": "s1" if kind == "tree" else "b1",
                                "node2": "s2" if kind == "tree" else "b2", "node4": "s2" if kind == "tree" else "b2"}
    ref = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0", "--out", str(ref / "final.pt")],
                 workdir=ref)
    job = fk.TrainJob(root=tmp_path / "topo", name="topo", nodes=2, steps=STEPS, ckpt_every=10, step_sleep=0.1,
                      supervise={"spare_nodes": 2, "node_fail_threshold": 1})
    job.submit()
    job.wait_step(15)
    assert job.signal_rank(1, signal.SIGKILL)
    info, story = fk.assert_healed(job, slurm, ref / "final.pt", timeout_s=240)
    topo = fk.events(job, "topology")
    assert topo and topo[0]["domains"]["node2"] == topo[0]["domains"]["node4"], story
    launches = fk.events(job, "launch")
    assert launches[0]["nodes"] == ["node1", "node2"] and launches[-1]["nodes"] == ["node1", "node4"], story
    assert not fk.events(job, "spare_out_of_domain") and info.restart_count == 0, story


@pytest.mark.timeout(120)
def test_a_segment_the_cluster_cannot_honour_is_refused_before_anything_is_written(topo_cluster, tmp_path):
    import subprocess
    import sys

    import yaml

    from clusterops.slurm.factory import connect

    dc, kind = topo_cluster
    old = connect().version() < (24, 5)
    # 22.05 knows no --segment at all; 24.05+ refuses a segment larger than the 4 nodes here.
    seg, nodes = (2, 2) if old else (8, 8)
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "seg", "nodes": nodes, "launcher": "torchrun", "script": "train.py",
                                    "segment": seg, "log_dir": "logs"}))
    r = subprocess.run([sys.executable, "-m", "clusterops", "launch", "submit", str(spec)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert str(spec) in line and "segment:" in line, r.stderr
    assert ("needs Slurm 24.05" in line) if old else ("larger than the cluster (4 node(s))" in line), line
    assert not (tmp_path / "logs").exists() and connect().jobs() == []
