"""The AMD probe through the amdsmi stand-in fed with recorded MI300X return values
(tests/fixtures/amd), and what it does on this machine, which has no AMD GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.health import load_gpu_models, load_profile, probe_specs
from clusterops.health.probes.amd import AMD_GRES, probe_amd
from clusterops.health.probes.amd_standin import StandinAMDSMI
from clusterops.health.probes.base import ProbeContext

FIX = Path(__file__).parent / "fixtures" / "amd"


def run(name, tmp_path, gres="gpu:mi300x:8", **cfg):
    doc = json.loads((FIX / name).read_text())
    ctx = ProbeContext(amdsmi=StandinAMDSMI(doc), gpu_models=load_gpu_models({}), host_root=str(tmp_path),
                       slurm_gres=lambda node, t: gres, gpus_required=True)
    return {r.name: r for r in probe_amd(cfg, ctx)}


def test_healthy_mi300x_node_passes_every_rule(tmp_path):
    res = run("mi300x_8gpu_healthy.json", tmp_path, xgmi_links=7)
    assert res["amd.gpu_count"].status == "pass" and res["amd.gpu_count"].value == 8
    assert res["amd.gpu_count"].threshold == 8          # from the AMD-typed Slurm gres
    for name in ("amd.ecc", "amd.bad_pages", "amd.ras", "amd.xgmi", "amd.pcie", "amd.temperature", "amd.power"):
        assert res[name].status == "pass", (name, res[name])
    assert res["amd.throttle"].status == "skip"         # "N/A" on an idle MI300X
    assert res["amd.xgmi"].value == 7 and res["amd.pcie"].value == 16
    assert res["amd.gpu_count"].data["gpus"][0]["model"] == "MI300X"


def test_gpu_missing_against_the_gres_fails(tmp_path):
    r = run("mi300x_8gpu_healthy.json", tmp_path, gres="gpu:mi300x:9")["amd.gpu_count"]
    assert r.status == "fail" and "8 AMD GPUs visible, expected 9 (Slurm gres)" in r.detail


def test_amd_gres_patterns():
    for g in ("gpu:mi300x:8", "gpu:MI250X:4(S:0-1)", "gpu:amd:2", "gpu:instinct_mi210:4,shard:8"):
        assert AMD_GRES.search(g), g
    for g in ("gpu:h100:8", "gpu:8", "gpu:a100:4(S:0)", ""):
        assert not AMD_GRES.search(g), g


def test_amd_node_without_amdsmi_is_an_error_that_says_what_to_install(tmp_path):
    # The amdgpu driver is there (/dev/kfd), the Python library is not.
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").write_text("")
    ctx = ProbeContext(host_root=str(tmp_path), env={}, slurm_gres=lambda n, t: "")
    res = probe_amd({}, ctx)
    assert [r.status for r in res] == ["error"]
    assert "pip install 'clusterops[amd]'" in res[0].detail and "/dev/kfd" in res[0].detail
    # A node whose Slurm gres says AMD GPUs, no local sign, no amdsmi: error too.
    ctx = ProbeContext(host_root=str(tmp_path / "none"), env={}, gpus_required=True,
                       slurm_gres=lambda n, t: "gpu:mi300x:8")
    res = probe_amd({}, ctx)
    assert res[0].status == "error" and "Slurm gres gpu:mi300x:8" in res[0].detail


def test_this_machine_skips(tmp_path):
    # No AMD GPU here and amdsmi not installed: a skip that says why (Slurm is not asked
    # on a node that is not on a GPU partition).
    asked = []
    ctx = ProbeContext(env={}, slurm_gres=lambda n, t: asked.append(n) or "")
    res = probe_amd({}, ctx)
    assert [r.status for r in res] == ["skip"] and not asked


def test_the_cli_reads_the_standin(tmp_path):
    env = dict(os.environ, CLUSTEROPS_AMDSMI_STANDIN=str(FIX / "mi300x_xgmi_link_down.json"),
               CLUSTEROPS_STATE_DIR=str(tmp_path))
    prof = tmp_path / "amd.yaml"
    prof.write_text("probes:\n  amd: {xgmi_links: 7}\n")
    p = subprocess.run([sys.executable, "-m", "clusterops", "health", "check", "--profile", str(prof), "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    doc = json.loads(p.stdout)
    assert p.returncode == 1 and doc["status"] == "fail"
    assert {r["name"]: r["status"] for r in doc["results"]}["amd.xgmi"] == "fail"


def test_fast_profile_has_the_amd_probe():
    assert "amd" in [s.name for s in probe_specs(load_profile("fast"))]


@pytest.mark.rocm
def test_amdsmi_for_real_on_an_amd_gpu(tmp_path):
    # The rocm tier: the real amdsmi on a node with AMD GPUs (deselected unless -m rocm).
    res = {r.name: r for r in probe_amd({"required": True}, ProbeContext(gpu_models=load_gpu_models({})))}
    assert res["amd.gpu_count"].value and res["amd.gpu_count"].status == "pass", res
    assert all(r.status in ("pass", "warn", "skip") for r in res.values()), [r.to_dict() for r in res.values()]


def test_mi300x_allreduce_floor_reaches_the_dist_probe(tmp_path):
    # The amd probe records the model and the GPU count; the dist probe then holds an
    # 8-rank all-reduce to Azure's 314 GB/s for MI300X (the profile's figure wins).
    from clusterops.health.probes.dist import busbw_floor

    doc = json.loads((FIX / "mi300x_8gpu_healthy.json").read_text())
    ctx = ProbeContext(amdsmi=StandinAMDSMI(doc), gpu_models=load_gpu_models({}), host_root=str(tmp_path),
                       slurm_gres=lambda node, t: "gpu:mi300x:8")
    probe_amd({}, ctx)
    assert ctx.cache["gpu_count"] == 8 and ctx.cache["gpu_model"] == "MI300X"
    assert busbw_floor({}, ctx, 8) == 314.0
    assert busbw_floor({}, ctx, 4) is None
    assert busbw_floor({"min_busbw_gbps": 300}, ctx, 8) == 300.0


def test_an_nvidia_node_on_a_gpu_partition_does_not_ask_slurm_again(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").write_text("")
    asked = []
    ctx = ProbeContext(env={}, host_root=str(tmp_path), gpus_required=True,
                       slurm_gres=lambda n, t: asked.append(n) or "gpu:h100:8")
    assert probe_amd({}, ctx)[0].status == "skip" and not asked


# -- amd-smi --json: the CLI when the library is absent ------------------------------------------

CLI_FIX = FIX / "cli"
_SUBCOMMAND = {"static": "static", "metric": "metric", "bad-pages": "bad-pages", "topology": "topology"}


def _amd_smi_on_path(tmp_path: Path, case: str, fail: str = "") -> dict:
    """A stand-in ``amd-smi`` on PATH that prints the case's recorded JSON for its subcommand
    (the healthy node's where the case changes nothing), logging each argv; ``fail``: that
    subcommand exits 1 with amd-smi's own kind of message."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "amd-smi"
    exe.write_text(f"#!{sys.executable}\n"
                   "import json, os, sys\n"
                   f"open({str(tmp_path / 'argv.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                   "sub = sys.argv[1]\n"
                   f"if sub == {fail!r}:\n"
                   "    sys.stderr.write('AMD SMI failed to initialize: AMDSMI_STATUS_DRIVER_NOT_LOADED\\n')\n"
                   "    sys.exit(1)\n"
                   f"for d in ({str(CLI_FIX / case)!r}, {str(CLI_FIX / 'mi300x_healthy')!r}):\n"
                   "    p = os.path.join(d, sub + '.json')\n"
                   "    if os.path.exists(p):\n"
                   "        sys.stdout.write(open(p).read())\n"
                   "        break\n")
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


def run_cli(case, tmp_path, fail="", **cfg):
    """The probe on an AMD node (/dev/kfd) whose checker has no amdsmi library: it reads the
    stand-in amd-smi through the runner."""
    from clusterops.runner import Runner

    host = tmp_path / "host"
    (host / "dev").mkdir(parents=True, exist_ok=True)
    (host / "dev" / "kfd").write_text("")
    ctx = ProbeContext(runner=Runner(env=_amd_smi_on_path(tmp_path, case, fail)), env={},
                       gpu_models=load_gpu_models({}), host_root=str(host),
                       slurm_gres=lambda node, t: "gpu:mi300x:8", gpus_required=True)
    return {r.name: r for r in probe_amd(cfg, ctx)}


def test_cli_healthy_mi300x_passes_every_rule_from_the_four_commands(tmp_path):
    res = run_cli("mi300x_healthy", tmp_path, xgmi_links=7)
    assert res["amd.gpu_count"].status == "pass" and res["amd.gpu_count"].value == 8
    assert "amd-smi CLI" in res["amd.gpu_count"].detail and res["amd.gpu_count"].data["source"] == "amd-smi"
    for name in ("amd.ecc", "amd.bad_pages", "amd.ras", "amd.xgmi", "amd.pcie", "amd.throttle", "amd.temperature",
                 "amd.power"):
        assert res[name].status == "pass", (name, res[name])
    assert res["amd.xgmi"].value == 7 and res["amd.pcie"].value == 16 and res["amd.temperature"].value == 42
    assert res["amd.power"].value == 138 and res["amd.gpu_count"].data["gpus"][4]["bdf"] == "0000:85:00.0"
    assert res["amd.gpu_count"].data["gpus"][0]["model"] == "MI300X"
    argvs = [json.loads(x) for x in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert sorted(argvs) == sorted([["static", "--json"], ["metric", "--json"], ["bad-pages", "--json"],
                                    ["topology", "-a", "-t", "--json"]])


def test_cli_that_fails_is_an_error_naming_the_command_and_cli_false_keeps_the_install_error(tmp_path):
    res = run_cli("mi300x_healthy", tmp_path, fail="metric")
    assert [r.status for r in res.values()] == ["error"]
    assert "amd-smi metric --json: exit 1: AMD SMI failed to initialize" in res["amd"].detail
    res = run_cli("mi300x_healthy", tmp_path / "off", cli=False)
    assert res["amd"].status == "error" and "amdsmi Python library is missing" in res["amd"].detail
    assert not (tmp_path / "off" / "argv.jsonl").exists()


def test_cli_values_and_shapes():
    from clusterops.health.probes.amd_cli import AmdSmiCliError, per_gpu, value

    assert value({"value": 42, "unit": "C"}) == 42 and value("N/A") is None and value(7) == 7
    assert set(per_gpu({"gpu_data": [{"gpu": 0}, {"gpu": 1}]}, "metric")) == {0, 1}   # newer releases' wrapper
    assert set(per_gpu({"gpu": 3, "ecc": {}}, "metric")) == {3}
    with pytest.raises(AmdSmiCliError):
        per_gpu("garbage", "metric")


def test_a_node_without_amd_gpus_never_runs_amd_smi(tmp_path):
    from clusterops.runner import Runner

    ctx = ProbeContext(runner=Runner(env=_amd_smi_on_path(tmp_path, "mi300x_healthy")), env={},
                       host_root=str(tmp_path / "none"), slurm_gres=lambda n, t: "")
    assert [r.status for r in probe_amd({}, ctx)] == ["skip"]
    assert not (tmp_path / "argv.jsonl").exists()


# -- the same cases from either source: the library's values and the CLI's JSON --------------------

_CASES = {"ecc": ("mi300x_ecc_errors.json", "mi300x_ecc_errors"), "bad_pages": ("mi300x_bad_pages.json", "mi300x_bad_pages"),
          "xgmi": ("mi300x_xgmi_link_down.json", "mi300x_xgmi_link_down")}


def _either(source, case, tmp_path, **cfg):
    lib, cli = _CASES[case]
    return run(lib, tmp_path, **cfg) if source == "amdsmi" else run_cli(cli, tmp_path, **cfg)


@pytest.mark.parametrize("source", ["amdsmi", "amd-smi"])
def test_ecc_errors_fail_with_the_ras_block(tmp_path, source):
    res = _either(source, "ecc", tmp_path)
    assert res["amd.ecc"].status == "fail" and res["amd.ecc"].value == 3
    assert "GPU2 (0000:46:00.0): 2 uncorrectable and 1 deferred ECC errors" in res["amd.ecc"].detail
    assert res["amd.ras"].status == "fail" and "RAS UMC MULT_UC" in res["amd.ras"].detail


@pytest.mark.parametrize("source", ["amdsmi", "amd-smi"])
def test_pending_bad_page_fails(tmp_path, source):
    r = _either(source, "bad_pages", tmp_path)["amd.bad_pages"]
    assert r.status == "fail" and r.value == 2 and "GPU6 (0000:c6:00.0): 1 bad pages pending" in r.detail


@pytest.mark.parametrize("source", ["amdsmi", "amd-smi"])
def test_xgmi_link_down_fails(tmp_path, source):
    r = _either(source, "xgmi", tmp_path, xgmi_links=7)["amd.xgmi"]
    assert r.status == "fail" and r.value == 6
    assert "GPU4 (0000:85:00.0): XGMI links down: 2; 6 XGMI links up < 7; XGMI error status ERROR" in r.detail
    if source == "amd-smi":   # the topology is both GPUs' view: GPU 2 sees the same link down
        assert "GPU2 (0000:46:00.0): XGMI links down: 3" in r.detail
