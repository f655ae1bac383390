"""Replay: data or hardware? (issue 29, part 2), on the dev cluster.

``on_nan``/``on_spike: replay``: on a finding the supervisor kills the step, sets aside what was
saved after the anomaly began, and reruns the steps from the newest checkpoint before it up to
the finding's step + ``replay_margin_steps``, with every node's ranks moved to the next node
(``CLUSTEROPS_REPLAY``: the SDK saves nothing, reports each rank's losses and first non-finite
step, and ends). Then:

- a poisoned data window (examples/train.py ``--poison-batches``, 4 ranks) comes back on the
  other nodes: verdict ``data``, the rollback with the skip as ``rollback`` does, and final
  weights bitwise equal to the uninterrupted run that skips the same batches;
- the bit-flip test hook on rank 1 (node2; an exponent bit of the output bias, once per job)
  sends that rank's loss to inf a step before the others, and the replay is clean: verdict
  ``hardware`` naming node2, node2 kept out (not drained: ``drain_bad_nodes`` off, and no
  healthy node drained), the run continued from the replay's checkpoint with nothing skipped
  on node1, node3 and the spare node4, and final weights bitwise equal to a run that never had
  the flip.
"""

from __future__ import annotations

import json

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl
from support.user_scripts import USER_SCRIPT

pytestmark = pytest.mark.integration

POISON = "70:80"          # data batches 70-74 scaled (spike), 75-79 NaN (as test_stability_guard)
GUARD = {"on_spike": "replay", "on_nan": "replay", "warmup_steps": 20, "min_samples": 4, "rollback_steps": 10,
         "skip_batches": 30, "lr_factor": 0.5, "max_rollbacks": 2, "replay_margin_steps": 2}


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.mark.timeout(300)
def test_a_poisoned_batch_reproduces_on_other_nodes_and_is_rolled_back_with_the_skip(cluster, slurm, tmp_path):
    steps, every = 120, 10
    j = fk.TrainJob(root=tmp_path / "data", name="replay-data", steps=steps, ckpt_every=every, step_sleep=0.1,
                    supervise={"stability": GUARD}, train_args=["--poison-batches", POISON])
    j.submit()
    info = j.wait_end(slurm, timeout_s=240)
    story = tl.format_text(j.timeline()) + j.failed_step_logs()
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}"
    found = fk.events(j, "nan") + fk.events(j, "loss_spike")
    assert found and found[0]["decision"] == "replay", story
    started, decided = fk.events(j, "replay_started"), fk.events(j, "replay_decided")
    assert len(started) == 1 and len(decided) == 1, story
    d = decided[0]
    assert d["verdict"] == "data" and d["reproduced"] is True and d["node"] is None, story
    assert d["reports"] == 4 and d["returncode"] == 0, story
    # The replay ran on other nodes: every rank one node further.
    replay_launch = [r for r in fk.events(j, "launch") if r.get("replay")]
    assert len(replay_launch) == 1, story
    placed = replay_launch[0]["replay"]
    assert placed["placement"] == "rotated" and placed["ranks"] == {"0": "node2", "1": "node3", "2": "node4",
                                                                      "3": "node1"}, story
    # What the ranks were told (the attempt's command file) and where they really ran.
    attempt = j.job_dir / f"attempt-{replay_launch[0]['attempt']}"
    assert '"until":%d' % started[0]["until"] in (attempt / "command.txt").read_text(), story
    reports = {p.name: json.loads(p.read_text()) for p in (attempt / "heartbeat" / "replay").glob("rank*.json")}
    assert {n: r["node"] for n, r in reports.items()} == {"rank0.json": "node2", "rank1.json": "node3",
                                                          "rank2.json": "node4", "rank3.json": "node1"}, reports
    # Then the rollback with the skip, as `rollback` does; the replay saved nothing.
    rb = fk.events(j, "rollback")
    assert len(rb) == 1 and rb[0]["lr_factor"] == 0.5, story
    to, skip = rb[0]["to_step"], rb[0]["skip_batches"]
    seen = [f["step"] for f in found if f["began"] == rb[0]["anomaly_step"]]
    assert seen and skip == max(30, seen[0] + 20 - to), story     # past the NaN seen by 30 - 10
    assert to % every == 0 and to <= found[0]["began"] - GUARD["rollback_steps"], story
    assert not fk.events(j, "node_bad") and not fk.events(j, "drain"), story
    assert fk.damaged_checkpoints(j.ckpt_dir) == []
    ref = fk.rollback_reference(4, tmp_path / "reference", steps=steps, poison=POISON, at=to, skip=skip,
                                args=["--ckpt-every", str(every), "--step-sleep", "0"])
    assert not fk.nan_weights(ref)
    assert fk.same_weights(j.out, ref), f"final weights differ from the run that skips the same batches\n{story}"


