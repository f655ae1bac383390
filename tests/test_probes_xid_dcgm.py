"""XID classification and state, DCGM diag parsing: recorded real formats (tests/fixtures/xid, dcgm)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes.dcgm import DiagAborted, parse_diag, probe_dcgm
from clusterops.health.probes.xid import XID_TABLE, ack, classify, parse_log, probe_xid

FIX = Path(__file__).parent / "fixtures"


# -- XID ------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,status,action", [
    (48, "fail", "reset"), (63, "warn", "reset"), (64, "fail", "RMA"), (74, "fail", "reset"),
    (79, "fail", "reboot"), (92, "warn", "watch"), (94, "warn", "reset"), (95, "fail", "reset"),
    (119, "fail", "reboot"), (120, "fail", "reboot"), (13, "warn", "check the job"),
    (31, "warn", "check the job"), (140, "fail", "reset"),
])
def test_xid_classification(code, status, action):
    s, a, _ = classify(code)
    assert (s, a) == (status, action)


def test_unknown_xid_is_warn():
    assert classify(9999)[0] == "warn" and 9999 not in XID_TABLE


def test_parse_dmesg_and_journal_lines():
    ev = parse_log((FIX / "xid" / "dmesg_mixed.log").read_text())
    assert [(e["code"], e["pci"]) for e in ev] == [(13, "0000:18:00"), (13, "0000:18:00"),
                                                    (63, "0000:5d:00"), (79, "0000:ab:00")]
    assert ev[-1]["ts"] == pytest.approx(8421.33719) and "fallen off the bus" in ev[-1]["message"]
    jev = parse_log((FIX / "xid" / "journal_monotonic.log").read_text())
    assert [e["code"] for e in jev] == [74, 45]


def _xid(tmp_path, log: Path, boot="boot-a"):
    bootf = tmp_path / "boot_id"
    bootf.write_text(boot + "\n")
    cfg = {"source": "file", "log_file": str(log), "boot_id_file": str(bootf),
           "state_file": str(tmp_path / "xid-state.json")}
    return probe_xid(cfg, ProbeContext(node="gpu001"))[0]


def test_xid_new_events_then_sticky_until_ack_or_reboot(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text((FIX / "xid" / "dmesg_mixed.log").read_text())
    first = _xid(tmp_path, log)
    assert first.status == "fail" and "Xid 79 on 0000:ab:00" in first.detail and "reboot the node" in first.detail
    # Same log, nothing new: the open Xid 79 keeps failing (the GPU was not fixed) ...
    again = _xid(tmp_path, log)
    assert again.status == "fail" and again.data["new_events"] == []
    # ... until acknowledged after a reset: old events then no longer count.
    assert ack(tmp_path / "xid-state.json") == 1
    assert _xid(tmp_path, log).status == "pass"
    # New events after the remembered position are seen; warn-class ones once only.
    log.write_text(log.read_text() + "[ 8999.000000] NVRM: Xid (PCI:0000:18:00): 92, pid=0, High single-bit ECC error rate.\n")
    w = _xid(tmp_path, log)
    assert w.status == "warn" and "Xid 92" in w.detail
    assert _xid(tmp_path, log).status == "pass"


def test_xid_reboot_clears_open_events(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text((FIX / "xid" / "dmesg_mixed.log").read_text())
    assert _xid(tmp_path, log, boot="boot-a").status == "fail"
    log.write_text("[    3.000000] Linux version 5.15.0\n")  # new boot, fresh ring buffer
    assert _xid(tmp_path, log, boot="boot-b").status == "pass"


def test_xid_worst_action_rma(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text((FIX / "xid" / "dmesg_later.log").read_text())
    r = _xid(tmp_path, log)
    assert r.status == "fail" and "RMA the GPU" in r.detail
    assert {e["code"] for e in r.data["open"]} == {48, 95, 74, 119, 64, 120}


def test_xid_unreadable_log_is_not_a_pass(tmp_path):
    cfg = {"source": "file", "log_file": str(tmp_path / "nope.log"), "state_file": str(tmp_path / "s.json")}
    r = probe_xid(cfg, ProbeContext(node="n1", gpus_required=True))[0]
    assert r.status == "warn" and "unreadable" in r.detail


def test_xid_reads_real_dmesg_through_runner(tmp_path):
    r = probe_xid({"source": "dmesg", "state_file": str(tmp_path / "s.json")}, ProbeContext(node="n1"))[0]
    assert r.status in ("pass", "skip") and json.loads((tmp_path / "s.json").read_text())["boot_id"]


# -- DCGM -----------------------------------------------------------------------------------

def _dcgm(name, **cfg):
    return probe_dcgm(dict(output_file=str(FIX / "dcgm" / name), level=2, **cfg), ProbeContext())[0]


def test_dcgm_pass_per_test_and_gpu():
    r = _dcgm("r2_pass_8gpu.json")
    assert r.status == "pass"
    rows = r.data["tests"]
    assert {(x["test"], x["gpus"]) for x in rows} >= {("PCIe", "3"), ("GPU Memory", "7")}


def test_dcgm_failure_names_test_and_gpu():
    r = _dcgm("r2_pcie_fail.json")
    assert r.status == "fail" and r.value == 1
    assert "PCIe on GPU 3" in r.detail and "replays" in r.detail


def test_dcgm4_shape_parses():
    assert _dcgm("r3_dcgm4_pass.json").status == "pass"


@pytest.mark.parametrize("name", ["runtime_error.json", "all_skipped.json"])
def test_dcgm_aborted_or_empty_is_fail_never_pass(name):
    r = _dcgm(name, exit_code=255)
    assert r.status == "fail"


def test_dcgm_unknown_status_counts_as_fail():
    rows = parse_diag(json.dumps({"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": [{"gpu_ids": "0", "status": "Bogus"}]}]}]}}))
    assert rows[0]["status"] == "fail"
    with pytest.raises(DiagAborted):
        parse_diag("Error: Unable to connect to host engine")


def test_dcgm_absent_skip_or_fail_when_required(tmp_path):
    ctx = ProbeContext(env={"PATH": str(tmp_path)})
    assert probe_dcgm({}, ctx)[0].status == "skip"
    assert probe_dcgm({"required": True}, ctx)[0].status == "fail"


def _fake_dcgmi(tmp_path, body: str) -> ProbeContext:
    # A real executable named dcgmi standing in for DCGM's CLI (the hardware boundary).
    exe = tmp_path / "dcgmi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return ProbeContext(env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})


def test_dcgm_runs_dcgmi_and_parses(tmp_path, monkeypatch):
    ctx = _fake_dcgmi(tmp_path, f'echo "args: $*" >&2\ncat {FIX / "dcgm" / "r2_pcie_fail.json"}\nexit 226\n')
    monkeypatch.setenv("PATH", ctx.env["PATH"])
    r = probe_dcgm({"level": 2, "dcgmi": str(tmp_path / "dcgmi")}, ctx)[0]
    assert r.status == "fail" and "PCIe on GPU 3" in r.detail


def test_dcgm_hung_diag_is_fail(tmp_path):
    # The engine answers, the diag hangs and the engine still answers after it: the GPU.
    ctx = _fake_dcgmi(tmp_path, '[ "$1" = diag ] && sleep 30\nexit 0\n')
    r = probe_dcgm({"level": 3, "dcgmi": str(tmp_path / "dcgmi"), "diag_timeout_s": 1}, ctx)[0]
    assert r.status == "fail" and "aborted" in r.detail


def test_diag_that_hangs_with_the_engine_is_an_error(tmp_path):
    # The first liveness query answers; then the engine wedges during the diag.
    flag = tmp_path / "asked"
    ctx = _fake_dcgmi(tmp_path, f'if [ "$1" = discovery ] && [ ! -e {flag} ]; then touch {flag}; exit 0; fi\n'
                                'sleep 30\n')
    res = probe_dcgm({"level": 3, "dcgmi": str(tmp_path / "dcgmi"), "diag_timeout_s": 1,
                      "hostengine_timeout_s": 1}, ctx)
    assert [(r.name, r.status) for r in res] == [("dcgm.hostengine", "error")]
    assert "dcgmi diag timed out and nv-hostengine did not answer" in res[0].detail


# -- files named in profiles: regular files only, read with a size bound (issue 18) ---------

# Each case runs in a child process with a time limit and an address-space cap: before the
# bound, a FIFO blocked the check forever and /dev/zero read until memory ran out.
_PROBE_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes import dcgm, host, xid
kind, cfg = sys.argv[1], json.loads(sys.argv[2])
probe = {"xid": xid.probe_xid, "dcgm": dcgm.probe_dcgm, "mounts": host.probe_mounts,
         "memory": host.probe_memory}[kind]
r = probe(cfg, ProbeContext(node="n1", gpus_required=True))[0]
print(json.dumps({"status": r.status, "detail": r.detail}))
"""


