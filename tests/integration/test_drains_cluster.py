"""Who owns a drain and who may lift it, on the real dev cluster: origin-aware resume by
`health check --drain-on-fail`, the library's refusal to resume a foreign reason, a broken
profile or site config that drains nothing, and the self-drain's fleet guard."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops import drains

pytestmark = pytest.mark.integration

PY = sys.executable
CLUSTEROPS = str(Path(PY).parent / "clusterops")

# The built-in `fast` profile (so drains read `clusterops:health:fast:`), made to check each
# dev-cluster node's own scratch directory through the site config.
SITE = """\
profiles:
  fast:
    probes:
      host.paths: {paths: [{path: "${CLUSTEROPS_NODE_SCRATCH}", min_free_gb: 0.001}]}
      host.stray_processes: false
"""
SCRATCH_PROBE = "host.path:${CLUSTEROPS_NODE_SCRATCH}"


def _env(dc, tmp_path, node=None, **extra):
    env = dict(os.environ, SLURM_CONF=str(dc.conf_path), CLUSTEROPS_STATE_DIR=str(tmp_path / "state"))
    env.pop(drains.FRACTION_ENV, None)
    env.pop("CLUSTEROPS_HEALTH_SITE", None)
    if node:
        env["CLUSTEROPS_NODE_SCRATCH"] = str(dc.scratch_dir(node))
    env.update(extra)
    return env


def site(tmp_path, text=SITE) -> Path:
    p = tmp_path / "site.yaml"
    p.write_text(text)
    return p


def check(dc, tmp_path, node, *args, profile="fast", **env):
    """`clusterops health check --drain-on-fail --json` for `node`, as HealthCheckProgram runs it."""
    argv = [PY, "-m", "clusterops", "health", "check", "--profile", profile, "--node", node, "--json",
            "--drain-on-fail", *args]
    r = subprocess.run(argv, env=_env(dc, tmp_path, node, **env), capture_output=True, text=True, timeout=90)
    try:
        rep = json.loads(r.stdout)
    except ValueError:
        rep = None
    return r.returncode, rep, r.stderr


def state(dc, node):
    from clusterops.slurm import Slurm

    n = Slurm.from_environment().node(node)
    return n.drained, n.reason


def admin_drain(dc, node, reason):
    """Test plumbing: put a reason on a node the way its writer would have."""
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
                   env=dict(os.environ, SLURM_CONF=str(dc.conf_path)), check=True, timeout=30)


class Broken:
    """A node's scratch directory removed for real; repaired on exit."""

    def __init__(self, dc, node):
        self.path = dc.scratch_dir(node)

    def __enter__(self):
        shutil.rmtree(self.path)
        return self

    def repair(self):
        (self.path / "tmp").mkdir(parents=True, exist_ok=True)

    def __exit__(self, *exc):
        self.repair()


@pytest.mark.timeout(240)
def test_passing_fast_check_lifts_only_what_it_rechecked(cluster, tmp_path):
    s = site(tmp_path)
    supervisor = drains.make_reason(drains.SUPERVISOR, "hang", "rank 1 stopped beating")
    deep = drains.make_reason(drains.HEALTH, "dcgm", "dcgm.diag: memory test failed on GPU2", profile="deep")
    legacy = f"clusterops: {SCRATCH_PROBE}: gone (written before origins)"
    admin_drain(cluster, "node2", supervisor)
    admin_drain(cluster, "node4", deep)
    admin_drain(cluster, "node1", legacy)
    with Broken(cluster, "node3") as broken:
        # Three nodes already carry our drains: let the guard allow this one (the env override).
        rc, rep, err = check(cluster, tmp_path, "node3", "--site-config", str(s),
                             **{drains.FRACTION_ENV: "1"})
        assert rc == 1 and rep["status"] == "fail" and rep["slurm"]["action"] == "drain", (rep, err)
        drained, reason = state(cluster, "node3")
        assert drained and reason.startswith(f"clusterops:health:fast: host.paths: {SCRATCH_PROBE}: ")
        broken.repair()
        # The failing probe passes again: the health drain is lifted.
        rc, rep, err = check(cluster, tmp_path, "node3", "--site-config", str(s))
        assert rc == 0 and rep["slurm"]["action"] == "resume", (rep, err)
        assert state(cluster, "node3") == (False, None)
    # A supervisor's drain and a deep check's drain are not the fast check's to lift.
    for node, reason in (("node2", supervisor), ("node4", deep)):
        rc, rep, err = check(cluster, tmp_path, node, "--site-config", str(s))
        assert rc == 0 and rep["status"] in ("pass", "warn"), (rep, err)
        assert rep["slurm"]["action"] == "none", rep["slurm"]
        assert state(cluster, node) == (True, reason)
    assert "waits for a sweep" in check(cluster, tmp_path, "node2", "--site-config", str(s))[1]["slurm"]["why"]
    # A drain from before origins whose probe the check re-ran and passed is lifted.
    rc, rep, err = check(cluster, tmp_path, "node1", "--site-config", str(s))
    assert rc == 0 and rep["slurm"]["action"] == "resume", (rep, err)
    assert state(cluster, "node1") == (False, None)


