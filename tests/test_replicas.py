"""Replicas that disagree (issue 29, part 1): the digest, the majority, the SDK's check on
real gloo ranks, and the supervisor's decision (fake clock)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.machine import P, only, records
from clusterops import drains, protocol
from clusterops import replicas as rp
from clusterops.supervisor import (CheckpointCommitted, DrainNodes, Heartbeats, Launch, ResumeChosen,
                                   StepExited, Supervisor)
from clusterops.supervisor.machine import HoldCheckpoint, KillStep as Kill, PickRollback, RollbackPicked, SetAside

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]


def test_digest_is_exact_and_one_flipped_bit_changes_it():
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(64, 32, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.arange(5)]
    b = [t.clone() for t in a]
    assert torch.equal(rp.digest(a), rp.digest(b))
    for i in range(2):
        c = [t.clone() for t in a]
        rp.flip_one_bit(c[i:], 3 + i)
        assert not torch.equal(rp.digest(c), rp.digest(a)), i
    # The tensor's place counts: the same tensors in another order differ.
    assert not torch.equal(rp.digest([a[1], a[0], a[2]]), rp.digest(a))


def test_majority_suspects_and_ambiguity():
    same, odd = (1, 2), (1, 3)
    assert rp.judge(5, [same] * 4).agree
    v = rp.judge(5, [same, odd, same, same])
    assert not v.agree and v.suspects == (1,) and not v.ambiguous
    v = rp.judge(5, [same, odd])                       # two replicas: nobody can be named
    assert not v.agree and v.ambiguous and v.suspects == ()
    v = rp.judge(5, [same, odd, (9, 9)])               # a three-way split
    assert v.ambiguous and v.suspects == ()
    assert set(rp.judge(5, [same, odd, same]).report(3)) == {"step", "agree", "suspects", "ambiguous", "ranks",
                                                             "digests"}


def test_flip_hook_spec_and_once_per_job(tmp_path):
    assert rp.parse_flip(None) is None and rp.parse_flip("12:1") == (12, 1, 20, 0)
    assert rp.parse_flip("3:0:7") == (3, 0, 7, 0) and rp.parse_flip("1:2:30:-1") == (1, 2, 30, -1)
    for bad in ("x", "12", "1:2:3:4:5", "-1:0", "1:2:3:x", "1:2:3:"):
        with pytest.raises(ValueError):
            rp.parse_flip(bad)
    hb = tmp_path / "job" / "attempt-0" / "heartbeat"
    hb.mkdir(parents=True)
    assert rp.claim_flip(str(hb)) and not rp.claim_flip(str(hb))
    assert (tmp_path / "job" / rp.FLIP_MARKER).exists()


def test_report_file_round_trip_and_junk_is_no_word(tmp_path):
    protocol.write_replicas(tmp_path, rp.judge(10, [(1, 1), (1, 2), (1, 1)]).report(3))
    got = protocol.read_replicas(tmp_path)
    assert got["step"] == 10 and got["agree"] is False and got["suspects"] == [1]
    assert (os.stat(tmp_path / protocol.REPLICAS_FILE).st_mode & 0o777) == 0o600
    (tmp_path / protocol.REPLICAS_FILE).write_text('{"step": "10", "agree": false, "suspects": []}')
    assert protocol.read_replicas(tmp_path) is None


RANKS = """
import json, os, sys
import torch, torch.distributed as dist
from clusterops import sdk
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
for p in model.parameters():
    dist.broadcast(p.data, 0)
out = []
for step in range(1, 13):
    v = sdk.check_replicas(step, model.parameters(), every=4)
    if v is not None:
        out.append([v.step, v.agree, list(v.suspects), v.ambiguous])
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sdk_check_on_three_gloo_ranks_names_the_flipped_rank_and_reports(tmp_path):
    hb = tmp_path / "job" / "attempt-0" / "heartbeat"
    hb.mkdir(parents=True)
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    port = str(_free_port())
    procs = []
    for r in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTEROPS_", "SLURM_"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE="3", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO), CLUSTEROPS_HEARTBEAT_DIR=str(hb), CLUSTEROPS_REPLICA_FLIP="6:2")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-800:] for _, e in outs]
    seen = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    # Step 4 agrees; the flip at step 6 is seen at step 8 and stays (nothing trains it away).
    assert seen[0] == [[4, True, [], False], [8, False, [2], False], [12, False, [2], False]], seen
    assert seen[0] == seen[1] == seen[2]
    rep = protocol.read_replicas(hb)       # the first disagreement stays the word
    assert rep["step"] == 8 and rep["suspects"] == [2] and rep["ranks"] == 3
    assert sorted(len(v) for v in rep["digests"].values()) == [1, 2]
    assert (tmp_path / "job" / rp.FLIP_MARKER).exists()


# -- the supervisor's decision -----------------------------------------------------------------


def _running(policy, nodes):
    s = Supervisor(policy, nodes)
    acts = s.start(1000.0)
    s.handle(ResumeChosen(1000.0, None, "", ()))
    for step in (10, 20, 30):
        s.handle(CheckpointCommitted(1001.0 + step, step, f"/ck/step_{step}"))
    return s, only(acts, Launch)[0]


