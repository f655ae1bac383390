"""`clusterops sweep` on the real dev cluster, running the real `clusterops health check`.

node3 is made bad for real: the test profile requires `${CLUSTEROPS_NODE_SCRATCH}` (set
per node by the dev cluster's task prolog) and the test deletes node3's scratch dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops.history import History
from clusterops.slurm import parse
from clusterops.sweep import NodeResult, SweepReport

pytestmark = pytest.mark.integration

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")

PROFILE = """\
# sweep tests: the fast profile plus the node's own scratch directory, required.
description: fast + the node's scratch dir (sweep tests)
extends: fast
probes:
  host.paths:
    paths:
      - {path: "${CLUSTEROPS_NODE_SCRATCH}", min_free_gb: 0.001, writable: true}
"""


@pytest.fixture
def profile(tmp_path):
    p = tmp_path / "sweeptest.yaml"
    p.write_text(PROFILE)
    return str(p)


def sweep(tmp_path, profile, *args, timeout=150):
    argv = [CLUSTEROPS, "sweep", "--profile", profile, "--db", str(tmp_path / "sweep.db"),
            "--timeout", "90", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def nodes_state(names=("node1", "node2", "node3", "node4")):
    """(state, reason) per node, straight from scontrol."""
    out = subprocess.run(["scontrol", "show", "node", "--oneliner", ",".join(names)],
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        name = re.search(r"NodeName=(\S+)", line).group(1)
        state = re.search(r"State=(\S+)", line).group(1)
        # The layer's reading of the reason: Slurm 24.11+ keep a resumed node's old reason.
        found[name] = (state, parse.node_from_oneliner(line).reason)
    return found


class BrokenScratch:
    """Delete a node's scratch dir for real; put it back afterwards."""

    def __init__(self, cluster, *nodes):
        self.dirs = [cluster.scratch_dir(n) for n in nodes]

    def __enter__(self):
        for d in self.dirs:
            shutil.move(str(d), str(d) + ".away")
        return self

    def repair(self):
        for d in self.dirs:
            if Path(str(d) + ".away").exists():
                shutil.move(str(d) + ".away", str(d))

    def __exit__(self, *exc):
        self.repair()


def busy_job(node="node4"):
    # --output: sbatch's default, slurm-<id>.out in the submitter's directory, would land in the checkout.
    jid = subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", "--job-name=busy", "--output=/dev/null",
                          "--wrap", "sleep 300"],
                         capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if st == "RUNNING":
            return jid
        time.sleep(0.3)
    raise AssertionError(f"busy job {jid} did not start")


@pytest.mark.timeout(240)
def test_sweep_drains_bad_skips_busy_leaves_admin_drain_then_resumes(cluster, tmp_path, profile):
    subprocess.run(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=admin: replacing fan"],
                   check=True)
    job = busy_job("node4")
    html, prom = tmp_path / "r.html", tmp_path / "m.prom"
    with BrokenScratch(cluster, "node3") as broken:
        out = sweep(tmp_path, profile, "--drain", "--json", "--report", str(html), "--prometheus", str(prom))
        assert out.returncode == 1, out.stderr
        doc = json.loads(out.stdout)
        by = {n["node"]: n for n in doc["nodes"]}
        assert by["node1"]["status"] in ("pass", "warn") and by["node1"]["probes"]
        assert by["node3"]["status"] == "fail" and by["node3"]["probe"].startswith("host.path")
        assert by["node2"]["status"] == "skipped" and "admin: replacing fan" in by["node2"]["detail"]
        assert by["node4"]["status"] == "skipped" and "busy" in by["node4"]["detail"]
        st = nodes_state()
        assert "DRAIN" in st["node3"][0] and st["node3"][1].startswith("clusterops:sweep: host.path")
        assert st["node2"] == ("IDLE+DRAIN", "admin: replacing fan")
        assert subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                              text=True).stdout.strip() == "RUNNING"     # never disturbed
        assert doc["applied"] == [{"node": "node3", "action": "drain", "reason": st["node3"][1]}]
        # The three outputs tell the same story.
        text = prom.read_text()
        assert 'clusterops_sweep_node_healthy{node="node3"} 0' in text
        assert 'clusterops_sweep_node_healthy{node="node1"} 1' in text
        assert 'clusterops_sweep_node_status{node="node4",status="skipped"} 1' in text
        assert 'clusterops_sweep_node_status{node="node2",status="skipped"} 1' in text
        assert 'clusterops_sweep_node_action{action="drain",node="node3"} 1' in text or \
            'clusterops_sweep_node_action{node="node3",action="drain"} 1' in text
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())   # atomic write, no leftovers
        page = html.read_text()
        for node, status in (("node1", by["node1"]["status"]), ("node2", "skipped"), ("node3", "fail"),
                             ("node4", "skipped")):
            assert f'data-node="{node}" data-status="{status}"' in page
        assert "<svg" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
        assert 'class="bar fail"' in page
        # Repaired: the next sweep rechecks node3 (inside a maintenance reservation) and resumes it.
        broken.repair()
        out = sweep(tmp_path, profile, "--drain", "--json")
        assert out.returncode == 0, out.stderr + out.stdout
        doc = json.loads(out.stdout)
        assert {"node": "node3", "action": "resume", "reason": ""} in doc["applied"]
        st = nodes_state()
        assert st["node3"][0] == "IDLE" and st["node3"][1] is None
        assert st["node2"] == ("IDLE+DRAIN", "admin: replacing fan")
        assert "No reservations" in subprocess.run(["scontrol", "show", "reservation"], capture_output=True,
                                                   text=True).stdout
    # History holds both sweeps for node3: fail, then pass.
    with History.open(tmp_path / "sweep.db") as h:
        first, second = [r.status for r in h.rows(node="node3", probe="check")]
        assert first == "fail" and second in ("pass", "warn")
    hist = subprocess.run([CLUSTEROPS, "health", "history", "node3", "--probe", "check", "--db",
                           str(tmp_path / "sweep.db"), "--json"], capture_output=True, text=True)
    assert hist.returncode == 0, hist.stderr
    assert [r["status"] for r in json.loads(hist.stdout)["rows"]] == [first, second]


