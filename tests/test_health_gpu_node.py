"""A GPU node that cannot be checked is not healthy; GPU expectations from Slurm's gres;
a Slurm job's processes on the GPUs are not strays (units: the host's /proc, /dev stood in
by a tree under tmp_path at the library boundary, NVML by the recorded stand-in)."""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.health import load_gpu_models
from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes.host import job_of_process
from clusterops.health.probes.nvml import local_gpu_evidence, probe_nvml
from clusterops.health.probes.nvml_standin import StandinNVML
from clusterops.slurm.gres import gpu_count

FIX = Path(__file__).parent / "fixtures" / "nvml"


class NoNVML:
    """What load_nvml sees when nvidia-ml-py is not installed: ctx.nvml None and no import."""


def _gpu_host(root: Path, n: int = 4, proc: bool = True, dev: bool = True) -> Path:
    if proc:
        for i in range(n):
            (root / "proc/driver/nvidia/gpus" / f"0000:{0x18 + i:02x}:00.0").mkdir(parents=True)
    if dev:
        (root / "dev").mkdir(parents=True, exist_ok=True)
        for name in [f"nvidia{i}" for i in range(n)] + ["nvidiactl", "nvidia-uvm"]:
            (root / "dev" / name).write_text("")
    return root


def _without_pynvml(monkeypatch):
    # The boundary: nvidia-ml-py missing from the environment (the `gpu` extra not installed).
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.mark.parametrize("proc,dev,expect", [
    (True, True, ["4 GPUs in /proc/driver/nvidia/gpus", "4 /dev/nvidiaN devices"]),
    (False, True, ["4 /dev/nvidiaN devices"]),
    (True, False, ["4 GPUs in /proc/driver/nvidia/gpus"]),
    (False, False, []),
])
def test_local_gpu_evidence(tmp_path, proc, dev, expect):
    assert local_gpu_evidence(str(_gpu_host(tmp_path, 4, proc, dev))) == expect


def test_gpu_node_without_pynvml_is_an_error_saying_what_to_install(tmp_path, monkeypatch):
    _without_pynvml(monkeypatch)
    ctx = ProbeContext(env={}, host_root=str(_gpu_host(tmp_path)))
    [r] = probe_nvml({}, ctx)
    assert r.status == "error"
    assert "this node has GPUs (4 GPUs in /proc/driver/nvidia/gpus; 4 /dev/nvidiaN devices)" in r.detail
    assert "pip install 'clusterops[gpu]' (nvidia-ml-py)" in r.detail


def test_cpu_node_without_pynvml_still_skips(tmp_path, monkeypatch):
    _without_pynvml(monkeypatch)
    [r] = probe_nvml({}, ProbeContext(env={}, host_root=str(tmp_path)))
    assert r.status == "skip"
    [r] = probe_nvml({"required": True}, ProbeContext(env={}, host_root=str(tmp_path)))
    assert r.status == "fail"


@pytest.mark.parametrize("init,words", [
    ("library_not_found", "libnvidia-ml.so.1 not found: install the NVIDIA driver's NVML library"),
    ("driver_not_loaded", "the NVIDIA kernel driver is not loaded: load it (modprobe nvidia)"),
])
def test_gpu_node_where_nvml_cannot_load_is_an_error(tmp_path, init, words):
    ctx = ProbeContext(env={}, nvml=StandinNVML({"init": init, "gpus": []}), host_root=str(_gpu_host(tmp_path)))
    [r] = probe_nvml({}, ctx)
    assert r.status == "error" and words in r.detail and "so no GPU was checked" in r.detail
    # The same library failure on a node with no GPU device is a skip, as before.
    ctx = ProbeContext(env={}, nvml=StandinNVML({"init": init, "gpus": []}), host_root=str(tmp_path / "cpu"))
    assert probe_nvml({}, ctx)[0].status == "skip"


