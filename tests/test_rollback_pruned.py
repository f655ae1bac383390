"""A stability rollback whose target the disk no longer backs (issue 32, case 4).

The guard picks its target from the checkpoints it was told about; retention may have pruned
it since (``clusterops ckpt prune --keep-last``), or it may no longer verify. Nothing may be
set aside before the target is known to exist and verify: else the next older good one (still
at least ``rollback_steps`` before the anomaly), else a give-up (exit 9) that moves nothing
from before the anomaly -- here nothing at all, as nothing was saved since it began.

The run-level tests drive ``SupervisorRun`` with the fakes of tests/test_supervisor_run_fast.py
(fake clock, fake Slurm, simulated ranks committing real checkpoints); the loss comes from
the ranks' output (``progress.loss_regex``), NaN from step 45 of the first attempt on.
Retention (``ck.prune``) and the damage (a truncated file) are real, done while the job runs.
The machine-level tests pin the protocol: ``PickRollback`` out, ``RollbackPicked`` in.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import test_supervisor_run_fast as fast
from clusterops import checkpoint as ck
from clusterops import supervisor as sv
from clusterops.protocol import ResumeHint
from clusterops.supervisor.run import PlainContract
from clusterops.supervisor.stability import StabilityConfig
from test_supervisor_run_fast import events, make_run, train_spawns, world  # noqa: F401 (the fixture)

GUARD = dict(warmup_steps=0, min_samples=3, patience=1, on_nan="rollback", rollback_steps=10, skip_batches=5,
             lr_factor=0.5, max_rollbacks=2, resume_grace_steps=0)
NAN_AT = 45          # began 45 -> a target at or before step 35: step 30 by the guard's own list


def _nan_world(world, at_step: int, damage):
    """Ranks print their loss (NaN from NAN_AT in the first attempt); ``damage(ckpt_dir)``
    runs once, when the first attempt reaches ``at_step`` (checkpoints 10..40 saved)."""
    done = []

    def fault(proc, now, step):
        bad = proc.attempt == 0 and step >= NAN_AT
        loss = "nan" if bad else f"{1.0 + 0.001 * (step % 3):.3f}"
        with open(proc.log, "a") as f:
            f.write("".join(f"{r}: step={step} loss={loss}\n" for r in range(proc.ranks)))
        if proc.attempt == 0 and step >= at_step and not done:
            done.append(step)
            damage(world.ckpt_dir)

    world.total_steps = 60
    world.fault = fault
    return world


def _run(world, tmp_path):
    run = make_run(world, tmp_path)
    run.cfg.plain = PlainContract(progress_regex=r"step=(\d+)", loss_regex=r"loss=(\S+)")
    run.cfg.stability = StabilityConfig(**GUARD)
    return run


def _steps(root: Path):
    return [s for s, _ in ck.committed_steps(root)]


def _resumed_from(world):
    return [Path(s["env"]["CLUSTEROPS_RESUME_FROM"]).name if s["env"]["CLUSTEROPS_RESUME_FROM"] else ""
            for s in train_spawns(world)]


def _hints(world):
    return [ResumeHint.from_json(s["env"].get("CLUSTEROPS_RESUME_HINT", "")) for s in train_spawns(world)]


# ------------------------------------------------------------------------ the real run
def test_target_pruned_rolls_back_to_the_next_older_good_one(world, tmp_path):
    # Retention as a site runs it: the newest one, and every 20th step (10 and 30 go).
    _nan_world(world, 42, lambda root: ck.prune(root, keep_last=1, keep_every=20))
    run = _run(world, tmp_path)
    assert run.run() == sv.EXIT_DONE
    rb = events(tmp_path, "rollback")
    assert [r["to_step"] for r in rb] == [20], rb
    aside = events(tmp_path, "checkpoint_set_aside")
    assert [a["after_step"] for a in aside] == [20]
    assert "step_00000020" not in aside[0]["moved"] and "step_00000040" in aside[0]["moved"]
    assert _resumed_from(world) == ["", "step_00000020"]
    # skip 5 < rollback 10: no margin asked past the anomaly, but the skip passes it (step 45)
    assert _hints(world)[1] == ResumeHint(from_step=20, skip_batches=25, lr_factor=0.5, anomaly_step=NAN_AT,
                                          rollback=1)
    bad = events(tmp_path, "checkpoint_bad")
    assert [b["step"] for b in bad] == [30] and "does not exist" in bad[0]["problems"][0]
    assert not [w for w in events(tmp_path, "warning") if "not the one resumed from" in w["what"]]
    assert "step_00000020" in ck.holds(world.ckpt_dir)    # retention keeps the new target


def test_target_truncated_rolls_back_to_the_next_older_good_one(world, tmp_path):
    def truncate(root):
        f = root / "step_00000030" / "model.bin"
        f.write_bytes(f.read_bytes()[:7])

    _nan_world(world, 42, truncate)
    run = _run(world, tmp_path)
    assert run.run() == sv.EXIT_DONE
    assert [r["to_step"] for r in events(tmp_path, "rollback")] == [20]
    bad = [b for b in events(tmp_path, "checkpoint_bad") if b["step"] == 30]
    assert bad and "truncated" in bad[0]["problems"][0]
    aside = events(tmp_path, "checkpoint_set_aside")
    assert [a["after_step"] for a in aside] == [20] and "step_00000020" not in aside[0]["moved"]
    assert _resumed_from(world) == ["", "step_00000020"]
    assert _hints(world)[1] is not None and _hints(world)[1].from_step == 20


def test_nothing_older_left_gives_up_with_nothing_moved(world, tmp_path):
    _nan_world(world, 42, lambda root: ck.prune(root, keep_last=1))     # only step 40 stays
    run = _run(world, tmp_path)
    assert run.run() == sv.EXIT_ROLLBACK_BUDGET
    # Step 40 is from before the NaN (step 45): a good one, not moved (nothing else is there).
    assert events(tmp_path, "checkpoint_set_aside") == [] and not list(world.ckpt_dir.glob("rolled-back-*"))
    assert events(tmp_path, "rollback") == []           # no rollback happened, none is told
    give = events(tmp_path, "give_up")
    assert give and give[0]["code"] == sv.EXIT_ROLLBACK_BUDGET
    assert "no checkpoint at or before step 35 exists and verifies" in give[0]["reason"], give
    assert len(train_spawns(world)) == 1                 # no relaunch from nothing
    # The last good checkpoint is where it was, whole, and held for the person taking over.
    assert 40 in _steps(world.ckpt_dir) and ck.verify(world.ckpt_dir / "step_00000040", deep=True).ok
    assert "step_00000040" in ck.holds(world.ckpt_dir)
    assert run.sup.memory.rollbacks == []


# ------------------------------------------------------------------------ the machine
def _machine():
    s = sv.Supervisor(sv.Policy(nodes=2, preflight=None, liveness_check=False), ["node1", "node2"],
                      stability=StabilityConfig(**GUARD))
    s.start(now=0.0)
    s.handle(sv.ResumeChosen(0.5, None, ""))
    s.handle(sv.StepLaunched(1.0))
    for step in (10, 20, 30, 40):
        s.handle(sv.CheckpointCommitted(1.5, step, f"/ck/step_{step}"))
    for i, step in enumerate(range(1, NAN_AT)):
        s.handle(sv.Heartbeats(2.0 + i, {0: (step, 2.0 + i), 1: (step, 2.0 + i)},
                               signals={0: (step, 1.0, None), 1: (step, 1.0, None)}))
    acts = s.handle(sv.Heartbeats(60.0, {0: (NAN_AT, 60.0), 1: (NAN_AT, 60.0)},
                                  signals={0: (NAN_AT, math.nan, None), 1: (NAN_AT, 1.0, None)}))
    assert sv.KillStep("rollback") in acts and not [a for a in acts if isinstance(a, sv.SetAside)]
    acts = s.handle(sv.StepExited(61.0, returncode=137))
    # Nothing moved yet: the disk is asked first.
    assert [a for a in acts if isinstance(a, (sv.SetAside, sv.Launch))] == []
    assert [a for a in acts if isinstance(a, sv.PickRollback)] == [sv.PickRollback(35, 30)]
    return s


def test_machine_sets_aside_only_after_the_checkpoint_the_disk_confirmed():
    s = _machine()
    gone = ((30, "/ck/step_00000030", ("does not exist",)),)
    acts = s.handle(sv.RollbackPicked(61.5, 20, "/ck/step_00000020", gone))
    assert [a.after_step for a in acts if isinstance(a, sv.SetAside)] == [20]
    launch = [a for a in acts if isinstance(a, sv.Launch)][0]
    assert launch.hint.from_step == 20 and s.stability.hint == launch.hint == s.memory.hint
    rb = [a.data for a in acts if isinstance(a, sv.Record) and a.kind == "rollback"]
    assert [r["to_step"] for r in rb] == [20]
    assert [a.step for a in acts if isinstance(a, sv.HoldCheckpoint)] == [20]
    assert s.memory.last_ckpt_step == 20 and s.stability.ckpt_steps == [10, 20] and s.state == sv.RUNNING


def test_machine_gives_up_moving_nothing_from_before_the_anomaly_when_the_disk_has_none():
    s = _machine()
    acts = s.handle(sv.RollbackPicked(61.5, None, "", ((30, "/ck/step_00000030", ("does not exist",)),)))
    assert not [a for a in acts if isinstance(a, sv.Launch)]
    # The guard's give-up path: only what was saved since the anomaly began (step 45) may go.
    assert [a.after_step for a in acts if isinstance(a, sv.SetAside)] == [NAN_AT - 1]
    assert [a.code for a in acts if isinstance(a, sv.Exit)] == [sv.EXIT_ROLLBACK_BUDGET]
    assert [a.step for a in acts if isinstance(a, sv.HoldCheckpoint)] == [40]   # newest before the NaN
    assert s.memory.rollbacks == [] and s.memory.hint is None and s.state == sv.DONE


def test_guard_retarget_keeps_to_its_bound():
    s = _machine()
    d = s.rollback_to_pick
    with pytest.raises(ValueError, match="after the bound 35"):
        s.stability.retarget(d, 40)
    assert s.stability.retarget(d, 30) is d