def _probe_in_child(kind: str, cfg: dict, timeout_s: float = 30) -> dict:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PROBE_CHILD, kind, json.dumps(cfg)],
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "named.fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "dir", "symlink-to-fifo"])
def test_xid_log_file_that_is_not_a_regular_file_is_refused_quickly(tmp_path, fifo, target):
    path = {"fifo": str(fifo), "/dev/zero": "/dev/zero", "dir": str(tmp_path)}.get(target)
    if target == "symlink-to-fifo":
        path = str(tmp_path / "kern.log")
        os.symlink(fifo, path)
    cfg = {"source": "file", "log_file": path, "state_file": str(tmp_path / "s.json")}
    r = _probe_in_child("xid", cfg)
    assert r["status"] == "warn" and "unreadable" in r["detail"], r
    assert ("is a FIFO" in r["detail"] or "is a device" in r["detail"] or "directory" in r["detail"]
            or "Is a directory" in r["detail"]), r


def test_xid_log_file_is_read_as_a_bounded_tail(tmp_path):
    from clusterops.health.probes import xid

    log = tmp_path / "kern.log"
    old = "[   10.000000] NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen off the bus.\n"
    filler = "[   20.000000] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"
    new = "[ 9000.000000] NVRM: Xid (PCI:0000:02:00): 48, pid=0, DBE (double bit error).\n"
    n = (xid.LOG_MAX_BYTES * 2) // len(filler) + 1
    with open(log, "w") as f:
        f.write(old)
        for _ in range(n):
            f.write(filler)
        f.write(new)
    assert log.stat().st_size > 2 * xid.LOG_MAX_BYTES
    r = _probe_in_child("xid", {"source": "file", "log_file": str(log), "state_file": str(tmp_path / "s.json"),
                                "boot_id_file": str(log)})
    # The newest event (at the end) is seen; the one before the last LOG_MAX_BYTES is not read.
    assert r["status"] == "fail" and "Xid 48 on 0000:02:00" in r["detail"] and "Xid 79" not in r["detail"], r


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_dcgm_output_file_fifo_or_device_is_an_error(tmp_path, fifo, target):
    path = str(fifo) if target == "fifo" else "/dev/zero"
    r = _probe_in_child("dcgm", {"output_file": path})
    assert r["status"] == "error" and "cannot read output_file" in r["detail"], r


