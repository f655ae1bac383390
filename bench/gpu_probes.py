#!/usr/bin/env python3
"""Device check for a GPU machine: the real NVML probe (with the driver-570 fields: recovery
action, clocks, slowdown counters, VBIOS), the torch-distributed test and all-reduce
bandwidth over the local GPUs (NCCL), matmul per GPU (bf16), the copy bandwidths
(pinned H2D/D2H, P2P per pair, device memory), the sdc digest (reproducible across runs,
processes and GPUs; changed by the fault hook) and the replica check's digest of a 1B-parameter
bf16 state (per check), with figures printed next to the published
ones (max achievable bf16 matmul: 794 TFLOPS on H100 SXM / H200, 271 on A100 SXM, target
within 10%; Azure's H100 floors 48 GB/s H2D/D2H and 335 GB/s P2P).

Needs: torch with CUDA, nvidia-ml-py. Short by design (about a minute on an 8-GPU node):
    python bench/gpu_probes.py [--json OUT.json] [--sizes 64M,256M,1G] [--deep]
Writes nothing but stdout (and --json). Exit 0 even when a probe fails: it reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The distributed test spawns one python per GPU: they must import this tree too.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

BOOK_TFLOPS = {"H100": 794, "H200": 794, "A100": 271}


def size_arg(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="64M,256M,1G")
    ap.add_argument("--deep", action="store_true", help="more matmul shapes and iterations")
    a = ap.parse_args()

    from clusterops.health import load_gpu_models
    from clusterops.health.probes.base import ProbeContext, ProbeSpec, run_probes
    from clusterops.health.probes.dist import probe_dist
    from clusterops.health.probes.matmul import probe_matmul
    from clusterops.health.probes.nvml import probe_nvml

    ctx = ProbeContext(gpu_models=load_gpu_models({}), gpus_required=True, state_dir="/tmp")
    out = {}

    t0 = time.perf_counter()
    nv = run_probes([ProbeSpec("nvml", probe_nvml, {"required": True}, timeout_s=30)], ctx).results
    out["nvml_s"] = time.perf_counter() - t0
    print(f"== NVML ({out['nvml_s']:.2f} s)")
    for r in nv:
        print(f"  {r.status.upper():5} {r.name:18} {r.value!s:>10} {r.unit:6} {r.detail}")
    gpus = (nv[0].data or {}).get("gpus", [])
    for g in gpus:
        print(f"  GPU{g['index']}: {g['name']} {g['pci_bus_id']} model={g['model']}")
    out["nvml"] = [r.to_dict() for r in nv]

    import torch

    ngpu = torch.cuda.device_count()
    if ngpu == 0:
        print("no CUDA GPU visible to torch: nothing more to measure")
        return 1
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        nccl = "?"
    print(f"== torch {torch.__version__}, CUDA {torch.version.cuda}, {ngpu} GPUs, NCCL {nccl}")

    sizes = [size_arg(s) for s in a.sizes.split(",") if s]
    t0 = time.perf_counter()
    dres = probe_dist({"local_ranks": ngpu, "backend": "nccl", "sizes_bytes": sizes, "warmup": 5, "iters": 20,
                       "test_timeout_s": 240}, ctx)
    out["dist_s"] = time.perf_counter() - t0
    print(f"== torch-distributed test + all-reduce over {ngpu} local GPUs ({out['dist_s']:.1f} s incl. start-up)")
    for r in dres:
        print(f"  {r.status.upper():5} {r.name:16} {r.value!s:>10} {r.unit:5} {r.detail}")
        for s in (r.data or {}).get("sizes", []):
            print(f"      {s['size_bytes'] / (1 << 20):8.0f} MiB  algbw {s['algbw_gbps']:8.2f} GB/s  "
                  f"busbw {s['busbw_gbps']:8.2f} GB/s  time {s['time_s'] * 1e3:8.3f} ms  correct={s['correct']}")
    out["dist"] = [r.to_dict() for r in dres]

    mcfg = {"required": True, "warmup": 5, "iters": 20 if a.deep else 10,
            "gpu_shapes": ([[4096, 4096, 4096], [8192, 8192, 8192], [16384, 8192, 5120], [8192, 16384, 8192]]
                           if a.deep else [[8192, 8192, 8192], [16384, 8192, 5120]]),
            "min_fraction": 0.9, "straggler_pct": 10}
    t0 = time.perf_counter()
    mres = probe_matmul(mcfg, ctx)[0]
    out["matmul_s"] = time.perf_counter() - t0
    print(f"== matmul bf16 per GPU ({out['matmul_s']:.1f} s): {mres.status.upper()} {mres.detail}")
    for dev, d in mres.data.get("devices", {}).items():
        book = BOOK_TFLOPS.get((d.get("model") or "").split("-")[0])
        cmp = f"  book {book}: {d['best'] / book:6.1%}" if book else ""
        print(f"  {dev}: best {d['best']:7.1f}  median {d['median']:7.1f} TFLOPS  ({d['best_shape']}, "
              f"{d['name']}){cmp}")
    out["matmul"] = mres.to_dict()

    from clusterops.health.probes.copybw import probe_copybw

    t0 = time.perf_counter()
    cres = probe_copybw({"required": True, "size_mib": 256, "warmup": 3, "iters": 20}, ctx)
    out["copybw_s"] = time.perf_counter() - t0
    print(f"== copy bandwidths ({out['copybw_s']:.1f} s), GB/s")
    for r in cres:
        figs = (r.data or {}).get("gbps", {})
        print(f"  {r.status.upper():5} {r.name:12} slowest {r.value!s:>8} floor {r.threshold!s:>8}  {r.detail}")
        for k, v in sorted(figs.items()):
            print(f"      {k:18} {v:9.1f}")
    out["copybw"] = [r.to_dict() for r in cres]

    out["sdc"] = run_sdc(ctx)
    out["replica_digest"] = run_replica_digest()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


def run_replica_digest() -> dict:
    """The replica check's cost per check for a 1B-parameter bf16 state on cuda:0
    (clusterops.replicas.digest over 1e9 elements in four tensors), median of 5."""
    import statistics

    import torch

    from clusterops.replicas import digest

    n = 1_000_000_000
    tensors = [torch.empty(n // 4, dtype=torch.bfloat16, device="cuda:0").normal_() for _ in range(4)]
    digest(tensors)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        digest(tensors).cpu()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"== replica digest: 1B bf16 parameters on cuda:0: {med * 1e3:.2f} ms per check (median of 5)")
    return {"seconds_per_check_1B_bf16": med, "runs": times}


def run_sdc(ctx) -> dict:
    """The sdc probe with deep's settings: twice here, once in a fresh process (the digest must
    be bitwise the same on every run and every GPU of the node), and once with the fault hook
    (it must differ). Prints the model key and digest to record in health/sdc_digests.yaml."""
    import subprocess

    from clusterops.health.probes.base import ProbeContext
    from clusterops.health.probes.sdc import FAULT_ENV, probe_sdc

    cfg = {"required": True, "size": 512, "iterations": 8, "seed": 29, "gpu_dtype": "bfloat16"}
    times, runs = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        runs.append(probe_sdc(dict(cfg), ctx)[0])
        times.append(time.perf_counter() - t0)
    code = ("import json, sys; from clusterops.health.probes.base import ProbeContext; "
            "from clusterops.health.probes.sdc import probe_sdc; "
            f"r = probe_sdc({cfg!r}, ProbeContext(gpus_required=True))[0]; print(json.dumps(r.value))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    other_value = json.loads(other.stdout.strip().splitlines()[-1]) if other.returncode == 0 else None
    flipped = probe_sdc(dict(cfg), ProbeContext(env={FAULT_ENV: "flip:9"}, gpus_required=True))[0]
    r = runs[0]
    same = r.value == runs[1].value == other_value and r.status == "pass"
    print(f"== sdc ({times[0]:.2f} s first, {times[1]:.3f} s second): {r.status.upper()} {r.detail}")
    print(f"  model key {r.data.get('model_key')!r}  workload {r.data.get('workload')!r}  digest {r.value}")
    print(f"  reproducible (2 runs here + 1 fresh process, all GPUs agree): {same}; "
          f"flip hook changes it: {flipped.value != r.value}")
    if other.returncode != 0:
        print(f"  fresh process failed: {other.stderr.strip()[-300:]}")
    return {"result": r.to_dict(), "times_s": times, "other_process": other_value,
            "reproducible": same, "flip_changes": flipped.value != r.value}


if __name__ == "__main__":
    sys.exit(main())
