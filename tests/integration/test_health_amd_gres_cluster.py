"""A node whose Slurm gres says it has AMD GPUs (``gpu:mi300x:2``) but that has no
``amdsmi``: the ``amd`` probe is an ``error`` that says what to install, and
``--drain-on-fail`` leaves the node in service. Real Slurm: a separate 2-node dev cluster
with a typed gres (the session's shared cluster is untyped and stays untouched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
PY = sys.executable

# The GPU partition's profile: GPUs required, so the amd probe asks Slurm on a node that
# shows no NVIDIA GPU; nvml off, as docs/health.md tells AMD partitions to set.
AMD_PROFILE = """\
extends: fast
gpus: {required: true}
probes:
  nvml: false
  host.stray_processes: false
"""


@pytest.fixture
def amd_cluster():
    from clusterops.devcluster import DevClusterConfig
    from conftest import own_dev_cluster, pick_port_base

    with own_dev_cluster("amd") as dc:
        dc.up(DevClusterConfig(nodes=2, gpus_per_node=2, gpu_type="mi300x", cpus_per_node=2,
                               port_base=pick_port_base(2)))
        yield dc


@pytest.mark.timeout(300)
def test_amd_gres_without_amdsmi_is_error_and_never_drains(amd_cluster, tmp_path):
    import importlib.util

    assert importlib.util.find_spec("amdsmi") is None      # this machine: no AMD library
    from clusterops.runner import Runner
    from clusterops.slurm import Slurm

    dc = amd_cluster
    slurm = Slurm(Runner(env=dc.env()))
    assert slurm.node("node1").gres.startswith("gpu:mi300x:2")
    profile = tmp_path / "amdpart.yaml"
    profile.write_text(AMD_PROFILE)
    env = dict(os.environ, SLURM_CONF=str(dc.conf_path), CLUSTEROPS_STATE_DIR=str(tmp_path / "state"))
    env.pop("CLUSTEROPS_HEALTH_SITE", None)
    r = subprocess.run([PY, "-m", "clusterops", "health", "check", "--profile", str(profile), "--node", "node1",
                        "--json", "--drain-on-fail"], env=env, capture_output=True, text=True, timeout=180)
    doc = json.loads(r.stdout)
    by = {x["name"]: x for x in doc["results"]}
    assert by["amd"]["status"] == "error", by["amd"]
    assert "gpu:mi300x:2" in by["amd"]["detail"] and "pip install 'clusterops[amd]'" in by["amd"]["detail"]
    assert r.returncode == 4, (r.returncode, r.stderr)
    node = slurm.node("node1")
    assert not node.drained and not (node.reason or ""), node
