"""Repeat offenders across two jobs and a sweep, on the dev cluster (issue 29, part 4), on
SQLite and PostgreSQL.

Two supervised jobs each lose their rank on node2 to a SIGKILL (`node_fail_threshold: 1`,
no drain: the supervisor only leaves node2 out and finishes on the spare); each verdict is a
blame of node2 in the fleet history (`CLUSTEROPS_HISTORY_DB` in the jobs' environment).
Then node2's scratch directory goes missing and a `--drain` sweep fails it: the third blame
within the window quarantines node2 (K=3), and no other node is quarantined.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

from support import faultkit as fk
from integration.test_quarantine import CLUSTEROPS, PROFILE, _env, _state, _sweep

pytestmark = pytest.mark.integration


@pytest.mark.timeout(480)
def test_two_jobs_and_a_sweep_quarantine_node2(cluster, tmp_path, history_target):
    from clusterops.history import History
    from clusterops.slurm.factory import connect

    slurm = connect()
    db = history_target
    for i in (1, 2):
        job = fk.TrainJob(root=tmp_path / f"j{i}", name=f"qj{i}", nodes=2, steps=40, ckpt_every=10,
                          supervise={"spare_nodes": 1, "node_fail_threshold": 1, "drain_bad_nodes": False})
        job.submit(env=dict(os.environ, CLUSTEROPS_HISTORY_DB=db))
        job.wait_step(12)
        assert job.signal_rank(1, signal.SIGKILL)          # rank 1 runs on node2
        info = job.wait_end(slurm, timeout_s=200)
        assert info.state == "COMPLETED", fk.events(job, "warning")
        assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"]
    with History.open(db) as h:
        assert [(b["node"], b["source"]) for b in h.blames()] == [("node2", "supervisor")] * 2
    (tmp_path / "p.yaml").write_text(PROFILE)
    (tmp_path / "site.yaml").write_text("quarantine:\n  blames: 3\n  window_s: 3600\ndrain:\n"
                                        "  max_drained_fraction: 0.5\n")
    scratch = cluster.scratch_dir("node2")
    shutil.move(str(scratch), str(scratch) + ".away")
    try:
        rc, doc = _sweep(cluster, tmp_path, db)
        assert rc == 1, doc
        state, reason = _state("node2")
        assert "DRAIN" in state and reason.startswith("clusterops:quarantine: node2: 3 blames in 1h"), reason
        assert "supervisor" in reason and "sweep" in reason, reason
        for n in ("node1", "node3", "node4"):
            assert not _state(n)[1].startswith("clusterops:"), (n, _state(n))
    finally:
        shutil.move(str(scratch) + ".away", str(scratch))
        subprocess.run([CLUSTEROPS, "health", "quarantine", "clear", "node2", "--db", db],
                       env=_env(cluster, tmp_path), capture_output=True, text=True, timeout=60)
    assert "DRAIN" not in _state("node2")[0]