@pytest.mark.timeout(180)
def test_guard_drains_none_when_three_of_four_fail(cluster, tmp_path, profile):
    before = nodes_state()
    with BrokenScratch(cluster, "node1", "node2", "node3"):
        # --max-running 2: at most two check jobs in flight, the others wait their turn.
        out = sweep(tmp_path, profile, "--drain", "--json", "--max-running", "2")
    assert out.returncode == 3, out.stderr
    assert "SAFETY GUARD" in out.stderr and "draining NONE" in out.stderr
    doc = json.loads(out.stdout)
    assert doc["plan"]["guard_tripped"] and doc["applied"] == []
    assert sum(1 for n in doc["nodes"] if n["status"] == "fail") == 3
    assert nodes_state() == before


@pytest.mark.timeout(180)
def test_dry_run_changes_nothing(cluster, tmp_path, profile):
    subprocess.run(["scontrol", "update", "NodeName=node4", "State=DRAIN",
                    "Reason=clusterops: host.paths: left from an earlier sweep"], check=True)
    before = nodes_state()
    with BrokenScratch(cluster, "node3"):
        out = sweep(tmp_path, profile, "--drain", "--dry-run")
    assert out.returncode == 1, out.stderr
    assert "would drain node3: clusterops:sweep: host.path" in out.stdout
    assert nodes_state() == before
    assert "No reservations" in subprocess.run(["scontrol", "show", "reservation"], capture_output=True,
                                               text=True).stdout


@pytest.mark.timeout(180)
def test_flapping_node_is_drained_although_it_passes(cluster, tmp_path, profile):
    # node3 failed two of its last three sweeps (history), and passes today.
    now = time.time()
    with History.open(tmp_path / "sweep.db") as h:
        for i, st in enumerate(["fail", "pass", "fail"]):
            r = {n: NodeResult(n, st if n == "node3" else "pass", probe="host.paths", detail="x")
                 for n in ("node1", "node2", "node3", "node4")}
            h.record(SweepReport(f"old{i}", now - 300 + i, now - 290 + i, {"via": "slurm"}, list(r), r, {}, None))
    out = sweep(tmp_path, profile, "--drain", "--flap-k", "2", "--flap-n", "5", "--json")
    doc = json.loads(out.stdout)
    assert {n["node"]: n["status"] for n in doc["nodes"]}["node3"] in ("pass", "warn")
    assert out.returncode == 0, out.stderr
    reason = nodes_state()["node3"][1]
    assert reason.startswith("clusterops:flapping: ") and "failed" in reason
    # Still flapping next time (2 failures in its last 5): kept drained, with the same kind of reason.
    out = sweep(tmp_path, profile, "--drain", "--flap-k", "2", "--flap-n", "5", "--json")
    doc = json.loads(out.stdout)
    assert {"node": "node3", "action": "keep", "reason": nodes_state()["node3"][1]} in doc["applied"]
    assert nodes_state()["node3"][1].startswith("clusterops:flapping: ")


