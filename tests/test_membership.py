"""The in-process generations (clusterops.supervisor.membership): pure decisions, fake clock."""

from __future__ import annotations

from clusterops.supervisor.membership import Fallback, KillProcess, Membership, Note, Publish, Report

NODES = ["node1", "node2", "node3", "node4"]


def started(ppn=1, spn=1, **kw):
    """A membership whose first generation is planned: ranks r -> uid "nodeK:1<local>"."""
    m = Membership(NODES, ppn, spn, **kw)
    out = []
    task = 0
    for i, node in enumerate(NODES):
        for local in range(ppn + spn):
            out += m.handle(Report("hello", f"{node}:{100 + local}", {"node": node, "local": local, "task": task}), 0.0)
            task += 1
    return m, out


def kinds(actions):
    return [a.kind if isinstance(a, Note) else type(a).__name__ for a in actions]


def test_first_plan_gives_each_node_its_ranks_in_order_and_the_rest_standby():
    m, out = started(ppn=2, spn=1)
    pub = [a for a in out if isinstance(a, Publish)]
    assert len(pub) == 1 and pub[0].plan.gen == 0 and pub[0].plan.world == 8
    ranks = pub[0].plan.ranks
    assert ranks["node1:100"] == 0 and ranks["node1:101"] == 1 and ranks["node4:101"] == 7
    assert set(pub[0].plan.standby) == {f"{n}:102" for n in NODES} and pub[0].plan.src is None


def test_no_plan_until_every_process_said_hello():
    m = Membership(NODES, 1, 1)
    for node in NODES[:3]:
        for local in (0, 1):
            assert not m.handle(Report("hello", f"{node}:{local}", {"node": node, "local": local}), 0.0)
    assert m.plan is None


def test_dead_rank_replaced_by_its_nodes_standby_state_from_highest_survivor():
    m, _ = started()
    out = m.handle(Report("dead", "node3:101", {"dead": "node3:100"}), 10.0)
    assert kinds(out) == ["inproc_fault"]
    out = m.handle(Report("join", "node1:100", {"gen": 1, "rank": 0, "step": 23}), 10.1)
    out += m.handle(Report("join", "node2:100", {"gen": 1, "rank": 1, "step": 24}), 10.2)
    assert not [a for a in out if isinstance(a, Publish)]
    out = m.handle(Report("join", "node4:100", {"gen": 1, "rank": 3, "step": 24}), 10.3)
    pub = [a for a in out if isinstance(a, Publish)][0].plan
    assert pub.gen == 1 and pub.ranks["node3:101"] == 2 and "node3:100" not in pub.ranks
    assert pub.src == 1 and pub.step == 24      # the highest step, the lowest rank holding it
    assert "node3:101" not in pub.standby
    note = [a for a in out if isinstance(a, Note) and a.kind == "inproc_rendezvous"][0]
    assert note.data["replaced"] == [{"rank": 2, "from": "node3", "to": "node3", "uid": "node3:101"}]
    out = m.handle(Report("step", "node1:100", {"gen": 1, "step": 25}), 11.0)
    assert kinds(out) == ["inproc_first_step"] and out[0].data["fault_to_step_s"] == 1.0
    assert m.recovery is None and m.recoveries == 1


def test_srun_task_number_names_the_dead_rank():
    m, _ = started()
    m.handle(Report("dead", "srun", {"task": 4, "node": "node3", "reason": "Killed"}), 5.0)   # node3 local 0
    assert m.recovery is not None and m.recovery.dead == {2}


def test_a_spare_standby_on_another_node_when_its_own_is_gone():
    m, _ = started()
    m.handle(Report("dead", "node1:100", {"dead": "node3:101"}), 1.0)    # node3's standby died
    assert m.recovery is None                                          # a standby: no new generation
    m.handle(Report("dead", "node1:101", {"dead": "node3:100"}), 2.0)
    out = []
    for node, rank in (("node1", 0), ("node2", 1), ("node4", 3)):
        out += m.handle(Report("join", f"{node}:100", {"gen": 1, "rank": rank, "step": 7}), 2.1)
    plan = [a for a in out if isinstance(a, Publish)][0].plan
    took = [u for u, r in plan.ranks.items() if r == 2][0]
    assert took.endswith(":101") and not took.startswith("node3")


