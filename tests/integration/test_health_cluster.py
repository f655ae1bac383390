"""Health on the real dev cluster: the 4-node distributed test (gloo, srun one task per node)
with a rank that never answers, and --drain-on-fail draining/resuming a node made bad for real."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops.runner import free_port

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def _env(dc, **extra):
    return dict(os.environ, SLURM_CONF=str(dc.conf_path), **extra)


def _node(dc, name):
    out = subprocess.run(["scontrol", "show", "node", name, "--oneliner"], env=_env(dc),
                         capture_output=True, text=True, check=True).stdout
    state = out.split("State=")[1].split()[0]
    # The layer's reading of the reason: Slurm 24.11+ keep a resumed node's old reason.
    from clusterops.slurm.parse import node_from_oneliner

    return state, node_from_oneliner(out.strip().splitlines()[0]).reason or ""


def _await_report(proc, report, timeout_s):
    """Wait for rank 0's report (bounded), then end the srun; -> (report, seconds waited)."""
    t0 = time.monotonic()
    try:
        while not report.exists() and time.monotonic() - t0 < timeout_s + 40:
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        assert report.exists(), "rank 0 wrote no report"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return json.loads(report.read_text()), elapsed


def _dist_srun(dc, tmp_path, wrapper_body: str, timeout_s: float, sizes="--size 1M --size 4M --iters 5"):
    rdir = tmp_path / "results"
    report = tmp_path / "report.json"
    wrapper = tmp_path / "rank.sh"
    cmd = (f'{PY} -m clusterops health dist --result-dir {rdir} --timeout-s {timeout_s} '
           f'{sizes} --warmup 2 --report {report}')
    wrapper.write_text("#!/bin/sh\n" + wrapper_body.replace("@CMD@", cmd).replace("@RDIR@", str(rdir)) +
                       f"exec {cmd}\n")
    wrapper.chmod(0o755)
    port = free_port("127.0.0.1")
    argv = ["srun", "-N4", "--ntasks-per-node=1", "--time=3", f"--export=ALL,MASTER_ADDR=127.0.0.1,MASTER_PORT={port}",
            str(wrapper)]
    proc = subprocess.Popen(argv, env=_env(dc), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path), start_new_session=True)
    return proc, rdir, report


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_dist_and_allreduce_across_4_nodes(cluster, tmp_path):
    proc, rdir, report = _dist_srun(cluster, tmp_path, "", timeout_s=60)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    rep = json.loads(report.read_text())
    assert rep["status"] == "pass" and rep["world_size"] == 4
    assert [rep["ranks"][str(r)]["node"] for r in range(4)] == ["node1", "node2", "node3", "node4"]
    assert {d["backend"] for d in rep["ranks"].values()} == {"gloo"}
    sizes = {b["size_bytes"]: b for b in rep["bandwidth"]}
    assert set(sizes) == {1 << 20, 4 << 20}
    for b in sizes.values():
        assert b["correct"] and b["busbw_gbps"] == pytest.approx(b["algbw_gbps"] * 2 * 3 / 4, rel=1e-3)
    assert rep["busbw_gbps"] == sizes[4 << 20]["busbw_gbps"] > 0


@pytest.mark.integration
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["STOP", "KILL"])
def test_rank_that_never_answers_is_named(cluster, tmp_path, fault):
    timeout_s = 15
    # Rank 2 (node3) stops or is killed -9 for real before it joins the process group.
    proc, rdir, report = _dist_srun(cluster, tmp_path,
                                    f'if [ "$SLURM_PROCID" = 2 ]; then kill -{fault} $$; fi\n', timeout_s)
    rep, elapsed = _await_report(proc, report, timeout_s)
    assert rep["status"] == "fail"
    assert rep["missing"] == [2]
    assert "rank 2 (node3) did not answer" in rep["detail"]
    assert sorted(rep["failed"]) == [0, 1, 3]   # they timed out waiting for rank 2
    assert elapsed < timeout_s + 30  # its deadline + 5 s grace + start-up on a shared machine


