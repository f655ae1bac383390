"""The copy-bandwidth probe: its judgement on recorded figures (pure), its floors from the GPU
model table, and what it does on this machine, which has no GPU (the measurement itself runs
in the gpu tier, tests/test_gpu_truth.py, and bench/gpu_probes.py)."""

from __future__ import annotations

from clusterops.health import load_gpu_models, load_profile, probe_specs
from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes.copybw import floors, judge, probe_copybw

MODELS = load_gpu_models({})
# Figures of the shape an 8-GPU HGX H100 node gives (GB/s): PCIe gen5 x16 pinned copies
# about 55, NVLink P2P about 370, HBM3 copy about 2900 of 3350 peak.
H2D_OK = {f"cuda:{i}": 55.0 + i * 0.1 for i in range(8)}


def test_h100_floors_come_from_the_model_table_and_the_profile_overrides_them():
    fl = floors({"hbm_min_fraction": 0.7}, MODELS["H100"])
    assert fl == {"h2d": 48, "d2h": 48, "p2p": 335, "hbm": 2345.0}
    assert floors({"min_h2d_gbps": 52}, MODELS["H100"])["h2d"] == 52
    assert floors({}, MODELS["A100"]) == {"h2d": None, "d2h": None, "p2p": None, "hbm": 1427.3}


def test_healthy_h2d_passes():
    r = judge("h2d", H2D_OK, 48, 15, "H100")
    assert r.status == "pass" and r.value == 55.0 and r.unit == "GB/s" and r.threshold == 48


def test_a_gpu_behind_a_degraded_pcie_link_fails_by_name():
    figs = dict(H2D_OK, **{"cuda:5": 26.1})     # x8 instead of x16
    r = judge("h2d", figs, 48, 15, "H100")
    assert r.status == "fail" and r.value == 26.1
    assert r.detail.startswith("cuda:5 26.1 GB/s < 48") and "PCIe link" in r.detail


def test_without_a_floor_a_straggler_still_fails():
    figs = {"cuda:0": 2900.0, "cuda:1": 2880.0, "cuda:2": 2000.0}
    r = judge("hbm", figs, None, 15, None)
    assert r.status == "fail" and "cuda:2 2000.0 GB/s is more than 15% below the node's best 2900.0" in r.detail
    r = judge("hbm", {"cuda:0": 2900.0, "cuda:1": 2880.0}, None, 15, None)
    assert r.status == "pass" and "no hbm floor" in r.detail


def test_p2p_pairs_without_peer_access_fail_when_the_model_has_a_floor():
    figs = {"cuda:0->cuda:1": 370.0, "cuda:1->cuda:0": 368.0, "cuda:0->cuda:2": None}
    r = judge("p2p", figs, 335, 15, "H100")
    assert r.status == "fail" and "no peer access cuda:0->cuda:2" in r.detail
    assert r.data["no_peer_access"] == ["cuda:0->cuda:2"]
    # a PCIe node (no P2P floor): missing peer access is reported, not failed
    assert judge("p2p", figs, None, 15, None).status == "pass"


def test_one_gpu_has_no_pairs():
    assert judge("p2p", {}, 335, 15, "H100").status == "skip"


def test_on_this_machine_without_a_gpu(tmp_path):
    # No CUDA device and no sign of GPUs: skip with the reason.
    ctx = ProbeContext(host_root=str(tmp_path), gpu_models=MODELS)
    res = probe_copybw({}, ctx)
    assert [r.status for r in res] == ["skip"] and "no CUDA device" in res[0].detail
    # The node shows GPUs (a /dev/nvidia0) but torch sees none: an error, never a skip.
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").write_text("")
    res = probe_copybw({}, ctx)
    assert [r.status for r in res] == ["error"] and "torch sees no CUDA device" in res[0].detail
    # A GPU partition's profile: error too.
    assert probe_copybw({"required": True}, ProbeContext(host_root=str(tmp_path / "none")))[0].status == "error"


def test_preflight_and_deep_run_it_alone_fast_does_not():
    for name in ("preflight", "deep"):
        spec = {s.name: s for s in probe_specs(load_profile(name))}["copybw"]
        assert spec.exclusive
    assert "copybw" not in [s.name for s in probe_specs(load_profile("fast"))]