def test_same_rank_lost_twice_falls_back():
    m, _ = started()
    m.handle(Report("dead", "x", {"dead": "node3:100"}), 1.0)
    for node, rank in (("node1", 0), ("node2", 1), ("node4", 3)):
        m.handle(Report("join", f"{node}:100", {"gen": 1, "rank": rank, "step": 7}), 1.1)
    m.handle(Report("step", "node1:100", {"gen": 1, "step": 8}), 1.5)
    out = m.handle(Report("dead", "srun", {"task": 5}), 3.0)   # node3:101, now rank 2
    assert [a.reason for a in out if isinstance(a, Fallback)] == ["rank 2 failed a second time"]
    assert m.fallen_back and not m.handle(Report("join", "node1:100", {"gen": 2, "rank": 0, "step": 9}), 3.1)


def test_fault_during_recovery_falls_back():
    m, _ = started()
    m.handle(Report("dead", "x", {"dead": "node3:100"}), 1.0)
    for node, rank in (("node1", 0), ("node2", 1), ("node4", 3)):
        m.handle(Report("join", f"{node}:100", {"gen": 1, "rank": rank, "step": 7}), 1.1)
    out = m.handle(Report("fail", "node2:100", {"gen": 1, "rank": 1, "error": "reset"}), 1.3)
    assert isinstance(out[0], Fallback) and "second fault during the recovery" in out[0].reason


def test_unresponsive_rank_is_killed_by_its_standby_then_timeout_falls_back():
    m, _ = started(timeout_s=30, unresponsive_s=3)
    m.handle(Report("fail", "node1:100", {"gen": 0, "rank": 0, "error": "reset"}), 0.0)
    assert m.tick(2.0) == []
    out = m.tick(3.5)
    assert sorted(a.uid for a in out if isinstance(a, KillProcess)) == [f"{n}:100" for n in NODES]
    assert m.tick(4.0) == []                                          # one kill order each
    out = m.tick(31.0)
    assert isinstance(out[0], Fallback) and "rendezvous did not come within 30 s" in out[0].reason


def test_stopped_rank_is_killed():
    m, _ = started()
    out = m.handle(Report("stopped", "node2:101", {"dead": "node2:100", "seconds": 1.0}), 5.0)
    assert kinds(out) == ["inproc_fault", "KillProcess"] and out[1] == KillProcess("node2", "node2:100")
    assert "hung" in m.recovery.first


def test_no_standby_left_falls_back_and_done_finishes():
    m, _ = started(spn=0)
    m.handle(Report("dead", "srun", {"task": 1}), 1.0)
    out = []
    for node, rank in (("node1", 0), ("node3", 2), ("node4", 3)):
        out += m.handle(Report("join", f"{node}:100", {"gen": 1, "rank": rank, "step": 7}), 1.1)
    assert [a.reason for a in out if isinstance(a, Fallback)] == ["no standby left for rank 1"]
    m2, _ = started()
    for i, node in enumerate(NODES):
        m2.handle(Report("done", f"{node}:100", {"rank": i, "step": 60}), 9.0)
    assert m2.finished


def test_job_metrics_count_inprocess_recoveries_and_fallbacks():
    from clusterops.supervisor import timeline as tl

    recs = [{"t": 1.0, "event": "launch", "attempt": 0, "nodes": ["node1"]},
            {"t": 5.0, "event": "inproc_fault", "gen": 0, "first": "rank 2 lost"},
            {"t": 6.0, "event": "inproc_first_step", "gen": 1, "step": 24, "fault_to_step_s": 0.7},
            {"t": 9.0, "event": "inproc_fault", "gen": 1, "first": "rank 2 lost"},
            {"t": 9.5, "event": "inproc_fallback", "reason": "rank 2 failed a second time"}]
    out = tl.job_metrics(recs, "j").text()
    assert 'clusterops_job_inprocess_recoveries{job="j"} 1.0' in out
    assert 'clusterops_job_inprocess_fallbacks{job="j"} 1.0' in out
    assert 'clusterops_job_inprocess_recovery_seconds{job="j"} 0.7' in out


