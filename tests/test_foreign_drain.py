"""A node drained by someone else under a running job (issue 30, part 3), fake clock."""

from __future__ import annotations

from support.machine import P, only, records
from clusterops.supervisor import (CheckpointCommitted, DrainNodes, Launch, NodesDown, Requeue,
                                   RequestStop, ResumeChosen, StepExited, Supervisor, Tick)


def _running(**kw):
    nodes = kw.pop("nodes_list", ["n1", "n2", "n3", "n4"])
    s = Supervisor(P(**kw), nodes)
    s.start(1000.0)
    s.handle(ResumeChosen(1000.0, None, "", ()))
    return s


def test_with_a_spare_the_job_stops_with_a_save_and_moves_off_the_node_leaving_the_drain_alone():
    s = _running(nodes=3, spare_nodes=1, drain_bad_nodes=True)
    acts = s.handle(NodesDown(1010.0, {}, {"n3": "maintenance"}))
    assert records(acts, "node_drained")[0].data == {"node": "n3", "reason": "maintenance", "action": "replace",
                                                     "spare": "n4"}
    assert only(acts, RequestStop)
    assert not s.handle(NodesDown(1011.0, {}, {"n3": "maintenance"}))      # seen once
    s.handle(CheckpointCommitted(1012.0, 37, "/ck/37"))
    acts = s.handle(StepExited(1013.0, returncode=0, stopped_by=None))
    assert records(acts, "stopped") and records(acts, "node_bad")[0].data["node"] == "n3"
    assert not only(acts, DrainNodes)                                          # never our drain
    assert only(acts, Launch)[0].nodes == ("n1", "n2", "n4")
    assert not only(acts, Requeue)


def test_without_a_spare_it_keeps_running_then_the_grace_stops_and_requeues_without_the_node():
    s = _running(nodes=3, nodes_list=["n1", "n2", "n3"], drain_grace_s=600, stop_timeout_s=120)
    acts = s.handle(NodesDown(1010.0, {}, {"n2": "reboot for firmware"}))
    rec = records(acts, "node_drained")[0].data
    assert rec["action"] == "keep running" and rec["why"] == "no spare node" and rec["stop_in_s"] == 480
    assert not only(acts, RequestStop)
    assert not only(s.handle(Tick(1400.0)), RequestStop)
    acts = s.handle(Tick(1491.0))
    assert only(acts, RequestStop) and records(acts, "node_bad")[0].data["node"] == "n2"
    acts = s.handle(StepExited(1500.0, returncode=0))
    rq = only(acts, Requeue)
    assert rq and "n2" in rq[0].exclude


def test_without_grace_it_only_keeps_running_and_a_drained_spare_is_dropped():
    s = _running(nodes=3, spare_nodes=1)
    s.handle(NodesDown(1005.0, {}, {"n4": "maintenance"}))
    assert "n4" not in s.spares
    s2 = _running(nodes=3, nodes_list=["n1", "n2", "n3"])
    acts = s2.handle(NodesDown(1010.0, {}, {"n1": "maintenance"}))
    assert records(acts, "node_drained")[0].data["action"] == "keep running"
    assert not only(s2.handle(Tick(99999.0)), RequestStop)
