"""The fast profile's fabric and AMD probes for real on every dev-cluster node: this machine
has no HCA and no AMD GPU, so each says so (skip, with the reason) and the node stays healthy;
the fabric probe's state file is written per node, concurrently (one srun, four tasks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
PY = sys.executable


def test_fast_check_on_all_nodes_skips_fabric_and_amd_with_the_reason(cluster, tmp_path):
    env = dict(os.environ, SLURM_CONF=str(cluster.conf_path), CLUSTEROPS_STATE_DIR=str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    script = (f'{PY} -m clusterops health check --profile fast --json > {out}/"$SLURMD_NODENAME".json; '
              f'echo $? > {out}/"$SLURMD_NODENAME".rc')
    r = subprocess.run(["srun", "-N4", "--ntasks-per-node=1", "--time=2", "sh", "-c", script], env=env,
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    for node in ("node1", "node2", "node3", "node4"):
        doc = json.loads((out / f"{node}.json").read_text())
        assert (out / f"{node}.rc").read_text().strip() == "0" and doc["node"] == node
        by = {x["name"]: x for x in doc["results"]}
        assert by["fabric.ports"]["status"] == "skip"
        assert "no InfiniBand/RoCE ports under /sys/class/infiniband" in by["fabric.ports"]["detail"]
        assert by["amd"]["status"] == "skip" and "no AMD GPUs" in by["amd"]["detail"]