@pytest.mark.parametrize("kind,key", [("mounts", "mounts_file"), ("memory", "meminfo_file")])
@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_host_files_fifo_or_device_is_an_error(tmp_path, fifo, kind, key, target):
    path = str(fifo) if target == "fifo" else "/dev/zero"
    r = _probe_in_child(kind, {key: path, "mounts": ["/"], "min_available_gb": 0})
    assert r["status"] == "error" and f"cannot read {path}" in r["detail"], r


def test_read_regular_bounds_and_kinds(tmp_path, fifo):
    from clusterops.fsutil import NotRegularFile, read_regular, read_regular_text

    f = tmp_path / "f.txt"
    f.write_bytes(b"line1\nline2\nline3\n")
    assert read_regular(f, 100) == (b"line1\nline2\nline3\n", False)
    assert read_regular(f, 5) == (b"line1", True)
    assert read_regular(f, 8, tail=True) == (b"2\nline3\n", True)
    assert read_regular_text(f, 8, tail=True) == "line3\n"     # the cut first line is dropped
    # A file that reports no size (procfs) is read through, keeping its end.
    data, cut = read_regular("/proc/self/status", 64, tail=True)
    assert len(data) == 64 and cut
    link = tmp_path / "link"
    os.symlink(f, link)
    assert read_regular(link, 100)[0].startswith(b"line1")
    with pytest.raises(OSError):
        read_regular(link, 100, follow_symlinks=False)
    for bad in (fifo, "/dev/zero", tmp_path):
        with pytest.raises(NotRegularFile) as e:
            read_regular(bad, 100)
        assert "not a regular file" in e.value.strerror


