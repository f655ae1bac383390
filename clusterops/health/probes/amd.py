"""AMD GPU probe (AMD's ``amdsmi`` Python library, the ``amd`` extra): one result per rule,
folded over the GPUs, as the NVML probe does for NVIDIA.

Rules: GPU count against the profile or Slurm's gres; ECC (uncorrectable or deferred
errors fail, correctable above ``ecc_correctable_max`` warn); retired (bad) pages
(any pending or unreservable page fails, reserved pages above ``bad_pages_max`` warn);
RAS error state per block (``MULT_UC``/``POISON`` fail, ``PARITY``/``SING_C`` warn);
XGMI links (a link down fails; the XGMI error status fails); the PCIe link against its
maximum width and speed (width fails, speed only when busy); throttle status (warns);
hotspot and memory temperatures; socket power against the cap.

Without the library, on a node with AMD GPUs, the probe reads ROCm's ``amd-smi`` CLI
(``amd-smi static|metric|bad-pages|topology --json``, through the runner:
:mod:`clusterops.health.probes.amd_cli`, ``cli: false`` turns it off). The library is passed in as ``ctx.amdsmi`` (tests use
:mod:`clusterops.health.probes.amd_standin`, fed with recorded return values; set
``CLUSTEROPS_AMDSMI_STANDIN=file.json`` for the CLI), or imported here, lazily. A node
with AMD GPUs (``/dev/kfd``, the amdgpu module, or a Slurm gres of an AMD type such as
``gpu:mi300x:8``) with neither ``amdsmi`` nor ``amd-smi`` is an ``error`` that says what to
install, never a skip.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from clusterops.health.probes.base import ProbeContext, ProbeResult, worst
from clusterops.health.probes.nvml import local_gpu_evidence, match_model
from clusterops.runner import CommandNotFound, CommandTimeout

NOT_SUPPORTED = object()
RAS_BLOCKS = ("UMC", "SDMA", "GFX", "MMHUB", "ATHUB", "PCIE_BIF", "HDP", "XGMI_WAFL", "DF", "SMN", "SEM",
              "MP0", "MP1", "FUSE")
_RAS_FAIL = {"MULT_UC", "POISON"}
_RAS_WARN = {"PARITY", "SING_C"}
# A Slurm gres type that names an AMD GPU: gpu:mi300x:8, gpu:amd:4, gpu:instinct_mi250:4.
AMD_GRES = re.compile(r"gpu:(?:[^:,(]*(?:mi\d{3}|amd|instinct)[^:,(]*)(?::|\(|,|$)", re.I)
INSTALL = ("pip install 'clusterops[amd]' (AMD's amdsmi binding, from the ROCm release that matches the "
           "driver: /opt/rocm/share/amd_smi)")


def load_amdsmi(ctx: ProbeContext):
    if ctx.amdsmi is not None:
        return ctx.amdsmi
    standin = ctx.env.get("CLUSTEROPS_AMDSMI_STANDIN")
    if standin:
        from clusterops.health.probes.amd_standin import load

        return load(standin)
    try:
        import amdsmi  # AMD's binding (ROCm 6+)
    except ImportError:
        return None
    return amdsmi


def local_amd_evidence(host_root: str = "/") -> List[str]:
    """What on this host says it has AMD GPUs (two cheap lookups)."""
    out = []
    if os.path.exists(os.path.join(host_root, "dev/kfd")):
        out.append("/dev/kfd")
    if os.path.isdir(os.path.join(host_root, "sys/module/amdgpu")):
        out.append("the amdgpu module")
    return out


def slurm_gres(node: str, timeout_s: float) -> Optional[str]:
    from clusterops.slurm.factory import connect

    return connect(timeout_s=timeout_s, read_attempts=1).node(node).gres


def _gres(cfg: Dict[str, Any], ctx: ProbeContext) -> str:
    if "slurm_gres" not in ctx.cache:
        ask = ctx.slurm_gres or slurm_gres
        try:
            ctx.cache["slurm_gres"] = ask(ctx.node, float(cfg.get("slurm_timeout_s", 2))) or ""
        except Exception:  # no Slurm, controller down, node unknown: no expectation
            ctx.cache["slurm_gres"] = ""
    return ctx.cache["slurm_gres"]


def _call(lib, name: str, *args) -> Any:
    fn = getattr(lib, name, None)
    if fn is None:
        return NOT_SUPPORTED
    try:
        return fn(*args)
    except Exception as e:   # AmdSmiLibraryException: not supported on this GPU / firmware
        if type(e).__name__ in ("AmdSmiLibraryException", "AmdSmiException", "AmdSmiParameterException") or \
                getattr(e, "err_code", None) is not None:
            return NOT_SUPPORTED
        raise


def _name(v: Any) -> str:
    """An amdsmi enum value (or its recorded name) -> its name without the class prefix."""
    return str(getattr(v, "name", v)).split(".")[-1].upper()


def read_gpu(lib, h, index: int) -> Dict[str, Any]:
    g: Dict[str, Any] = {"index": index}
    asic = _call(lib, "amdsmi_get_gpu_asic_info", h)
    g["name"] = (asic or {}).get("market_name", "") if asic is not NOT_SUPPORTED else ""
    bdf = _call(lib, "amdsmi_get_gpu_device_bdf", h)
    g["bdf"] = "" if bdf is NOT_SUPPORTED else str(bdf)
    g["ecc"] = _call(lib, "amdsmi_get_gpu_total_ecc_count", h)
    g["bad_pages"] = _call(lib, "amdsmi_get_gpu_bad_page_info", h)
    blocks = getattr(lib, "AmdSmiGpuBlock", None)
    ras: Dict[str, str] = {}
    for b in RAS_BLOCKS:
        arg = getattr(blocks, b, b) if blocks is not None else b
        st = _call(lib, "amdsmi_get_gpu_ecc_status", h, arg)
        if st is not NOT_SUPPORTED:
            ras[b] = _name(st)
    g["ras"] = ras
    g["xgmi_status"] = _call(lib, "amdsmi_get_gpu_xgmi_link_status", h)
    g["xgmi_error"] = _call(lib, "amdsmi_gpu_xgmi_error_status", h)
    g["pcie"] = _call(lib, "amdsmi_get_pcie_info", h)
    g["metrics"] = _call(lib, "amdsmi_get_gpu_metrics_info", h)
    g["power_cap"] = _call(lib, "amdsmi_get_power_cap_info", h)
    act = _call(lib, "amdsmi_get_gpu_activity", h)
    g["busy_pct"] = act.get("gfx_activity") if isinstance(act, dict) else None
    return g


# -- rules: (gpu, cfg) -> (status, message, value) ------------------------------------------

def rule_ecc(g, cfg):
    e = g["ecc"]
    if e is NOT_SUPPORTED or not isinstance(e, dict):
        return "skip", "", None
    unc, dfr, cor = (int(e.get(k, 0) or 0) for k in ("uncorrectable_count", "deferred_count", "correctable_count"))
    if unc > int(cfg.get("ecc_uncorrectable_max", 0)) or dfr > int(cfg.get("ecc_deferred_max", 0)):
        return "fail", f"{unc} uncorrectable and {dfr} deferred ECC errors: reset the GPU, RMA if they recur", unc + dfr
    if cor > int(cfg.get("ecc_correctable_max", 1000)):
        return "warn", f"{cor} correctable ECC errors: watch the GPU's memory", cor
    return "pass", "", unc


def rule_bad_pages(g, cfg):
    pages = g["bad_pages"]
    if pages is NOT_SUPPORTED:
        return "skip", "", None
    pages = list(pages or [])
    states = [_name(p.get("status", "")) for p in pages if isinstance(p, dict)]
    pending = sum(1 for s in states if s == "PENDING")
    unres = sum(1 for s in states if s == "UNRESERVABLE")
    if pending or unres:
        return "fail", (f"{pending} bad pages pending retirement, {unres} unreservable: reboot to retire them "
                        "(unreservable: RMA)"), len(pages)
    if len(pages) > int(cfg.get("bad_pages_max", 64)):
        return "warn", f"{len(pages)} retired pages: the HBM is wearing, plan an RMA", len(pages)
    return "pass", "", len(pages)


def rule_ras(g, cfg):
    if not g["ras"]:
        return "skip", "", None
    bad = {b: s for b, s in g["ras"].items() if s in _RAS_FAIL}
    soft = {b: s for b, s in g["ras"].items() if s in _RAS_WARN}
    if bad:
        return "fail", "RAS " + ", ".join(f"{b} {s}" for b, s in bad.items()) + ": reset the GPU, RMA if it recurs", len(bad)
    if soft:
        return "warn", "RAS " + ", ".join(f"{b} {s}" for b, s in soft.items()), 0
    return "pass", "", 0


def rule_xgmi(g, cfg):
    st, err = g["xgmi_status"], g["xgmi_error"]
    if st is NOT_SUPPORTED and err is NOT_SUPPORTED:
        return "skip", "", None
    links = [_name(s) for s in ((st or {}).get("status") or [])] if isinstance(st, dict) else []
    down = [i for i, s in enumerate(links) if s == "DOWN"]
    up = sum(1 for s in links if s == "UP")
    want = cfg.get("_xgmi_links")
    problems = []
    if down:
        problems.append(f"XGMI links down: {', '.join(map(str, down))}")
    if want and links and up < int(want):
        problems.append(f"{up} XGMI links up < {want}")
    if err is not NOT_SUPPORTED and _name(err) not in ("NO_ERRORS", "0", "NONE"):
        problems.append(f"XGMI error status {_name(err)}")
    if problems:
        return "fail", "; ".join(problems) + ": reset the GPU (amd-smi reset -G), reseat/RMA if it stays", up
    return "pass", "", up


def rule_pcie(g, cfg):
    p = g["pcie"]
    if p is NOT_SUPPORTED or not isinstance(p, dict):
        return "skip", "", None
    st, mt = p.get("pcie_static") or {}, p.get("pcie_metric") or {}
    w, mw = mt.get("pcie_width"), st.get("max_pcie_width")
    sp, msp = mt.get("pcie_speed"), st.get("max_pcie_speed")
    if isinstance(w, int) and isinstance(mw, int) and w < mw:
        return "fail", f"PCIe x{w} < x{mw}: reseat the GPU, check the riser/switch", w
    busy = g.get("busy_pct")
    if isinstance(sp, int) and isinstance(msp, int) and sp < msp and (busy or 0) >= float(cfg.get("pcie_busy_pct", 50)):
        return "fail", f"PCIe {sp} MT/s < {msp} MT/s while {busy}% busy: check the link", w
    return "pass", "", w


def rule_throttle(g, cfg):
    m = g["metrics"]
    if m is NOT_SUPPORTED or not isinstance(m, dict) or m.get("throttle_status") in (None, "N/A"):
        return "skip", "", None
    t = m["throttle_status"]
    if t not in (0, False, "0"):
        return "warn", f"throttling (status {t}): check cooling and power", 1
    return "pass", "", 0


def rule_temperature(g, cfg):
    m = g["metrics"]
    if m is NOT_SUPPORTED or not isinstance(m, dict):
        return "skip", "", None
    hot, mem = m.get("temperature_hotspot"), m.get("temperature_mem")
    vals = [v for v in (hot, mem) if isinstance(v, (int, float))]
    if not vals:
        return "skip", "", None
    t = max(vals)
    if t >= float(cfg.get("temperature_fail_c", 105)):
        return "fail", f"{t} C (hotspot {hot}, HBM {mem}): check cooling", t
    if t >= float(cfg.get("temperature_warn_c", 95)):
        return "warn", f"{t} C (hotspot {hot}, HBM {mem}) is running hot", t
    return "pass", "", t


def rule_power(g, cfg):
    m, cap = g["metrics"], g["power_cap"]
    if m is NOT_SUPPORTED or not isinstance(m, dict):
        return "skip", "", None
    w = m.get("current_socket_power", m.get("average_socket_power"))
    if not isinstance(w, (int, float)):
        return "skip", "", None
    limit = cap.get("power_cap") if isinstance(cap, dict) else None
    if isinstance(limit, (int, float)) and limit > 1e5:
        limit = limit / 1e6     # amdsmi reports the cap in microwatts
    if isinstance(limit, (int, float)) and limit > 0 and w > limit * 1.05:
        return "warn", f"socket power {w} W above the cap {limit:g} W", w
    return "pass", "", w


RULES: List[Tuple[str, Callable, str]] = [
    ("amd.ecc", rule_ecc, "errors"),
    ("amd.bad_pages", rule_bad_pages, "pages"),
    ("amd.ras", rule_ras, "blocks"),
    ("amd.xgmi", rule_xgmi, "links"),
    ("amd.pcie", rule_pcie, "lanes"),
    ("amd.throttle", rule_throttle, ""),
    ("amd.temperature", rule_temperature, "C"),
    ("amd.power", rule_power, "W"),
]


def _fold(name: str, unit: str, per_gpu: List[Tuple[Dict[str, Any], str, str, Any]]) -> ProbeResult:
    status = worst([s for _, s, _, _ in per_gpu]) if per_gpu else "skip"
    bad = [(g, m) for g, s, m, _ in per_gpu if s in ("fail", "warn") and m]
    nums = [v for _, _, _, v in per_gpu if isinstance(v, (int, float)) and not isinstance(v, bool)]
    value = (min(nums) if name in ("amd.xgmi", "amd.pcie") else max(nums)) if nums else None
    data = {f"gpu{g['index']}": {"status": s, "value": v} for g, s, _, v in per_gpu}
    if bad:
        detail = "; ".join(f"GPU{g['index']} ({g['bdf'] or g['name']}): {m}" for g, m in bad[:4])
    elif status == "skip":
        detail = "not supported on these GPUs"
    else:
        detail = f"{len(per_gpu)} GPUs ok"
    return ProbeResult(name, status, value=value, unit=unit, detail=detail, data=data)


def probe_amd(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    lib = load_amdsmi(ctx)
    evidence = local_amd_evidence(ctx.host_root)
    # Slurm is asked only where it can tell something: a node with AMD signs, or a GPU
    # partition's node that shows no NVIDIA GPU either (an NVIDIA node never pays the query).
    ask = evidence or (cfg.get("gres_from_slurm", True) and ctx.gpus_required
                       and not local_gpu_evidence(ctx.host_root))
    gres = _gres(cfg, ctx) if ask else ""
    amd_gres = bool(AMD_GRES.search(gres or ""))
    amd_node = bool(evidence or amd_gres or cfg.get("required"))
    why = ", ".join(evidence) or (f"Slurm gres {gres}" if amd_gres else "the profile requires AMD GPUs")
    reader = "amdsmi"
    if lib is None and amd_node and cfg.get("cli", True):
        # No Python library: ROCm's amd-smi CLI, if the node has it (its JSON, through the runner).
        from clusterops.health.probes.amd_cli import AmdSmiCli

        lib = AmdSmiCli(ctx.runner, program=str(cfg.get("amd_smi", "amd-smi")),
                        timeout_s=float(cfg.get("cli_timeout_s", 10)))
        reader = "amd-smi"
    if lib is None:
        if amd_node:
            return [ProbeResult("amd", "error", detail=f"this node has AMD GPUs ({why}) but the amdsmi Python "
                                                       f"library is missing: {INSTALL}")]
        return [ProbeResult("amd", "skip", detail="no AMD GPUs (no /dev/kfd, no amdgpu module, no AMD gres)")]
    try:
        lib.amdsmi_init()
    except CommandNotFound:
        return [ProbeResult("amd", "error", detail=f"this node has AMD GPUs ({why}) but neither the amdsmi Python "
                                                   f"library nor the amd-smi CLI is there: {INSTALL}")]
    except CommandTimeout as e:
        return [ProbeResult("amd", "error", detail=f"amd-smi did not answer: {e}")]
    except Exception as e:
        status = "error" if (evidence or amd_gres) else "skip"
        what = "amd-smi failed" if reader == "amd-smi" else "amdsmi_init failed"
        return [ProbeResult("amd", status, detail=f"{what} ({type(e).__name__}: {e}): load the amdgpu "
                                                  "driver (modprobe amdgpu) and check ROCm")]
    try:
        handles = list(lib.amdsmi_get_processor_handles() or [])
        gpus = [read_gpu(lib, h, i) for i, h in enumerate(handles)]
    finally:
        try:
            lib.amdsmi_shut_down()
        except Exception:
            pass
    results: List[ProbeResult] = []
    from clusterops.slurm.gres import gpu_count

    if gpus:   # the local dist test runs one rank per GPU (ROCm torch: the cuda API, RCCL)
        ctx.cache["gpu_count"] = len(gpus)
    want, source = cfg.get("gpu_count"), "profile"
    if want is None and amd_gres:
        want, source = gpu_count(gres), "Slurm gres"
    if want is not None and len(gpus) != int(want):
        results.append(ProbeResult("amd.gpu_count", "fail", value=len(gpus), unit="GPUs", threshold=int(want),
                                   detail=f"{len(gpus)} AMD GPUs visible, expected {want} ({source}): a GPU is "
                                          "missing; check dmesg (amdgpu), reboot, RMA if it stays"))
    else:
        results.append(ProbeResult("amd.gpu_count", "pass", value=len(gpus), unit="GPUs", threshold=want,
                                   detail=f"{len(gpus)} AMD GPUs visible"
                                          + (" (read from the amd-smi CLI)" if reader == "amd-smi" else "")))
    results[0].data["source"] = reader
    if not gpus:
        return results
    models = {g["index"]: match_model(g["name"], ctx.gpu_models) for g in gpus}
    ctx.cache.setdefault("gpu_model", models[0])
    for name, rule, unit in RULES:
        per = []
        for g in gpus:
            c = dict(cfg, _xgmi_links=cfg.get("xgmi_links"))
            per.append((g, *rule(g, c)))
        results.append(_fold(name, unit, per))
    results[0].data["gpus"] = [{"index": g["index"], "name": g["name"], "bdf": g["bdf"],
                                "model": models[g["index"]]} for g in gpus]
    return results
