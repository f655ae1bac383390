"""`clusterops health check --drain-on-fail` on a dev-cluster node whose fabric is a healthy
InfiniBand rail beside an RDMA-capable Ethernet NIC with an unused port down (issue 32):
the fast profile does not drain it. Real Slurm and the real CLI; only the HCA tree is
stood in for (this machine has none), given to the fabric probe as ``sys_root`` through
the site config (``$CLUSTEROPS_HEALTH_SITE``), the way a site sets any probe setting.
Naming that port in the site config makes it an expected port, and then the same node
is drained for real (and resumed once the expectation is lifted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
PY = sys.executable
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "fabric"
NODE = "node2"


def _tree(tmp_path: Path) -> Path:
    """The recorded healthy node (four NDR IB ports, one RoCE port mlx5_4) plus mlx5_5/1,
    the Ethernet NIC's second port, down with no cable, written in the kernel's format."""
    root = tmp_path / "sys-class-infiniband"
    shutil.copytree(FIX / "healthy" / "t0", root)
    port = root / "mlx5_5" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (root / "mlx5_5" / "node_type").write_text("1: CA\n")
    for name, text in (("state", "1: DOWN"), ("phys_state", "3: Disabled"), ("link_layer", "Ethernet"),
                       ("rate", "10 Gb/sec (4X SDR)")):
        (port / name).write_text(text + "\n")
    for c in ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors"):
        (port / "counters" / c).write_text("0\n")
    return root


def _site(tmp_path: Path, name: str, tree: Path, ports=None) -> Path:
    fabric = f"sys_root: {json.dumps(str(tree))}"
    if ports:
        fabric += f", ports: {json.dumps(ports)}"
    p = tmp_path / name
    # Stray processes of other tests on the shared cluster are not this test's business.
    p.write_text(f"profiles:\n  fast:\n    probes:\n      fabric: {{{fabric}}}\n"
                 "      host.stray_processes: false\n")
    return p


def _check(cluster, tmp_path, site: Path):
    env = dict(os.environ, SLURM_CONF=str(cluster.conf_path), CLUSTEROPS_STATE_DIR=str(tmp_path / "state"),
               CLUSTEROPS_HEALTH_SITE=str(site))
    r = subprocess.run([PY, "-m", "clusterops", "health", "check", "--profile", "fast", "--node", NODE,
                        "--json", "--drain-on-fail"], env=env, capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.stdout, r.stderr
    doc = json.loads(r.stdout)
    return r.returncode, doc, {x["name"]: x for x in doc["results"]}


@pytest.mark.timeout(300)
def test_an_unused_ethernet_port_down_does_not_drain_and_a_named_one_does(cluster, tmp_path):
    from clusterops.runner import Runner
    from clusterops.slurm import Slurm

    slurm = Slurm(Runner(env=cluster.env()))
    assert not slurm.node(NODE).drained
    tree = _tree(tmp_path)
    plain = _site(tmp_path, "site.yaml", tree)

    # The fast profile with nothing named: the IB rail is judged and healthy, the unused
    # Ethernet port is only reported (a warning), and the node stays in service.
    rc, doc, by = _check(cluster, tmp_path, plain)
    node = slurm.node(NODE)
    assert doc["slurm"]["action"] == "none", doc["slurm"]
    assert not node.drained and not (node.reason or ""), node
    assert doc["status"] in ("pass", "warn") and rc == 0, (rc, doc["status"], [
        (x["name"], x["status"], x.get("detail")) for x in doc["results"] if x["status"] not in ("pass", "skip")])
    fab = by["fabric.ports"]
    assert fab["status"] == "warn", fab
    assert "mlx5_5/1 DOWN (not judged" in fab["detail"]
    assert "judged: mlx5_0/1, mlx5_1/1, mlx5_2/1, mlx5_3/1;" in fab["detail"]
    assert "only reported: mlx5_4/1 ACTIVE, mlx5_5/1 DOWN" in fab["detail"]

    # The site names the port (it carries RoCE here): an expected port down fails, and the
    # same command drains the node for real, with the port in the reason.
    named = _site(tmp_path, "site-named.yaml", tree, ports=["mlx5_[0-3]/1", "mlx5_5/1"])
    rc, doc, by = _check(cluster, tmp_path, named)
    assert by["fabric.ports"]["status"] == "fail" and "mlx5_5/1 DOWN" in by["fabric.ports"]["detail"]
    assert rc == 1 and doc["slurm"]["action"] == "drain", (rc, doc["slurm"])
    node = slurm.node(NODE)
    assert node.drained and node.reason.startswith("clusterops:health:fast: fabric: fabric.ports: mlx5_5/1 DOWN")

    # The expectation lifted again, the next check re-judges the fabric and resumes the
    # node (its own drain, for the probe it has just re-checked).
    rc, doc, by = _check(cluster, tmp_path, plain)
    assert rc == 0 and doc["slurm"]["action"] == "resume", (rc, doc["slurm"])
    assert not slurm.node(NODE).drained
