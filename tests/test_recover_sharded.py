"""recover.run's sharded mode without Slurm: what rank 0 reports after a recovery from the
checkpoint (through a real TCPStore, read back as the rendezvous reads it, fed to the real
Membership), and the SDK's resume hook on a real checkpoint."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from clusterops import checkpoint as ck
from clusterops import protocol, recover, sdk
from clusterops.supervisor.membership import Membership, Note, Report


@pytest.fixture(autouse=True)
def fresh_sdk(monkeypatch):
    for var in (*protocol.CONTRACT_ENV, ck.FAULT_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    sdk._reset()
    yield
    sdk._set_resume_hook(None)
    sdk._set_step_hook(None)
    sdk._reset()


@pytest.fixture
def client():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    c = recover._Client(f"127.0.0.1:{server.port}/tok", 10.0)
    c.server = server
    return c


def reports(c) -> list:
    n = c.store.add(protocol.RDZV_REPORTS, 0)
    return [json.loads(c.store.peek(protocol.rdzv_key("rep", i))) for i in range(1, n + 1)]


def test_from_checkpoint_reports_the_checkpoint_step_and_the_steps_recomputed(client):
    plan = {"gen": 1, "world": 4, "ranks": {}, "standby": [], "src": 1, "step": 25}
    rep = recover._Reporter(client, plan, 0, restored=False, from_ckpt=True)
    rep.on_step(25)                      # a beat before the resume: no first step yet
    rep.on_resume(sdk.Resumed(step=20, state={}, rank_state=None, path=Path("/c/step_20"), manifest={},
                              rng_restored=False), 0.05)
    rep.on_step(20)                      # the forced beat at the resumed step: not a trained step
    rep.on_step(21)                      # the first step trained in the new generation
    rep.on_step(22)                      # said once
    got = reports(client)
    assert [(r["kind"], r.get("step")) for r in got] == [("state", 20), ("step", 21)]
    assert got[0]["source"] == "checkpoint" and got[0]["survivors_step"] == 25 and got[0]["recomputed"] == 5
    assert got[1]["from_step"] == 20 and got[1]["recomputed"] == 5


def test_from_checkpoint_without_a_checkpoint_recomputes_from_step_0(client):
    plan = {"gen": 2, "world": 2, "ranks": {}, "standby": [], "src": 0, "step": 7}
    rep = recover._Reporter(client, plan, 0, restored=False, from_ckpt=True)
    rep.on_resume(None, 0.0)
    rep.on_step(0)
    rep.on_step(1)
    got = reports(client)
    assert [(r["kind"], r.get("step"), r.get("recomputed")) for r in got] == [("state", 0, 7), ("step", 1, 7)]


def test_only_rank_0_reports_and_the_replicated_case_is_unchanged(client):
    plan = {"gen": 1, "world": 2, "ranks": {}, "standby": [], "src": 1, "step": 23}
    other = recover._Reporter(client, plan, 1, restored=False, from_ckpt=True)
    other.on_resume(None, 0.0)
    other.on_step(5)
    rep = recover._Reporter(client, plan, 0, restored=True, from_ckpt=False)
    rep.on_resume(None, 0.0)              # a script's resume in a restored generation: not a report
    rep.on_step(23)
    rep.on_step(24)
    assert [(r["kind"], r["step"], "recomputed" in r) for r in reports(client)] == [("step", 24, False)]


def test_membership_first_step_note_carries_the_recomputed_steps():
    m = Membership(["n1", "n2"], 1, 1, timeout_s=30, unresponsive_s=3)
    for i, (node, local) in enumerate([("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]):
        m.handle(Report("hello", f"{node}:{i}", {"node": node, "local": local, "task": i}), 0.0)
    assert m.plan is not None and m.plan.ranks == {"n1:0": 0, "n2:2": 1}
    m.handle(Report("dead", "n2:3", {"dead": "n2:2"}), 1.0)
    out = m.handle(Report("join", "n1:0", {"gen": 1, "rank": 0, "step": 25}), 1.2)
    assert m.plan.gen == 1 and m.plan.ranks == {"n1:0": 0, "n2:3": 1}, out
    m.handle(Report("state", "n1:0", {"gen": 1, "source": "checkpoint", "step": 20, "recomputed": 5}), 1.5)
    out = m.handle(Report("step", "n1:0", {"gen": 1, "step": 21, "from_step": 20, "recomputed": 5}), 1.8)
    first = [a for a in out if isinstance(a, Note) and a.kind == "inproc_first_step"]
    assert len(first) == 1 and first[0].data["from_step"] == 20 and first[0].data["recomputed"] == 5
    assert first[0].data["fault_to_step_s"] == 0.8 and m.recoveries == 1


def test_resume_hook_sees_what_resume_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path))
    seen = []
    sdk._set_resume_hook(lambda r, s: seen.append((None if r is None else r.step, s >= 0)))
    assert sdk.resume() is None
    sdk.save({"w": torch.ones(3)}, 12)
    r = sdk.resume()
    assert r is not None and r.step == 12
    assert seen == [(None, True), (12, True)]
