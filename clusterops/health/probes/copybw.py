"""Copy bandwidth on the GPUs, through torch: host<->device, peer-to-peer, device memory.

Four results, each folded over the node's GPUs (or GPU pairs):

- ``copybw.h2d`` / ``copybw.d2h``: a pinned host buffer copied to each GPU and back
  (``non_blocking`` copies from page-locked memory: what a data loader with
  ``pin_memory=True`` gets). A GPU behind a degraded PCIe link or switch shows here first.
- ``copybw.p2p``: one GPU's buffer copied to another's, for every ordered pair that has
  peer access (NVLink or PCIe P2P); a pair without peer access fails when the model has a
  P2P floor.
- ``copybw.hbm``: a device-to-device copy within each GPU. Bytes counted: read + written
  (2 x the buffer), the convention of STREAM's copy kernel, so the figure compares with
  the vendor's peak memory bandwidth.

Each copy is timed with CUDA events around ``iters`` copies after ``warmup`` ones; the
figure is bytes / median time in GB/s (10^9). Floors come from the GPU model
(``gpu_models.yaml``: ``h2d_gbps``, ``d2h_gbps``, ``p2p_gbps``, and ``hbm_gbps`` x
``hbm_min_fraction``), or the profile's ``min_*_gbps`` over them; a GPU (or pair) more
than ``straggler_pct`` below the node's best is a straggler whatever the floor.

torch is imported here only, lazily; the ``fast`` profile never runs this probe.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Mapping, Optional

from clusterops.health.probes.base import ProbeContext, ProbeResult
from clusterops.health.probes.nvml import local_gpu_evidence, match_model

KINDS = ("h2d", "d2h", "p2p", "hbm")
_ADVICE = {
    "h2d": "check the GPU's PCIe link (nvml.pcie), the switch and NUMA placement; reseat the GPU if it stays slow",
    "d2h": "check the GPU's PCIe link (nvml.pcie), the switch and NUMA placement; reseat the GPU if it stays slow",
    "p2p": "check NVLink (nvml.nvlink, nvidia-smi topo -m) and that P2P is not disabled (ACS, IOMMU)",
    "hbm": "check clocks (nvml.clocks, nvml.app_clocks) and row remapping; reset the GPU, RMA if it stays slow",
}


def _time_copies(torch, dst, src, warmup: int, iters: int, stream_device) -> float:
    """Median seconds of one ``dst.copy_(src)`` (CUDA events on ``stream_device``)."""
    with torch.cuda.device(stream_device):
        for _ in range(warmup):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(torch, size_bytes: int, warmup: int, iters: int, kinds=KINDS) -> Dict[str, Dict[str, float]]:
    """GB/s per kind: ``{"h2d": {"cuda:0": x, ...}, "p2p": {"cuda:0->cuda:1": y, ...}, ...}``.
    A pair without peer access is ``None``."""
    n = torch.cuda.device_count()
    out: Dict[str, Dict[str, Optional[float]]] = {k: {} for k in kinds}
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True) if {"h2d", "d2h"} & set(kinds) else None
    bufs = [torch.empty(size_bytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    for i, buf in enumerate(bufs):
        dev = f"cuda:{i}"
        if "h2d" in kinds:
            out["h2d"][dev] = size_bytes / _time_copies(torch, buf, host, warmup, iters, i) / 1e9
        if "d2h" in kinds:
            out["d2h"][dev] = size_bytes / _time_copies(torch, host, buf, warmup, iters, i) / 1e9
        if "hbm" in kinds:
            half = size_bytes // 2
            a, b = buf[:half], buf[half:2 * half]
            out["hbm"][dev] = 2 * half / _time_copies(torch, b, a, warmup, iters, i) / 1e9
    if "p2p" in kinds:
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                key = f"cuda:{i}->cuda:{j}"
                if not torch.cuda.can_device_access_peer(i, j):
                    out["p2p"][key] = None
                    continue
                out["p2p"][key] = size_bytes / _time_copies(torch, bufs[j], bufs[i], warmup, iters, i) / 1e9
    return out


def floors(cfg: Mapping[str, Any], spec: Mapping[str, Any]) -> Dict[str, Optional[float]]:
    """The floor of each kind: the profile's ``min_<kind>_gbps``, else the model's figure."""
    frac = float(cfg.get("hbm_min_fraction", 0.7))
    out = {"h2d": cfg.get("min_h2d_gbps"), "d2h": cfg.get("min_d2h_gbps"), "p2p": cfg.get("min_p2p_gbps"),
           "hbm": cfg.get("min_hbm_gbps")}
    for k in ("h2d", "d2h", "p2p"):
        if out[k] is None:
            out[k] = spec.get(f"{k}_gbps")
    if out["hbm"] is None and spec.get("hbm_gbps"):
        out["hbm"] = round(float(spec["hbm_gbps"]) * frac, 1)
    return out


def judge(kind: str, figures: Mapping[str, Optional[float]], floor: Optional[float], straggler_pct: float,
          model: Optional[str]) -> ProbeResult:
    """One kind's figures (GB/s per GPU or pair; None: no peer access) -> one result (pure)."""
    name = f"copybw.{kind}"
    measured = {k: round(v, 2) for k, v in figures.items() if v is not None}
    no_peer = sorted(k for k, v in figures.items() if v is None)
    data = {"gbps": measured, "no_peer_access": no_peer, "model": model}
    if not measured and not no_peer:
        return ProbeResult(name, "skip", unit="GB/s", detail="nothing to measure (one GPU)" if kind == "p2p"
                           else "no GPU measured")
    problems: List[str] = []
    if no_peer and floor:
        problems.append(f"no peer access {', '.join(no_peer[:3])}{' ...' if len(no_peer) > 3 else ''}")
    best = max(measured.values()) if measured else 0.0
    for k, v in sorted(measured.items(), key=lambda kv: kv[1]):
        if floor and v < floor:
            problems.append(f"{k} {v:.1f} GB/s < {floor:g}")
        elif len(measured) > 1 and v < best * (1 - straggler_pct / 100):
            problems.append(f"{k} {v:.1f} GB/s is more than {straggler_pct:g}% below the node's best {best:.1f}")
    value = min(measured.values()) if measured else None
    if problems:
        return ProbeResult(name, "fail", value=value, unit="GB/s", threshold=floor, data=data,
                           detail="; ".join(problems[:3]) + f"; {_ADVICE[kind]}")
    if not floor:
        return ProbeResult(name, "pass", value=value, unit="GB/s", threshold=None, data=data,
                           detail=f"slowest {value:.1f} GB/s (no {kind} floor for "
                                  f"{model or 'this GPU model'}; set min_{kind}_gbps to hold it to one)")
    return ProbeResult(name, "pass", value=value, unit="GB/s", threshold=floor, data=data,
                       detail=f"slowest {value:.1f} GB/s >= {floor:g}")


