"""Spares in the same topology domain (issue 30, part 5): ``scontrol show topology`` read
(tree and block), the machine's choice of a replacement (fake clock), and the dev cluster's
topology.conf."""

from __future__ import annotations

import pytest

from support.machine import P, lose, only, records
from clusterops.devcluster import DevClusterConfig, render_slurm_conf, render_topology_conf
from clusterops.errors import InputError
from clusterops.slurm.parse import parse_topology
from clusterops.supervisor import Launch, NodesDown, ResumeChosen, Supervisor

# Slurm 22.05's answer on the dev cluster (`devcluster up --topology tree --domain node[1,3]
# --domain node[2,4]`), recorded on this machine.
TREE = """\
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=node[1,3]
SwitchName=s2 Level=0 LinkSpeed=1 Nodes=node[2,4]
SwitchName=top Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=s[1-2]
"""
# topology/block's lines (Slurm 24.11's `scontrol show topology` layout), not recorded here.
BLOCK = """\
BlockName=b1 BlockIndex=0 Nodes=gpu[001-018] BlockSize=18
BlockName=b2 BlockIndex=1 Nodes=gpu[019-036] BlockSize=18
"""


def test_tree_leaf_switches_and_blocks_are_the_domains():
    assert parse_topology(TREE) == {"node1": "s1", "node3": "s1", "node2": "s2", "node4": "s2"}
    doms = parse_topology(BLOCK)
    assert doms["gpu001"] == doms["gpu018"] == "b1" and doms["gpu019"] == "b2" and len(doms) == 36
    assert parse_topology("") == {}
    with pytest.raises(ValueError):
        parse_topology("BlockName=b1 Nodes=gpu[001-")


def _running(domains, nodes=2, spare_nodes=2, names=("n1", "n2", "n3", "n4")):
    s = Supervisor(P(nodes=nodes, spare_nodes=spare_nodes, node_fail_threshold=1), list(names), domains=domains)
    acts = s.start(1000.0)
    acts += s.handle(ResumeChosen(1000.0, None, "", ()))
    return s, acts


def test_the_replacement_comes_from_the_lost_nodes_domain_first():
    # Domains interleaved with the allocation's order: n2's own spare is n4, not n3.
    s, acts = _running({"n1": "a", "n3": "a", "n2": "b", "n4": "b"})
    assert only(acts, Launch)[0].nodes == ("n1", "n2")
    acts = lose(s, "n2", 1010.0)
    assert only(acts, Launch)[0].nodes == ("n1", "n4") and not records(acts, "spare_out_of_domain")
    acts = lose(s, "n1", 1020.0)
    assert only(acts, Launch)[0].nodes == ("n3", "n4") and not records(acts, "spare_out_of_domain")


def test_a_spare_from_another_domain_only_when_none_is_left_and_the_timeline_says_so():
    s, _ = _running({"n1": "a", "n2": "a", "n3": "b", "n4": "b"})
    acts = lose(s, "n2", 1010.0)
    assert only(acts, Launch)[0].nodes == ("n1", "n3")
    out = records(acts, "spare_out_of_domain")[0].data
    assert (out["node"], out["spare"], out["domain"], out["spare_domain"]) == ("n2", "n3", "a", "b")


def test_without_domains_the_allocation_order_stands():
    s, _ = _running({})
    acts = lose(s, "n2", 1010.0)
    assert only(acts, Launch)[0].nodes == ("n1", "n3") and not records(acts, "spare_out_of_domain")


def test_a_planned_replacement_names_the_in_domain_spare():
    s, _ = _running({"n1": "a", "n3": "a", "n2": "b", "n4": "b"})
    acts = s.handle(NodesDown(1010.0, {}, {"n2": "maintenance"}))
    assert records(acts, "node_drained")[0].data["spare"] == "n4"


def test_devcluster_topology_conf_and_its_checks(tmp_path):
    cfg = DevClusterConfig(nodes=4, topology="tree", domains=("node[1,3]", "node[2,4]"))
    cfg.validate()
    assert render_topology_conf(cfg).splitlines()[1:] == [
        "SwitchName=s1 Nodes=node[1,3]", "SwitchName=s2 Nodes=node[2,4]", "SwitchName=top Switches=s[1-2]"]
    assert "TopologyPlugin=topology/tree" in render_slurm_conf(cfg, tmp_path, "h")
    block = DevClusterConfig(nodes=4, topology="block")
    assert render_topology_conf(block).splitlines()[1:] == ["BlockName=b1 Nodes=node[1-2]", "BlockName=b2 Nodes=node[3-4]"]
    assert "TopologyPlugin" not in render_slurm_conf(DevClusterConfig(nodes=4), tmp_path, "h")
    for bad, what in [(dict(topology="ring"), "--topology"), (dict(domains=("node1",)), "needs --topology"),
                      (dict(topology="tree", domains=("node[1-9]",)), "no such node"),
                      (dict(topology="tree", domains=("node[1-2]", "node[2-3]")), "two domains"),
                      (dict(topology="block", domains=("node[1-3]", "node4")), "one size")]:
        with pytest.raises(InputError, match=what.replace("-", r"\-")):
            DevClusterConfig(nodes=4, **bad).validate()


def _spec(tmp_path, **extra):
    import yaml

    (tmp_path / "train.py").write_text("print('hi')\n")
    doc = {"name": "seg", "nodes": 4, "launcher": "torchrun", "script": "train.py", **extra}
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_segment_renders_and_must_divide_the_allocation(tmp_path):
    from clusterops import launch as lib

    job = lib.load_spec(_spec(tmp_path, segment=2))
    assert "#SBATCH --segment=2\n" in lib.render(job)
    assert "--segment" not in lib.render(lib.load_spec(_spec(tmp_path)))
    with pytest.raises(InputError, match=r"job\.yaml.*segment: 4 does not divide the job's 6 node"):
        lib.load_spec(_spec(tmp_path, segment=4, supervise={"spare_nodes": 2}))


class _Cluster:
    def __init__(self, version, nodes):
        self.v, self.n, self.submitted = version, nodes, []

    def version(self):
        return self.v

    def nodes(self):
        return [object()] * self.n

    def partition_nodes(self, partition):
        return [f"n{i}" for i in range(self.n)]

    def submit(self, path):
        self.submitted.append(path)
        return 1


def test_segment_is_checked_against_the_cluster_before_anything_is_written(tmp_path):
    from clusterops import launch as lib
    from clusterops.launch.submit import SpecMismatch

    job = lib.load_spec(_spec(tmp_path, segment=2, log_dir="logs"))
    old = _Cluster((22, 5, 8), 8)
    with pytest.raises(SpecMismatch, match=r"^segment: --segment needs Slurm 24\.05 .* Slurm is 22\.05$"):
        lib.submit(job, old)
    small = _Cluster((24, 11, 1), 1)
    with pytest.raises(SpecMismatch, match=r"^segment: 2 is larger than the cluster \(1 node"):
        lib.submit(job, small)
    assert not old.submitted and not small.submitted and not (tmp_path / "logs").exists()
    ok = _Cluster((24, 11, 1), 4)
    assert lib.submit(job, ok).job_id == 1 and ok.submitted
