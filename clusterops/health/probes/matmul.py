"""Matmul throughput: each GPU on its own (bf16), or the CPU (fp32) on CPU-only nodes.

Method (after the ml-engineering book's maximum-achievable-matmul-FLOPS finder): a few
shapes, warm-up, then timed iterations with the L2 cache flushed between them (a buffer
twice the L2 size is overwritten, outside the timed region), CUDA events around the
matmul alone. TFLOPS = 2*m*n*k / time. The best and the median are reported per device;
the best is held to the profile's expected figure for the GPU model and to the node's
fastest GPU (a GPU more than ``straggler_pct`` below it is a straggler).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

from clusterops.health.probes.base import ProbeContext, ProbeResult
from clusterops.health.probes.nvml import match_model


def measure(torch, device: str, shapes: Sequence[Sequence[int]], dtype, *, warmup: int = 3,
            iters: int = 10, flush: bool = True) -> Dict[str, Any]:
    """TFLOPS samples per shape on one device -> {best, median, per_shape}."""
    is_cuda = device.startswith("cuda")
    per_shape: Dict[str, Dict[str, float]] = {}
    best_shape, best = None, -1.0
    samples_of: Dict[str, List[float]] = {}
    cache = None
    if is_cuda and flush:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
        cache = torch.empty(int(2 * l2), dtype=torch.int8, device=device)
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        flops = 2.0 * m * n * k
        for _ in range(warmup):
            torch.matmul(a, b)
        if is_cuda:
            torch.cuda.synchronize(device)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for i in range(iters):
                if cache is not None:
                    cache.zero_()  # evict a and b from L2: measure HBM-fed matmul
                starts[i].record()
                torch.matmul(a, b)
                ends[i].record()
            torch.cuda.synchronize(device)
            times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
        else:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                times.append(time.perf_counter() - t0)
        tflops = [flops / t / 1e12 for t in times if t > 0]
        key = f"{m}x{n}x{k}"
        samples_of[key] = tflops
        per_shape[key] = {"best": round(max(tflops), 3), "median": round(statistics.median(tflops), 3)}
        if max(tflops) > best:
            best, best_shape = max(tflops), key
        del a, b
    return {"best": round(best, 3), "median": per_shape[best_shape]["median"], "best_shape": best_shape,
            "per_shape": per_shape}


def probe_matmul(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    required = bool(cfg.get("required", ctx.gpus_required))
    try:
        import torch
    except ImportError:
        return [ProbeResult("matmul", "fail" if required else "skip",
                            detail="torch not installed: pip install clusterops[torch]")]
    warmup, iters = int(cfg.get("warmup", 3)), int(cfg.get("iters", 10))
    straggler_pct = float(cfg.get("straggler_pct", 10))
    min_fraction = float(cfg.get("min_fraction", 0.85))
    devices: List[Tuple[str, str]] = []
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        for i in range(torch.cuda.device_count()):
            devices.append((f"cuda:{i}", torch.cuda.get_device_name(i)))
        dtype, shapes = torch.bfloat16, cfg.get("gpu_shapes", [[8192, 8192, 8192], [4096, 4096, 4096]])
    elif required:
        return [ProbeResult("matmul", "fail", detail="no CUDA device visible to torch but the profile "
                                                     "requires GPUs: check the driver and CUDA_VISIBLE_DEVICES")]
    else:
        devices.append(("cpu", "cpu"))
        dtype, shapes = torch.float32, cfg.get("cpu_shapes", [[1024, 1024, 1024], [2048, 2048, 2048]])

    per_dev: Dict[str, Dict[str, Any]] = {}
    for dev, name in devices:
        r = measure(torch, dev, shapes, dtype, warmup=warmup, iters=iters, flush=bool(cfg.get("flush_l2", True)))
        model = match_model(name, ctx.gpu_models) if dev != "cpu" else None
        expected = (ctx.gpu_models.get(model) or {}).get("matmul_bf16_tflops") if model else cfg.get("cpu_expected_tflops")
        r.update(name=name, model=model, expected=expected)
        per_dev[dev] = r

    return [judge(per_dev, str(dtype).replace("torch.", ""), min_fraction, straggler_pct)]


def judge(per_dev: Dict[str, Dict[str, Any]], dtype: str, min_fraction: float, straggler_pct: float) -> ProbeResult:
    """Per-device figures ({best, median, expected, model, name}) -> one result (pure)."""
    node_best = max(r["best"] for r in per_dev.values())
    problems: List[str] = []
    warn_notes: List[str] = []
    for dev, r in per_dev.items():
        exp = r["expected"]
        if exp:
            floor = exp * min_fraction
            r["threshold"] = round(floor, 3)
            if r["best"] < floor:
                problems.append(f"{dev} {r['best']:.1f} TFLOPS < {floor:.1f} ({min_fraction:.0%} of {exp} "
                                f"for {r['model'] or r['name']})")
        elif dev != "cpu":
            warn_notes.append(f"{dev} ({r['name']}): no expected figure for this GPU model in the profile")
        if len(per_dev) > 1 and r["best"] < node_best * (1 - straggler_pct / 100):
            problems.append(f"{dev} straggler: {r['best']:.1f} TFLOPS is more than {straggler_pct:g}% "
                            f"below the node's best {node_best:.1f}")
    weakest = min(per_dev.values(), key=lambda r: r["best"])
    unit = "TFLOPS"
    threshold = weakest.get("threshold")
    data = {"dtype": dtype, "devices": per_dev, "node_best": node_best}
    if problems:
        return ProbeResult("matmul", "fail", value=weakest["best"], unit=unit, threshold=threshold, data=data,
                            detail="; ".join(problems[:3]) + "; check clocks/cooling/power (nvml.clocks), "
                                                             "reset the GPU, RMA if it stays slow")
    status = "warn" if warn_notes else "pass"
    detail = (warn_notes[0] if warn_notes else
              f"{len(per_dev)} device(s), weakest {weakest['best']:.3f} TFLOPS best / "
              f"{weakest['median']:.3f} median ({data['dtype']})")
    return ProbeResult("matmul", status, value=weakest["best"], unit=unit, threshold=threshold,
                       data=data, detail=detail)