def _beat(now, step, report):
    beats = {r: (step, now) for r in range(3)}
    return Heartbeats(now, beats, replicas=(("replicas", report),))


def test_disagreement_rolls_back_to_the_last_agreeing_check_and_drains_with_the_sdc_origin():
    s, launch = _running(P(nodes=3, spare_nodes=1, drain_bad_nodes=True, replica_check_every=5),
                         ["n1", "n2", "n3", "n4"])
    assert launch.nodes == ("n1", "n2", "n3")
    acts = s.handle(_beat(1040.0, 25, {"step": 25, "agree": True, "suspects": []}))
    assert not records(acts, "sdc_suspect") and not only(acts, Kill) and s.memory.replica_agree == 25
    acts = s.handle(_beat(1041.0, 30, {"step": 30, "agree": False, "suspects": [1], "ambiguous": False,
                                       "digests": {"a": [0, 2], "b": [1]}}))
    rec = records(acts, "sdc_suspect")[0].data
    assert rec["ranks"] == [1] and rec["nodes"] == ["n2"] and rec["last_agree"] == 25 and not rec["ambiguous"]
    assert records(acts, "node_bad")[0].data["node"] == "n2"
    drain = only(acts, DrainNodes)[0]
    assert drain.nodes == ("n2",) and drains.parse_reason(drain.reason).origin == drains.SDC
    assert only(acts, HoldCheckpoint)[0].step == 20 and only(acts, Kill)
    acts = s.handle(StepExited(1045.0, returncode=-9))
    pick = only(acts, PickRollback)[0]
    assert pick.before == 25 and pick.planned == 20
    acts = s.handle(RollbackPicked(1046.0, 20, "/ck/step_20"))
    assert records(acts, "rollback")[0].data["to_step"] == 20
    assert only(acts, SetAside)[0].after_step == 20
    nodes = only(acts, Launch)[0].nodes
    assert sorted(nodes) == ["n1", "n3", "n4"] and nodes[0] == "n1"     # the spare replaces n2


def test_ambiguous_disagreement_rolls_back_and_blames_nobody():
    s, _ = _running(P(nodes=2, replica_check_every=5, drain_bad_nodes=True), ["n1", "n2"])
    s.handle(_beat(1040.0, 25, {"step": 25, "agree": True, "suspects": []}))
    acts = s.handle(_beat(1041.0, 30, {"step": 30, "agree": False, "suspects": [], "ambiguous": True}))
    assert records(acts, "sdc_suspect")[0].data["ambiguous"] is True
    assert not records(acts, "node_bad") and not only(acts, DrainNodes) and only(acts, Kill)
    acts = s.handle(StepExited(1045.0, returncode=-9))
    assert only(acts, PickRollback)[0].before == 25


def test_the_ranks_own_last_agreement_counts_when_the_supervisor_missed_its_report():
    s, _ = _running(P(nodes=3, spare_nodes=1, replica_check_every=5), ["n1", "n2", "n3", "n4"])
    s.handle(_beat(1040.0, 15, {"step": 15, "agree": True, "suspects": []}))
    # The report of step 20 (agreed) was rewritten by step 25's before the supervisor looked.
    acts = s.handle(_beat(1041.0, 25, {"step": 25, "agree": False, "suspects": [1], "last_agree": 20}))
    assert records(acts, "sdc_suspect")[0].data["last_agree"] == 20
    acts = s.handle(StepExited(1045.0, returncode=-9))
    assert only(acts, PickRollback)[0].before == 20


def test_a_resume_trusts_its_checkpoint_and_forgets_the_discarded_timelines_reports():
    s, _ = _running(P(nodes=3, spare_nodes=1, replica_check_every=5), ["n1", "n2", "n3", "n4"])
    s.handle(_beat(1040.0, 35, {"step": 35, "agree": True, "suspects": []}))
    s.handle(_beat(1041.0, 40, {"step": 40, "agree": False, "suspects": [0], "ambiguous": False}))
    s.handle(StepExited(1045.0, returncode=-9))
    s.handle(RollbackPicked(1046.0, 30, "/ck/step_30"))
    s.handle(ResumeChosen(1047.0, 30, "/ck/step_30", ()))
    assert s.memory.replica_agree == 30
    # The replay's check at 35 is handled again (a new attempt), and agrees.
    acts = s.handle(_beat(1050.0, 35, {"step": 35, "agree": True, "suspects": []}))
    assert not records(acts, "sdc_suspect") and not only(acts, Kill)
    assert s.memory.replica_agree == 35


def test_without_a_checkpoint_before_the_last_agreement_it_gives_up_moving_nothing_earlier():
    s = Supervisor(P(nodes=3, replica_check_every=5), ["n1", "n2", "n3"])
    s.start(1000.0)
    s.handle(ResumeChosen(1000.0, None, "", ()))
    s.handle(CheckpointCommitted(1030.0, 30, "/ck/step_30"))
    acts = s.handle(_beat(1041.0, 10, {"step": 10, "agree": False, "suspects": [2], "ambiguous": False}))
    assert records(acts, "sdc_suspect")[0].data["decision"] == "give_up"
    acts = s.handle(StepExited(1045.0, returncode=-9))
    assert only(acts, SetAside)[0].after_step == -1 and s.exit_code == 9