def probe_copybw(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    required = bool(cfg.get("required", ctx.gpus_required))
    evidence = local_gpu_evidence(ctx.host_root)
    try:
        import torch
    except ImportError:
        return [ProbeResult("copybw", "error" if (required or evidence) else "skip",
                            detail="torch not installed: pip install clusterops[torch]")]
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        if required or evidence:
            return [ProbeResult("copybw", "error", detail="the node shows GPUs but torch sees no CUDA device: "
                                                          "check the driver, torch's CUDA build and CUDA_VISIBLE_DEVICES")]
        return [ProbeResult("copybw", "skip", detail="no CUDA device (copy bandwidths are measured on GPUs only)")]
    kinds = tuple(k for k in KINDS if k in (cfg.get("kinds") or KINDS))
    size = int(cfg.get("size_mib", 256)) << 20
    figures = measure(torch, size, int(cfg.get("warmup", 3)), int(cfg.get("iters", 10)), kinds)
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    model = match_model(names[0], ctx.gpu_models) if names else None
    fl = floors(cfg, ctx.gpu_models.get(model or "") or {})
    pct = float(cfg.get("straggler_pct", 15))
    return [judge(k, figures[k], fl[k], pct, model) for k in kinds]


__all__ = ["KINDS", "floors", "judge", "measure", "probe_copybw"]
