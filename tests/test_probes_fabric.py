"""The fabric probe on recorded sysfs trees (tests/fixtures/fabric): ports, counter rises
kept between checks in the node's local state, link flaps in a window."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from clusterops.health import load_profile, probe_specs
from clusterops.health.probes import fabric, state as local_state
from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes.fabric import evaluate, parse_rate, probe_fabric, read_ports
from clusterops.schema import PROBE_SETTINGS

FIX = Path(__file__).parent / "fixtures" / "fabric"


def _cfg(tmp_path, **over):
    cfg = dict(load_profile("fast").probes["fabric"])
    cfg["state_file"] = str(tmp_path / "fabric-state.json")
    cfg.update(over)
    return cfg


def _run(tmp_path, tree, **over):
    res = probe_fabric(_cfg(tmp_path, sys_root=str(FIX / tree), **over), ProbeContext(node="n1"))
    return {r.name: r for r in res}


def test_parse_rate_kernel_formats():
    assert parse_rate("400 Gb/sec (4X NDR)") == (400.0, "4X", "NDR")
    assert parse_rate("200 Gb/sec (2X NDR)") == (200.0, "2X", "NDR")
    assert parse_rate("25 Gb/sec (1X EDR)") == (25.0, "1X", "EDR")
    assert parse_rate("56 Gb/sec (4X FDR)") == (56.0, "4X", "FDR")
    assert parse_rate("100 Gb/sec") == (100.0, None, None)
    assert parse_rate("") == (None, None, None)


def test_healthy_node_passes_and_records_a_baseline(tmp_path):
    # The RoCE port mlx5_4 is one of this node's rails only because the profile names it.
    first = _run(tmp_path, "healthy/t0", expected_rate_gbps=200, min_ports=5, ports=["mlx5_*/1"])
    assert first["fabric.ports"].status == "pass" and first["fabric.ports"].value == 5
    assert first["fabric.errors"].status == "pass" and "baseline" in first["fabric.errors"].detail
    assert first["fabric.flaps"].status == "pass"
    saved = json.loads((tmp_path / "fabric-state.json").read_text())
    assert saved["counters"]["mlx5_0/1"]["symbol_error"] == 3
    second = _run(tmp_path, "healthy/t1", expected_rate_gbps=200)
    assert second["fabric.errors"].status == "pass" and second["fabric.errors"].value == 2
    assert second["fabric.errors"].data["rises"] == {"mlx5_0/1:symbol_error": 2}


def test_the_ndr_rate_floor_fails_the_hdr_roce_port_only_where_it_is_named(tmp_path):
    r = _run(tmp_path, "healthy/t0", expected_rate_gbps=400, ports=["mlx5_*"])["fabric.ports"]
    assert r.status == "fail" and "mlx5_4/1 at 200 Gb/sec (4X HDR) < 400 Gb/sec" in r.detail
    r = _run(tmp_path, "healthy/t0", expected_rate_gbps=400, devices=["mlx5_*"])["fabric.ports"]
    assert r.status == "fail" and "mlx5_4/1 at 200 Gb/sec" in r.detail
    # Unnamed, the Ethernet port is not held to the InfiniBand floor (a 200 GbE NIC is no defect).
    r = _run(tmp_path, "healthy/t0", expected_rate_gbps=400)["fabric.ports"]
    assert r.status == "pass" and r.value == 4 and "only reported: mlx5_4/1 ACTIVE" in r.detail
    assert _run(tmp_path, "healthy/t0", expected_rate_gbps=400, ports=["mlx5_*"],
                link_layers=["InfiniBand"])["fabric.ports"].status == "pass"
    assert _run(tmp_path, "healthy/t0", expected_rate_gbps=400, devices=["mlx5_[0-3]"])["fabric.ports"].value == 4


def test_degraded_width_warns_against_its_siblings_and_fails_against_the_stated_width(tmp_path):
    r = _run(tmp_path, "degraded_width/t0")["fabric.ports"]
    assert r.status == "warn" and "mlx5_3/1 width 2X < 4X" in r.detail
    r = _run(tmp_path, "degraded_width/t0", expected_width="4X")["fabric.ports"]
    assert r.status == "fail" and "mlx5_3/1 width 2X < 4X (degraded link)" in r.detail
    assert r.data["mlx5_3/1"]["rate_gbps"] == 200.0


def test_a_port_down_fails(tmp_path):
    r = _run(tmp_path, "port_down/t0")["fabric.ports"]
    assert r.status == "fail" and "mlx5_1/1 DOWN" in r.detail and r.value == 3


# -- which ports are judged (issue 32): only those an expectation names ---------------------------

def _tree(tmp_path, base="healthy/t0", **ports):
    """A copy of a recorded tree with ports added, ``mlx5_5_1=("1: DOWN", "3: Disabled",
    "Ethernet")`` writing mlx5_5/ports/1 as the kernel does (rate of an untrained port)."""
    root = tmp_path / "sys"
    shutil.copytree(FIX / base, root)
    for key, (st, phys, layer) in ports.items():
        dev, _, num = key.rpartition("_")
        d = root / dev / "ports" / num
        (d / "counters").mkdir(parents=True, exist_ok=True)
        (root / dev / "node_type").write_text("1: CA\n")
        for name, text in (("state", st), ("phys_state", phys), ("link_layer", layer),
                           ("rate", "10 Gb/sec (4X SDR)" if "DOWN" in st else "400 Gb/sec (4X NDR)")):
            (d / name).write_text(text + "\n")
        for c in fabric.COUNTER_BITS:
            (d / "counters" / c).write_text("0\n")
    return root


def _check(tmp_path, root, **over):
    res = probe_fabric(_cfg(tmp_path, sys_root=str(root), **over), ProbeContext(node="n1"))
    return {r.name: r for r in res}


def test_an_unused_ethernet_port_down_beside_a_healthy_ib_rail_does_not_fail(tmp_path):
    # The fast profile as shipped, nothing named: four IB ports ACTIVE, the RoCE-capable
    # Ethernet NIC's second port (mlx5_5) down with no cable. host.infiniband passed this node.
    root = _tree(tmp_path, mlx5_5_1=("1: DOWN", "3: Disabled", "Ethernet"))
    res = _check(tmp_path, root)
    r = res["fabric.ports"]
    assert r.status in ("pass", "warn") and r.status != "fail"
    assert r.status == "warn" and "mlx5_5/1 DOWN (not judged" in r.detail
    assert "judged: mlx5_0/1, mlx5_1/1, mlx5_2/1, mlx5_3/1;" in r.detail
    assert "only reported: mlx5_4/1 ACTIVE, mlx5_5/1 DOWN" in r.detail
    assert r.data["mlx5_5/1"]["judged"] is False and r.data["mlx5_0/1"]["judged"] is True
    assert all(x.status != "fail" for x in res.values())
    # Once the site names its ports, the unnamed one is only reported: no warning at all.
    r = _check(tmp_path, root, ports=["mlx5_[0-3]/1"])["fabric.ports"]
    assert r.status == "pass" and "only reported: mlx5_4/1 ACTIVE, mlx5_5/1 DOWN" in r.detail
    # The same with devices: the Ethernet NIC is left out.
    r = _check(tmp_path, root, devices=["mlx5_[0-3]"])["fabric.ports"]
    assert r.status == "pass" and r.value == 4


def test_the_same_ethernet_port_named_by_the_site_fails(tmp_path):
    root = _tree(tmp_path, mlx5_5_1=("1: DOWN", "3: Disabled", "Ethernet"))
    # Named by the profile's ports (RoCE use named) ...
    r = _check(tmp_path, root, ports=["mlx5_[0-3]/1", "mlx5_5/1"])["fabric.ports"]
    assert r.status == "fail" and "mlx5_5/1 DOWN" in r.detail and "judged: mlx5_0/1" in r.detail
    assert "mlx5_5/1" in r.detail.split("[judged:")[1].split(";")[0]
    # ... or through a site config over the fast profile, as a site writes it.
    site = tmp_path / "site.yaml"
    site.write_text("profiles:\n  fast:\n    probes:\n      fabric:\n"
                    "        ports: [\"mlx5_[0-3]/1\", mlx5_5/1]\n")
    cfg = dict(load_profile("fast", str(site)).probes["fabric"], sys_root=str(root),
               state_file=str(tmp_path / "s2.json"))
    r = {x.name: x for x in probe_fabric(cfg, ProbeContext(node="n1"))}["fabric.ports"]
    assert r.status == "fail" and "mlx5_5/1 DOWN" in r.detail


def test_an_expected_ib_port_down_still_fails(tmp_path):
    # By default (InfiniBand ports are expected) and when the profile names it.
    assert _run(tmp_path, "port_down/t0")["fabric.ports"].status == "fail"
    r = _run(tmp_path, "port_down/t0", ports=["mlx5_[0-3]/1"])["fabric.ports"]
    assert r.status == "fail" and "mlx5_1/1 DOWN" in r.detail
    # A second, uncabled port of an IB card that the site's ports leave out is only reported.
    root = _tree(tmp_path, mlx5_0_2=("1: DOWN", "2: Polling", "InfiniBand"))
    assert _check(tmp_path, root)["fabric.ports"].status == "fail"      # nothing named: IB is expected
    r = _check(tmp_path, root, ports=["mlx5_*/1"])["fabric.ports"]
    assert r.status == "pass" and "only reported: mlx5_0/2 DOWN" in r.detail


def test_a_named_port_that_is_not_there_fails(tmp_path):
    r = _run(tmp_path, "healthy/t0", ports=["mlx5_[0-3]/1", "mlx5_7/1"])["fabric.ports"]
    assert r.status == "fail" and "expected port mlx5_7/1 not found" in r.detail
    r = _run(tmp_path, "absent", ports=["mlx5_0/1"])["fabric.ports"]
    assert r.status == "fail"


def test_a_node_with_only_unnamed_ethernet_ports_skips_and_required_fails(tmp_path):
    root = tmp_path / "eth"
    shutil.copytree(FIX / "healthy" / "t0" / "mlx5_4", root / "mlx5_4")
    r = _check(tmp_path, root)["fabric.ports"]
    assert r.status == "skip" and "no port judged" in r.detail and "mlx5_4/1 ACTIVE" in r.detail
    assert _check(tmp_path, root, required=True)["fabric.ports"].status == "fail"


def test_flapping_link_warns_then_fails_at_five_in_the_window(tmp_path):
    _run(tmp_path, "flapping/t0")
    r = _run(tmp_path, "flapping/t1")
    assert r["fabric.flaps"].status == "warn" and r["fabric.flaps"].value == 3
    assert "mlx5_2/1 x3" in r["fabric.flaps"].detail
    # link_error_recovery rose by 3 too: warn >= 1, fail >= 10
    assert r["fabric.errors"].status == "warn" and "link_error_recovery +3" in r["fabric.errors"].detail
    r = _run(tmp_path, "flapping/t2")
    assert r["fabric.flaps"].status == "fail" and r["fabric.flaps"].value == 5
    # The next check sees no new flap but the window still holds five: the node stays failing.
    r = _run(tmp_path, "flapping/t2")
    assert r["fabric.flaps"].status == "fail" and r["fabric.flaps"].value == 5


def test_flaps_leave_the_window(tmp_path):
    ports = read_ports(FIX / "flapping" / "t2")
    cfg = _cfg(tmp_path)
    now = 1_000_000.0
    saved = {"counters": {p["port"]: dict(p["counters"]) for p in ports},
             "events": [{"t": now - 25 * 3600, "port": "mlx5_2/1", "counter": "link_downed", "rise": 9},
                        {"t": now - 3600, "port": "mlx5_2/1", "counter": "link_downed", "rise": 2}]}
    res = {r.name: r for r in evaluate(ports, saved, cfg, now)}
    assert res["fabric.flaps"].value == 2 and res["fabric.flaps"].status == "warn"
    assert len(saved["events"]) == 1    # the old event is gone from the state too
    res = {r.name: r for r in evaluate(ports, saved, dict(cfg, window_h=0.5), now)}
    assert res["fabric.flaps"].status == "pass"


def test_counters_rising_fail_and_name_the_port(tmp_path):
    _run(tmp_path, "counters_rising/t0")
    r = _run(tmp_path, "counters_rising/t1")["fabric.errors"]
    assert r.status == "fail" and r.value == 1643
    assert "symbol_error +1600 in 24 h (most on mlx5_1/1) >= 1000" in r.detail
    assert r.data["rises"] == {"mlx5_1/1:port_rcv_errors": 43, "mlx5_1/1:symbol_error": 1600}


def test_a_saturated_counter_warns(tmp_path):
    r = _run(tmp_path, "counters_rising/t2_saturated")["fabric.errors"]
    assert r.status == "warn" and "saturated" in r.detail and "mlx5_1/1 symbol_error" in r.detail


def test_a_reset_counter_counts_its_value_as_the_rise(tmp_path):
    ports = read_ports(FIX / "counters_rising" / "t0")
    saved = {"counters": {"mlx5_1/1": {"symbol_error": 5000, "port_rcv_errors": 2}}, "events": []}
    res = {r.name: r for r in evaluate(ports, saved, _cfg(tmp_path), 10.0)}
    assert res["fabric.errors"].data["rises"] == {"mlx5_1/1:symbol_error": 120}


def test_no_sysfs_skips_and_required_fails(tmp_path):
    assert _run(tmp_path, "absent")["fabric.ports"].status == "skip"
    r = _run(tmp_path, "absent", required=True)["fabric.ports"]
    assert r.status == "fail" and "check the HCA driver" in r.detail


def test_unwritable_state_is_an_error_beside_the_port_verdict(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = probe_fabric(_cfg(tmp_path, sys_root=str(FIX / "healthy" / "t0"), state_file=str(blocker / "s.json")),
                       ProbeContext(node="n1"))
    assert [r.status for r in res] == ["pass", "error"]
    assert "CLUSTEROPS_STATE_DIR" in res[1].detail


def test_a_truncated_or_foreign_state_file_is_a_fresh_baseline(tmp_path):
    (tmp_path / "fabric-state.json").write_text('{"counters": {"mlx5_0/1": ')
    assert "baseline" in _run(tmp_path, "healthy/t0")["fabric.errors"].detail
    (tmp_path / "fabric-state.json").write_text("[1, 2]")
    assert "baseline" in _run(tmp_path, "healthy/t0")["fabric.errors"].detail


def test_concurrent_checks_of_one_node_keep_every_rise(tmp_path):
    # Two checks at the same second (HealthCheckProgram and a preflight): the state file's
    # lock serialises them, so the rise recorded by one is not lost by the other's write.
    path = tmp_path / "s.json"
    local_state.save_state(path, {"n": 0})
    barrier = threading.Barrier(8)

    def bump():
        barrier.wait()
        for _ in range(25):
            local_state.update(path, lambda s: s.__setitem__("n", s["n"] + 1))

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert local_state.load_state(path)["n"] == 200


def test_the_live_sysfs_of_this_machine(tmp_path):
    # The real tree: on this machine there is no HCA (skip, with the reason); on a node with
    # one, the ports are read for real.
    res = probe_fabric(_cfg(tmp_path, sys_root="/sys/class/infiniband"), ProbeContext(node="n1"))
    if not Path("/sys/class/infiniband").is_dir() or not any(Path("/sys/class/infiniband").iterdir()):
        assert [r.status for r in res] == ["skip"] and "no InfiniBand/RoCE ports" in res[0].detail
    else:
        assert res[0].name == "fabric.ports" and res[0].status in ("pass", "warn", "fail")


def test_schema_counter_names_are_the_probes():
    counters = [f for f in PROBE_SETTINGS["fabric"] if f.name == "counters"][0]
    assert {f.name for f in counters.fields} == set(fabric.COUNTER_BITS) - {fabric.FLAP_COUNTER}


def test_fast_profile_runs_the_fabric_probe_not_the_old_port_check():
    names = [s.name for s in probe_specs(load_profile("fast"))]
    assert "fabric" in names and "host.infiniband" not in names


def test_profile_refuses_a_misspelt_counter(tmp_path):
    from clusterops.errors import InputError
    from clusterops.health import check_file

    p = tmp_path / "site.yaml"
    p.write_text("extends: fast\nprobes:\n  fabric:\n    counters:\n      symbol_errors: {warn: 1}\n")
    with pytest.raises(InputError) as e:
        check_file(str(p))
    assert "site.yaml:5: probes.fabric.counters.symbol_errors" in str(e.value)
