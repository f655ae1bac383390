"""Profiles, the check report/exit codes, Prometheus output, matmul and the local dist test on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from clusterops.cli.health import health
from clusterops.errors import InputError
from clusterops.health import (drain_decision, drain_reason, load_profile, prometheus_text, run_check)
from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes.matmul import probe_matmul

REPO = Path(__file__).resolve().parent.parent
FIX = Path(__file__).parent / "fixtures"
CLI = [sys.executable, "-m", "clusterops"]


def write(p: Path, text: str) -> Path:
    p.write_text(textwrap.dedent(text))
    return p


# -- profiles --------------------------------------------------------------------------------

def test_builtin_profiles_resolve_with_inheritance():
    fast = load_profile("fast")
    pre = load_profile("preflight")
    deep = load_profile("deep")
    assert "dist" not in fast.probes and "matmul" not in fast.probes
    assert set(fast.probes) <= set(pre.probes) and {"dist", "matmul"} <= set(pre.probes)
    assert deep.probes["dcgm"]["level"] == 3
    assert deep.probes["nvml"] == fast.probes["nvml"]
    for model in ("A100", "H100", "H200", "B200"):
        assert deep.gpu_models[model]["matmul_bf16_tflops"]
    assert deep.gpu_models["H100"]["matmul_bf16_tflops"] == 794
    assert deep.gpu_models["A100"]["matmul_bf16_tflops"] == 271


def test_site_overrides_and_env(tmp_path, monkeypatch):
    site = write(tmp_path / "site.yaml", """\
        gpu_models:
          H100: {matmul_bf16_tflops: 700}
        defaults:
          gpus: {required: true, count: 8}
        profiles:
          fast:
            probes:
              host.paths: {paths: [{path: /scratch, min_free_gb: 500}]}
              host.stray_processes: false
        """)
    p = load_profile("fast", str(site))
    assert p.gpus_required and p.gpu_count == 8
    assert p.probes["host.paths"]["paths"] == [{"path": "/scratch", "min_free_gb": 500}]
    assert p.probes["host.paths"]["timeout_s"] == 10  # untouched settings kept
    assert "host.stray_processes" not in p.probes
    assert p.gpu_models["H100"]["matmul_bf16_tflops"] == 700
    monkeypatch.setenv("CLUSTEROPS_HEALTH_SITE", str(site))
    assert load_profile("preflight").gpu_models["H100"]["matmul_bf16_tflops"] == 700
    out = CliRunner().invoke(health, ["profiles", "fast", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["gpus"]["count"] == 8


@pytest.mark.parametrize("text,msg", [
    ("probes:\n  nvml: {}\n  hots.paths: {}\n", "bad.yaml:3: probes.hots.paths: unknown probe (did you mean 'host.paths'?)"),
    ("descripton: x\n", "bad.yaml:1: descripton: unknown key (did you mean 'description'?)"),
    ("gpus:\n  count: eight\n", "bad.yaml:2: gpus.count: must be a whole number"),
    ("probes:\n  xid:\n    timeout_s: -1\n", "bad.yaml:3: probes.xid.timeout_s: must be a number"),
    ("probes: [\n", "bad.yaml:2: YAML error"),
    ("probes:\n  nvml:\n    temprature_fail_c: 90\n",
     "bad.yaml:3: probes.nvml.temprature_fail_c: unknown setting (did you mean 'temperature_fail_c'?)"),
    ("extends: nosuch\n", "unknown health profile 'nosuch'"),
])
def test_bad_profiles_exit_2_with_one_line(tmp_path, text, msg):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(InputError) as e:
        load_profile(str(bad))
    assert msg in str(e.value) and "\n" not in str(e.value)
    r = subprocess.run(CLI + ["health", "check", "--profile", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and msg in r.stderr
    assert r.stdout == ""


def test_unknown_profile_name_suggests():
    r = subprocess.run(CLI + ["health", "check", "--profile", "fsat"], capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean 'fast'" in r.stderr


# -- the check ---------------------------------------------------------------------------------

def _profile(tmp_path, body: str) -> Path:
    return write(tmp_path / "p.yaml", body)


def test_check_json_contract_and_exit_codes(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    prof = _profile(tmp_path, """\
        extends: fast
        probes:
          host.paths:
            paths: [{path: "${MY_SCRATCH}", min_free_gb: 0.001}]
        """)
    env = dict(os.environ, MY_SCRATCH=str(scratch), CLUSTEROPS_STATE_DIR=str(tmp_path / "state"),
               SLURMD_NODENAME="node9")
    r = subprocess.run(CLI + ["health", "check", "--profile", str(prof), "--json",
                              "--prometheus", str(tmp_path / "h.prom")], capture_output=True, text=True, env=env)
    rep = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert set(rep) >= {"node", "profile", "status", "exit_code", "duration_s", "results"}
    assert rep["node"] == "node9" and rep["profile"] == "p" and rep["status"] in ("pass", "warn")
    for res in rep["results"]:
        assert set(res) == {"name", "status", "value", "unit", "threshold", "detail", "duration_s", "data",
                            "probe"}
    # Each result names the probe that made it (a drain reason names the probe).
    probe_of = {x["name"]: x["probe"] for x in rep["results"]}
    assert probe_of["host.path:${MY_SCRATCH}"] == "host.paths" and probe_of["host.memory"] == "host.memory"
    assert {x["name"] for x in rep["results"]} >= {"nvml", "xid", "host.memory", "host.path:${MY_SCRATCH}"}
    prom = (tmp_path / "h.prom").read_text()
    assert 'clusterops_health_status{node="node9",profile="p"} ' in prom
    assert 'clusterops_health_probe_value{node="node9",probe="host.memory",unit="GB"}' in prom
    # Remove the scratch dir: unhealthy, exit 1, the table names the path.
    scratch.rmdir()
    r = subprocess.run(CLI + ["health", "check", "--profile", str(prof)], capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert "FAIL" in r.stdout and f"{scratch} is missing" in r.stdout


def test_fast_profile_never_imports_torch(tmp_path):
    code = ("import sys; from clusterops.cli import main\n"
            "sys.argv=['clusterops','health','check','--json']\n"
            "try:\n main()\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'numpy' not in sys.modules\n"
            "print('NO_TORCH')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, CLUSTEROPS_STATE_DIR=str(tmp_path)))
    assert "NO_TORCH" in r.stdout, r.stderr


def test_gpu_node_through_nvml_standin_fails_on_bad_gpu(tmp_path):
    d = json.loads((FIX / "nvml" / "h100_sxm_8gpu_idle.json").read_text())
    d["gpus"]["5"]["remapped_rows"] = [0, 2, 1, 0]
    f = tmp_path / "nvml.json"
    f.write_text(json.dumps(d))
    prof = _profile(tmp_path, "extends: fast\ngpus: {required: true, count: 8}\n")
    env = dict(os.environ, CLUSTEROPS_NVML_STANDIN=str(f), CLUSTEROPS_STATE_DIR=str(tmp_path))
    r = subprocess.run(CLI + ["health", "check", "--profile", str(prof), "--json"], capture_output=True,
                       text=True, env=env)
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["status"] == "fail"
    bad = [x for x in rep["results"] if x["status"] == "fail"]
    assert [x["name"] for x in bad] == ["nvml.row_remap"]
    assert drain_reason(rep).startswith("clusterops:health:p: nvml: nvml.row_remap: GPU5 (00000000:AB:00.0): "
                                        "row remap pending")


def test_gpus_required_on_cpu_node_fails(tmp_path):
    prof = load_profile("fast")
    prof.gpus_required = True
    ctx = ProbeContext(env=dict(os.environ, CLUSTEROPS_STATE_DIR=str(tmp_path)), node="n1")
    rep = run_check(prof, ctx).report
    nv = [x for x in rep["results"] if x["name"] == "nvml"][0]
    assert nv["status"] == "fail" and rep["exit_code"] == 1


def test_hung_probe_does_not_hang_the_cli(tmp_path):
    d = json.loads((FIX / "nvml" / "h100_sxm_8gpu_idle.json").read_text())
    d["gpus"]["1"]["temperature_c"] = "hang"
    f = tmp_path / "nvml.json"
    f.write_text(json.dumps(d))
    prof = _profile(tmp_path, "extends: fast\nprobes:\n  nvml: {timeout_s: 1}\n")
    env = dict(os.environ, CLUSTEROPS_NVML_STANDIN=str(f), CLUSTEROPS_STATE_DIR=str(tmp_path))
    r = subprocess.run(CLI + ["health", "check", "--profile", str(prof), "--json"], capture_output=True,
                       text=True, env=env, timeout=30)
    rep = json.loads(r.stdout)
    assert r.returncode == 4 and rep["status"] == "error" and rep["exit_code"] == 4
    assert "left in service (exit 4)" in r.stderr
    nv = [x for x in rep["results"] if x["name"] == "nvml"][0]
    assert nv["status"] == "error" and "did not finish within 1s" in nv["detail"]


# -- drain decision (pure) ---------------------------------------------------------------------

def _rep(status, results, profile="fast"):
    return {"node": "n1", "profile": profile, "status": status, "results": results}


def _res(name, status, probe=None, detail=""):
    return {"name": name, "status": status, "probe": probe or name, "detail": detail}


FAST_PASS = _rep("pass", [_res("nvml", "pass"), _res("xid", "pass"), _res("host.path:/x", "pass", "host.paths")])
FAST_FAIL = _rep("fail", [_res("nvml", "pass"), _res("xid", "pass"),
                          _res("host.path:/x", "fail", "host.paths", "/x is missing")])
FAST_ERROR = _rep("error", [_res("nvml", "error", detail="probe raised KeyError: 'x'"), _res("xid", "pass")])


@pytest.mark.parametrize("report,drained,down,reason,action", [
    (FAST_FAIL, False, False, None, "drain"),
    # a new cause, and the current drain is one this check could lift: reason updated
    (FAST_FAIL, True, False, "clusterops:health:fast: xid: Xid 79", "drain"),
    (FAST_FAIL, True, False, "clusterops: host.path:/x: gone", "drain"),           # legacy, re-checked
    (FAST_FAIL, True, False, "clusterops:health:fast: host.paths: host.path:/x: /x is missing", "none"),
    # a drain this check cannot lift is never relabelled (that would hand it to the fast check)
    (FAST_FAIL, True, False, "clusterops:supervisor: hang: rank 3", "none"),
    (FAST_FAIL, True, False, "clusterops:health:deep: dcgm: dcgm.diag: memory test failed", "none"),
    (FAST_FAIL, True, False, "admin: bad fan", "none"),                           # someone else's
    (FAST_PASS, True, False, "clusterops:health:fast: host.paths: host.path:/x: /x is missing", "resume"),
    (FAST_PASS, True, False, "clusterops: host.path:/x: gone", "resume"),           # legacy, re-checked
    (FAST_PASS, True, False, "clusterops:health:deep: dcgm: dcgm.diag: failed", "none"),
    (FAST_PASS, True, False, "clusterops:supervisor: preflight fail: x", "none"),
    (FAST_PASS, True, False, "clusterops:flapping: 3/5: failed 3 of the last 5 sweeps", "none"),
    (FAST_PASS, True, False, "admin: bad fan", "none"),
    (FAST_PASS, False, True, "Not responding", "none"),
    (FAST_PASS, False, False, None, "none"),
    # an error decides nothing: never drains, never resumes
    (FAST_ERROR, False, False, None, "none"),
    (FAST_ERROR, True, False, "clusterops:health:fast: xid: Xid 79", "none"),
])
def test_drain_decision(report, drained, down, reason, action):
    assert drain_decision(report, drained, down, reason)[0] == action


def test_drain_reason_names_origin_profile_and_probe():
    assert drain_reason(FAST_FAIL) == "clusterops:health:fast: host.paths: host.path:/x: /x is missing"
    one = _rep("fail", [_res("xid", "fail", detail="Xid 79\nGPU fell off")], profile="my site:fast")
    assert drain_reason(one) == "clusterops:health:my_site_fast: xid: Xid 79 GPU fell off"


def test_error_never_drains_for_real(tmp_path):
    """A profile value that makes a probe raise: status error, exit 4, and no Slurm call at all
    (the controller named here does not exist: a drain attempt would show up as 'not reachable')."""
    prof = _profile(tmp_path, f"extends: fast\nprobes:\n  host.memory: {{meminfo_file: {tmp_path}/no-meminfo}}\n")
    env = dict(os.environ, CLUSTEROPS_STATE_DIR=str(tmp_path), SLURM_CONF=str(tmp_path / "no-slurm.conf"),
               SLURMD_NODENAME="node1")
    r = subprocess.run(CLI + ["health", "check", "--profile", str(prof), "--drain-on-fail", "--json"],
                       capture_output=True, text=True, env=env, timeout=60)
    rep = json.loads(r.stdout)
    assert r.returncode == 4 and rep["status"] == "error" and rep["exit_code"] == 4, r.stderr
    assert rep["slurm"]["action"] == "none" and "never drains" in rep["slurm"]["why"], rep["slurm"]
    assert len(r.stderr.strip().splitlines()) == 1 and "exit 4" in r.stderr


def test_bad_drain_setting_is_exit_2_and_runs_nothing(tmp_path):
    site = write(tmp_path / "site.yaml", "drain:\n  max_drained_fraction: 1.5\n")
    r = subprocess.run(CLI + ["health", "check", "--site-config", str(site), "--drain-on-fail"],
                       capture_output=True, text=True, env=dict(os.environ, CLUSTEROPS_STATE_DIR=str(tmp_path)))
    assert r.returncode == 2 and "drain.max_drained_fraction" in r.stderr and r.stdout == ""
    r = subprocess.run(CLI + ["health", "check", "--drain-on-fail"], capture_output=True, text=True,
                       env=dict(os.environ, CLUSTEROPS_STATE_DIR=str(tmp_path), CLUSTEROPS_MAX_DRAINED_FRACTION="x"))
    assert r.returncode == 2 and "CLUSTEROPS_MAX_DRAINED_FRACTION" in r.stderr


def test_prometheus_escapes_labels():
    rep = {"node": 'n"1', "profile": "fast", "status": "warn", "duration_s": 0.5, "time": 1,
           "results": [{"name": "host.path:/a b", "status": "pass", "value": 1.5, "unit": "GB"}]}
    text = prometheus_text(rep)
    assert 'node="n\\"1"' in text and 'probe="host.path:/a b",unit="GB"} 1.5' in text


# -- matmul and the local dist test, for real on CPU ---------------------------------------------

def test_matmul_cpu_real():
    r = probe_matmul({"cpu_shapes": [[256, 256, 256], [512, 512, 512]], "warmup": 1, "iters": 3},
                     ProbeContext())[0]
    assert r.status == "pass" and r.unit == "TFLOPS" and r.value > 0
    dev = r.data["devices"]["cpu"]
    assert dev["best"] >= dev["median"] > 0 and set(dev["per_shape"]) == {"256x256x256", "512x512x512"}
    assert r.data["dtype"] == "float32"
    slow = probe_matmul({"cpu_shapes": [[256, 256, 256]], "warmup": 1, "iters": 2,
                         "cpu_expected_tflops": 10 ** 6}, ProbeContext())[0]
    assert slow.status == "fail" and "TFLOPS <" in slow.detail


def test_matmul_gpu_required_without_cuda_fails():
    r = probe_matmul({"required": True}, ProbeContext())[0]
    assert r.status == "fail" and "no CUDA device" in r.detail


@pytest.mark.timeout(120)
def test_local_dist_probe_gloo_real():
    from clusterops.health.probes.dist import probe_dist

    res = {r.name: r for r in probe_dist({"cpu_ranks": 2, "test_timeout_s": 60, "sizes_bytes": [1 << 20],
                                          "warmup": 1, "iters": 3}, ProbeContext())}
    a = res["dist.allreduce"]
    assert a.status == "pass", a.detail
    assert {d["status"] for d in a.data["ranks"].values()} == {"pass"}
    b = res["dist.busbw"]
    assert b.status == "pass" and b.value > 0 and b.unit == "GB/s"
    size = b.data["sizes"][0]
    # nccl-tests: busbw = algbw * 2(n-1)/n; n=2 -> equal.
    assert size["busbw_gbps"] == pytest.approx(size["algbw_gbps"]) and size["correct"]


def _dev(best, model="H100", expected=794):
    return {"best": best, "median": best * 0.98, "expected": expected, "model": model,
            "name": "NVIDIA H100 80GB HBM3"}


def test_matmul_judge_expected_figure_and_straggler():
    from clusterops.health.probes.matmul import judge

    ok = judge({f"cuda:{i}": _dev(780 - i) for i in range(8)}, "bfloat16", 0.9, 10)
    assert ok.status == "pass" and ok.value == 773 and ok.threshold == pytest.approx(714.6)
    slow = {f"cuda:{i}": _dev(780) for i in range(8)}
    slow["cuda:6"] = _dev(650)                        # below 90% of 794 and > 10% below the node's best
    r = judge(slow, "bfloat16", 0.9, 10)
    assert r.status == "fail" and "cuda:6 650.0 TFLOPS < 714.6" in r.detail and "cuda:6 straggler" in r.detail
    # A straggler even when every GPU clears the absolute floor (a model without a figure).
    rel = {f"cuda:{i}": _dev(500, model=None, expected=None) for i in range(4)}
    rel["cuda:2"] = _dev(430, model=None, expected=None)
    r = judge(rel, "bfloat16", 0.9, 10)
    assert r.status == "fail" and "cuda:2 straggler" in r.detail
    nofig = judge({"cuda:0": _dev(500, model=None, expected=None)}, "bfloat16", 0.9, 10)
    assert nofig.status == "warn" and "no expected figure" in nofig.detail


def test_dist_report_names_stuck_missing_and_failed_ranks(tmp_path):
    import time as _t

    from clusterops.health.probes.dist import collect_report, report_results

    now = _t.time()
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "node": "gpu001", "status": "fail",
                                                     "stage": "allreduce", "error": "Connection closed by peer"}))
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "node": "gpu002", "status": "running",
                                                     "stage": "allreduce", "pid": 4242}))
    rep = collect_report(tmp_path, 3, deadline=now + 0.3, hosts={2: "gpu003"})
    assert rep["status"] == "fail" and rep["stuck"] == [1] and rep["missing"] == [2] and rep["failed"] == [0]
    assert "rank 1 (gpu002, pid 4242) stopped answering at stage allreduce" in rep["detail"]
    assert "rank 2 (gpu003) did not answer" in rep["detail"]
    res = report_results(rep)
    assert res[0].name == "dist.allreduce" and res[0].status == "fail"


def test_expected_hosts_from_slurm_env():
    from clusterops.health.probes.dist import expected_hosts

    env = {"SLURM_STEP_NODELIST": "gpu[001-003]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    assert expected_hosts(env, 5) == {0: "gpu001", 1: "gpu001", 2: "gpu002", 3: "gpu002", 4: "gpu003"}
