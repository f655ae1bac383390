"""The sdc probe in a real sweep on the dev cluster: the node with a flipped bit is drained.

Four nodes run the same fixed-seed workload (CPU path) through real `clusterops sweep` check
jobs. The test hook CLUSTEROPS_SDC_FAULT=flip:<bit>@node3 reaches every check job (sbatch
exports the submitter's environment) and flips one bit of the workload's result on node3
alone; the sweep's majority comparison fails node3 and the drain goes through the fleet
guard. Without the hook, nobody is drained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_sweep_slurm import nodes_state

pytestmark = pytest.mark.integration

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")

# No recorded digest for this workload: only the nodes' comparison with each other can blame.
PROFILE = """\
description: fast + the sdc probe (sdc sweep test)
extends: fast
probes:
  sdc: {timeout_s: 120, size: 192, iterations: 4, seed: 4242}
"""


def sweep(tmp_path, profile, fault=None):
    env = dict(os.environ)
    env.pop("CLUSTEROPS_SDC_FAULT", None)
    if fault:
        env["CLUSTEROPS_SDC_FAULT"] = fault
    argv = [CLUSTEROPS, "sweep", "--profile", profile, "--db", str(tmp_path / "sweep.db"), "--timeout", "120",
            "--nodes", "node[1-4]", "--drain", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    return out, json.loads(out.stdout)


@pytest.mark.timeout(420)
def test_sweep_drains_the_node_whose_sdc_digest_differs(cluster, tmp_path):
    profile = tmp_path / "sdctest.yaml"
    profile.write_text(PROFILE)
    out, doc = sweep(tmp_path, str(profile))
    assert out.returncode == 0, out.stderr + out.stdout
    assert doc["applied"] == []
    digests = {n["node"]: next(p["value"] for p in n["probes"] if p["name"] == "sdc") for n in doc["nodes"]}
    assert len(set(digests.values())) == 1 and len(digests) == 4
    assert all("DRAIN" not in s for s, _ in nodes_state().values())

    out, doc = sweep(tmp_path, str(profile), fault="flip:9@node3")
    assert out.returncode == 1, out.stderr + out.stdout
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["node3"]["status"] == "fail" and by["node3"]["probe"] == "sdc"
    assert "differs from the majority of 4 nodes of model cpu:" in by["node3"]["detail"]
    assert {by[n]["status"] for n in ("node1", "node2", "node4")} <= {"pass", "warn"}
    st = nodes_state()
    assert "DRAIN" in st["node3"][0]
    assert st["node3"][1].startswith("clusterops:sweep: sdc: sdc digest differs from the majority of 4 nodes")
    assert all("DRAIN" not in st[n][0] for n in ("node1", "node2", "node4"))
    assert [a["node"] for a in doc["applied"] if a["action"] == "drain"] == ["node3"]