def _write_profile(tmp_path) -> Path:
    p = tmp_path / "node-scratch.yaml"
    p.write_text("extends: fast\nprobes:\n  host.paths:\n    paths:\n"
                 "      - {path: \"${CLUSTEROPS_NODE_SCRATCH}\", min_free_gb: 0.01}\n"
                 "  host.stray_processes: false\n")
    return p


def _check_on_node_as_slurmd(dc, node, profile, tmp_path, *extra):
    """Run the HealthCheckProgram wrapper the way slurmd runs it on `node` (SLURMD_NODENAME set)."""
    env = _env(dc, SLURMD_NODENAME=node, CLUSTEROPS_NODE_SCRATCH=str(dc.scratch_dir(node)),
               CLUSTEROPS=str(Path(PY).parent / "clusterops"), CLUSTEROPS_HEALTH_PROFILE=str(profile),
               CLUSTEROPS_HEALTH_LOG=str(tmp_path / f"hc-{node}.log"), CLUSTEROPS_STATE_DIR=str(tmp_path),
               CLUSTEROPS_PROM_FILE=str(tmp_path / f"{node}.prom"))
    r = subprocess.run([str(REPO / "slurm" / "clusterops-healthcheck.sh"), *extra], env=env,
                       capture_output=True, text=True, timeout=90)
    return r.returncode, (tmp_path / f"hc-{node}.log").read_text()


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_drain_on_fail_drains_bad_node3_resumes_it_and_spares_admin_drain(cluster, tmp_path):
    profile = _write_profile(tmp_path)
    scratch3 = cluster.scratch_dir("node3")
    shutil.rmtree(scratch3)
    try:
        # The check runs inside a job pinned to node3 (its task env names node3's scratch).
        r = subprocess.run(["srun", "-w", "node3", "-N1", "-n1", "--time=2", PY, "-m", "clusterops", "health",
                            "check", "--profile", str(profile), "--drain-on-fail", "--json"],
                           env=_env(cluster, CLUSTEROPS_STATE_DIR=str(tmp_path)), capture_output=True,
                           text=True, timeout=90, cwd=str(tmp_path))
        assert r.returncode == 1, r.stderr
        rep = json.loads(r.stdout)
        assert rep["node"] == "node3" and rep["status"] == "fail"
        assert rep["slurm"]["action"] == "drain", rep["slurm"]
        state, reason = _node(cluster, "node3")
        assert "DRAIN" in state
        assert reason.startswith("clusterops:health:node-scratch: host.paths: host.path:${CLUSTEROPS_NODE_SCRATCH}: ")
        assert f"{scratch3} is missing" in reason
    finally:
        (scratch3 / "tmp").mkdir(parents=True, exist_ok=True)  # repair
    # Repaired: the next health check (as slurmd runs it) resumes node3.
    rc, log = _check_on_node_as_slurmd(cluster, "node3", profile, tmp_path)
    assert rc == 0, log
    assert "slurm: resume" in log
    state, reason = _node(cluster, "node3")
    assert "DRAIN" not in state and reason in ("", "none", "(null)")
    assert 'clusterops_health_status{node="node3",profile="node-scratch"} 0' in (tmp_path / "node3.prom").read_text()

    # An administrator drained node2 for another reason: never resumed, never relabelled.
    subprocess.run(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=admin: swap DIMM B3"],
                   env=_env(cluster), check=True)
    rc, log = _check_on_node_as_slurmd(cluster, "node2", profile, tmp_path)
    assert rc == 0 and "left alone" in log
    assert _node(cluster, "node2")[1] == "admin: swap DIMM B3"
    shutil.rmtree(cluster.scratch_dir("node2"))
    try:
        rc, log = _check_on_node_as_slurmd(cluster, "node2", profile, tmp_path)
        assert rc == 1 and "left alone" in log
        state, reason = _node(cluster, "node2")
        assert "DRAIN" in state and reason == "admin: swap DIMM B3"
    finally:
        (cluster.scratch_dir("node2") / "tmp").mkdir(parents=True, exist_ok=True)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_drain_never_blocks_on_unreachable_controller(devcluster, tmp_path):
    # A controller that accepts connections and never answers: a listening socket, no accept.
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(100)
    port = hang.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    lines = []
    for line in devcluster.conf_path.read_text().splitlines():
        if line.startswith("SlurmctldPort="):
            line = f"SlurmctldPort={port}"
        lines.append(line)
    conf.write_text("\n".join(lines) + "\n")
    profile = _write_profile(tmp_path)
    env = dict(os.environ, SLURM_CONF=str(conf), SLURMD_NODENAME="node1", CLUSTEROPS_STATE_DIR=str(tmp_path),
               CLUSTEROPS_NODE_SCRATCH=str(tmp_path / "gone"))
    t0 = time.monotonic()
    r = subprocess.run([PY, "-m", "clusterops", "health", "check", "--profile", str(profile), "--drain-on-fail",
                        "--drain-timeout-s", "3", "--json"], env=env, capture_output=True, text=True, timeout=40)
    elapsed = time.monotonic() - t0
    hang.close()
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["status"] == "fail"
    assert rep["slurm"]["action"] == "none" and not rep["slurm"]["ok"]
    # The 3 s bound cut the Slurm calls short (not scontrol's own, much longer, timeouts) ...
    assert "did not answer within 3s" in rep["slurm"]["why"], rep["slurm"]
    # ... and the process ended soon after (generous: this machine is shared with other test runs).
    assert elapsed < 25


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_stray_process_of_finished_job_is_found(cluster, tmp_path):
    # A job leaves a process behind for real (double fork + setsid escapes the job's tracking).
    pidfile = tmp_path / "stray.pid"
    r = subprocess.run(["srun", "-w", "node4", "-N1", "-n1", "--time=1", "sh", "-c",
                        f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 300' </dev/null >/dev/null 2>&1 &"],
                       env=_env(cluster), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    try:
        from clusterops.health.probes.base import ProbeContext
        from clusterops.health.probes.host import probe_stray_processes

        # node4's view: the job has ended, its sleep is still there.
        res = None
        for _ in range(20):
            res = probe_stray_processes({"status": "warn"}, ProbeContext(node="node4", env={}))[0]
            if res.status == "warn":
                break
            time.sleep(0.5)
        assert res.status == "warn", res
        assert pid in res.data["pids"] and "kill them" in res.detail
        # Another node does not see node4's processes as its own.
        other = probe_stray_processes({}, ProbeContext(node="node1", env={}))[0]
        assert pid not in (other.data or {}).get("pids", [])
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_rank_killed_mid_bandwidth_is_named_with_its_stage(cluster, tmp_path):
    timeout_s = 30
    # Rank 2 (node3) runs normally and is killed -9 once it is inside the bandwidth loop.
    body = ('if [ "$SLURM_PROCID" = 2 ]; then\n'
            '  @CMD@ &\n  pid=$!\n'
            '  while ! grep -q \'"stage": "bandwidth\' @RDIR@/rank2.json 2>/dev/null; do sleep 0.05; done\n'
            '  kill -9 $pid; exit 137\n'
            'fi\n')
    proc, rdir, report = _dist_srun(cluster, tmp_path, body, timeout_s, sizes="--size 64M --iters 200")
    rep, elapsed = _await_report(proc, report, timeout_s)
    assert rep["status"] == "fail" and rep["stuck"] == [2] and rep["missing"] == []
    assert "rank 2 (node3, pid " in rep["detail"] and "stopped answering at stage bandwidth 67108864B" in rep["detail"]
    # The survivors saw the peer go (a gloo connection error), not only their deadline.
    assert sorted(rep["failed"]) == [0, 1, 3]
    errors = [rep["ranks"][str(r)]["error"] for r in (0, 1, 3)]
    assert any("timed out" not in e for e in errors), errors
    assert elapsed < timeout_s + 30
