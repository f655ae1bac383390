"""An administrator's drain under a running job, on the dev cluster (issue 30, part 3).

A supervised run of examples/train.py on 3 nodes and a spare; at step 15 an administrator
runs `scontrol update NodeName=node3 State=DRAIN Reason="maintenance"`. The supervisor sees
it at its next node poll (the read it makes anyway), stops the ranks with a checkpoint at the
step they reached, and relaunches on node1, node2 and node4 from exactly that step: 0 steps
lost, final weights bitwise equal to an uninterrupted run, node3 still drained with the
administrator's reason (clusterops never touched it). The same with in-process recovery on
(examples/train_recoverable.py, a warm standby per node): the planned stop and relaunch go
through its step the same way.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from support import faultkit as fk

pytestmark = pytest.mark.integration

STEPS = 60
# The supervisor reads the nodes every 10 s (SupervisorConfig.node_poll_s). After the drain at
# step 15 the run must last well past one poll even when the machine is loaded: 45 steps of
# 0.4 s is 18 s of sleeping alone (at 0.15 s the run once finished 10 s after the drain, before
# the next poll, and nothing was there to move).
STEP_SLEEP = 0.4


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


def _scontrol(*args):
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30, check=True).stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inprocess", [False, True], ids=["relaunch", "inprocess"])
def test_admin_drain_moves_the_job_to_the_spare_with_no_step_lost(cluster, slurm, tmp_path, inprocess):
    ref = tmp_path / "ref"
    script = fk.REPO / "examples" / ("train_recoverable.py" if inprocess else "train.py")
    fk.run_local(3, ["--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0", "--out", str(ref / "final.pt")],
                 workdir=ref, script=script)
    extra = {"inprocess": {"standbys_per_node": 1}} if inprocess else {}
    job = fk.TrainJob(root=tmp_path / "adm", name="adm", nodes=3, steps=STEPS, ckpt_every=10, step_sleep=STEP_SLEEP,
                      script=script, supervise={"spare_nodes": 1, "drain_bad_nodes": True, **extra})
    job.submit()
    try:
        job.wait_step(15)
        _scontrol("update", "NodeName=node3", "State=DRAIN", "Reason=maintenance")
        info, story = fk.assert_healed(job, slurm, ref / "final.pt", timeout_s=240)
        line = _scontrol("show", "node", "node3", "--oneliner")
        assert "DRAIN" in line and re.search(r"Reason=maintenance", line), line    # the drain left alone
    finally:
        subprocess.run(["scontrol", "update", "NodeName=node3", "State=RESUME"], capture_output=True, timeout=30)
    seen = fk.events(job, "node_drained")
    assert len(seen) == 1 and seen[0]["node"] == "node3" and seen[0]["reason"] == "maintenance", story
    assert seen[0]["action"] == "replace" and seen[0]["spare"] == "node4", story
    stop = fk.events(job, "stop_requested")
    assert stop and stop[0]["reason"] == "node_drained", story
    stopped = fk.events(job, "stopped")[0]
    later = [r for r in fk.events(job, "resume") if r.get("step") is not None]
    assert stopped["ckpt_step"] is not None and later[-1]["step"] == stopped["ckpt_step"], story   # 0 steps lost
    assert sorted(fk.events(job, "launch")[-1]["nodes"]) == ["node1", "node2", "node4"], story
    assert not fk.events(job, "drain") and not fk.events(job, "requeue"), story