@pytest.mark.timeout(300)
def test_a_bit_flip_on_one_node_does_not_reproduce_and_that_node_is_kept_out(cluster, slurm, tmp_path):
    steps = 40
    script = tmp_path / "user_ddp.py"
    script.write_text(USER_SCRIPT)
    ref = tmp_path / "ref"
    fk.run_local(3, ["--steps", str(steps), "--ckpt-every", "0", "--check-replicas", "--out", str(ref / "final.pt")],
                 workdir=ref, script=script)
    # Bit 30 (the float32 exponent's top bit) of the last tensor (the output bias) of rank 1 at
    # step 22: rank 1's loss is inf at step 23, the others' at step 24 (the all-reduce).
    job = fk.TrainJob(root=tmp_path / "hw", name="replay-hw", nodes=3, steps=steps, ckpt_every=10, step_sleep=0.2,
                      script=script, train_args=["--check-replicas"],
                      supervise={"spare_nodes": 1, "drain_bad_nodes": False, "replica_check_every": 0,
                                 "stability": {"on_nan": "replay", "replay_margin_steps": 2}},
                      spec_extra={"env": {"OMP_NUM_THREADS": "1", "CLUSTEROPS_REPLICA_FLIP": "22:1:30:-1"}})
    job.submit()
    info, story = fk.assert_healed(job, slurm, ref / "final.pt", timeout_s=240)
    nan = fk.events(job, "nan")
    assert len(nan) == 1 and nan[0]["decision"] == "replay", story
    # The guard places the onset after the last finite sample it saw, and the samples are a
    # beat a second (about 5 steps here): the onset lands from about step 19 to 23. So the
    # newest checkpoint before it is 20 (a beat after step 20) or 10 (the last beat at step
    # 19 or before: step 20 may already hold the anomaly, and checkpoint 20 is not trusted).
    began = nan[0]["began"]
    assert 12 <= began <= 23, story
    target = 20 if began > 20 else 10
    started = fk.events(job, "replay_started")
    assert len(started) == 1, story
    s = started[0]
    assert s["from_step"] == target and s["first_step"] == 23 and s["first_ranks"] == [1] and s["first_nodes"] == [
        "node2"], story
    d = fk.events(job, "replay_decided")
    assert len(d) == 1 and d[0]["verdict"] == "hardware" and d[0]["node"] == "node2" and d[0]["ranks"] == [1], story
    assert d[0]["reproduced"] is False and d[0]["reports"] == 3, story
    rb = fk.events(job, "rollback")
    assert len(rb) == 1 and rb[0]["to_step"] == target and rb[0]["skip_batches"] == 0 and rb[0]["lr_factor"] == 1.0, story
    assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"], story
    launches = fk.events(job, "launch")
    assert launches[-2]["replay"]["ranks"] == {"0": "node2", "1": "node3", "2": "node1"}, story
    assert launches[-1]["nodes"] == ["node1", "node3", "node4"] and not launches[-1].get("replay"), story
    # Nothing good lost: no node drained, no checkpoint before the anomaly moved or damaged.
    assert not fk.events(job, "drain") and not slurm.node("node2").drained, story
    for aside in fk.events(job, "checkpoint_set_aside"):
        assert aside["after_step"] >= target, story
    assert fk.damaged_checkpoints(job.ckpt_dir) == []
    assert (job.job_dir / "replica-flip-done").exists()
    assert info.restart_count == 0, story