def test_recovery_notes_carry_when_each_phase_ended():
    """The goodput report's in-process phases come from these times (the rendezvous's clock,
    not the moment the supervisor's loop wrote the record)."""
    m, _ = started()
    out = m.handle(Report("dead", "node3:101", {"dead": "node3:100"}), 10.0)
    assert out[0].data["at"] == 10.0
    out = []
    for t, (node, rank) in zip((10.25, 10.3, 10.5), (("node1", 0), ("node2", 1), ("node4", 3))):
        out += m.handle(Report("join", f"{node}:100", {"gen": 1, "rank": rank, "step": 9}), t)
    note = [a for a in out if isinstance(a, Note) and a.kind == "inproc_rendezvous"][0]
    assert note.data["abort_s"] == 0.25 and note.data["wait_s"] == 0.5 and note.data["at"] == 10.5
    st = m.handle(Report("state", "node1:100", {"gen": 1, "seconds": 0.01, "src": 0}), 10.7)
    assert st[0].kind == "inproc_state" and st[0].data["at"] == 10.7 and st[0].data["seconds"] == 0.01


def heal(m, dead_uid, survivors, step, t):
    """A rank lost, the survivors (uid -> rank) rejoin, the new generation's first step."""
    out = m.handle(Report("dead", "x", {"dead": dead_uid}), t)
    for uid, rank in survivors.items():
        out += m.handle(Report("join", uid, {"gen": m.gen + 1, "rank": rank, "step": step}), t + 0.1)
    plan = [a for a in out if isinstance(a, Publish)][0].plan
    out += m.handle(Report("step", "x", {"gen": plan.gen, "step": step + 1}), t + 0.5)
    return plan, out


def test_a_used_standby_is_refilled_on_its_node_and_the_next_fault_there_heals_in_process():
    from clusterops.supervisor.membership import StartStandby

    m, _ = started(ppn=2, spn=1, refill=True)       # node3: ranks 4 (node3:100), 5 (node3:101), standby node3:102
    others = {"node1:100": 0, "node1:101": 1, "node2:100": 2, "node2:101": 3, "node4:100": 6, "node4:101": 7}
    plan, out = heal(m, "node3:100", {**others, "node3:101": 5}, 10, 1.0)
    assert plan.ranks["node3:102"] == 4
    assert [a for a in out if isinstance(a, StartStandby)] == [StartStandby("node3", "node3:102")]
    assert m.refills == 1
    # The new standby (a Slurm step of its own: SLURM_PROCID 0 there) says hello after the first plan.
    hello = m.handle(Report("hello", "node3:200", {"node": "node3", "local": 0, "task": 0}), 3.0)
    assert kinds(hello) == ["inproc_standby"] and hello[0].data["node"] == "node3"
    assert m.procs["node3:200"].task == -1 and "node3:200" in m.plan.standby
    # Another rank of node3: it takes the refilled standby there, not node1's (another node).
    plan, out = heal(m, "node3:101", {**others, "node3:102": 4}, 20, 5.0)
    assert plan.ranks["node3:200"] == 5 and "node1:102" in plan.standby
    assert not [a for a in out if isinstance(a, Fallback)] and m.recoveries == 2
    assert [a for a in out if isinstance(a, StartStandby)] == [StartStandby("node3", "node3:200")]


def test_a_late_standby_is_not_taken_for_the_training_steps_task_of_the_same_number():
    m, _ = started(refill=True)
    m.handle(Report("hello", "node3:200", {"node": "node3", "local": 0, "task": 0}), 1.0)
    m.handle(Report("dead", "srun", {"task": 0, "node": "node1", "reason": "Killed"}), 2.0)
    assert m.recovery is not None and m.recovery.dead == {0}      # node1:100, task 0 of the training step
    assert m.procs["node3:200"].alive


def test_no_refill_unless_asked_and_a_hello_said_twice_counts_once():
    from clusterops.supervisor.membership import StartStandby

    m, _ = started()
    _, out = heal(m, "node3:100", {"node1:100": 0, "node2:100": 1, "node4:100": 3}, 10, 1.0)
    assert not [a for a in out if isinstance(a, StartStandby)] and m.refills == 0
    m.handle(Report("hello", "node3:200", {"node": "node3", "local": 0}), 3.0)
    assert m.handle(Report("hello", "node3:200", {"node": "node3", "local": 0}), 3.1) == []
    assert m.plan.standby.count("node3:200") == 1