def test_fast_check_on_gpu_node_without_pynvml_is_not_healthy(tmp_path):
    """End to end: the CLI in a fresh interpreter that cannot import pynvml, on a host whose
    /proc and /dev show GPUs: the report is `error`, never a silent pass."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "pynvml.py").write_text("raise ImportError('nvidia-ml-py not installed (test)')\n")
    root = _gpu_host(tmp_path / "host")
    env = dict(os.environ, PYTHONPATH=str(blocker), CLUSTEROPS_STATE_DIR=str(tmp_path),
               CLUSTEROPS_HOST_ROOT=str(root))
    env.pop("CLUSTEROPS_NVML_STANDIN", None)
    prof = tmp_path / "p.yaml"
    prof.write_text("extends: fast\nprobes:\n  host.stray_processes: false\n  xid: false\n")
    r = subprocess.run([sys.executable, "-m", "clusterops", "health", "check", "--profile", str(prof), "--json"],
                       capture_output=True, text=True, env=env)
    rep = json.loads(r.stdout)
    nv = [x for x in rep["results"] if x["name"] == "nvml"][0]
    assert nv["status"] == "error" and "pip install 'clusterops[gpu]'" in nv["detail"], nv
    assert rep["status"] == "error" and r.returncode != 0


@pytest.mark.parametrize("gres,n", [
    ("gpu:4", 4), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:4,gpu:v100:2", 6), ("gpu:8(S:0,1),nic:1", 8),
    ("gpu:h100:4(IDX:0-3)", 4), ("gpu", 1), ("gpu:h100", 1), ("nic:2", None), ("(null)", None), ("", None),
    (None, None), ("gpu:0", 0), ("mps:100,gpu:2", 2),
])
def test_gres_gpu_count(gres, n):
    assert gpu_count(gres) == n


def _h100(n: int, **gpu0) -> dict:
    d = json.loads((FIX / "h100_sxm_8gpu_idle.json").read_text())
    d["count"] = n
    d["gpus"] = {k: v for k, v in d["gpus"].items() if int(k) < n}
    d["gpus"]["0"].update(gpu0)
    return d


def _run(d, tmp_path, slurm_gpus, **cfg):
    asked = []

    def ask(node, timeout_s):
        asked.append((node, timeout_s))
        return slurm_gpus

    ctx = ProbeContext(env={}, nvml=StandinNVML(d), gpu_models=load_gpu_models({}), node="gpu017",
                       host_root=str(tmp_path), slurm_gpus=ask)
    return {r.name: r for r in probe_nvml(cfg, ctx)}, asked


def test_gpu_count_defaults_from_slurm_gres(tmp_path):
    res, asked = _run(_h100(7), tmp_path, 8)
    r = res["nvml.gpu_count"]
    assert r.status == "fail" and r.threshold == 8 and "7 GPUs visible, expected 8 (Slurm gres)" in r.detail
    assert asked == [("gpu017", 2.0)]
    res, _ = _run(_h100(8), tmp_path, 8)
    assert res["nvml.gpu_count"].status == "pass" and res["nvml.gpu_count"].data["expected_from"] == "Slurm gres"
    # The profile's count wins, and Slurm is not asked.
    res, asked = _run(_h100(7), tmp_path, 8, gpu_count=7)
    assert res["nvml.gpu_count"].status == "pass" and asked == []
    # Slurm unreachable or no gres: no expectation, as before.
    res, _ = _run(_h100(7), tmp_path, None)
    assert res["nvml.gpu_count"].status == "pass" and res["nvml.gpu_count"].threshold is None
    res, asked = _run(_h100(7), tmp_path, 8, gpus_from_slurm=False)
    assert res["nvml.gpu_count"].status == "pass" and asked == []


def test_zero_gpus_visible_on_a_node_whose_dev_shows_gpus_is_held_to_gres(tmp_path):
    root = _gpu_host(tmp_path, 8)
    res, asked = _run({"driver_version": "550.54.15", "gpus": []}, root, 8)
    assert res["nvml.gpu_count"].status == "fail" and "0 GPUs visible, expected 8" in res["nvml.gpu_count"].detail


def test_cpu_node_never_asks_slurm(tmp_path):
    res, asked = _run({"driver_version": "550.54.15", "gpus": []}, tmp_path, 8)
    assert asked == [] and res["nvml.gpu_count"].status == "pass"


def test_processes_of_a_slurm_job_are_not_strays(tmp_path):
    """Real processes: one with SLURM_JOB_ID in its environment (a job's task), one without."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    job = subprocess.Popen(["sleep", "60"], env=dict(env, SLURM_JOB_ID="4242"))
    stray = subprocess.Popen(["sleep", "60"], env=env)
    # The kernel closes the exec pipe (so Popen returns) before it has laid out the new
    # environment: wait until /proc shows it, as a real checker meets long-running tasks.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(
            Path(f"/proc/{p.pid}/environ").read_bytes() for p in (job, stray)):
        time.sleep(0.01)
    try:
        assert job_of_process(job.pid) == "4242" and job_of_process(stray.pid) is None
        busy = _h100(2, processes=[{"pid": job.pid, "used_bytes": 40 << 30}])
        res, _ = _run(busy, Path("/"), None)
        r = res["nvml.processes"]
        assert r.status == "pass" and r.data["job_processes"] == {str(job.pid): "4242"}
        both = _h100(2, processes=[{"pid": job.pid, "used_bytes": 1 << 30}, {"pid": stray.pid, "used_bytes": 1 << 30}])
        r = _run(both, Path("/"), None)[0]["nvml.processes"]
        assert r.status == "fail" and f"pids {stray.pid})" in r.detail and str(job.pid) not in r.detail
        assert "of no Slurm job" in r.detail
        r = _run(both, Path("/"), None, leftover_process_status="warn")[0]["nvml.processes"]
        assert r.status == "warn"
    finally:
        for p in (job, stray):
            p.kill()
            p.wait()


def test_job_of_process_follows_the_slurmstepd_ancestor(tmp_path):
    """A task that cleared its environment still belongs to the step it descends from."""
    proc = tmp_path / "proc"
    for pid, ppid, cmd, environ in [(500, 1, b"slurmstepd: [77.0]\0", b""),
                                    (501, 500, b"python\0train.py\0", b"HOME=/root\0"),
                                    (600, 1, b"python\0", b"HOME=/root\0")]:
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{pid} (x) S {ppid} 0 0")
        (d / "cmdline").write_bytes(cmd)
        (d / "environ").write_bytes(environ)
    assert job_of_process(501, str(proc)) == "77"
    assert job_of_process(600, str(proc)) is None
    assert job_of_process(999, str(proc)) is None