# -- DCGM health watches and the host engine's liveness (issue 22) ----------------------------

def _health(name, **cfg):
    return probe_dcgm(dict(output_file=str(FIX / "dcgm" / "r2_pass_8gpu.json"),
                           health_output_file=str(FIX / "dcgm" / name), **cfg), ProbeContext())


def test_dcgm_health_healthy_passes_beside_the_diag():
    res = _health("health_healthy.json")
    assert [(r.name, r.status) for r in res] == [("dcgm.health", "pass"), ("dcgm.diag", "pass")]


def test_dcgm_health_failure_names_gpu_and_system():
    r = _health("health_memory_failure.json")[0]
    assert r.status == "fail" and r.value == 1
    assert r.detail.startswith("GPU/3 Memory system: Volatile double-bit ECC error on GPU 3 (DBE count 2).")


def test_dcgm_health_warning_warns():
    r = _health("health_pcie_warning.json")[0]
    assert r.status == "warn" and "GPU/5 PCIe system: Detected more than 8 PCIe replays" in r.detail


def test_dcgm_health_without_a_report_is_an_error_never_a_pass():
    r = _health("health_watches_off.txt")[0]
    assert r.status == "error" and "Health watches not enabled" in r.detail


def test_recorded_diag_that_only_says_the_engine_is_unreachable_is_an_error():
    r = _dcgm("aborted.txt", exit_code=255)
    assert r.name == "dcgm.hostengine" and r.status == "error" and "restart the host engine" in r.detail


def test_hung_host_engine_is_an_error_and_no_diag_runs(tmp_path):
    # Every dcgmi call hangs (nv-hostengine wedged): the liveness query times out first.
    marker = tmp_path / "diag-ran"
    ctx = _fake_dcgmi(tmp_path, f'[ "$1" = diag ] && touch {marker}\nsleep 30\n')
    t0 = time.monotonic()
    res = probe_dcgm({"level": 3, "dcgmi": str(tmp_path / "dcgmi"), "hostengine_timeout_s": 1}, ctx)
    assert time.monotonic() - t0 < 10
    assert [(r.name, r.status) for r in res] == [("dcgm.hostengine", "error")]
    assert "did not answer `dcgmi discovery -l` within 1s" in res[0].detail and not marker.exists()


def test_engine_that_cannot_be_reached_is_an_error(tmp_path):
    ctx = _fake_dcgmi(tmp_path, f"cat {FIX / 'dcgm' / 'aborted.txt'} >&2\nexit 255\n")
    res = probe_dcgm({"level": 1, "dcgmi": str(tmp_path / "dcgmi")}, ctx)
    assert [(r.name, r.status) for r in res] == [("dcgm.hostengine", "error")]


def test_live_engine_runs_health_then_diag(tmp_path):
    log = tmp_path / "calls"
    body = (f'echo "$*" >> {log}\n'
            f'case "$1 $5" in "health -j") cat {FIX / "dcgm" / "health_pcie_warning.json"};;\n'
            f'  "diag "*) cat {FIX / "dcgm" / "r2_pass_8gpu.json"};; esac\n')
    ctx = _fake_dcgmi(tmp_path, body)
    res = probe_dcgm({"level": 2, "dcgmi": str(tmp_path / "dcgmi"), "health": True, "health_group": 2}, ctx)
    assert [(r.name, r.status) for r in res] == [("dcgm.health", "warn"), ("dcgm.diag", "pass")]
    assert log.read_text().splitlines() == ["discovery -l", "health -g 2 -s a", "health -g 2 -c -j", "diag -r 2 -j"]
