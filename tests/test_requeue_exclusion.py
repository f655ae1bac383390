"""A requeue's exclusion never leaves the job unable to start again.

Seen on the Debian 13 tier (Slurm 24.11): Slurm reported two healthy nodes of a 4-node
partition failed, a chain's generation that then got them back requeued itself off them,
and the job, 3 nodes wanted with 2 left outside its ExcNodeList, pended for ever. The
exclusion is now checked against the partition before the requeue: nodes only Slurm lost
are left off it when needed (Slurm keeps a DOWN node out itself); if that is not enough
the job is not requeued and the supervisor ends with exit 6, the reason named.
"""

from __future__ import annotations

import pytest

from clusterops import supervisor as sv
from clusterops.slurm.api import UnschedulableExclusion, schedulable_exclusion
from clusterops.slurm.parse import JobInfo, NodeInfo
from support.fakes import FakeSlurm

PART = ["node1", "node2", "node3", "node4"]


def test_an_exclusion_that_leaves_enough_is_kept_whole():
    assert schedulable_exclusion(PART, "", ["node3"], ["node3"], 3) == (("node3",), ())
    assert schedulable_exclusion(PART, "(null)", ["node2", "node3"], [], 2) == (("node2", "node3"), ())


def test_nodes_only_slurm_lost_are_dropped_when_the_partition_needs_them():
    assert schedulable_exclusion(PART, None, ["node2", "node3"], ["node3"], 3) == (("node2",), ("node3",))


def test_an_exclusion_the_partition_cannot_live_with_is_refused_with_the_numbers():
    with pytest.raises(UnschedulableExclusion,
                       match=r"^keeping the job off node\[2-3\] leaves partition debug 2 of its 4 node\(s\), 3 needed: "
                             r"the requeued job could never start$"):
        schedulable_exclusion(PART, "", ["node2", "node3"], [], 3, "debug")
    # What the job already excludes counts too, and is never narrowed (node1 stays out).
    with pytest.raises(UnschedulableExclusion, match=r"off node\[1,4\] leaves the job's partition 2 of its 4"):
        schedulable_exclusion(PART, "node1", ["node4"], [], 3)


def _run(tmp_path, slurm, nodes=("node2", "node3", "node4")):
    from clusterops.supervisor.run import RunConfig, SupervisorRun

    (tmp_path / "job").mkdir(mode=0o700, exist_ok=True)
    cfg = RunConfig(command=["true"], job_dir=tmp_path / "job", ckpt_dir=tmp_path / "ck",
                    policy=sv.Policy(nodes=len(nodes)), nodes=list(nodes), job_id="55")
    return SupervisorRun(cfg, slurm=slurm, echo=lambda s: None)


def _slurm(excluded=""):
    nodes = [NodeInfo(n, "idle", partitions=("debug",)) for n in PART]
    return FakeSlurm(nodes, [JobInfo(55, "j", "RUNNING", "running", partition="debug", excluded_nodes=excluded)])


def test_the_run_checks_the_partition_and_drops_what_only_slurm_lost(tmp_path):
    from clusterops.supervisor import timeline as tl

    run = _run(tmp_path, _slurm())
    current, exclude = run._schedulable(sv.Requeue(("node3", "node4"), "too few", lost=("node3", "node4")))
    assert (current, exclude) == ("", ())
    assert ("partition_nodes", "debug") in run.slurm.calls
    warn = [r for r in tl.read(tmp_path / "job") if r["event"] == "warning"]
    assert warn and warn[0]["nodes"] == ["node3", "node4"] and "could not start the job without them" in warn[0]["what"]


def test_the_run_refuses_a_requeue_the_partition_could_never_start(tmp_path):
    run = _run(tmp_path, _slurm())
    with pytest.raises(UnschedulableExclusion, match="leaves partition debug 2 of its 4 node"):
        run._schedulable(sv.Requeue(("node3", "node4"), "too few", lost=()))


def test_a_controller_that_cannot_be_read_does_not_stop_the_requeue(tmp_path):
    from clusterops.errors import ClusteropsError

    class Late(FakeSlurm):
        def partition_nodes(self, partition):
            raise ClusteropsError("sinfo: Socket timed out")

    slurm = _slurm(excluded="node1")
    late = Late(slurm.node_infos, slurm.job_infos)
    assert _run(tmp_path, late)._schedulable(sv.Requeue(("node3",), "x")) == ("node1", ("node3",))
