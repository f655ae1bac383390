"""Repeat offenders on the real dev cluster, on SQLite and PostgreSQL: node3 (its scratch
directory removed for real) fails two health checks and a sweep (K=3) and is quarantined;
a passing check and a passing sweep do not resume it; `clusterops health quarantine clear
node3` does; no healthy node is quarantined."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.slurm import parse

pytestmark = pytest.mark.integration

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")
PROFILE = """\
extends: fast
probes:
  host.paths:
    paths:
      - {path: "${CLUSTEROPS_NODE_SCRATCH}", min_free_gb: 0.001, writable: true}
"""


def _state(node):
    line = subprocess.run(["scontrol", "show", "node", "--oneliner", node], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[0]
    return re.search(r"State=(\S+)", line).group(1), parse.node_from_oneliner(line).reason or ""


def _env(cluster, tmp_path, node=None):
    env = dict(os.environ, SLURM_CONF=str(cluster.conf_path), CLUSTEROPS_HEALTH_SITE=str(tmp_path / "site.yaml"),
               CLUSTEROPS_STATE_DIR=str(tmp_path), CLUSTEROPS_HEALTH_SPOOL=str(tmp_path / "spool"))
    env.pop("CLUSTEROPS_HISTORY_DB", None)
    env.pop("CLUSTEROPS_SWEEP_DB", None)
    if node:
        env.update(SLURMD_NODENAME=node, CLUSTEROPS_NODE_SCRATCH=str(cluster.scratch_dir(node)))
    return env


def _check(cluster, tmp_path, db, node="node3"):
    """The node's own check, as slurmd's HealthCheckProgram runs it (no job: it may be drained)."""
    r = subprocess.run([CLUSTEROPS, "health", "check", "--profile", str(tmp_path / "p.yaml"), "--drain-on-fail",
                        "--db", db, "--json", "--node", node], env=_env(cluster, tmp_path, node),
                       capture_output=True, text=True, timeout=90)
    return r.returncode, json.loads(r.stdout)


def _sweep(cluster, tmp_path, db):
    r = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(tmp_path / "p.yaml"), "--db", db, "--timeout", "90",
                        "--drain", "--json"], env=_env(cluster, tmp_path), capture_output=True, text=True,
                       timeout=200)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else r.stderr


@pytest.mark.timeout(420)
def test_three_blames_quarantine_node3_until_a_person_clears_it(cluster, tmp_path, history_target):
    db = history_target
    (tmp_path / "p.yaml").write_text(PROFILE)
    (tmp_path / "site.yaml").write_text("quarantine:\n  blames: 3\n  window_s: 3600\ndrain:\n"
                                        "  max_drained_fraction: 0.5\n")
    scratch = cluster.scratch_dir("node3")
    shutil.move(str(scratch), str(scratch) + ".away")
    try:
        for i in (1, 2):                      # two failed checks: blamed twice, drained, not quarantined
            rc, rep = _check(cluster, tmp_path, db)
            assert rc == 1 and rep["status"] == "fail", rep
            assert rep["history"]["error"] is None, rep["history"]
            assert rep["quarantine"]["action"] == "none", rep["quarantine"]
            state, reason = _state("node3")
            assert "DRAIN" in state and reason.startswith("clusterops:health:"), reason
        rc, doc = _sweep(cluster, tmp_path, db)    # the sweep rechecks node3: third blame -> quarantine
        assert rc == 1, doc
        assert {n["node"]: n["status"] for n in doc["nodes"]}["node3"] == "fail"
        state, reason = _state("node3")
        assert "DRAIN" in state and reason.startswith("clusterops:quarantine: node3: 3 blames in 1h"), reason
        assert any(a["node"] == "node3" and a["action"] == "quarantine" for a in doc["applied"]), doc["applied"]
    finally:
        shutil.move(str(scratch) + ".away", str(scratch))
    # Repaired: a passing check and a passing sweep leave the quarantine alone.
    rc, rep = _check(cluster, tmp_path, db)
    assert rc == 0, rep
    assert _state("node3")[1].startswith("clusterops:quarantine:")
    rc, doc = _sweep(cluster, tmp_path, db)
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["node3"]["status"] == "skipped" and "quarantined" in by["node3"]["detail"]
    assert "DRAIN" in _state("node3")[0]
    out = subprocess.run([CLUSTEROPS, "health", "quarantine", "list", "--db", db, "--json"],
                         env=_env(cluster, tmp_path), capture_output=True, text=True, timeout=60)
    listed = json.loads(out.stdout)
    assert [o["node"] for o in listed["offenders"]] == ["node3"]
    assert [n["node"] for n in listed["drained"]] == ["node3"]
    # Healthy nodes were never quarantined.
    for n in ("node1", "node2", "node4"):
        assert not _state(n)[1].startswith("clusterops:"), (n, _state(n))
    # A person clears it: resumed, and the blames no longer count.
    out = subprocess.run([CLUSTEROPS, "health", "quarantine", "clear", "node3", "--db", db, "--json"],
                         env=_env(cluster, tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["slurm"] == "resumed"
    state, reason = _state("node3")
    assert "DRAIN" not in state and not reason.startswith("clusterops:quarantine"), (state, reason)
    listed = json.loads(subprocess.run([CLUSTEROPS, "health", "quarantine", "list", "--db", db, "--json"],
                                       env=_env(cluster, tmp_path), capture_output=True, text=True).stdout)
    assert listed["offenders"] == [] and listed["drained"] == []
