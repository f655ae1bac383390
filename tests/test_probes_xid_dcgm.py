"""XID classification and state, DCGM diag parsing: recorded real formats (tests/fixtures/xid, dcgm)."""

from __future__ import annotations

import json
import os
import stat
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


@pytest.mark.parametrize("name", ["runtime_error.json", "aborted.txt", "all_skipped.json"])
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
    ctx = _fake_dcgmi(tmp_path, "sleep 30\n")
    r = probe_dcgm({"level": 3, "dcgmi": str(tmp_path / "dcgmi"), "diag_timeout_s": 1}, ctx)[0]
    assert r.status == "fail" and "aborted" in r.detail