def with_spare(spn=1):
    """NODES[:3] train (one rank each, ``spn`` standbys); node4 is a spare running standbys only,
    whose hello comes first (its own step) and does not count toward the first plan."""
    m = Membership(NODES[:3], 1, spn, spares=["node4"], unresponsive_s=10.0)
    out = m.handle(Report("hello", "node4:900", {"node": "node4", "local": 0, "task": 0}), 0.0)
    task = 0
    for node in NODES[:3]:
        for local in range(1 + spn):
            out += m.handle(Report("hello", f"{node}:{100 + local}", {"node": node, "local": local, "task": task}), 0.0)
            task += 1
    return m, out


def test_a_spares_standbys_join_the_pool_without_holding_up_the_first_plan():
    m = Membership(NODES[:3], 1, 1, spares=["node4"])
    m.handle(Report("hello", "node4:900", {"node": "node4", "local": 0, "task": 5}), 0.0)
    for node in NODES[:3]:
        m.handle(Report("hello", f"{node}:100", {"node": node, "local": 0, "task": 0}), 0.0)
    assert m.plan is None          # 1 of 3 standbys of the training nodes still to come
    m2, out = with_spare()
    plan = [a for a in out if isinstance(a, Publish)][0].plan
    assert plan.world == 3 and "node4:900" in plan.standby and "node4:900" not in plan.ranks
    assert m2.procs["node4:900"].task == -1     # not a task of the training step


def test_a_node_lost_whole_is_declared_by_its_silence_and_its_rank_goes_to_the_spare():
    m, _ = with_spare()
    out = m.handle(Report("join", "node1:100", {"gen": 1, "rank": 0, "step": 23}), 10.0)
    out += m.handle(Report("join", "node2:100", {"gen": 1, "rank": 1, "step": 23}), 10.1)
    assert kinds(out) == ["inproc_fault"]       # rank 2 neither joined nor died: no plan yet
    assert m.watch_nodes() == ["node3"]         # its node's standby is the one to listen to
    out = m.handle(Report("silent", "host", {"node": "node3", "seconds": 3.0}), 13.1)
    assert kinds(out)[:1] == ["inproc_node_lost"] and out[0].data["procs"] == 2
    pub = [a for a in out if isinstance(a, Publish)][0].plan
    assert pub.ranks["node4:900"] == 2 and pub.src == 0 and pub.step == 23
    assert not m.procs["node3:101"].alive and "node3:101" not in pub.standby   # the dead standby is not picked
    note = [a for a in out if isinstance(a, Note) and a.kind == "inproc_rendezvous"][0]
    assert note.data["replaced"] == [{"rank": 2, "from": "node3", "to": "node4", "uid": "node4:900"}]
    assert m.lost_nodes == {"node3"} and m.watch_nodes() == []
    # srun's later word about the node's tasks changes nothing; the task numbers are healed ones.
    assert m.handle(Report("dead", "srun", {"task": 4}), 20.0) == []
    assert {4, 5} <= m.lost_tasks()


def test_a_lost_rank_of_a_node_that_lives_stays_on_it_and_otherwise_prefers_the_emptiest_node():
    m, _ = with_spare()
    out = m.handle(Report("dead", "node1:101", {"dead": "node2:100"}), 5.0)
    for rank, uid in ((0, "node1:100"), (2, "node3:100")):
        out += m.handle(Report("join", uid, {"gen": 1, "rank": rank, "step": 7}), 5.1)
    pub = [a for a in out if isinstance(a, Publish)][0].plan
    assert pub.ranks["node2:101"] == 1          # node2 lives (its standby answered): same node
    # Its own standby gone too: node4 (no rank) is chosen over node1's and node3's standbys.
    m, _ = with_spare()
    m.handle(Report("dead", "node1:101", {"dead": "node2:101"}), 4.0)
    out = m.handle(Report("dead", "node1:101", {"dead": "node2:100"}), 5.0)
    for rank, uid in ((0, "node1:100"), (2, "node3:100")):
        out += m.handle(Report("join", uid, {"gen": 1, "rank": rank, "step": 7}), 5.1)
    pub = [a for a in out if isinstance(a, Publish)][0].plan
    assert pub.ranks["node4:900"] == 1


def test_a_node_falling_silent_after_the_plan_that_holds_a_new_rank_falls_back():
    m, _ = with_spare()
    m.handle(Report("dead", "node1:101", {"dead": "node3:100"}), 5.0)
    for rank, uid in ((0, "node1:100"), (1, "node2:100")):
        m.handle(Report("join", uid, {"gen": 1, "rank": rank, "step": 7}), 5.1)
    assert m.plan.gen == 1 and m.plan.ranks["node3:101"] == 2     # node3 lives: its standby took it
    out = m.handle(Report("silent", "host", {"node": "node3", "seconds": 3.0}), 6.0)
    assert [type(a).__name__ for a in out][-1] == "Fallback" and "node node3 lost during" in out[-1].reason


