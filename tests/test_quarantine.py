"""Repeat offenders: blames in the fleet history (both drivers), the pure quarantine
decision, and the rule that no passing check or sweep lifts a quarantine."""

from __future__ import annotations

import sqlite3
import time

from clusterops import drains, quarantine
from clusterops.history import SCHEMA, SCHEMA_VERSION, History
from clusterops.sweep import NodeResult, SweepReport
from clusterops.sweep.options import SweepOptions
from clusterops.sweep.run import _classify_targets

WEEK = 7 * 86400.0


def _check(cid, node, status, t, gpus=None, failing_gpu=None):
    results = [{"name": "host.paths", "status": "pass", "detail": ""}]
    nv = {"name": "nvml.ecc", "status": status, "detail": "GPU1: volatile ECC", "data": {}}
    if gpus:
        nv["data"]["gpus"] = gpus
        for g in gpus:
            nv["data"][f"gpu{g['index']}"] = {"status": "fail" if g["index"] == failing_gpu else "pass"}
    results.append(nv)
    return {"id": cid, "node": node, "time": t, "status": status, "profile": "fast", "exit_code": 1,
            "results": results}


def _sweep(sid, t, statuses):
    results = {n: NodeResult(n, st, detail="" if st == "pass" else "broken", probe="" if st == "pass" else "nvml")
               for n, st in statuses.items()}
    return SweepReport(sid, t - 5, t, {"via": "slurm", "profile": "fast"}, list(statuses), results, {}, None)


def test_blames_from_checks_sweeps_and_supervisor_make_an_offender(history_target):
    now = time.time()
    gpus = [{"index": 0, "uuid": "GPU-aaa", "serial": "S0"}, {"index": 1, "uuid": "GPU-bbb", "serial": "S1"}]
    with History.open(history_target) as h:
        assert h.schema_version() == SCHEMA_VERSION
        h.record_check(_check("c1", "node3", "fail", now - 300, gpus, failing_gpu=1))
        h.record_check(_check("c1", "node3", "fail", now - 300, gpus, failing_gpu=1))   # spooled twice: one blame
        h.record_check(_check("c2", "node3", "pass", now - 250))                        # a pass blames nothing
        h.record_check(_check("c3", "node2", "fail", now - 200))
        assert h.offenders(3, WEEK, now) == []
        h.record_check(_check("c4", "node3", "fail", now - 100, gpus, failing_gpu=1))
        h.record(_sweep("s1", now - 50, {"node1": "pass", "node2": "unreachable", "node3": "fail"}))
        found = h.offenders(3, WEEK, now)
        assert [(o["kind"], o["node"], o["count"]) for o in found] == [("node", "node3", 3)]
        assert found[0]["sources"] == ["check", "sweep"]
        # the supervisor's blame (no GPU) counts for the node; the GPU reaches 3 by its own blames
        h.record_blame("node3", None, None, "supervisor", "rank_exit twice", job_id="77", at=now - 10)
        h.record_blame("node4", "GPU-bbb", "S1", "check", "moved GPU still bad", at=now - 5)
        found = h.offenders(3, WEEK, now)
        assert [(o["kind"], o["node"], o["gpu_uuid"], o["count"]) for o in found] == [
            ("node", "node3", None, 4), ("gpu", "node4", "GPU-bbb", 3)]
        assert found[1]["gpu_serial"] == "S1"
        # out of the window: not counted
        assert h.offenders(3, 60.0, now) == []
        # a person clears one GPU, then the node
        assert h.clear_blames("node4", gpu_uuid="GPU-bbb", by="alice", now=now) == 3
        assert [o["kind"] for o in h.offenders(3, WEEK, now)] == ["node"]
        assert h.clear_blames("node3", by="alice", now=now) >= 2
        assert h.offenders(3, WEEK, now) == []
        assert all(b["cleared_by"] == "alice" for b in h.blames(include_cleared=True) if b["node"] == "node3")


def test_migration_to_blames_is_idempotent(tmp_path):
    db = tmp_path / "v1.db"
    con = sqlite3.connect(db)
    con.executescript(SCHEMA)
    con.execute("INSERT INTO results (time, sweep_id, node, probe, status) VALUES (1, 's0', 'node1', 'check', "
                "'fail')")
    con.commit()
    con.close()
    with History.open(db) as h:
        assert h.schema_version() == SCHEMA_VERSION
        h.record_blame("node1", None, None, "check", "x", at=100.0)
    with History.open(db) as h:      # opened again: nothing applied twice, nothing lost
        assert h.migrate() == []
        assert [b["node"] for b in h.blames()] == ["node1"]
        assert len(h.rows(node="node1")) == 1


def test_decision_is_pure_and_needs_a_failure_at_hand():
    now = 1_000_000.0
    bl = [{"at": now - i, "node": "node3", "gpu_uuid": None, "source": "check", "job_id": f"c{i}"}
          for i in range(3)]
    bl.append({"at": now - 1, "node": "node3", "gpu_uuid": None, "source": "check", "job_id": "c1"})  # same blame
    bl.append({"at": now - 5, "node": "node1", "gpu_uuid": None, "source": "sweep", "job_id": "s", "cleared": 9.0})
    found = quarantine.offenders_of(bl, 3, WEEK, now)
    assert [(o["node"], o["count"]) for o in found] == [("node3", 3)]
    assert quarantine.offenders_of(bl, 4, WEEK, now) == []
    # blames alone never drain: only together with a real failure of that node now
    assert quarantine.decide(found, [], WEEK) == []
    [(node, reason)] = quarantine.decide(found, ["node3", "node1"], WEEK)
    assert node == "node3" and reason.startswith("clusterops:quarantine: node3: 3 blames in 7d")
    assert drains.parse_reason(reason).origin == drains.QUARANTINE


def test_gpu_blames_need_a_uuid():
    results = [{"name": "nvml.ecc", "status": "fail", "data": {"gpu0": {"status": "fail"}}}]
    assert quarantine.gpu_blames(results) == []          # the probe named no UUID: node blame only
    results[0]["data"]["gpus"] = [{"index": 0, "uuid": "GPU-x", "serial": None}]
    assert quarantine.gpu_blames(results) == [("GPU-x", None, "nvml.ecc")]


def test_a_passing_check_or_sweep_never_lifts_a_quarantine():
    reason = quarantine.reason({"kind": "node", "node": "node3", "count": 3, "sources": ["check"]}, WEEK)
    everything = frozenset({"nvml.ecc", "host.paths", "node3"})
    for who in (drains.Resumer(drains.BY_HEALTH, "deep", everything),
                drains.Resumer(drains.BY_SWEEP, "deep", everything, flap_clean=True)):
        ok, why = drains.may_resume(reason, who)
        assert not ok and "quarantine clear" in why
    assert drains.may_resume(reason, drains.Resumer(drains.BY_ADMIN))[0]


class _Info:
    def __init__(self, name, reason):
        self.name, self.reason, self.state, self.flags, self.partitions = name, reason, "idle", {"DRAIN"}, ["p"]
        self.drained, self.is_down, self.is_idle, self.busy = True, False, True, False


def test_the_sweep_does_not_resume_a_quarantined_node_for_its_recheck():
    q = quarantine.reason({"kind": "node", "node": "node3", "count": 3, "sources": ["check"]}, WEEK)
    infos = {"node3": _Info("node3", q), "node2": _Info("node2", drains.make_reason(drains.SWEEP, "nvml", "x"))}
    check, recheck, skipped = _classify_targets(["node2", "node3"], infos, SweepOptions(drain=True))
    assert recheck == ["node2"] and "node3" in skipped and "quarantined" in skipped["node3"].detail
