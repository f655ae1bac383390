"""Busy nodes on the real dev cluster: a node running a Slurm job passes the fast check (the
job's process on the GPU is not a stray), a process started outside Slurm fails it, and the
GPU count is held to the node's Slurm gres (gpu:4 on every dev-cluster node).

Only the GPU is stood in (the recorded NVML stand-in lists which pids hold a GPU); the job,
its process, the stray process and the gres query are real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops.health.probes.host import find_job_processes
from clusterops.health.probes.nvml import slurm_gpu_count

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
PY = sys.executable


def _env(dc, **extra):
    return dict(os.environ, SLURM_CONF=str(dc.conf_path), **extra)


def _standin(tmp_path, n_gpus, holders):
    d = json.loads((FIX / "h100_sxm_8gpu_idle.json").read_text())
    d["count"] = n_gpus
    d["gpus"] = {k: v for k, v in d["gpus"].items() if int(k) < n_gpus}
    for i, pid in enumerate(holders):
        d["gpus"][str(i)]["processes"] = [{"pid": pid, "used_bytes": 20 << 30}]
    f = tmp_path / f"nvml-{n_gpus}-{len(holders)}.json"
    f.write_text(json.dumps(d))
    return f


def _check(dc, tmp_path, standin):
    prof = tmp_path / "busy.yaml"
    prof.write_text("extends: fast\nprobes:\n  xid: false\n")
    env = _env(dc, CLUSTEROPS_NVML_STANDIN=str(standin), CLUSTEROPS_STATE_DIR=str(tmp_path),
               SLURMD_NODENAME="node2")
    r = subprocess.run([PY, "-m", "clusterops", "health", "check", "--profile", str(prof), "--node", "node2",
                        "--json"], capture_output=True, text=True, env=env, timeout=60)
    rep = json.loads(r.stdout)
    return r.returncode, rep, {x["name"]: x for x in rep["results"]}


def _job_pid(job_id: str, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid, job in find_job_processes("node2").items():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if job == job_id and cmd.endswith(b"sleep"):
                return pid
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}'s sleep did not start on node2")


@pytest.mark.integration
def test_dev_cluster_gres_gives_4_gpus_per_node(cluster):
    assert slurm_gpu_count("node1", 5) == 4
    assert slurm_gpu_count("node4", 5) == 4


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_busy_node_passes_and_a_stray_gpu_process_fails(cluster, tmp_path):
    out = subprocess.run(["sbatch", "--parsable", "-w", "node2", "-N1", "--gpus-per-node=1", "--time=5",
                          f"--output={tmp_path}/job.out", "--wrap", "sleep 300"],
                         env=_env(cluster), capture_output=True, text=True, check=True, cwd=str(tmp_path))
    job_id = out.stdout.strip().split(";")[0]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    stray = subprocess.Popen(["sleep", "300"], env=clean)  # outside Slurm: no job
    try:
        job_pid = _job_pid(job_id)

        # The job's process holds GPU0: the node is busy, not broken.
        rc, rep, res = _check(cluster, tmp_path, _standin(tmp_path, 4, [job_pid]))
        assert res["nvml.processes"]["status"] == "pass", res["nvml.processes"]
        assert res["nvml.processes"]["data"]["job_processes"] == {str(job_pid): job_id}
        assert res["nvml.gpu_count"]["threshold"] == 4  # from Slurm: Gres=gpu:4
        assert res["nvml.gpu_count"]["data"]["expected_from"] == "Slurm gres"
        # The job is active, so its processes are not strays here either. (Other dev clusters on
        # this shared host also name their nodes node2; their jobs' leftovers may show up.)
        assert job_id not in (res["host.stray_processes"].get("data") or {}).get("jobs", [])
        assert res["host.stray_processes"]["status"] in ("pass", "warn")
        assert rc == 0 and rep["status"] in ("pass", "warn"), rep

        # A process started outside Slurm holds GPU1: a stray, the node fails.
        rc, rep, res = _check(cluster, tmp_path, _standin(tmp_path, 4, [job_pid, stray.pid]))
        r = res["nvml.processes"]
        assert r["status"] == "fail" and f"(pids {stray.pid})" in r["detail"] and "GPU1" in r["detail"]
        assert str(job_pid) not in r["detail"]
        assert rc == 1 and rep["status"] == "fail"

        # Three GPUs visible where Slurm schedules four: a GPU fell off.
        rc, rep, res = _check(cluster, tmp_path, _standin(tmp_path, 3, [job_pid]))
        assert res["nvml.gpu_count"]["status"] == "fail"
        assert "3 GPUs visible, expected 4 (Slurm gres)" in res["nvml.gpu_count"]["detail"]
        assert rc == 1
    finally:
        stray.kill()
        stray.wait()
        subprocess.run(["scancel", job_id], env=_env(cluster), capture_output=True, timeout=30)
