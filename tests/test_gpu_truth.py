"""The GPU tier: the NVML, NCCL and CUDA paths against real hardware.

Marked ``gpu``: deselected by default (setup.cfg addopts ``-m "not gpu"``), so they
are not part of the CPU suite's count. Run them on a machine with NVIDIA GPUs:

    .venv/bin/python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_truth.py

Nothing is stood in: pynvml loads the real libnvidia-ml, torch uses CUDA and NCCL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(scope="module")
def ctx():
    from clusterops.health import load_gpu_models
    from clusterops.health.probes.base import ProbeContext

    return ProbeContext(gpu_models=load_gpu_models({}), gpus_required=True, state_dir="/tmp")


@pytest.fixture(scope="module")
def ngpu():
    import torch

    n = torch.cuda.device_count()
    assert n > 0, "the gpu tier needs a CUDA GPU visible to torch"
    return n


def test_nvml_probe_reads_the_real_library(ctx, ngpu):
    from clusterops.health.probes.base import ProbeSpec, run_probes
    from clusterops.health.probes.nvml import probe_nvml

    res = run_probes([ProbeSpec("nvml", probe_nvml, {"required": True}, timeout_s=60)], ctx).results
    assert res and all(r.status in ("pass", "warn") for r in res), [r.to_dict() for r in res]
    gpus = (res[0].data or {}).get("gpus", [])
    assert len(gpus) == ngpu
    for g in gpus:
        assert g["name"] and g["pci_bus_id"]


def test_distributed_test_and_allreduce_on_nccl(ctx, ngpu):
    from clusterops.health.probes.dist import probe_dist

    res = probe_dist({"local_ranks": ngpu, "backend": "nccl", "sizes_bytes": [64 << 20], "warmup": 3,
                      "iters": 10, "test_timeout_s": 240}, ctx)
    assert res and all(r.status == "pass" for r in res), [r.to_dict() for r in res]
    sizes = [s for r in res for s in (r.data or {}).get("sizes", [])]
    assert sizes and all(s["correct"] and s["busbw_gbps"] > 0 for s in sizes)


def test_matmul_tflops_against_the_model_figure(ctx, ngpu):
    from clusterops.health.probes.matmul import probe_matmul

    cfg = {"required": True, "warmup": 5, "iters": 10, "gpu_shapes": [[8192, 8192, 8192]],
           "min_fraction": 0.9, "straggler_pct": 10}
    res = probe_matmul(cfg, ctx)[0]
    devices = res.data.get("devices", {})
    assert len(devices) == ngpu
    # a model without a figure in the table cannot be judged: that is a gap in the table, not a pass
    assert all(d.get("model") for d in devices.values()), devices
    assert res.status == "pass", res.to_dict()


def test_copy_bandwidths_against_the_model_floors(ctx, ngpu):
    from clusterops.health.probes.copybw import probe_copybw

    res = {r.name: r for r in probe_copybw({"required": True, "size_mib": 256, "warmup": 3,
                                            "iters": 10}, ctx)}
    assert set(res) == {"copybw.h2d", "copybw.d2h", "copybw.p2p", "copybw.hbm"}, res
    for kind in ("h2d", "d2h", "hbm"):
        r = res[f"copybw.{kind}"]
        assert len(r.data["gbps"]) == ngpu and all(v > 0 for v in r.data["gbps"].values()), r.to_dict()
    # A healthy node meets its model's floors (H100/H200: 48 GB/s H2D/D2H, 335 GB/s P2P).
    assert all(r.status in ("pass", "skip") for r in res.values()), [r.to_dict() for r in res.values()]


def test_nvml_driver_570_fields_read_for_real(ctx, ngpu):
    # Recovery action, VBIOS, clocks: each either a reading or, on an older driver, a skip;
    # never a crash or an error (the field call's per-value return codes are honoured).
    from clusterops.health.probes.nvml import probe_nvml

    res = {r.name: r for r in probe_nvml({"required": True}, ctx)}
    assert res["nvml.recovery_action"].status in ("pass", "skip"), res["nvml.recovery_action"].to_dict()
    assert res["nvml.versions"].value.startswith("driver ") and "VBIOS" in res["nvml.versions"].value
    assert res["nvml.app_clocks"].status in ("pass", "warn", "skip")
    assert res["nvml.slowdown"].status in ("pass", "warn", "skip")


SDK_NCCL = r"""
import sys, torch
from clusterops import sdk
d = sdk.init_distributed("nccl")
assert d.backend == "nccl"
dev = torch.device("cuda", d.local_rank)
x = torch.ones(1 << 20, device=dev)
torch.distributed.all_reduce(x)
assert torch.equal(x, torch.full_like(x, d.world_size))
g = torch.Generator(device=dev).manual_seed(1)
state = {"w": torch.randn(1024, 1024, device=dev, generator=g)}
sdk.save(state, 1, root=sys.argv[1], async_=True)
sdk.wait()
tmpl = {"w": torch.zeros(1024, 1024, device=dev)}
r = sdk.resume(root=sys.argv[1], template=tmpl)
assert r.step == 1 and torch.equal(r.state["w"], state["w"])
print(f"ok rank={d.rank}", flush=True)
sdk.shutdown()
"""


def test_sdk_on_nccl_all_reduce_and_checkpoint_of_cuda_state(tmp_path, ngpu):
    n = min(ngpu, 2)
    script = tmp_path / "sdk_nccl.py"
    script.write_text(SDK_NCCL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTEROPS_")}
    p = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={n}", str(script), str(tmp_path / "ck")],
                       env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("ok rank=") == n
