"""A stability rollback whose target retention pruned, on the real dev cluster (issue 32, case 4).

examples/train.py (2 nodes, 2 gloo ranks) with one data batch poisoned (``--poison-batches
85:86``: NaN from step 85, and the weights stay NaN), a guard that rolls back on NaN at least 10
steps before the anomaly, and a real retention pass running beside the job the way a site's
cron runs ``clusterops ckpt prune``: ``ck.prune`` over and over from the moment the supervisor
has recorded checkpoint 70 (so the guard knew of 60 before it went).

The guard places the onset after the last finite sample it saw, and the samples are a beat
a second: under load the onset lands anywhere from about step 70 to 85, so the bound (onset
- 10) from 60 to 75 and the guard's target is 60 or 70. Both are pruned in either case (a
bound of onset - 20 would let a late sample put the target at 50, with nothing pruned to find).

- ``keep_last: 1, keep_every: 25``: 60 and 70 are pruned, 50 stays. The job rolls back to 50
  (a ``checkpoint_bad`` record for the guard's target, 60 or 70: does not exist), only what
  is newer is set aside, and it finishes, resumed from 50 with the hint.
- ``keep_last: 1``: nothing at or before the bound is left. The guard gives up (exit 9): no
  rollback, no relaunch, and nothing from before the NaN moved; what was saved after it began
  (the heartbeats see the NaN a few steps late, so step 90 may already hold NaN weights) is
  set aside as on the guard's other give-ups, so that no later resume picks it up.
"""

from __future__ import annotations

import threading
import time

import pytest

from support import faultkit as fk
from clusterops import checkpoint as ck
from clusterops import supervisor as sv
from clusterops.errors import ClusteropsError
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 100
GUARD = {"on_spike": "record", "on_nan": "rollback", "warmup_steps": 20, "min_samples": 4,
         "rollback_steps": 10, "skip_batches": 40, "lr_factor": 0.5, "max_rollbacks": 2}


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


def events(j, kind):
    return [r for r in j.timeline() if r["event"] == kind]


class Retention(threading.Thread):
    """``ck.prune`` every 0.3 s once the supervisor has recorded checkpoint ``after``."""

    def __init__(self, job, after: int, **keep):
        super().__init__(daemon=True)
        self.job, self.after, self.keep = job, after, keep
        self.halt = threading.Event()
        self.removed = set()

    def run(self):
        while not self.halt.is_set():
            if any(r.get("step") == self.after for r in events(self.job, "checkpoint")):
                try:
                    plan = ck.prune(self.job.ckpt_dir, **self.keep)
                    self.removed |= {p.name for p in plan.remove}
                except (ClusteropsError, OSError):
                    pass      # a root being written: the next pass sees it settled
            time.sleep(0.3)


def run_job(tmp_path, name, slurm, **keep):
    j = fk.TrainJob(root=tmp_path / name, name=name, nodes=2, steps=STEPS, ckpt_every=10, step_sleep=0.15,
                    supervise={"stability": GUARD}, train_args=["--poison-batches", "85:86"])
    pruner = Retention(j, 70, **keep)
    j.submit()
    pruner.start()
    try:
        info = j.wait_end(slurm, timeout_s=150)
    finally:
        pruner.halt.set()
        pruner.join(timeout=10)
    return j, info, pruner


def test_target_pruned_rolls_back_to_the_older_good_checkpoint(cluster, slurm, tmp_path):
    j, info, pruner = run_job(tmp_path, "rb-pruned", slurm, keep_last=1, keep_every=25)
    story = tl.format_text(j.timeline())
    assert "step_00000060" in pruner.removed, story
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}"
    assert events(j, "nan"), story
    assert [r["to_step"] for r in events(j, "rollback")] == [50], story
    bad = events(j, "checkpoint_bad")
    assert bad and bad[0]["step"] in (60, 70), story       # the guard's target, pruned
    assert all(b["step"] > 50 and f"step_{b['step']:08d}" in pruner.removed for b in bad), story
    assert all("does not exist" in b["problems"][0] for b in bad), story
    aside = events(j, "checkpoint_set_aside")
    assert [a["after_step"] for a in aside] == [50] and "step_00000050" not in aside[0]["moved"], story
    launches = events(j, "launch")
    assert [ln["resume_step"] for ln in launches] == [None, 50], story
    skip = events(j, "rollback")[0]["skip_batches"]     # 40, or more to pass the NaN seen by 30
    past = GUARD["skip_batches"] - GUARD["rollback_steps"]
    assert skip == max(GUARD["skip_batches"], events(j, "nan")[0]["step"] + past - 50), story
    assert f"rollback-hint step=50 skip={skip} lr_factor=0.5" in (j.latest_attempt() / "step.log").read_text()
    assert fk.damaged_checkpoints(j.ckpt_dir) == []


def test_nothing_old_enough_left_gives_up_moving_nothing_from_before_the_nan(cluster, slurm, tmp_path):
    j, info, pruner = run_job(tmp_path, "rb-none", slurm, keep_last=1)
    story = tl.format_text(j.timeline())
    assert "step_00000060" in pruner.removed, story
    assert info.exit_code == sv.EXIT_ROLLBACK_BUDGET, f"{info.state} {info.exit_code}\n{story}"
    give = events(j, "give_up")
    assert give and "exists and verifies" in give[0]["reason"], story
    assert events(j, "rollback") == [] and len(events(j, "launch")) == 1, story
    began = events(j, "nan")[0]["began"]
    # Nothing from before the anomaly was moved; what is left in the root is all from before it.
    for a in events(j, "checkpoint_set_aside"):
        assert a["after_step"] == began - 1 and all(ck.parse_step(n) >= began for n in a["moved"]), story
    assert all(info.step < began and info.ok for info in ck.list_checkpoints(j.ckpt_dir, deep=True)), story
