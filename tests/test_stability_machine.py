"""The stability guard in the supervisor's state machine: events in, actions out, a fake clock."""

from __future__ import annotations

import math

from clusterops import supervisor as sv
from clusterops.protocol import ResumeHint
from clusterops.supervisor import (CheckpointCommitted, Exit, Heartbeats, KillStep, Launch, Policy, Record,
                                   ResumeChosen, SetAside, StepExited, StepLaunched, Supervisor)
from clusterops.supervisor.stability import StabilityConfig

NODES = ["node1", "node2"]


def only(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def kinds(actions):
    return [a.kind for a in actions if isinstance(a, Record) and a.kind != "progress"]


def running(**cfg):
    cfg = dict(dict(warmup_steps=0, min_samples=3, patience=1, rollback_steps=10, skip_batches=30, lr_factor=0.5,
                    max_rollbacks=2), **cfg)
    s = Supervisor(Policy(nodes=2, preflight=None, liveness_check=False), NODES, stability=StabilityConfig(**cfg))
    launch = only(s.start(now=0.0), Launch)[0]
    s.handle(ResumeChosen(0.5, None, ""))
    s.handle(StepLaunched(1.0))
    return s, launch


def beat(s, now, step, loss, gnorm=None):
    """Both ranks at ``step`` with ``loss``; heartbeats fresh."""
    return s.handle(Heartbeats(now, {0: (step, now), 1: (step, now)},
                               signals={0: (step, loss, gnorm), 1: (step, loss, gnorm)}))


def healthy(s, steps, t0=2.0):
    for i, step in enumerate(steps):
        assert not only(beat(s, t0 + i, step, 1.0 + 0.001 * (step % 3)), KillStep)


def test_a_guard_off_job_ignores_signals():
    s = Supervisor(Policy(nodes=2, preflight=None, liveness_check=False), NODES)
    s.start(now=0.0)
    s.handle(StepLaunched(1.0))
    acts = beat(s, 2.0, 5, math.nan)
    assert kinds(acts) == [] and not only(acts, KillStep)


def test_record_only_records():
    s, _ = running(on_nan="record")
    healthy(s, range(1, 20))
    for step in (10, 20):     # 20 may hold the anomaly: it began after step 19 (the last sample)
        s.handle(CheckpointCommitted(20.0, step, f"/ck/step_{step}"))
    acts = beat(s, 30.0, 21, math.nan)
    assert [h.step for h in only(acts, sv.HoldCheckpoint)] == [10]     # the way back stays, for a person
    assert kinds(acts) == ["nan"] and not only(acts, KillStep) and s.state == sv.RUNNING
    rec = [r for r in only(acts, Record) if r.kind == "nan"][0].data
    assert rec["value"] == "nan" and rec["decision"] == "record" and rec["step"] == 21


def test_nan_rolls_back_past_the_window_and_relaunches_with_the_hint():
    s, first = running()
    assert first.hint is None
    for step in (10, 20, 30):
        s.handle(CheckpointCommitted(1.5, step, f"/ck/step_{step}"))
    healthy(s, range(1, 26))
    acts = beat(s, 40.0, 27, math.nan)
    assert kinds(acts) == ["nan"]       # the rollback is told once the disk confirmed its target
    assert only(acts, KillStep) == [KillStep("rollback")] and s.state == sv.KILLING
    assert [h.step for h in only(acts, sv.HoldCheckpoint)] == [10]     # retention keeps the way back
    # A checkpoint the dying step still commits is not one a rollback may use, nor progress.
    s.handle(CheckpointCommitted(41.0, 40, "/ck/step_40"))
    acts = s.handle(StepExited(42.0, returncode=137, ckpt_step=40))
    assert only(acts, sv.PickRollback) == [sv.PickRollback(16, 10)] and not only(acts, SetAside)
    acts += s.handle(sv.RollbackPicked(42.0, 10, "/ck/step_10"))
    rb = [r for r in only(acts, Record) if r.kind == "rollback"][0].data
    # skip 30 from step 10 would end at step 39; it must reach 20 (skip 30 - rollback 10)
    # past step 27, the NaN seen: 37 batches
    assert (rb["to_step"], rb["anomaly_step"], rb["skip_batches"], rb["lr_factor"]) == (10, 26, 37, 0.5)
    assert only(acts, SetAside) == [SetAside(10, "rollback 1 (nan from step 26)")]
    launch = only(acts, Launch)[0]
    assert launch.hint == ResumeHint(from_step=10, skip_batches=37, lr_factor=0.5, anomaly_step=26, rollback=1)
    assert s.memory.last_ckpt_step == 10 and s.state == sv.RUNNING
    assert [r.data["cause"] for r in only(acts, Record) if r.kind == "step_exit"] == ["rolled_back"]
    # A crash before the next save: the restart from the same checkpoint keeps the hint.
    s.handle(ResumeChosen(43.0, 10, "/ck/step_10"))
    s.handle(StepLaunched(43.5))
    acts = s.handle(StepExited(44.0, returncode=1, failures=(sv.RankFailure("node1", 0, "Exited with exit code 1"),),
                               ckpt_step=10))
    assert only(acts, Launch)[0].hint == launch.hint
    # Once a newer checkpoint is saved, the skip is in its data position: no more hint.
    s.handle(ResumeChosen(45.0, 10, "/ck/step_10"))
    s.handle(StepLaunched(45.5))
    s.handle(CheckpointCommitted(46.0, 20, "/ck/step_20"))
    assert s.stability.hint is None


def test_repeated_spikes_give_up_with_the_rollback_budget_code():
    s, _ = running(on_spike="rollback")
    for step in (10, 20, 30):
        s.handle(CheckpointCommitted(1.5, step, f"/ck/step_{step}"))
    healthy(s, range(1, 26))
    codes = []
    for i in range(3):
        acts = beat(s, 50.0 + 10 * i, 28 + i, 500.0)
        assert kinds(acts)[0] == "loss_spike"
        acts = s.handle(StepExited(51.0 + 10 * i, returncode=137))
        acts += s.handle(sv.RollbackPicked(51.0 + 10 * i, 10, "/ck/step_10"))
        codes += [a.code for a in only(acts, Exit)]
        if not codes:
            s.handle(ResumeChosen(52.0 + 10 * i, 10, "/ck/step_10"))
            s.handle(StepLaunched(52.5 + 10 * i))
            healthy(s, range(12, 26), t0=53.0 + 10 * i)
    assert codes == [sv.EXIT_ROLLBACK_BUDGET]
    # The last good checkpoint before the anomaly stays: only what came after is set aside.
    assert only(acts, SetAside)[0].after_step == 25


def test_stop_ends_with_the_diverged_code_without_a_save():
    s, _ = running(on_nan="stop")
    healthy(s, range(1, 10))
    acts = beat(s, 20.0, 11, 1.0, math.inf)
    assert only(acts, KillStep) == [KillStep("diverged")]
    assert not only(acts, sv.RequestStop)          # a stop request would save the bad state
    acts = s.handle(StepExited(21.0, returncode=137))
    assert [a.code for a in only(acts, Exit)] == [sv.EXIT_DIVERGED]
    assert only(acts, SetAside) == [SetAside(9, "nan from step 10")]


def test_the_rollback_count_and_the_open_hint_survive_a_requeue(tmp_path):
    import pytest

    from clusterops.errors import InputError
    from clusterops.supervisor import run as svrun

    cfg = dict(warmup_steps=0, min_samples=3, patience=1, rollback_steps=10, skip_batches=30, lr_factor=0.5,
               max_rollbacks=2)
    s, _ = running(on_spike="rollback", **cfg)
    for step in (10, 20, 30):
        s.handle(CheckpointCommitted(1.5, step, f"/ck/step_{step}"))
    healthy(s, range(1, 26))
    assert kinds(beat(s, 40.0, 28, 500.0))[:1] == ["loss_spike"]
    s.handle(StepExited(41.0, returncode=137))
    s.handle(sv.RollbackPicked(41.0, 10, "/ck/step_10"))
    hint = s.stability.hint
    assert hint is not None and s.memory.rollbacks == [26]
    # The allocation is lost (preempted, requeued) before the next save: a new incarnation
    # reads what the first left in the job directory.
    svrun.save_memory(tmp_path, s.memory)
    mem = svrun.load_memory(tmp_path)
    assert mem.rollbacks == [26] and mem.hint == hint
    s2 = Supervisor(Policy(nodes=2, preflight=None, liveness_check=False), NODES, memory=mem, ckpt_step=10,
                    stability=StabilityConfig(on_spike="rollback", **cfg))
    first = only(s2.start(now=100.0), Launch)[0]
    assert first.hint == hint                       # the skip is not lost with the allocation
    s2.handle(ResumeChosen(100.5, 10, "/ck/step_10"))
    s2.handle(StepLaunched(101.0))
    codes = []
    for i in range(2):                              # the budget (2) is spent across both incarnations
        healthy(s2, range(12, 26), t0=102.0 + 30 * i)
        assert kinds(beat(s2, 120.0 + 30 * i, 28 + i, 500.0))[0] == "loss_spike"
        acts = s2.handle(StepExited(121.0 + 30 * i, returncode=137))
        acts += s2.handle(sv.RollbackPicked(121.0 + 30 * i, 10, "/ck/step_10"))
        codes += [a.code for a in only(acts, Exit)]
        if not codes:
            s2.handle(ResumeChosen(122.0 + 30 * i, 10, "/ck/step_10"))
            s2.handle(StepLaunched(122.5 + 30 * i))
    assert codes == [sv.EXIT_ROLLBACK_BUDGET] and len(s2.memory.rollbacks) == 2
    # A state file of before the guard (no such keys) still reads; a damaged one names the field.
    (tmp_path / svrun.STATE_FILE).write_text('{"attempts": 1, "restarts": 0, "no_progress": 0}')
    assert svrun.load_memory(tmp_path).rollbacks == [] and svrun.load_memory(tmp_path).hint is None
    (tmp_path / svrun.STATE_FILE).write_text('{"attempts": 1, "restarts": 0, "no_progress": 0, "rollbacks": ["x"]}')
    with pytest.raises(InputError, match="rollbacks: must be a list of step numbers"):
        svrun.load_memory(tmp_path)
    (tmp_path / svrun.STATE_FILE).write_text('{"attempts": 1, "restarts": 0, "no_progress": 0, "hint": {"a": 1}}')
    with pytest.raises(InputError, match="hint: must be a resume hint"):
        svrun.load_memory(tmp_path)
