"""A sharded (FSDP2) job recovering from its checkpoint in-process, on the real dev cluster.

examples/train_fsdp_recoverable.py trains FSDP2 on gloo through
``clusterops.recover.run(train, state, sharded=True)`` under ``supervise: inprocess:``, 4 nodes
x 1 rank + 1 warm standby per node. Rank 2 SIGKILLs itself at step 25, between the checkpoints
of steps 20 and 30: its shards are gone with it, so the survivors and node3's standby form the
new generation, rebuild the model on the new group and resume from the step-20 checkpoint
(5 steps recomputed) -- one launch, no relaunch -- and the final model and optimizer state
equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 40
CKPT_EVERY = 10
CRASH_AT = 25
SCRIPT = fk.REPO / "examples" / "train_fsdp_recoverable.py"


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.mark.timeout(600)
def test_fsdp2_kill9_recovers_from_checkpoint_in_process_bitwise(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    ref = tmp_path / "ref"
    fk.run_local(4, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(ref / "final.pt")],
                 workdir=ref, script=SCRIPT)
    marker = tmp_path / "crashed"
    job = fk.TrainJob(root=tmp_path / "ipf", name="ipf", nodes=4, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.2, script=SCRIPT, supervise={"inprocess": {"standbys_per_node": 1}},
                      train_args=["--crash-at-step", str(CRASH_AT), "--crash-rank", "2",
                                  "--crash-marker", str(marker)])
    job.submit()
    info = job.wait_end(connect(), timeout_s=400)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert marker.exists(), story
    # one launch: healed inside the running step, no relaunch
    assert len(events(job, "launch")) == 1 and not events(job, "restart"), story
    assert not events(job, "inproc_fallback"), story
    rdzv = events(job, "inproc_rendezvous")
    assert len(rdzv) == 1 and rdzv[0]["step"] == CRASH_AT, story          # the survivors' step
    moved = [(m["rank"], m["from"], m["to"]) for m in rdzv[0]["replaced"]]
    # Rank 2 goes to node3's standby. Measured on this dev cluster (3 of 3 runs): rank 0, a
    # survivor, neither reports the failed collective nor rejoins; after `unresponsive_s` (10 s)
    # the rendezvous has it killed and node1's standby takes it too (in-process still). The
    # cause is not found yet (docs/supervisor.md, "In-process recovery"); either way every
    # lost rank is taken on its own node.
    assert (2, "node3", "node3") in moved and all(a == b for _, a, b in moved), story
    # the new generation's state came from the checkpoint of step 20, 5 steps recomputed
    state = events(job, "inproc_state")
    assert len(state) == 1, story
    assert state[0]["source"] == "checkpoint" and state[0]["step"] == 20, story
    assert state[0]["survivors_step"] == CRASH_AT and state[0]["recomputed"] == CRASH_AT - 20, story
    first = events(job, "inproc_first_step")
    assert len(first) == 1 and first[0]["step"] == 21, story
    assert first[0]["from_step"] == 20 and first[0]["recomputed"] == 5, story
    assert tl.goodput_report(job.timeline())["inprocess"]["recoveries"] == 1, story
    assert events(job, "done"), story
    assert fk.same_weights(job.out, ref / "final.pt"), f"final state differs from an uninterrupted run\n{story}"
