"""NVML probe rules, through the pynvml stand-in fed with recorded values (tests/fixtures/nvml)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pynvml
import pytest

from clusterops.health import load_gpu_models
from clusterops.health.probes.base import ProbeContext, ProbeSpec, run_probes
from clusterops.health.probes.nvml import probe_nvml
from clusterops.health.probes.nvml_standin import StandinNVML

FIX = Path(__file__).parent / "fixtures" / "nvml"


def doc(name: str, **gpu_overrides) -> dict:
    d = json.loads((FIX / name).read_text())
    for idx, over in gpu_overrides.items():
        d["gpus"].setdefault(idx.lstrip("g"), {}).update(over)
    return d


def run(d: dict, **cfg) -> dict:
    ctx = ProbeContext(nvml=StandinNVML(d), gpu_models=load_gpu_models({}))
    return {r.name: r for r in probe_nvml(cfg, ctx)}


def test_healthy_h100_node_passes_every_rule():
    res = run(doc("h100_sxm_8gpu_idle.json"), gpu_count=8)
    assert res["nvml.gpu_count"].status == "pass" and res["nvml.gpu_count"].value == 8
    for name in ("nvml.ecc", "nvml.row_remap", "nvml.sram", "nvml.temperature", "nvml.clocks",
                 "nvml.pcie", "nvml.nvlink", "nvml.persistence", "nvml.processes", "nvml.driver"):
        assert res[name].status == "pass", (name, res[name])
    assert res["nvml.nvlink"].value == 18
    assert res["nvml.gpu_count"].data["gpus"][0]["model"] == "H100"


def test_gpu_count_below_profile_fails():
    res = run(doc("h100_sxm_8gpu_idle.json"), gpu_count=9)
    assert res["nvml.gpu_count"].status == "fail"
    assert "8 GPUs visible, expected 9" in res["nvml.gpu_count"].detail


def test_volatile_uncorrectable_ecc_fails_and_names_gpu():
    d = doc("h100_sxm_8gpu_idle.json", g3={"ecc": {"volatile": 2, "aggregate": 2}})
    r = run(d)["nvml.ecc"]
    assert r.status == "fail" and r.value == 2
    assert "GPU3 (00000000:5D:00.0)" in r.detail and "reset the GPU" in r.detail


def test_aggregate_only_ecc_warns():
    r = run(doc("h100_sxm_8gpu_idle.json", g1={"ecc": {"volatile": 0, "aggregate": 5}}))["nvml.ecc"]
    assert r.status == "warn" and "lifetime" in r.detail


def test_ecc_not_supported_is_skip():
    d = doc("h100_sxm_8gpu_idle.json")
    d["template"]["ecc"] = {"volatile": "not_supported", "aggregate": "not_supported"}
    assert run(d)["nvml.ecc"].status == "skip"


def test_remapped_rows_pending_fails_with_reset_action():
    r = run(doc("a100_sxm_8gpu_busy.json", g2={"remapped_rows": [0, 1, 1, 0]}))["nvml.row_remap"]
    assert r.status == "fail" and "reset the GPU" in r.detail and "GPU2" in r.detail


def test_remap_failure_means_rma():
    r = run(doc("a100_sxm_8gpu_busy.json", g6={"remapped_rows": [3, 9, 0, 1]}))["nvml.row_remap"]
    assert r.status == "fail" and "RMA" in r.detail


def test_pre_ampere_uses_retired_pages_pending():
    ok = run(doc("v100_sxm2_4gpu.json"))["nvml.row_remap"]
    assert ok.status == "pass"
    bad = run(doc("v100_sxm2_4gpu.json", g0={"retired_pages_pending": 1}))["nvml.row_remap"]
    assert bad.status == "fail" and "retired pages pending" in bad.detail


def test_sram_uncorrectable_fails_and_not_supported_skips():
    assert run(doc("h100_sxm_8gpu_idle.json", g4={"sram_uncorrected": 1}))["nvml.sram"].status == "fail"
    assert run(doc("v100_sxm2_4gpu.json"))["nvml.sram"].status == "skip"


@pytest.mark.parametrize("temp,status", [(84, "pass"), (86, "warn"), (96, "fail")])
def test_temperature_thresholds(temp, status):
    r = run(doc("h100_sxm_8gpu_idle.json", g5={"temperature_c": temp}),
            temperature_warn_c=85, temperature_fail_c=95)["nvml.temperature"]
    assert r.status == status and r.value == max(temp, 34)


@pytest.mark.parametrize("bits,status,text", [
    (0x1 | 0x4, "pass", ""),                  # idle + SW power cap: normal
    (0x20, "warn", "SW thermal"),
    (0x8, "fail", "HW slowdown"),
    (0x8 | 0x40, "fail", "HW thermal slowdown"),
    (0x8 | 0x80, "fail", "HW power brake"),
])
def test_clock_event_reasons(bits, status, text):
    r = run(doc("a100_sxm_8gpu_busy.json", g7={"clock_event_reasons": bits}))["nvml.clocks"]
    assert r.status == status
    assert text in r.detail


def test_pcie_width_drop_fails_even_at_idle():
    d = doc("h100_sxm_8gpu_idle.json", g2={"pcie": {"gen": 1, "max_gen": 5, "width": 8, "max_width": 16}})
    r = run(d)["nvml.pcie"]
    assert r.status == "fail" and "x8 < x16" in r.detail


def test_pcie_gen_drop_at_idle_is_not_a_fault_but_under_load_it_is():
    idle = run(doc("h100_sxm_8gpu_idle.json"))["nvml.pcie"]  # gen1 of 5 at 0% util
    assert idle.status == "pass"
    busy = run(doc("a100_sxm_8gpu_busy.json", g1={"pcie": {"gen": 3, "max_gen": 4, "width": 16, "max_width": 16}}))
    assert busy["nvml.pcie"].status == "fail" and "gen3 < gen4" in busy["nvml.pcie"].detail


def test_nvlink_inactive_link_fails():
    d = doc("h100_sxm_8gpu_idle.json", g0={"nvlink": {"links": 18, "inactive": [4, 11], "errors": {}}})
    r = run(d)["nvml.nvlink"]
    assert r.status == "fail" and "links 4,11 inactive" in r.detail


def test_nvlink_fewer_links_than_model_fails():
    d = doc("a100_sxm_8gpu_busy.json", g3={"nvlink": {"links": 10, "inactive": [], "errors": {}}})
    r = run(d)["nvml.nvlink"]
    assert r.status == "fail" and "10 NVLink links < 12" in r.detail


def test_nvlink_error_counters():
    ok = run(doc("a100_sxm_8gpu_busy.json"))["nvml.nvlink"]  # a few replays: fine
    assert ok.status == "pass"
    rec = run(doc("a100_sxm_8gpu_busy.json", g5={"nvlink": {"links": 12, "inactive": [],
                                                            "errors": {"2": {"recovery": 3}}}}))
    assert rec["nvml.nvlink"].status == "fail" and "recovery" in rec["nvml.nvlink"].detail
    crc = run(doc("a100_sxm_8gpu_busy.json", g5={"nvlink": {"links": 12, "inactive": [],
                                                            "errors": {"2": {"crc_flit": 5000}}}}))
    assert crc["nvml.nvlink"].status == "warn"


def test_pcie_card_without_nvlink_skips_and_persistence_off_warns():
    res = run(doc("l4_pcie_1gpu.json"))
    assert res["nvml.nvlink"].status == "skip"
    assert res["nvml.persistence"].status == "warn"
    assert "nvidia-persistenced" in res["nvml.persistence"].detail
    assert run(doc("l4_pcie_1gpu.json"), persistence_required=True)["nvml.persistence"].status == "fail"


def test_driver_version_against_profile():
    res = run(doc("a100_sxm_8gpu_busy.json"), driver={"min": "535.104"})
    assert res["nvml.driver"].status == "pass"
    old = run(doc("v100_sxm2_4gpu.json"), driver={"min": "535.104"})["nvml.driver"]
    assert old.status == "fail" and "470.223.02 older than 535.104" in old.detail
    pin = run(doc("h100_sxm_8gpu_idle.json"), driver={"exact": "550.90.07"})["nvml.driver"]
    assert pin.status == "fail"


def test_leftover_compute_processes_fail():
    d = doc("h100_sxm_8gpu_idle.json", g6={"processes": [{"pid": 31337, "used_bytes": 40 << 30}]})
    r = run(d)["nvml.processes"]
    assert r.status == "fail" and "31337" in r.detail and "GPU6" in r.detail


def test_gpu_lost_during_read_fails_the_node():
    d = doc("h100_sxm_8gpu_idle.json", g3={"temperature_c": "gpu_lost"})
    res = run(d)
    assert res["nvml.gpu_lost"].status == "fail" and "GPU3" in res["nvml.gpu_lost"].detail


def test_no_driver_is_skip_unless_gpus_required():
    d = {"init": "driver_not_loaded", "gpus": []}
    assert run(d)["nvml"].status == "skip"
    assert run(d, required=True)["nvml"].status == "fail"


def test_errors_are_real_pynvml_classes():
    nv = StandinNVML(doc("v100_sxm2_4gpu.json"))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetRemappedRows(0)


def test_hung_nvml_call_becomes_error_within_its_timeout():
    d = doc("h100_sxm_8gpu_idle.json", g2={"temperature_c": "hang"})
    ctx = ProbeContext(nvml=StandinNVML(d), gpu_models=load_gpu_models({}))
    t0 = time.monotonic()
    out = run_probes([ProbeSpec("nvml", probe_nvml, {}, timeout_s=1.0),
                      ProbeSpec("other", lambda c, x: [], {}, timeout_s=1.0)], ctx)
    assert time.monotonic() - t0 < 3
    assert [r.status for r in out.results] == ["error"]
    assert out.abandoned == ["nvml"] and "did not finish within 1s" in out.results[0].detail


# -- driver 570+: NVML's recovery action, clocks, slowdown counters, versions ----------------

R570 = "h100_sxm_8gpu_driver570.json"


def run_state(d: dict, tmp_path, **cfg) -> dict:
    cfg.setdefault("state_file", str(tmp_path / "nvml-state.json"))
    return run(d, **cfg)


def test_driver_570_node_passes_the_new_rules(tmp_path):
    res = run_state(doc(R570), tmp_path, gpu_count=8)
    assert res["nvml.recovery_action"].status == "pass" and res["nvml.recovery_action"].value == "NONE"
    assert res["nvml.app_clocks"].status == "pass" and res["nvml.app_clocks"].value == 1980
    assert res["nvml.slowdown"].status == "skip"      # the first check only records the counters
    assert res["nvml.versions"].status == "pass"
    assert res["nvml.versions"].value == "driver 570.133.20, VBIOS 96.00.99.00.01"
    assert res["nvml.versions"].data["vbios"]["gpu7"] == "96.00.99.00.01"


@pytest.mark.parametrize("action,name,todo", [
    (1, "GPU_RESET", "reset the GPU"),
    (2, "NODE_REBOOT", "reboot the node"),
    (3, "DRAIN_P2P", "stop peer-to-peer traffic"),
    (4, "DRAIN_AND_RESET", "drain the node's jobs, then reset the GPU"),
])
def test_each_recovery_action_fails_with_the_action_in_the_detail(tmp_path, action, name, todo):
    d = doc(R570, g5={"fields": {"230": action, "270": 0, "271": 0}})
    r = run_state(d, tmp_path)["nvml.recovery_action"]
    assert r.status == "fail" and r.value == name
    assert f"GPU5 (00000000:AB:00.0): NVML recovery action {name}: {todo}" in r.detail


def test_recovery_action_unknown_to_the_driver_skips(tmp_path):
    # Before driver 570 the field's own nvmlReturn is NOT_SUPPORTED.
    r = run_state(doc("h100_sxm_8gpu_idle.json"), tmp_path)["nvml.recovery_action"]
    assert r.status == "skip"


def test_application_clocks_set_low_warn_and_a_low_max_clock_fails(tmp_path):
    d = doc(R570, g2={"clocks_mhz": {"app_sm": 1410, "app_mem": 2619, "default_app_sm": 1980,
                                     "default_app_mem": 2619, "max_sm": 1980}})
    r = run_state(d, tmp_path)["nvml.app_clocks"]
    assert r.status == "warn" and "application SM clock 1410 MHz < default 1980 MHz" in r.detail
    assert "nvidia-smi -rac" in r.detail
    d = doc(R570, g4={"clocks_mhz": {"app_sm": 1755, "default_app_sm": 1755, "max_sm": 1755}})
    r = run_state(d, tmp_path)["nvml.app_clocks"]
    assert r.status == "fail" and "max SM clock 1755 MHz < the model's 1980 MHz" in r.detail


def test_slowdown_counters_are_judged_over_the_time_between_checks(tmp_path):
    state = tmp_path / "nvml-state.json"
    run_state(doc(R570), tmp_path)
    saved = json.loads(state.read_text())
    # The previous check was 600 s ago; since then GPU1 spent 3 s in HW power brake (warn),
    # GPU6 60 s in HW thermal slowdown (10% of the time > 5%: fail).
    saved["time"] -= 600
    state.write_text(json.dumps(saved))
    d = doc(R570, g1={"fields": {"230": 0, "270": 1200000000, "271": 3000000000}},
            g6={"fields": {"230": 0, "270": 61200000000, "271": 0}})
    r = run_state(d, tmp_path)["nvml.slowdown"]
    assert r.status == "fail" and r.value == 60.0
    assert "GPU6 (00000000:BA:00.0): clocks held down 60 s of the last 600 s (hw thermal 60 s)" in r.detail
    assert r.data["gpu1"]["status"] == "warn" and r.data["gpu0"]["status"] == "pass"
    # Nothing new since: pass.
    assert run_state(d, tmp_path)["nvml.slowdown"].status == "pass"


def test_gpus_of_one_node_on_different_vbios_warn(tmp_path):
    r = run_state(doc(R570, g3={"vbios": "96.00.74.00.0B"}), tmp_path)["nvml.versions"]
    assert r.status == "warn" and "96.00.74.00.0B, 96.00.99.00.01" in r.detail