def test_with_confirm_alive_a_same_node_heal_waits_for_the_nodes_beat_or_its_silence():
    def confirming():
        m = Membership(NODES[:3], 1, 1, spares=["node4"], confirm_alive=True, unresponsive_s=10.0)
        m.handle(Report("hello", "node4:900", {"node": "node4", "local": 0, "task": 0}), 0.0)
        for i, node in enumerate(NODES[:3]):
            for local in (0, 1):
                m.handle(Report("hello", f"{node}:{100 + local}", {"node": node, "local": local, "task": 2 * i + local}), 0.0)
        return m

    # srun says rank 2's task ended; node3's standby may have died with it (a node lost whole).
    m = confirming()
    out = m.handle(Report("dead", "srun", {"task": 4}), 10.0)
    for rank, uid in ((0, "node1:100"), (1, "node2:100")):
        out += m.handle(Report("join", uid, {"gen": 1, "rank": rank, "step": 9}), 10.1)
    assert not [a for a in out if isinstance(a, Publish)] and m.confirm_nodes() == ["node3"]
    assert m.beat_seen("node1", 10.2) == []                 # another node's beat decides nothing
    pub = [a for a in m.beat_seen("node3", 10.3) if isinstance(a, Publish)][0].plan
    assert pub.ranks["node3:101"] == 2                      # node3 lives: its own standby
    # Its beat never moves: the host reports it silent, and the spare takes the rank.
    m = confirming()
    m.handle(Report("dead", "srun", {"task": 4}), 10.0)
    for rank, uid in ((0, "node1:100"), (1, "node2:100")):
        m.handle(Report("join", uid, {"gen": 1, "rank": rank, "step": 9}), 10.1)
    out = m.handle(Report("silent", "host", {"node": "node3", "seconds": 3.0}), 13.0)
    pub = [a for a in out if isinstance(a, Publish)][0].plan
    assert pub.ranks["node4:900"] == 2 and m.confirm_nodes() == []


def test_gone_nodes_are_those_with_no_process_left_however_each_was_heard_of():
    m, _ = with_spare()
    m.handle(Report("dead", "srun", {"task": 4}), 5.0)      # node3's rank (task 4)
    assert m.gone_nodes() == set()                          # its standby lives
    m.handle(Report("dead", "srun", {"task": 5}), 5.1)      # and its standby: node3 has nothing left
    assert m.gone_nodes() == {"node3"}
    m2, _ = with_spare()
    m2.handle(Report("silent", "host", {"node": "node2", "seconds": 3.0}), 6.0)
    assert m2.gone_nodes() == {"node2"}


def test_a_survivor_that_joined_then_died_is_never_the_state_source():
    """Rank 1 joins at the highest step and then dies before the plan: its place goes to a
    standby that holds only its start state, so the source must be a live survivor."""
    m, _ = started()
    m.handle(Report("dead", "node3:101", {"dead": "node3:100"}), 10.0)
    m.handle(Report("join", "node1:100", {"gen": 1, "rank": 0, "step": 23}), 10.1)
    m.handle(Report("join", "node2:100", {"gen": 1, "rank": 1, "step": 24}), 10.2)
    m.handle(Report("dead", "node2:101", {"dead": "node2:100"}), 10.25)
    out = m.handle(Report("join", "node4:100", {"gen": 1, "rank": 3, "step": 23}), 10.3)
    pub = [a for a in out if isinstance(a, Publish)][0].plan
    assert pub.ranks["node2:101"] == 1 and pub.ranks["node3:101"] == 2
    assert pub.src in (0, 3) and pub.step == 23       # a live survivor, never the dead rank 1


def test_a_late_join_of_a_dead_rank_counts_for_nothing():
    m, _ = started()
    m.handle(Report("dead", "node3:101", {"dead": "node3:100"}), 10.0)
    out = m.handle(Report("join", "node3:100", {"gen": 1, "rank": 2, "step": 99}), 10.1)
    assert not [a for a in out if isinstance(a, Publish)] and m.recovery.joined == {}
