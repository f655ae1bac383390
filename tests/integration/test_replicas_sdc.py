"""Replicas that disagree, on the dev cluster (issue 29, part 1).

A user's DDP script (3 nodes, one rank each, a spare) calls ``sdk.check_replicas`` after every
optimizer step; the supervisor asks for a check every 5 steps. The documented test hook
``CLUSTEROPS_REPLICA_FLIP=22:1`` flips one bit of rank 1's parameters at step 22 (once per
job). The check at step 25 finds rank 1 outside the majority: an ``sdc_suspect`` naming rank 1
and node2, the step killed, the checkpoints after the last agreeing check (step 20) set
aside, the run rolled back to step 20 and continued on node1, node3 and node4 (node2 kept
out, not drained: ``drain_bad_nodes`` off). Final weights bitwise equal to a run that never
had the flip; no good checkpoint removed.
"""

from __future__ import annotations

import pytest

from support import faultkit as fk
from support.user_scripts import USER_SCRIPT

pytestmark = pytest.mark.integration

STEPS = 40


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.mark.timeout(300)
def test_bit_flip_on_one_replica_is_found_rolled_back_and_its_node_kept_out(cluster, slurm, tmp_path):
    script = tmp_path / "user_ddp.py"
    script.write_text(USER_SCRIPT)
    ref = tmp_path / "ref"
    fk.run_local(3, ["--steps", str(STEPS), "--ckpt-every", "0", "--check-replicas", "--out", str(ref / "final.pt")],
                 workdir=ref, script=script)
    job = fk.TrainJob(root=tmp_path / "sdc", name="sdc", nodes=3, steps=STEPS, ckpt_every=10, step_sleep=0.2,
                      script=script, train_args=["--check-replicas"],
                      supervise={"spare_nodes": 1, "replica_check_every": 5, "drain_bad_nodes": False},
                      spec_extra={"env": {"OMP_NUM_THREADS": "1", "CLUSTEROPS_REPLICA_FLIP": "22:1"}})
    job.submit()
    info, story = fk.assert_healed(job, slurm, ref / "final.pt", timeout_s=240)
    found = fk.events(job, "sdc_suspect")
    assert len(found) == 1, story
    f = found[0]
    # Within one check of the flip, the right rank and node, the last agreeing check known.
    assert f["step"] == 25 and f["ranks"] == [1] and f["nodes"] == ["node2"] and f["last_agree"] == 20, story
    assert not f["ambiguous"] and f["decision"] == "rollback", story
    rb = fk.events(job, "rollback")
    assert len(rb) == 1 and rb[0]["to_step"] == 20 and rb[0]["skip_batches"] == 0 and rb[0]["lr_factor"] == 1.0, story
    assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"], story
    last = fk.events(job, "launch")[-1]
    assert "node2" not in last["nodes"] and sorted(last["nodes"]) == ["node1", "node3", "node4"], story
    # The replay resumed from step 20 and its own checks agreed past the flip's step.
    assert any(r.get("step") == 20 for r in fk.events(job, "resume") if r["incarnation"] == 0), story
    assert not fk.events(job, "drain") and not slurm.node("node2").drained, story
    assert (job.job_dir / "replica-flip-done").exists()
    assert info.restart_count == 0, story
