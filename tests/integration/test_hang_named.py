"""A hang with a name, on the dev cluster (issue 29, part 5).

A user's DDP script on 3 nodes and a spare: the rank on node3 stops at step 15 outside any
collective (as a stuck data loader or a bad device would); the other ranks block in their
next all-reduce, so every rank falls silent within a second and the heartbeats name nobody.
Before the kill, the ranks' flight recorders (asked through the heartbeat channel's beacons)
say that rank 2 never entered the collective the others wait in: `hang_named` names rank 2
and node3. The restart runs into the same hang; named twice, node3 is left out and the spare
takes its place; the run finishes bitwise equal to an uninterrupted one, nothing drained.
"""

from __future__ import annotations

import pytest

from support import faultkit as fk
from support.user_scripts import USER_SCRIPT

pytestmark = pytest.mark.integration


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.mark.timeout(420)
def test_a_rank_stuck_outside_the_collective_is_named_and_its_node_left_out(cluster, slurm, tmp_path):
    script = tmp_path / "user_ddp.py"
    script.write_text(USER_SCRIPT)
    ref = tmp_path / "ref"
    fk.run_local(3, ["--steps", "40", "--ckpt-every", "0", "--out", str(ref / "final.pt")], workdir=ref,
                 script=script)
    job = fk.TrainJob(root=tmp_path / "hang", name="hang", nodes=3, steps=40, ckpt_every=10, step_sleep=0.15,
                      script=script, train_args=["--hang-on-node", "node3", "--hang-at", "15"],
                      supervise={"spare_nodes": 1, "hang_timeout_s": 15, "node_fail_threshold": 2,
                                 "drain_bad_nodes": False})
    job.submit()
    info, story = fk.assert_healed(job, slurm, ref / "final.pt", timeout_s=360)
    named = fk.events(job, "hang_named")
    assert len(named) == 2, story
    for n in named:
        assert n["ranks"] == [2] and n["nodes"] == ["node3"], story
        assert "never entered collective" in n["why"] and n["silent"] == [], story
    exits = [e for e in fk.events(job, "step_exit") if e["cause"] == "hang"]
    assert len(exits) == 2 and all(e["blamed"] == ["node3"] for e in exits), story
    assert [r["node"] for r in fk.events(job, "node_bad")] == ["node3"], story
    assert "node3" not in fk.events(job, "launch")[-1]["nodes"], story
    assert not fk.events(job, "drain") and not slurm.node("node3").drained, story
    # The dumps are in the attempts' heartbeat directories, one a rank.
    first = job.job_dir / "attempt-0" / "heartbeat" / "flightrec"
    assert sorted(p.name for p in first.glob("rank*.json")) == ["rank0.json", "rank1.json", "rank2.json"]
