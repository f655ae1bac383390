"""An exclusion that holds across a requeue, without a drain (issue 28, part 3).

A 3-node supervised job on the 4-node dev cluster, no spare, ``drain_bad_nodes`` off: a rank
SIGKILLed on node2 blames node2 (``node_fail_threshold: 1``), too few nodes are left, and
the supervisor requeues the job excluding node2. Slurm allocates first fit, so without an
ExcNodeList on the requeued job the next incarnation gets node[1-3] again (before the fix:
node2 again, too few usable nodes, requeue budget spent, exit 4). With the fix the
supervisor sets ExcNodeList on the job once the requeue has made it pending, and the next
incarnation runs on node1, node3 and node4, with the same job id and one timeline.
"""

from __future__ import annotations

import signal

import pytest

from support import faultkit as fk
from clusterops.slurm.parse import expand

pytestmark = pytest.mark.integration


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


def _rank_on_node2_killed(slurm, tmp_path, name, *, nodes, steps, max_requeues):
    """A job with no drain and no spare whose rank 1 (on node2) is SIGKILLed at step 12, to
    its end -> (job, Slurm's JobInfo, the story for assertion messages)."""
    job = fk.TrainJob(root=tmp_path / name, name=name, nodes=nodes, steps=steps, ckpt_every=10,
                      supervise={"drain_bad_nodes": False, "node_fail_threshold": 1, "max_requeues": max_requeues,
                                 "liveness_check": False})
    job.submit()
    job.wait_step(12)
    assert job.signal_rank(1, signal.SIGKILL)           # rank 1 runs on node2
    info = job.wait_end(slurm, timeout_s=150)
    story = (" | ".join(f"{r.get('incarnation')}:{r.get('event')}" for r in job.timeline())
             + f"\nwarnings: {[r.get('what') for r in fk.events(job, 'warning')]}\nbatch log: {job.batch_log()[-3000:]}")
    return job, info, story


@pytest.mark.timeout(180)
def test_blamed_node_stays_excluded_after_requeue_without_drain(cluster, slurm, tmp_path):
    job, info, story = _rank_on_node2_killed(slurm, tmp_path, "xq", nodes=3, steps=40, max_requeues=1)
    assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"], story
    rq = fk.events(job, "requeue")
    assert len(rq) == 1 and rq[0]["exclude"] == ["node2"], story
    # The requeued incarnation was never given node2, so nothing in it needed keeping out.
    second = [r for r in fk.events(job, "start") if r["incarnation"] == 1]
    assert second and "node2" not in second[0]["nodes"] and not second[0]["known_bad"], story
    assert all("node2" not in r["nodes"] for r in fk.events(job, "launch") if r["incarnation"] == 1), story
    assert info.restart_count == 1 and info.category == "done", story
    assert expand(info.excluded_nodes) == ["node2"], info.excluded_nodes
    assert fk.events(job, "done"), story
    # Excluded, not drained: node2 is free for everyone else.
    assert not fk.events(job, "drain") and not slurm.node("node2").drained, story


@pytest.mark.timeout(180)
def test_a_requeue_the_partition_could_never_start_is_not_made(cluster, slurm, tmp_path):
    # All 4 nodes of the partition, no spare: leaving node2 out of a requeue would leave the
    # job pending for ever (3 nodes outside its ExcNodeList, 4 wanted). The supervisor says so
    # and ends with exit 6 instead; nothing is requeued, excluded or drained.
    job, info, story = _rank_on_node2_killed(slurm, tmp_path, "xn", nodes=4, steps=400, max_requeues=3)
    assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"], story
    assert fk.events(job, "requeue")[0]["exclude"] == ["node2"], story    # asked for ...
    give = fk.events(job, "give_up")
    assert give and give[-1]["code"] == 6, story                          # ... and not made
    assert give[-1]["reason"].startswith("not requeued: keeping the job off node2 leaves partition "), story
    assert "3 of its 4 node(s), 4 needed" in give[-1]["reason"], story
    assert info.restart_count == 0 and info.category == "failed" and info.exit_code == 6, (info, story)
    assert not info.excluded_nodes or info.excluded_nodes == "(null)", info.excluded_nodes
    assert not slurm.node("node2").drained, story