@pytest.mark.timeout(180)
def test_foreign_reason_is_never_resumed_and_the_library_refuses(cluster, tmp_path):
    from clusterops.slurm import ForeignDrainError, Slurm

    s = site(tmp_path)
    admin_drain(cluster, "node2", "admin: swap DIMM B3")
    rc, rep, _ = check(cluster, tmp_path, "node2", "--site-config", str(s))
    assert rc == 0 and rep["slurm"]["action"] == "none" and "someone else" in rep["slurm"]["why"]
    assert state(cluster, "node2") == (True, "admin: swap DIMM B3")
    # The library itself refuses, for the whole request: node1 (ours) is not resumed either.
    slurm = Slurm.from_environment()
    slurm.drain("node1", drains.make_reason(drains.ADMIN, "test"))
    with pytest.raises(ForeignDrainError) as ei:
        slurm.resume(["node1", "node2"])
    assert "node2" in str(ei.value) and "admin: swap DIMM B3" in str(ei.value)
    assert state(cluster, "node2") == (True, "admin: swap DIMM B3")
    assert state(cluster, "node1")[0]
    # And so does the CLI, in one line, exit 1.
    r = subprocess.run([CLUSTEROPS, "slurm", "resume", "node2"], env=_env(cluster, tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "someone else" in r.stderr
    assert state(cluster, "node2") == (True, "admin: swap DIMM B3")
    # The administrator's lift of a clusterops drain works.
    r = subprocess.run([CLUSTEROPS, "slurm", "resume", "node1"], env=_env(cluster, tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not state(cluster, "node1")[0]


@pytest.mark.timeout(180)
def test_broken_profile_or_site_config_drains_nothing(cluster, tmp_path):
    # A profile value that makes a probe raise: status error, exit 4, the node stays in service.
    prof = tmp_path / "typo.yaml"
    prof.write_text(f"extends: fast\nprobes:\n  host.memory: {{meminfo_file: {tmp_path}/no-such-meminfo}}\n")
    for node in ("node1", "node2", "node3", "node4"):
        rc, rep, err = check(cluster, tmp_path, node, profile=str(prof), **{drains.FRACTION_ENV: "1"})
        assert rc == 4 and rep["status"] == "error" and rep["exit_code"] == 4, (rep, err)
        assert rep["slurm"]["action"] == "none" and "never drains" in rep["slurm"]["why"]
        assert len(err.strip().splitlines()) == 1 and "left in service (exit 4)" in err
        assert state(cluster, node) == (False, None)
    # A site config with a typo pushed to every node: exit 2, nothing run, nothing drained.
    bad = site(tmp_path, SITE.replace("profiles:", "profile:"))
    for node in ("node1", "node2", "node3", "node4"):
        with Broken(cluster, node):
            rc, rep, err = check(cluster, tmp_path, node, "--site-config", str(bad))
            assert rc == 2 and rep is None and len(err.strip().splitlines()) == 1, err
            assert state(cluster, node) == (False, None)


@pytest.mark.timeout(180)
def test_self_drain_guard_leaves_failing_node_in_service(cluster, tmp_path):
    from clusterops.slurm import Slurm

    s = site(tmp_path)
    slurm = Slurm.from_environment()
    slurm.drain("node1", drains.make_reason(drains.SWEEP, "host.paths", "earlier sweep"))
    with Broken(cluster, "node3"):
        # 1 of 4 nodes already drained by clusterops; max_drained_fraction 0.1 allows 1.
        rc, rep, err = check(cluster, tmp_path, "node3", "--site-config", str(s))
        assert rc == 3 and rep["status"] == "fail" and rep["exit_code"] == 3, (rep, err)
        assert rep["slurm"]["action"] == "refused" and rep["slurm"]["guard"]["drained"] == 1
        assert err.count("\n") == 1 and "fleet guard: NOT draining node3" in err
        assert state(cluster, "node3") == (False, None)
        # Through the HealthCheckProgram wrapper: the same exit code, the node still in service.
        env = _env(cluster, tmp_path, "node3", CLUSTEROPS=CLUSTEROPS, CLUSTEROPS_HEALTH_SITE=str(s),
                   SLURMD_NODENAME="node3", CLUSTEROPS_HEALTH_LOG=str(tmp_path / "hc.log"))
        r = subprocess.run([str(Path(__file__).resolve().parents[2] / "slurm" / "clusterops-healthcheck.sh")],
                           env=env, capture_output=True, text=True, timeout=90)
        assert r.returncode == 3 and "slurm: refused (fleet guard" in (tmp_path / "hc.log").read_text()
        assert state(cluster, "node3") == (False, None)
        # The site raises the limit: now it drains.
        s2 = site(tmp_path, SITE + "drain: {max_drained_fraction: 0.5}\n")
        rc, rep, err = check(cluster, tmp_path, "node3", "--site-config", str(s2))
        assert rc == 1 and rep["slurm"]["action"] == "drain", (rep, err)
        assert state(cluster, "node3")[0]


@pytest.mark.timeout(240)
def test_sweep_lifts_what_waits_for_it_and_keeps_deeper_or_admin_drains(cluster, tmp_path):
    prof = tmp_path / "sweeptest.yaml"
    prof.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                    "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}\", min_free_gb: 0.001}\n"
                    "  host.stray_processes: false\n")
    reasons = {
        "node1": drains.make_reason(drains.SUPERVISOR, "hang", "rank 0 stopped beating"),
        "node2": drains.make_reason(drains.HEALTH, "dcgm", "dcgm.diag: memory test failed", profile="deep"),
        "node3": drains.make_reason(drains.ADMIN, "swap DIMM B3"),
        "node4": drains.make_reason(drains.HEALTH, "host.paths", f"{SCRATCH_PROBE}: missing", profile="sweeptest"),
    }
    for node, reason in reasons.items():
        admin_drain(cluster, node, reason)
    r = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(prof), "--db", str(tmp_path / "sweep.db"),
                        "--timeout", "90", "--drain", "--json"], env=_env(cluster, tmp_path),
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr + r.stdout
    doc = json.loads(r.stdout)
    by = {a["node"]: a for a in doc["plan"]["actions"]}
    # The supervisor's drain waited for a sweep; the health drain was re-checked by its own profile.
    assert by["node1"]["action"] == "resume" and by["node4"]["action"] == "resume", by
    assert state(cluster, "node1") == (False, None) and state(cluster, "node4") == (False, None)
    # The deep DCGM drain was not re-checked by this profile: kept, with its reason.
    assert by["node2"]["action"] == "keep" and "deep" in by["node2"]["why"], by
    assert state(cluster, "node2") == (True, reasons["node2"])
    # An administrator's drain is not even rechecked.
    assert [n["status"] for n in doc["nodes"] if n["node"] == "node3"] == ["skipped"]
    assert state(cluster, "node3") == (True, reasons["node3"])


@pytest.mark.timeout(240)
def test_sweep_applies_the_partition_wide_guard_over_earlier_drains(cluster, tmp_path):
    """--max-drain-fraction allows this sweep's one drain, but the partition already carries
    one clusterops drain (an administrator's through clusterops) and the site's guard
    (0.1 of 4 nodes: 1) allows no second: nothing drained, exit 3, the banner says why."""
    prof = tmp_path / "sweeptest.yaml"
    prof.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                    "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}\", min_free_gb: 0.001}\n"
                    "  host.stray_processes: false\n")
    admin = drains.make_reason(drains.ADMIN, "swap DIMM B3")
    admin_drain(cluster, "node1", admin)
    with Broken(cluster, "node3"):
        r = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(prof), "--db", str(tmp_path / "sweep.db"),
                            "--timeout", "90", "--drain", "--max-drain-fraction", "0.5", "--json"],
                           env=_env(cluster, tmp_path), capture_output=True, text=True, timeout=200)
        assert r.returncode == 3, r.stderr + r.stdout
        doc = json.loads(r.stdout)
        by = {a["node"]: a for a in doc["plan"]["actions"]}
        assert by["node3"]["action"] == "untouched" and "fleet guard: NOT draining node3" in by["node3"]["why"], by
        assert doc["plan"]["guard_tripped"] and "SAFETY GUARD (partition)" in r.stderr
        assert state(cluster, "node3") == (False, None)
        assert state(cluster, "node1") == (True, admin)
        # The site allows more: the same sweep drains node3.
        r = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(prof), "--db", str(tmp_path / "sweep.db"),
                            "--timeout", "90", "--drain", "--max-drain-fraction", "0.5", "--json"],
                           env=_env(cluster, tmp_path, **{drains.FRACTION_ENV: "0.5"}), capture_output=True,
                           text=True, timeout=200)
        assert r.returncode == 1, r.stderr + r.stdout
        assert state(cluster, "node3")[0]
