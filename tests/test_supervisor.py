"""The supervisor's decisions, on their own: events in, actions out, a fake clock."""

from __future__ import annotations

import pytest

from clusterops import supervisor as sv
from clusterops.supervisor import (CaptureStacks, CheckpointCommitted, DrainNodes, Exit, Heartbeats, KillStep,
                                   Launch, Memory, NodesDown, Policy, PreflightDone, RankFailure, Record,
                                   Requeue, RequestStop, RunPreflight, StepExited, StepLaunched, StopRequested,
                                   Supervisor, Tick)

NODES = ["node1", "node2", "node3", "node4"]


def P(**kw):
    """A policy without the extra steps a test does not look at (preflight, liveness)."""
    kw.setdefault("preflight", None)
    kw.setdefault("liveness_check", False)
    return Policy(**kw)


def only(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def records(actions, kind=None):
    return [a for a in actions if isinstance(a, Record) and (kind is None or a.kind == kind)]


def launched(actions):
    found = only(actions, Launch)
    assert len(found) == 1, actions
    return found[0]


def start(policy=None, nodes=NODES, **kw):
    policy = policy or P(nodes=len(nodes), preflight=None)
    s = Supervisor(policy, nodes, **kw)
    return s, s.start(now=1000.0)


def killed(node, rank, reason="Killed"):
    return RankFailure(node=node, rank=rank, reason=reason)


# ---------------------------------------------------------------- happy path, preflight
def test_fault_free_run_launches_once_and_finishes():
    s, acts = start()
    assert launched(acts).nodes == tuple(NODES)
    assert launched(acts).attempt == 0
    assert s.handle(StepLaunched(1001.0)) == []
    acts = s.handle(StepExited(1100.0, returncode=0, ckpt_step=100))
    assert only(acts, Exit) == [Exit(0, "training finished")]
    assert records(acts, "done")
    assert s.handle(Tick(1200.0)) == []   # done is final


def test_preflight_failure_excludes_node_and_uses_spare():
    s, acts = start(P(nodes=3, spare_nodes=1, preflight="preflight", drain_bad_nodes=True))
    pf = only(acts, RunPreflight)[0]
    assert pf.nodes == tuple(NODES) and pf.profile == "preflight"
    assert not only(acts, Launch)
    acts = s.handle(PreflightDone(1010.0, {"node1": "pass", "node2": "warn", "node3": "fail", "node4": "pass"},
                                  {"node3": "host: /scratch missing"}))
    assert launched(acts).nodes == ("node1", "node2", "node4")
    drains = only(acts, DrainNodes)
    assert drains and drains[0].nodes == ("node3",)
    assert drains[0].reason == "clusterops:supervisor: preflight fail: host: /scratch missing"
    assert "node3" in s.memory.bad_nodes


def test_preflight_error_excludes_but_never_drains():
    s, acts = start(P(nodes=2, spare_nodes=2, preflight="preflight", drain_bad_nodes=True))
    acts = s.handle(PreflightDone(1010.0, {"node1": "pass", "node2": "error", "node3": "missing", "node4": "pass"},
                                  {"node2": "host.memory: probe raised FileNotFoundError"}))
    assert launched(acts).nodes == ("node1", "node4")
    assert {r.data["node"] for r in records(acts, "node_bad")} == {"node2", "node3"}
    # The check crashed on node2: excluded, not drained. node3 never answered (a lost node): drained.
    assert [d.nodes for d in only(acts, DrainNodes)] == [("node3",)]


@pytest.mark.parametrize("statuses", [
    {n: "fail" for n in NODES},
    {"node1": "fail", "node2": "fail", "node3": "error", "node4": "missing"},
])
def test_preflight_failing_on_every_node_is_a_broken_check(statuses):
    s, acts = start(P(nodes=4, preflight="preflight", drain_bad_nodes=True))
    acts = s.handle(PreflightDone(1010.0, statuses, {n: "host.paths: ${SCRATCH} unset" for n in NODES}))
    assert not only(acts, DrainNodes) and not records(acts, "node_bad") and not s.bad
    broken = records(acts, "check_broken")
    assert broken and broken[0].data["check"] == "preflight" and "broken check" in broken[0].data["what"]
    assert launched(acts).nodes == tuple(NODES)


def test_one_node_failing_preflight_alone_is_that_node():
    s, acts = start(P(nodes=1, preflight="preflight", drain_bad_nodes=True, max_requeues=0), nodes=["node1"])
    acts = s.handle(PreflightDone(1010.0, {"node1": "fail"}, {"node1": "xid: Xid 79"}))
    assert only(acts, DrainNodes) and not records(acts, "check_broken")


def test_preflight_that_nobody_could_run_is_ignored_not_fatal():
    s, acts = start(P(nodes=4, preflight="preflight"))
    acts = s.handle(PreflightDone(1010.0, {n: "missing" for n in NODES}))
    assert launched(acts).nodes == tuple(NODES)
    assert records(acts, "warning")


def test_preflight_leaving_too_few_nodes_requeues_excluding_them():
    s, acts = start(P(nodes=4, preflight="preflight", max_requeues=3), slurm_restart_count=0)
    acts = s.handle(PreflightDone(1010.0, {"node1": "pass", "node2": "pass", "node3": "fail", "node4": "pass"}))
    rq = only(acts, Requeue)
    assert rq and rq[0].exclude == ("node3",)
    assert not only(acts, Launch)


# ---------------------------------------------------------------- crashes
def test_rank_killed_restarts_on_same_nodes_then_drops_repeat_offender_for_spare():
    s, acts = start(P(nodes=3, spare_nodes=1, preflight=None, node_fail_threshold=2))
    assert launched(acts).nodes == ("node1", "node2", "node3")
    acts = s.handle(StepExited(1050.0, returncode=137, failures=(killed("node2", 1), killed("node1", 0, "Terminated")),
                               ckpt_step=20))
    exit_rec = records(acts, "step_exit")[0]
    assert exit_rec.data["cause"] == "rank_killed" and exit_rec.data["blamed"] == ["node2"]
    assert records(acts, "restart")
    assert launched(acts).nodes == ("node1", "node2", "node3")   # one failure is bad luck
    acts = s.handle(StepExited(1100.0, returncode=137, failures=(killed("node2", 1),), ckpt_step=40))
    la = launched(acts)
    assert la.nodes == ("node1", "node3", "node4")             # twice: node2 out, spare node4 in
    assert la.restart_count == 2 and la.attempt == 2
    assert records(acts, "spare_used")[0].data["nodes"] == ["node4"]


def test_crash_loop_gives_up_with_no_progress_code():
    s, acts = start(P(nodes=2, preflight=None, no_progress_restarts=2, max_restarts=10), nodes=["a", "b"])
    launches = 1
    for i in range(10):
        acts = s.handle(StepExited(1000.0 + i, returncode=1, ckpt_step=None,
                                   failures=(killed("a", 0, "Exited with exit code 1"),
                                             killed("b", 1, "Exited with exit code 1"))))
        assert records(acts, "step_exit")[0].data["cause"] == "program_error"
        if only(acts, Exit):
            break
        launches += len(only(acts, Launch))
    assert only(acts, Exit)[0].code == sv.EXIT_NO_PROGRESS
    assert launches == 3            # the first attempt plus K=2 restarts, then give up
    assert records(acts, "give_up")
    assert not only(acts, Requeue)


def test_progress_resets_the_no_progress_count_and_restart_budget_applies():
    s, acts = start(P(nodes=1, preflight=None, no_progress_restarts=1, max_restarts=3, node_fail_threshold=9),
                 nodes=["a"])
    for i, ck in enumerate([10, 20, 30]):
        acts = s.handle(StepExited(1000.0 + i, returncode=1, failures=(killed("a", 0),), ckpt_step=ck))
        assert only(acts, Launch), acts
    acts = s.handle(StepExited(1010.0, returncode=1, failures=(killed("a", 0),), ckpt_step=40))
    assert only(acts, Exit)[0].code == sv.EXIT_RESTART_BUDGET


def test_checkpoint_events_count_as_progress():
    s, _ = start(P(nodes=1, preflight=None, no_progress_restarts=0), nodes=["a"])
    s.handle(CheckpointCommitted(1001.0, 10, "/ck/step_10"))
    acts = s.handle(StepExited(1002.0, returncode=1, failures=(killed("a", 0),)))
    assert only(acts, Launch)
    acts = s.handle(StepExited(1003.0, returncode=1, failures=(killed("a", 0),)))
    assert only(acts, Exit)[0].code == sv.EXIT_NO_PROGRESS


# ---------------------------------------------------------------- hangs
def test_stale_heartbeat_captures_stacks_kills_and_restarts():
    p = P(nodes=4, preflight=None, hang_timeout_s=30, startup_timeout_s=100)
    s, _ = start(p)
    s.handle(StepLaunched(1000.0))
    fresh = {r: (5, 1040.0) for r in range(4)}
    assert not only(s.handle(Heartbeats(1045.0, fresh)), KillStep)
    beats = {0: (9, 1019.0), 1: (9, 1019.5), 2: (5, 1010.0), 3: (9, 1019.2)}   # rank 2 went silent first
    acts = s.handle(Heartbeats(1050.0, beats))
    assert only(acts, CaptureStacks)[0].ranks == (0, 1, 2, 3)   # everyone is stuck by now
    assert records(acts, "heartbeat_lost")[0].data["culprits"] == [2]
    assert only(acts, KillStep)[0].reason == "hang"
    acts = s.handle(StepExited(1052.0, returncode=137, failures=(killed("node1", 0),), ckpt_step=0))
    assert records(acts, "step_exit")[0].data["cause"] == "hang"
    assert records(acts, "step_exit")[0].data["blamed"] == ["node3"]
    assert launched(acts).nodes == tuple(NODES)


def test_ranks_silent_within_the_window_of_the_first_stale_one_are_named_together():
    """A stopped rank blocks the rest in their next collective: which rank crosses the
    timeout first is scheduling, so every rank gone quiet with it is named (and its stack
    taken), and nobody is a culprit."""
    s, _ = start(P(nodes=4, preflight=None, hang_timeout_s=10, hang_blame_margin_s=5))
    s.handle(StepLaunched(1000.0))
    # At 1030: rank 2 went quiet 10.1 s ago, rank 1 (the stopped one) and the others a
    # moment later; only ranks 0 and 2 are past the timeout.
    beats = {0: (40, 1019.96), 1: (40, 1020.2), 2: (40, 1019.9), 3: (40, 1020.4)}
    acts = s.handle(Heartbeats(1030.0, beats))
    lost = records(acts, "heartbeat_lost")[0].data
    assert lost["ranks"] == [0, 1, 2, 3] and lost["nodes"] == ["node1", "node2", "node3", "node4"]
    assert lost["ages_s"] == [10.0, 9.8, 10.1, 9.6]
    assert lost["culprits"] == []
    assert only(acts, CaptureStacks)[0].ranks == (0, 1, 2, 3)
    assert only(acts, KillStep)[0].reason == "hang"


def test_the_together_window_is_at_most_half_the_hang_timeout():
    s, _ = start(P(nodes=2, preflight=None, hang_timeout_s=4, hang_blame_margin_s=5), nodes=["a", "b"])
    s.handle(StepLaunched(1000.0))
    # rank 0 is 4.5 s quiet; rank 1 stepped 2.4 s ago (a slow step): outside the window of
    # half the timeout (2 s) from the oldest, so not named with it.
    acts = s.handle(Heartbeats(1030.0, {0: (7, 1025.5), 1: (8, 1027.6)}))
    assert records(acts, "heartbeat_lost")[0].data["ranks"] == [0]


def test_hang_where_all_ranks_stall_together_blames_no_node():
    s, _ = start(P(nodes=2, hang_timeout_s=10, node_fail_threshold=1), nodes=["a", "b"])
    s.handle(StepLaunched(1000.0))
    acts = s.handle(Heartbeats(1030.0, {0: (7, 1015.0), 1: (7, 1015.6)}))
    assert only(acts, KillStep)
    acts = s.handle(StepExited(1032.0, returncode=137, failures=(killed("a", 0),)))
    assert records(acts, "step_exit")[0].data == {**records(acts, "step_exit")[0].data, "cause": "hang", "blamed": []}
    assert launched(acts).nodes == ("a", "b")


def test_startup_timeout_of_every_rank_blames_no_node():
    s, _ = start(P(nodes=2, startup_timeout_s=20, node_fail_threshold=1), nodes=["a", "b"])
    s.handle(StepLaunched(1000.0))
    acts = s.handle(Heartbeats(1021.0, {}))
    assert only(acts, KillStep)
    acts = s.handle(StepExited(1022.0, returncode=137))
    assert launched(acts).nodes == ("a", "b")


def test_missing_first_heartbeat_uses_startup_timeout():
    p = P(nodes=2, preflight=None, hang_timeout_s=10, startup_timeout_s=60)
    s, _ = start(p, nodes=["a", "b"])
    s.handle(StepLaunched(1000.0))
    assert not only(s.handle(Heartbeats(1050.0, {0: (1, 1049.0)})), KillStep)   # rank 1 still starting
    acts = s.handle(Heartbeats(1061.0, {0: (3, 1060.0)}))
    assert only(acts, CaptureStacks)[0].ranks == (1,)
    assert only(acts, KillStep)


def test_ranks_per_node_maps_ranks_to_nodes():
    s, _ = start(P(nodes=2, preflight=None, ranks_per_node=4), nodes=["a", "b"])
    assert s.expected_ranks == 8
    assert s.rank_node(3) == "a" and s.rank_node(4) == "b" and s.rank_node(8) is None


def test_kill_escalates_when_step_does_not_go_away():
    s, _ = start(P(nodes=1, preflight=None, hang_timeout_s=5, kill_timeout_s=20), nodes=["a"])
    s.handle(Heartbeats(1010.0, {0: (1, 1001.0)}))
    assert s.state == sv.KILLING
    assert not only(s.handle(Tick(1020.0)), KillStep)
    acts = s.handle(Tick(1031.0))
    assert only(acts, KillStep)[0].force


def test_progress_samples_are_rate_limited():
    s, _ = start(P(nodes=1, preflight=None, progress_interval_s=5), nodes=["a"])
    assert records(s.handle(Heartbeats(1001.0, {0: (1, 1001.0)})), "progress")
    assert not records(s.handle(Heartbeats(1002.0, {0: (2, 1002.0)})), "progress")
    assert records(s.handle(Heartbeats(1007.0, {0: (7, 1007.0)})), "progress")


# ---------------------------------------------------------------- nodes lost
def test_node_down_uses_spare():
    s, acts = start(P(nodes=3, spare_nodes=1, preflight=None, drain_bad_nodes=False))
    assert s.spares == ["node4"]
    acts = s.handle(NodesDown(1030.0, {"node3": "down+NOT_RESPONDING"}))
    assert only(acts, KillStep)[0].reason == "node_down"
    acts = s.handle(StepExited(1035.0, returncode=1, failures=(RankFailure("node3", 2, "Killed"),),
                               node_failure=("node3",), ckpt_step=20))
    assert records(acts, "step_exit")[0].data["cause"] == "node_lost"
    assert launched(acts).nodes == ("node1", "node2", "node4")
    assert not only(acts, DrainNodes)
    # Seen again in the next poll: nothing new happens.
    assert not only(s.handle(NodesDown(1040.0, {"node3": "down"})), KillStep)


def test_ranks_moved_in_process_to_the_spare_keep_the_step_when_slurm_reports_the_node():
    s, _ = start(P(nodes=3, spare_nodes=1, preflight=None, drain_bad_nodes=True))
    s.handle(StepLaunched(1001.0))
    acts = s.handle(sv.RanksMoved(1020.0, ((2, "node3", "node4"),), ("node1", "node2", "node4")))
    assert records(acts, "spare_used")[0].data == {"nodes": ["node4"], "replacing": "node3", "inprocess": True}
    assert s.active == ["node1", "node2", "node4"] and s.spares == [] and s.rank_node(2) == "node4"
    acts = s.handle(NodesDown(1030.0, {"node3": "down+NOT_RESPONDING"}))
    assert not only(acts, KillStep) and s.state == "running"
    assert only(acts, DrainNodes)[0].nodes == ("node3",)     # still a real node loss: drained
    acts = s.handle(StepExited(1100.0, returncode=0, ckpt_step=60))
    assert only(acts, Exit) == [Exit(0, "training finished")]
    # A move to a node of the step (no spare): the lost node keeps its place for rank numbers,
    # its loss does not end the step, and no later step uses it.
    s, _ = start(P(nodes=3, preflight=None), nodes=["node1", "node2", "node3"])
    s.handle(StepLaunched(1001.0))
    s.handle(sv.RanksMoved(1020.0, ((2, "node3", "node1"),), ("node1", "node2")))
    assert not only(s.handle(NodesDown(1030.0, {"node3": "down"})), KillStep)
    assert s.active == ["node1", "node2", "node3"] and "node3" not in s._usable()
    # A move that leaves ranks on the node changes nothing.
    s, _ = start(P(nodes=3, spare_nodes=1, preflight=None))
    s.handle(StepLaunched(1001.0))
    assert s.handle(sv.RanksMoved(1020.0, ((2, "node3", "node4"),), ("node1", "node2", "node3", "node4"))) == []
    assert only(s.handle(NodesDown(1030.0, {"node3": "down"})), KillStep)


def test_node_down_without_spare_shrinks_when_allowed():
    s, _ = start(P(nodes=4, min_nodes=3, preflight=None))
    s.handle(NodesDown(1030.0, {"node4": "down"}))
    acts = s.handle(StepExited(1035.0, returncode=1, node_failure=("node4",), ckpt_step=20))
    assert launched(acts).nodes == ("node1", "node2", "node3")
    assert records(acts, "shrink")


def test_node_down_without_spare_requeues_excluding_node():
    s, _ = start(P(nodes=3, preflight=None, drain_bad_nodes=True), nodes=["node1", "node2", "node3"])
    acts = s.handle(NodesDown(1030.0, {"node3": "down"}))
    assert only(acts, DrainNodes)[0].nodes == ("node3",)
    acts = s.handle(StepExited(1035.0, returncode=1, node_failure=("node3",), ckpt_step=20))
    rq = only(acts, Requeue)
    assert rq and rq[0].exclude == ("node3",)
    assert s.memory.bad_nodes.keys() == {"node3"}


def test_requeue_budget_spent_gives_up():
    s, _ = start(P(nodes=2, preflight=None, max_requeues=2), nodes=["a", "b"], slurm_restart_count=2)
    s.handle(NodesDown(1030.0, {"b": "down"}))
    acts = s.handle(StepExited(1035.0, returncode=1, node_failure=("b",)))
    assert only(acts, Exit)[0].code == sv.EXIT_REQUEUE_BUDGET
    assert not only(acts, Requeue)


def test_requeue_not_allowed_gives_up_too_few_nodes():
    s, _ = start(P(nodes=2, preflight=None, requeue=False), nodes=["a", "b"])
    s.handle(NodesDown(1030.0, {"b": "down"}))
    acts = s.handle(StepExited(1035.0, returncode=1, node_failure=("b",)))
    assert only(acts, Exit)[0].code == sv.EXIT_TOO_FEW_NODES


def test_known_bad_nodes_from_earlier_incarnation_stay_out():
    mem = Memory(bad_nodes={"node3": sv.LOST_WHY}, attempts=2, restarts=1)
    s, acts = start(P(nodes=3, preflight=None), memory=mem, slurm_restart_count=1)
    la = launched(acts)
    assert la.nodes == ("node1", "node2", "node4")
    assert la.attempt == 2 and la.restart_count == 1
    assert records(acts, "start")[0].data["known_bad"] == ["node3"]
    assert not records(acts, "warning") and mem.bad_nodes == {"node3": sv.LOST_WHY}


def test_nodes_only_slurm_lost_are_used_again_when_slurm_gives_them_back_and_none_other_will_do():
    # A chain's generation (seen on Slurm 24.11): Slurm reported node3 and node4 failed in
    # the last one, then gave them back to this one, with nothing else up in the partition.
    mem = Memory(bad_nodes={"node3": sv.LOST_WHY, "node4": sv.LOST_WHY})
    s, acts = start(P(nodes=3), nodes=["node2", "node3", "node4"], memory=mem)
    assert launched(acts).nodes == ("node2", "node3", "node4")
    assert not only(acts, Requeue)
    warn = records(acts, "warning")[0].data
    assert warn["nodes"] == ["node3", "node4"] and "1 node(s) are left, 3 needed: used again" in warn["what"]
    assert mem.bad_nodes == {} and s.bad == {}


def test_a_node_blamed_on_our_own_evidence_is_never_taken_back_and_the_requeue_names_what_only_slurm_lost():
    mem = Memory(bad_nodes={"node3": sv.LOST_WHY, "node4": "2 failures blamed on it (last: rank_killed)"})
    s, acts = start(P(nodes=3, requeue=True), nodes=["node2", "node3", "node4"], memory=mem)
    # node3 alone would not be enough (node4 is out on our evidence): nothing taken back.
    rq = only(acts, Requeue)
    assert len(rq) == 1 and rq[0].exclude == ("node3", "node4") and rq[0].lost == ("node3",)
    assert not records(acts, "warning") and set(mem.bad_nodes) == {"node3", "node4"}


def test_a_requeue_the_partition_cannot_start_ends_with_too_few_nodes_not_failed():
    s, acts = start(P(nodes=3, requeue=True), nodes=["node1", "node2", "node3"],
                    memory=Memory(bad_nodes={"node3": "exit_code 3: the script named it suspect"}))
    assert only(acts, Requeue)
    acts = s.handle(sv.RequeueFailed(1001.0, "keeping the job off node3 leaves partition debug 2 of its 3 node(s), "
                                             "3 needed: the requeued job could never start", unschedulable=True))
    ex = only(acts, Exit)[0]
    assert ex.code == sv.EXIT_TOO_FEW_NODES and ex.reason.startswith("not requeued: keeping the job off node3")
    s2, _ = start(P(nodes=3, requeue=True), nodes=["node1", "node2", "node3"],
                  memory=Memory(bad_nodes={"node3": "x"}))
    assert only(s2.handle(sv.RequeueFailed(1001.0, "socket timed out")), Exit)[0].code == sv.EXIT_FAILED


def test_memory_round_trips():
    m = Memory(bad_nodes={"x": "why"}, attempts=3, restarts=2, no_progress=1, last_ckpt_step=40)
    assert Memory.from_dict(m.to_dict()) == m


# ---------------------------------------------------------------- stop: time limit, preemption
def test_stop_request_asks_ranks_then_requeues_after_exit():
    s, _ = start(P(nodes=4, preflight=None, stop_timeout_s=60))
    acts = s.handle(StopRequested(1100.0, "time_limit"))
    assert only(acts, RequestStop)[0].reason == "time_limit"
    assert not only(s.handle(StopRequested(1101.0, "preemption")), RequestStop)   # once
    acts = s.handle(StepExited(1120.0, returncode=0, ckpt_step=57))
    assert records(acts, "stopped")[0].data["ckpt_step"] == 57
    assert only(acts, Requeue)
    assert not only(acts, Launch)


def test_stop_timeout_kills_then_requeues():
    s, _ = start(P(nodes=4, preflight=None, stop_timeout_s=30))
    s.handle(StopRequested(1100.0, "preemption"))
    assert not only(s.handle(Tick(1120.0)), KillStep)
    acts = s.handle(Tick(1131.0))
    assert only(acts, KillStep)[0].reason == "stop_timeout"
    acts = s.handle(StepExited(1133.0, returncode=137))
    assert only(acts, Requeue)


def test_stop_with_requeue_disabled_exits_stopped():
    s, _ = start(P(nodes=1, preflight=None, requeue=False), nodes=["a"])
    s.handle(StopRequested(1100.0, "time_limit"))
    acts = s.handle(StepExited(1110.0, returncode=0))
    assert only(acts, Exit)[0].code == sv.EXIT_STOPPED_NO_REQUEUE


def test_stop_during_preflight_requeues_without_launch():
    s, _ = start(P(nodes=2, preflight="preflight"), nodes=["a", "b"])
    s.handle(StopRequested(1001.0, "preemption"))
    acts = s.handle(PreflightDone(1005.0, {"a": "pass", "b": "pass"}))
    assert only(acts, Requeue) and not only(acts, Launch)


def test_stop_while_killing_requeues_after_exit():
    s, _ = start(P(nodes=1, preflight=None, hang_timeout_s=5), nodes=["a"])
    s.handle(Heartbeats(1010.0, {0: (1, 1001.0)}))
    s.handle(StopRequested(1011.0, "preemption"))
    acts = s.handle(StepExited(1012.0, returncode=137))
    assert only(acts, Requeue) and not only(acts, Launch)


def test_requeue_failure_gives_up():
    s, _ = start(P(nodes=1, preflight=None), nodes=["a"])
    s.handle(StopRequested(1001.0, "time_limit"))
    s.handle(StepExited(1002.0, returncode=0))
    acts = s.handle(sv.RequeueFailed(1003.0, "job is not requeueable"))
    assert only(acts, Exit)[0].code == sv.EXIT_FAILED


# ---------------------------------------------------------------- postmortem, policy
def test_postmortem_probe_on_blamed_node_decides_its_fate():
    s, _ = start(P(nodes=2, spare_nodes=1, preflight=None, postmortem="fast"), nodes=["a", "b", "c"])
    acts = s.handle(StepExited(1010.0, returncode=1, failures=(killed("b", 1, "Exited with exit code 1"),),
                               ckpt_step=10))
    pm = only(acts, RunPreflight)[0]
    assert pm.postmortem and pm.nodes == ("a", "b", "c") and pm.profile == "fast"
    assert not only(acts, Launch)
    acts = s.handle(PreflightDone(1015.0, {"a": "pass", "b": "fail", "c": "pass"}, {"b": "xid 79"}, postmortem=True))
    assert launched(acts).nodes == ("a", "c")


def test_liveness_check_after_failure_finds_dead_node_before_slurm_does():
    s, _ = start(P(nodes=3, spare_nodes=1, liveness_check=True))
    acts = s.handle(StepExited(1010.0, returncode=137, ckpt_step=20,
                               failures=(killed("node3", 2), killed("node1", 0, "Exited with exit code 1"))))
    assert records(acts, "step_exit")[0].data["cause"] == "rank_killed"
    check = only(acts, RunPreflight)[0]
    assert check.profile == sv.LIVENESS and check.postmortem and check.nodes == tuple(NODES)
    acts = s.handle(PreflightDone(1012.0, {"node1": "pass", "node2": "pass", "node3": "missing", "node4": "pass"},
                                  postmortem=True))
    assert records(acts, "liveness")
    assert launched(acts).nodes == ("node1", "node2", "node4")


def test_policy_validation():
    assert P(nodes=4, spare_nodes=1, min_nodes=2).validate() == []
    problems = P(nodes=2, min_nodes=3, hang_timeout_s=0, max_restarts=-1).validate()
    assert any(p.startswith("min_nodes") for p in problems)
    assert any(p.startswith("hang_timeout_s") for p in problems)
    assert any(p.startswith("max_restarts") for p in problems)


def test_unknown_event_is_a_type_error():
    s, _ = start()
    with pytest.raises(TypeError):
        s.handle(object())   # type: ignore[arg-type]


def test_resume_chosen_corrects_the_progress_baseline():
    # The newest checkpoint (30) turned out corrupt: the launch really resumes from 20,
    # and a failure that then saves 30 again is progress, not a crash loop.
    s, _ = start(P(nodes=1, no_progress_restarts=0), nodes=["a"], ckpt_step=30)
    acts = s.handle(sv.ResumeChosen(1000.5, 20, "/ck/step_20", ("/ck/step_30",)))
    assert records(acts, "resume")[0].data == {"step": 20, "path": "/ck/step_20", "skipped": ["/ck/step_30"]}
    acts = s.handle(StepExited(1010.0, returncode=1, failures=(killed("a", 0),), ckpt_step=30))
    assert only(acts, Launch)


def test_exit_zero_after_a_stop_that_bypassed_us_is_a_stop_not_done():
    s, _ = start(P(nodes=4))
    acts = s.handle(StepExited(1050.0, returncode=0, ckpt_step=39, stopped_by="preemption"))
    assert not only(acts, Exit)
    assert records(acts, "stopped")[0].data == {"returncode": 0, "ckpt_step": 39, "reason": "preemption"}
    assert only(acts, Requeue)
