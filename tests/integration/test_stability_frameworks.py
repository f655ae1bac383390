"""The stability guard's rollback through the Lightning and Hugging Face Trainer callbacks,
on the real dev cluster (2 nodes x 1 rank, DDP over gloo), with a data window poisoned on
purpose (the examples' ``--poison-batches``: the loss spikes, then goes NaN).

The supervisor kills the step, relaunches from the checkpoint before the anomaly with the
hint; the callback applies it inside the framework's own resume (after the framework
restored weights, optimizer and schedule: the learning rate times ``lr_factor``, the data
position ``skip_batches`` further), and the job finishes with final weights bitwise equal
to an uninterrupted local run that skips the same batches and lowers the LR at the same
step (``--skip-batches-at`` / ``--lr-factor-at``, through the same callback code).
"""

from __future__ import annotations

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 100
CKPT_EVERY = 10
POISON = "60:70"          # data batches 60-64 scaled (spike), 65-69 NaN
GUARD = {"on_spike": "rollback", "on_nan": "rollback", "warmup_steps": 20, "min_samples": 4,
         "rollback_steps": 10, "skip_batches": 30, "lr_factor": 0.5, "max_rollbacks": 2}


def events(j, kind):
    return [r for r in j.timeline() if r["event"] == kind]


def rollback_bitwise(tmp_path, name, script, env=None):
    from clusterops.slurm.factory import connect

    slurm = connect()
    j = fk.TrainJob(root=tmp_path / name, name=name, nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY, step_sleep=0.1,
                    script=script, supervise={"stability": GUARD}, train_args=["--poison-batches", POISON],
                    spec_extra={"env": env} if env else {})
    j.submit()
    info = j.wait_end(slurm, timeout_s=300)
    story = tl.format_text(j.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}\n{j.batch_log()[-3000:]}"
    found = events(j, "nan") + events(j, "loss_spike")
    rb = events(j, "rollback")
    assert found and len(rb) == 1, story
    to = rb[0]["to_step"]
    assert to % CKPT_EVERY == 0 and to <= found[0]["began"] - GUARD["rollback_steps"], story
    assert [r["cause"] for r in events(j, "step_exit")][0] == "rolled_back", story
    assert fk.damaged_checkpoints(j.ckpt_dir) == []
    skip = rb[0]["skip_batches"]       # 30, or more so it passes the anomaly seen (by 20 = 30 - 10)
    seen = [f["step"] for f in found if f["began"] == rb[0]["anomaly_step"]]
    assert seen and skip == max(30, seen[0] + 20 - to), story
    assert f"rollback-hint step={to} skip={skip} lr_factor=0.5" in (j.latest_attempt() / "step.log").read_text()
    d = tmp_path / "ref"
    ref = fk.rollback_reference(2, d, steps=STEPS, poison=POISON, at=to, skip=skip, script=script, one_per_node=True,
                                args=["--ckpt-every", "0", "--ckpt-dir", str(d / "ck")])
    assert not fk.nan_weights(ref)
    assert not fk.nan_weights(j.out), story
    assert fk.same_weights(j.out, ref), f"final weights differ from the run that skips the same batches\n{story}"


@pytest.mark.timeout(420)
def test_lightning_rollback_skips_the_window_and_ends_bitwise_equal(cluster, tmp_path):
    rollback_bitwise(tmp_path, "stab-lt", fk.REPO / "examples" / "lightning_train.py")


@pytest.mark.timeout(420)
def test_hf_trainer_rollback_skips_the_window_and_ends_bitwise_equal(cluster, tmp_path):
    rollback_bitwise(tmp_path, "stab-hf", fk.REPO / "examples" / "hf_train.py",
                     env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})


def flip_bitwise(tmp_path, name, script, env=None):
    """Replicas that disagree through the framework's callback (issue 29, part 1): 3 nodes x 1
    rank and a spare, rank 1's parameters flipped at step 22 by the test hook; found at the
    check of step 25, rolled back to step 20 without node2; the replay's replicas agree.

    The final weights are compared with a run without the flip to a tolerance, not bitwise:
    with these frameworks a 3-rank resume is not bitwise even without a fault (measured: a
    local 3-rank run of examples/lightning_train.py resumed from its own step-20 checkpoint
    ends with different bits than the uninterrupted run; at 2 ranks it is equal, which is
    what the 2-rank rollback tests above rely on). The SDK script's flip test
    (test_replicas_sdc.py) is bitwise."""
    from clusterops.slurm.factory import connect

    slurm = connect()
    env = dict(env or {"OMP_NUM_THREADS": "1"}, CLUSTEROPS_REPLICA_FLIP="22:1")
    j = fk.TrainJob(root=tmp_path / name, name=name, nodes=3, steps=40, ckpt_every=CKPT_EVERY, step_sleep=0.1,
                    script=script, supervise={"spare_nodes": 1, "replica_check_every": 5},
                    spec_extra={"env": env})
    j.submit()
    d = tmp_path / "ref"
    out = d / "final.pt"
    fk.run_local(3, ["--steps", "40", "--ckpt-every", "0", "--ckpt-dir", str(d / "ck"), "--out", str(out)],
                 workdir=d, script=script, one_per_node=True)
    info = j.wait_end(slurm, timeout_s=360)
    story = tl.format_text(j.timeline()) + j.failed_step_logs()
    assert info.state == "COMPLETED" and info.exit_code == 0 and events(j, "done"), story
    import torch

    got, ref = (torch.load(p, map_location="cpu", weights_only=True) for p in (j.out, out))
    assert got.keys() == ref.keys() and all(torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-6) for k in got), story
    assert fk.damaged_checkpoints(j.ckpt_dir) == [], story
    last = j.latest_attempt() / "step.log"
    assert "differ" not in last.read_text(), story            # the replay's replicas agree
    found = events(j, "sdc_suspect")
    assert len(found) == 1 and found[0]["ranks"] == [1] and found[0]["nodes"] == ["node2"], story
    assert found[0]["step"] == 25 and found[0]["last_agree"] == 20, story
    assert [r["to_step"] for r in events(j, "rollback")] == [20], story
    assert "node2" not in events(j, "launch")[-1]["nodes"], story


@pytest.mark.timeout(420)
def test_lightning_callback_finds_a_flipped_replica_and_rolls_back_bitwise(cluster, tmp_path):
    flip_bitwise(tmp_path, "sdc-lt", fk.REPO / "examples" / "lightning_train.py")


@pytest.mark.timeout(420)
def test_hf_callback_finds_a_flipped_replica_and_rolls_back_bitwise(cluster, tmp_path):
    flip_bitwise(tmp_path, "sdc-hf", fk.REPO / "examples" / "hf_train.py",
                 env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
