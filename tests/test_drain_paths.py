"""Every drain path goes through ``drain_apply.apply_drain``: the supervisor's DrainNodes
action keeps a node drained or down with someone else's reason, and the sweep applies the
partition-wide fleet guard on top of its own per-sweep fraction. Against the in-memory
controller of tests/test_drains.py (drains stamp the controller's second)."""

from __future__ import annotations

import time

from clusterops import drains
from clusterops.drains import GuardSettings
from support.fakes import FleetSlurm
from test_drains import Clock


def supervisor_with(slurm, guard):
    from clusterops.supervisor.run import SupervisorRun

    run = SupervisorRun.__new__(SupervisorRun)     # only what the drain action touches
    run.slurm, run.guard, run.sleep = slurm, guard, lambda s: None
    run.events = []
    run._record = lambda kind, data=None: run.events.append((kind, data or {}))
    return run


def test_supervisor_keeps_a_down_node_with_someone_elses_reason():
    from clusterops.supervisor import DrainNodes

    slurm = FleetSlurm(4, clock=Clock())
    slurm.state["n02"].update(down=True, reason="Not responding", time=1.7e9)
    slurm.state["n03"].update(down=True, reason="admin: PSU swap", time=1.7e9)
    run = supervisor_with(slurm, GuardSettings(1.0))
    run._act_drain_nodes(DrainNodes(("n02", "n03"), drains.make_reason(drains.SUPERVISOR, "lost", "no beats")))
    assert [k for k, _ in run.events] == ["drain_skipped", "drain_skipped"], run.events
    assert all("someone else" in d["why"] for _, d in run.events)
    assert slurm.state["n02"]["reason"] == "Not responding" and slurm.state["n03"]["reason"] == "admin: PSU swap"
    assert not slurm.state["n02"]["drained"] and "drain" not in slurm.calls


def test_supervisor_drains_a_plain_bad_node_and_is_refused_past_the_limit():
    from clusterops.supervisor import DrainNodes

    clock = Clock()
    slurm = FleetSlurm(4, clock=clock)
    run = supervisor_with(slurm, GuardSettings(0.25))
    reason = drains.make_reason(drains.SUPERVISOR, "hang", "rank 1")
    run._act_drain_nodes(DrainNodes(("n01", "n04"), reason))
    assert [k for k, _ in run.events] == ["drain", "drain_refused"], run.events
    assert "fleet guard: NOT draining n04" in run.events[1][1]["why"]
    assert slurm.drained() == ["n01"]


def _plan_with_drains(names):
    from clusterops.sweep.policy import Action, DrainPlan

    return DrainPlan([Action(n, "drain", "fail: bad", drains.make_reason(drains.SWEEP, "p", "bad")) for n in names],
                     swept=len(names), allowed=len(names))


def test_sweep_drain_respects_the_partition_wide_guard():
    """One drain per sweep is within --max-drain-fraction every night; the partition guard
    counts the drains already there, so the night that would pass the limit drains nothing."""
    from clusterops.sweep.run import apply_sweep_plan

    slurm = FleetSlurm(8, clock=time.time)      # limit 2 at 0.25; the sweep waits for real
    for n in ("n05", "n06"):                    # two earlier nights' drains
        slurm.state[n].update(drained=True, reason=drains.make_reason(drains.SWEEP, "p", "old"), time=time.time() - 86400)
    plan = _plan_with_drains(["n01"])
    applied, errors = apply_sweep_plan(slurm, plan, [], {}, drain=True, guard=GuardSettings(0.25), settle_s=0)
    assert applied == [] and errors == []
    assert plan.guard_tripped and "fleet guard: NOT draining n01" in plan.message
    assert plan.actions[0].action == "untouched" and plan.actions[0].why.startswith("guard: ")
    assert slurm.drained() == ["n05", "n06"]
    # Under the limit the same plan drains.
    slurm.resume(["n06"])
    plan = _plan_with_drains(["n01"])
    applied, errors = apply_sweep_plan(slurm, plan, [], {}, drain=True, guard=GuardSettings(0.25), settle_s=0)
    assert [a["node"] for a in applied] == ["n01"] and not plan.guard_tripped
    assert slurm.drained() == ["n01", "n05"]


def test_sweep_exit_code_is_the_guards_when_the_partition_guard_refused():
    from clusterops.sweep.options import SweepOptions
    from clusterops.sweep.run import EXIT_GUARD, SweepReport, _exit_code

    plan = _plan_with_drains(["n01"])
    plan.guard_tripped = True
    report = SweepReport("s", 0, 1, {}, ["n01"], {}, {}, plan)
    assert _exit_code(report, SweepOptions(drain=True)) == EXIT_GUARD
