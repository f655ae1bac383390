"""The deadline runner and the host probes, for real: real dirs, a real full tmpfs, a missing mount."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from clusterops.health.probes.base import ProbeContext, ProbeResult, ProbeSpec, overall_status, run_probes, worst
from clusterops.health.probes.host import (expand, probe_cpus, probe_infiniband, probe_memory, probe_mounts,
                                    probe_paths, read_mounts)


# -- runner -----------------------------------------------------------------------------------

def test_blocking_probe_becomes_error_and_others_finish(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def blocks_in_kernel(cfg, ctx):
        open(fifo).read()  # open() of a FIFO with no writer blocks in the kernel
        return []

    release = threading.Event()

    def blocks_forever(cfg, ctx):
        release.wait()

    def fine(cfg, ctx):
        return [ProbeResult("fine", "pass", value=1)]

    t0 = time.monotonic()
    out = run_probes([ProbeSpec("fifo", blocks_in_kernel, timeout_s=1.0),
                      ProbeSpec("event", blocks_forever, timeout_s=1.5),
                      ProbeSpec("fine", fine, timeout_s=5),
                      ProbeSpec("heavy", fine, timeout_s=5, exclusive=True)], ProbeContext())
    elapsed = time.monotonic() - t0
    assert elapsed < 3.5
    assert [(r.name, r.status) for r in out.results] == [("fifo", "error"), ("event", "error"),
                                                         ("fine", "pass"), ("fine", "pass")]
    assert out.abandoned == ["fifo", "event"]
    assert overall_status(out.results) == "error"
    # Let the abandoned threads go (a writer on the FIFO, the event set).
    release.set()
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)


def test_probe_exception_is_error_not_crash():
    def boom(cfg, ctx):
        raise KeyError("gpu_count")

    out = run_probes([ProbeSpec("boom", boom, timeout_s=2)], ProbeContext())
    assert out.results[0].status == "error" and "KeyError" in out.results[0].detail


def test_status_folding_and_one_line_detail():
    assert worst(["pass", "skip", "warn"]) == "warn"
    assert overall_status([ProbeResult("a", "pass"), ProbeResult("b", "fail"), ProbeResult("c", "error")]) == "fail"
    assert overall_status([ProbeResult("a", "skip")]) == "pass"
    assert ProbeResult("a", "warn", detail="two\nlines").detail == "two lines"
    with pytest.raises(ValueError):
        ProbeResult("a", "ok")


# -- paths and mounts -----------------------------------------------------------------------

def test_expand_env_and_unset_variable():
    assert expand("${A}/x/$B", {"A": "/s", "B": "y"}) == "/s/x/y"
    with pytest.raises(ValueError):
        expand("${CLUSTEROPS_NODE_SCRATCH}/x", {})


def test_paths_real_dir_missing_dir_and_unset_var(tmp_path):
    ctx = ProbeContext(env={"SCR": str(tmp_path)})
    cfg = {"paths": [{"path": "${SCR}", "min_free_gb": 0.001, "min_free_inodes": 10},
                     {"path": "${SCR}/gone"}, {"path": "${NOT_SET}/x"},
                     {"path": "${SCR}", "min_free_gb": 10 ** 9}]}
    res = probe_paths(cfg, ctx)
    assert [r.status for r in res] == ["pass", "fail", "fail", "fail"]
    assert res[0].value > 0 and res[0].data["writable"] is True
    assert "gone is missing" in res[1].detail
    assert "NOT_SET is not set" in res[2].detail
    assert "GB free <" in res[3].detail


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=64", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount tmpfs (tests run as root on this machine): {r.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_fails_space_inodes_and_write(small_tmpfs):
    ctx = ProbeContext()
    cfg = {"paths": [{"path": str(small_tmpfs), "min_free_gb": 0.0005, "min_free_inodes": 5}],
           "mounts": [{"path": str(small_tmpfs), "fstype": "tmpfs"}]}
    assert [r.status for r in probe_paths(cfg, ctx)] == ["pass"]
    assert [r.status for r in probe_mounts(cfg, ctx)] == ["pass"]
    # Fill it up for real: data until ENOSPC, then inodes.
    with open(small_tmpfs / "fill", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    for i in range(100):
        try:
            (small_tmpfs / f"i{i}").touch()
        except OSError:
            break
    p = probe_paths(cfg, ctx)[0]
    assert p.status == "fail"
    assert "GB free" in p.detail and "inodes free" in p.detail and "not writable" in p.detail
    m = probe_mounts(cfg, ctx)[0]
    assert m.status == "fail" and "not writable" in m.detail


def test_missing_and_wrong_type_mount(tmp_path):
    ctx = ProbeContext()
    cfg = {"mounts": [{"path": str(tmp_path / "shared")}, {"path": "/proc", "fstype": "nfs4"},
                      {"path": "/proc", "writable": False}]}
    res = probe_mounts(cfg, ctx)
    assert [r.status for r in res] == ["fail", "fail", "pass"]
    assert "is not mounted" in res[0].detail and "expected nfs4" in res[1].detail


def test_read_mounts_decodes_escapes():
    t = read_mounts("srv:/x /mnt/with\\040space nfs4 rw 0 0\n")
    assert t["/mnt/with space"] == ("nfs4", "srv:/x")


def test_hung_mount_check_is_bounded(tmp_path):
    # A writability check that blocks (a FIFO named like the probe's file cannot be
    # faked portably); instead the child check's own timeout is exercised on a FIFO path:
    # statvfs works, the write target is a FIFO that blocks open() in the child.
    d = tmp_path / "m"
    d.mkdir()
    ctx = ProbeContext()
    from clusterops.health.probes import host

    orig = host._PATH_CHECK
    host._PATH_CHECK = orig.replace('f = os.path.join(p, f".clusterops-health-{os.getpid()}")',
                                    'f = os.path.join(p, "fifo"); os.mkfifo(f)')
    try:
        t0 = time.monotonic()
        r = probe_paths({"paths": [{"path": str(d)}], "path_timeout_s": 1}, ctx)[0]
    finally:
        host._PATH_CHECK = orig
    assert time.monotonic() - t0 < 5
    assert r.status == "fail" and "no answer within 1s" in r.detail


# -- memory, CPUs, InfiniBand ------------------------------------------------------------------

def test_memory_and_cpus_real():
    ctx = ProbeContext()
    assert probe_memory({"min_available_gb": 0.1}, ctx)[0].status == "pass"
    r = probe_memory({"min_available_gb": 10 ** 6}, ctx)[0]
    assert r.status == "fail" and "available" in r.detail
    assert probe_cpus({"min_cpus": 1}, ctx)[0].status == "pass"
    assert probe_cpus({"min_cpus": 4096}, ctx)[0].status == "fail"


def _ib_port(root: Path, dev: str, port: int, state: str, rate: str, phys="5: LinkUp", layer="InfiniBand"):
    p = root / dev / "ports" / str(port)
    p.mkdir(parents=True)
    (p / "state").write_text(state + "\n")
    (p / "phys_state").write_text(phys + "\n")
    (p / "rate").write_text(rate + "\n")
    (p / "link_layer").write_text(layer + "\n")


def test_infiniband_sysfs_layout(tmp_path):
    # /sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer} as the kernel writes them.
    ctx = ProbeContext()
    assert probe_infiniband({"sys_root": str(tmp_path / "none")}, ctx)[0].status == "skip"
    assert probe_infiniband({"sys_root": str(tmp_path / "none"), "required": True}, ctx)[0].status == "fail"
    root = tmp_path / "ib"
    _ib_port(root, "mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)")
    _ib_port(root, "mlx5_1", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)")
    _ib_port(root, "mlx5_2", 1, "4: ACTIVE", "25 Gb/sec (1X EDR)", layer="Ethernet")
    ok = probe_infiniband({"sys_root": str(root), "expected_rate_gbps": 400, "min_ports": 2}, ctx)[0]
    assert ok.status == "pass" and ok.value == 2
    _ib_port(root, "mlx5_3", 1, "1: DOWN", "10 Gb/sec (4X SDR)", phys="3: Disabled")
    _ib_port(root, "mlx5_4", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    bad = probe_infiniband({"sys_root": str(root), "expected_rate_gbps": 400}, ctx)[0]
    assert bad.status == "fail"
    assert "mlx5_3/1 DOWN" in bad.detail and "mlx5_4/1 at 200 Gb/sec (4X HDR) < 400" in bad.detail