@pytest.mark.timeout(180)
def test_node_that_never_answers_is_unreachable_and_its_job_cancelled(cluster, tmp_path, profile):
    cluster.kill_node("node4")          # slurmd gone; Slurm will not notice for ~10 s (SlurmdTimeout)
    t0 = time.monotonic()
    out = sweep(tmp_path, profile, "--nodes", "node[1,4]", "--json", "--timeout", "12")
    took = time.monotonic() - t0
    doc = json.loads(out.stdout)
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["node1"]["status"] in ("pass", "warn")
    assert by["node4"]["status"] == "unreachable", by["node4"]
    assert out.returncode == 1
    assert took < 60
    jid = by["node4"]["job_id"]
    state = subprocess.run(["squeue", "-h", "-j", str(jid), "-o", "%T"], capture_output=True,
                           text=True).stdout.strip()
    assert state in ("", "CANCELLED", "COMPLETING", "FAILED", "NODE_FAIL"), state   # not left behind
    text = subprocess.run([CLUSTEROPS, "sweep", "--help"], capture_output=True, text=True).stdout
    assert "unreachable" in text


@pytest.mark.timeout(60)
def test_second_sweep_exits_at_once_while_one_holds_the_lock(tmp_path):
    import fcntl

    db = tmp_path / "sweep.db"
    fd = os.open(str(db) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        out = subprocess.run([CLUSTEROPS, "sweep", "--nodes", "node1", "--db", str(db)], capture_output=True,
                             text=True, timeout=30)
        took = time.monotonic() - t0
    finally:
        os.close(fd)
    assert out.returncode == 4
    assert "another sweep is running" in out.stderr
    assert took < 10


def test_bad_input_is_exit_2(tmp_path):
    for args, word in ((["--partition", "debug", "--nodes", "node1"], "--partition"),
                       (["--max-drain-fraction", "2"], "--max-drain-fraction"),
                       (["--nodes", "node[1-"], "--nodes"),
                       (["--flap-k", "5", "--flap-n", "3"], "--flap-k")):
        out = subprocess.run([CLUSTEROPS, "sweep", "--db", str(tmp_path / "d.db"), *args], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 2, (args, out.stderr)
        assert word in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(180)
def test_pairs_run_a_two_node_allreduce_on_each_pair(cluster, tmp_path, profile):
    html = tmp_path / "r.html"
    out = sweep(tmp_path, profile, "--pairs", "--json", "--report", str(html), "--no-history")
    assert out.returncode == 0, out.stderr + out.stdout
    doc = json.loads(out.stdout)
    pairs = sorted(doc["pairs"], key=lambda p: p["nodes"])
    assert [p["nodes"] for p in pairs] == [["node1", "node2"], ["node3", "node4"]]
    for p in pairs:
        assert p["status"] == "pass", p
        assert p["busbw_gbps"] and p["busbw_gbps"] > 0
        # The ib_write_bw step ran on both nodes of the pair: no HCA here, so skip with the reason.
        ib = p["ib_write_bw"]
        assert ib["status"] == "skip" and "no HCA" in ib["detail"], ib
    text = html.read_text()
    assert "2-node all-reduce" in text and "ib_write_bw" in text and "no HCA" in text


@pytest.mark.timeout(180)
def test_sigterm_mid_sweep_leaves_nothing_behind(cluster, tmp_path):
    """systemd stops a sweep with SIGTERM: its check jobs are cancelled, the node it had
    resumed for a recheck is drained again with its reason, the reservation is gone."""
    import signal

    reason = "clusterops: host.path: left from an earlier sweep"
    subprocess.run(["scontrol", "update", "NodeName=node4", "State=DRAIN", f"Reason={reason}"], check=True)
    # preflight imports torch and runs a matmul: slow enough to be caught in flight.
    proc = subprocess.Popen([CLUSTEROPS, "sweep", "--profile", "preflight", "--drain", "--db",
                             str(tmp_path / "sweep.db"), "--timeout", "120", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    running = ""
    while time.monotonic() < deadline and "RUNNING" not in running:
        running = subprocess.run(["squeue", "-h", "--name=clusterops-sweep", "-o", "%T"], capture_output=True,
                                 text=True).stdout
        time.sleep(0.3)
    assert "RUNNING" in running
    assert "MAINT" in nodes_state()["node4"][0] or "RESERVED" in nodes_state()["node4"][0] \
        or nodes_state()["node4"][1] is None                 # resumed inside the reservation
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    left = subprocess.run(["squeue", "-h", "--name=clusterops-sweep", "-o", "%i %T"], capture_output=True,
                          text=True).stdout.split("\n")
    assert all(not ln.strip() or "COMPLETING" in ln or "CANCELLED" in ln for ln in left), left
    st = nodes_state()
    assert "DRAIN" in st["node4"][0] and st["node4"][1] == reason
    assert "No reservations" in subprocess.run(["scontrol", "show", "reservation"], capture_output=True,
                                               text=True).stdout
