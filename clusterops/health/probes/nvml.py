"""NVML probe (nvidia-ml-py, ``import pynvml``): one result per rule, folded over the GPUs.

Rules (per GPU unless said): GPU count against the profile; uncorrectable ECC
(volatile -> fail, aggregate -> warn); remapped rows pending / remap failure (Ampere and
later) or retired pages pending (earlier GPUs); uncorrectable SRAM errors; temperature;
clock-event reasons (HW slowdown, HW thermal, power brake -> fail; SW thermal -> warn);
PCIe link width against the maximum (fail), generation against the maximum only while the
GPU is busy (the link drops to a low generation at idle to save power); NVLink links
inactive and error counters; persistence mode; driver version against the profile;
compute processes left over from a previous job. Per node: the driver and VBIOS versions,
and the GPU fabric's NVLink domain (GB200 NVL72: ``nvml.fabric``, which the supervisor
places spares by).

The pynvml module is passed in through ``ctx.nvml`` (tests use the stand-in in
``clusterops.health.probes.nvml_standin``) or imported here, lazily.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from clusterops.health.probes import state as local_state
from clusterops.health.probes.base import ProbeContext, ProbeResult, worst

# NVML return codes (nvml.h); used through err.value so any pynvml-like module works.
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_DRIVER_NOT_LOADED = 9
ERR_LIBRARY_NOT_FOUND = 12
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15

# Clock-event ("throttle") reason bits (nvml.h nvmlClocksEventReason*).
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80

MEMORY_ERROR_UNCORRECTED = 1
VOLATILE_ECC = 0
AGGREGATE_ECC = 1
MEMORY_LOCATION_SRAM = 7
TEMPERATURE_GPU = 0
NVLINK_MAX_LINKS = 18
NVLINK_ERRORS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}

NOT_SUPPORTED = object()  # a sentinel: the GPU or driver does not offer this reading

# Field ids (nvml.h, nvmlDeviceGetFieldValues). The recovery action is NVML's own advice
# after a fault (driver 570 and newer); the two slowdown fields are cumulative time (ns)
# the clocks were held down by the HW thermal / HW power-brake slowdown.
FI_GPU_RECOVERY_ACTION = 230
FI_HW_THERM_SLOWDOWN_NS = 270
FI_HW_POWER_BRAKE_NS = 271
# nvmlGpuRecoveryAction_t -> (what it means, what to do). 0 is "none".
RECOVERY_ACTIONS: Dict[int, Tuple[str, str]] = {
    1: ("GPU_RESET", "reset the GPU (nvidia-smi -r) when it is idle"),
    2: ("NODE_REBOOT", "reboot the node"),
    3: ("DRAIN_P2P", "stop peer-to-peer traffic to this GPU (drain the node's jobs), then reset it"),
    4: ("DRAIN_AND_RESET", "drain the node's jobs, then reset the GPU"),
    5: ("RECOVER_IMEX_DOMAIN", "recover the node's IMEX domain"),
    6: ("BUS_RESET", "reset the GPU's PCIe bus (reboot if unsure)"),
    7: ("SYSTEM_REBOOT", "reboot the node (full power cycle)"),
}
CLOCK_SM = 1
CLOCK_MEM = 2
# nvmlValueType_t -> the member of nvmlValue_t that holds it.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

# The GPU fabric (nvml.h nvmlGpuFabricState_t): a GPU of a multi-node NVLink domain (GB200
# NVL72) registers with the fabric; once COMPLETED with a success status, its cluster UUID
# and clique id name the domain. GPUs without such a fabric answer NOT_SUPPORTED.
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
FABRIC_NOT_SUPPORTED = 0
FABRIC_COMPLETED = 3
FABRIC_RESULT = "nvml.fabric"
# (pynvml function, the struct it fills): the versioned call first, then the first form,
# which NVML deprecates in its favour (a pynvml or driver without one: the next).
_FABRIC_CALLS = (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                 ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"))


class GpuLost(Exception):
    pass


def load_nvml(ctx: ProbeContext):
    """The pynvml-like module to use: injected, the recorded stand-in, or the real one."""
    if ctx.nvml is not None:
        return ctx.nvml
    standin = ctx.env.get("CLUSTEROPS_NVML_STANDIN")
    if standin:
        from clusterops.health.probes.nvml_standin import load

        return load(standin)
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml


def _code(err: BaseException) -> Optional[int]:
    return getattr(err, "value", None)


def _call(nv, fn_name: str, *args):
    """Call nv.fn_name; NOT_SUPPORTED when the GPU/driver lacks it; GpuLost when the GPU is gone."""
    fn = getattr(nv, fn_name, None)
    if fn is None:
        return NOT_SUPPORTED
    try:
        return fn(*args)
    except nv.NVMLError as e:
        code = _code(e)
        if code in (ERR_NOT_SUPPORTED, ERR_FUNCTION_NOT_FOUND, ERR_INVALID_ARGUMENT):
            return NOT_SUPPORTED
        if code == ERR_GPU_IS_LOST:
            raise GpuLost(str(e)) from None
        raise


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def version_tuple(v: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", str(v)))


def match_model(name: str, gpu_models: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """GPU marketing name (``NVIDIA H100 80GB HBM3``) -> model key of the profile's gpu_models."""
    for key, spec in gpu_models.items():
        for pat in spec.get("match", [key]):
            if re.search(pat, name, re.I):
                return key
    return None


# -- per-GPU readings ------------------------------------------------------------------

def read_gpu(nv, index: int) -> Dict[str, Any]:
    """Every reading the rules need, for one GPU. NOT_SUPPORTED where the GPU lacks it."""
    h = nv.nvmlDeviceGetHandleByIndex(index)
    g: Dict[str, Any] = {"index": index}
    g["name"] = _text(_call(nv, "nvmlDeviceGetName", h))
    pci = _call(nv, "nvmlDeviceGetPciInfo", h)
    g["pci_bus_id"] = _text(getattr(pci, "busId", "")) if pci is not NOT_SUPPORTED else ""
    g["ecc_volatile"] = _call(nv, "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)
    g["ecc_aggregate"] = _call(nv, "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_UNCORRECTED, AGGREGATE_ECC)
    g["remapped_rows"] = _call(nv, "nvmlDeviceGetRemappedRows", h)
    if g["remapped_rows"] is NOT_SUPPORTED:
        g["retired_pages_pending"] = _call(nv, "nvmlDeviceGetRetiredPagesPendingStatus", h)
    g["sram_uncorrected"] = _call(nv, "nvmlDeviceGetMemoryErrorCounter", h, MEMORY_ERROR_UNCORRECTED,
                                  VOLATILE_ECC, MEMORY_LOCATION_SRAM)
    g["temperature_c"] = _call(nv, "nvmlDeviceGetTemperature", h, TEMPERATURE_GPU)
    reasons = _call(nv, "nvmlDeviceGetCurrentClocksEventReasons", h)
    if reasons is NOT_SUPPORTED:  # drivers before 535 only know the old name
        reasons = _call(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", h)
    g["clock_event_reasons"] = reasons
    g["pcie_width"] = _call(nv, "nvmlDeviceGetCurrPcieLinkWidth", h)
    g["pcie_max_width"] = _call(nv, "nvmlDeviceGetMaxPcieLinkWidth", h)
    g["pcie_gen"] = _call(nv, "nvmlDeviceGetCurrPcieLinkGeneration", h)
    g["pcie_max_gen"] = _call(nv, "nvmlDeviceGetMaxPcieLinkGeneration", h)
    util = _call(nv, "nvmlDeviceGetUtilizationRates", h)
    g["utilization_pct"] = getattr(util, "gpu", None) if util is not NOT_SUPPORTED else None
    links: Dict[int, Any] = {}
    for link in range(NVLINK_MAX_LINKS):
        state = _call(nv, "nvmlDeviceGetNvLinkState", h, link)
        if state is NOT_SUPPORTED:
            continue  # no such link on this GPU
        errs = {}
        for ename, ecode in NVLINK_ERRORS.items():
            v = _call(nv, "nvmlDeviceGetNvLinkErrorCounter", h, link, ecode)
            if v is not NOT_SUPPORTED:
                errs[ename] = int(v)
        links[link] = {"active": bool(state), "errors": errs}
    g["nvlink"] = links
    g["fabric"] = read_fabric(nv, h)
    g["persistence"] = _call(nv, "nvmlDeviceGetPersistenceMode", h)
    fields = read_fields(nv, h, (FI_GPU_RECOVERY_ACTION, FI_HW_THERM_SLOWDOWN_NS, FI_HW_POWER_BRAKE_NS))
    g["recovery_action"] = fields[FI_GPU_RECOVERY_ACTION]
    g["slowdown_ns"] = {"hw_thermal": fields[FI_HW_THERM_SLOWDOWN_NS], "hw_power_brake": fields[FI_HW_POWER_BRAKE_NS]}
    g["vbios"] = _text(_call(nv, "nvmlDeviceGetVbiosVersion", h))
    g["clocks_mhz"] = {
        "app_sm": _call(nv, "nvmlDeviceGetApplicationsClock", h, CLOCK_SM),
        "app_mem": _call(nv, "nvmlDeviceGetApplicationsClock", h, CLOCK_MEM),
        "default_app_sm": _call(nv, "nvmlDeviceGetDefaultApplicationsClock", h, CLOCK_SM),
        "default_app_mem": _call(nv, "nvmlDeviceGetDefaultApplicationsClock", h, CLOCK_MEM),
        "max_sm": _call(nv, "nvmlDeviceGetMaxClockInfo", h, CLOCK_SM),
        "sm": _call(nv, "nvmlDeviceGetClockInfo", h, CLOCK_SM),
    }
    procs = _call(nv, "nvmlDeviceGetComputeRunningProcesses", h)
    g["processes"] = [] if procs is NOT_SUPPORTED else [
        {"pid": int(p.pid), "used_mib": (int(p.usedGpuMemory) // (1 << 20)) if p.usedGpuMemory else None}
        for p in procs]
    return g


def read_fields(nv, h, ids: Tuple[int, ...]) -> Dict[int, Any]:
    """Field values by id (one ``nvmlDeviceGetFieldValues`` call); NOT_SUPPORTED for each
    field the driver does not know (its own nvmlReturn is not success) or a driver without
    the call."""
    vals = _call(nv, "nvmlDeviceGetFieldValues", h, list(ids))
    out: Dict[int, Any] = {i: NOT_SUPPORTED for i in ids}
    if vals is NOT_SUPPORTED:
        return out
    for fid, v in zip(ids, vals):
        if int(getattr(v, "nvmlReturn", 1)) != 0:
            continue
        member = _VALUE_MEMBER.get(int(getattr(v, "valueType", 3)), "ullVal")
        out[fid] = getattr(v.value, member)
    return out


def read_fabric(nv, h) -> Any:
    """The GPU's fabric registration: ``{"state", "status", "cluster_uuid", "clique_id"}``;
    NOT_SUPPORTED where the GPU has no fabric or neither pynvml nor the driver has the call;
    ``{"error": ...}`` when the call fails otherwise (the domain is then unknown, which says
    nothing of the node's health)."""
    for fn_name, struct_name in _FABRIC_CALLS:
        struct = getattr(nv, struct_name, None)
        if struct is None:
            continue
        info = struct()
        try:
            if _call(nv, fn_name, h, ctypes.pointer(info)) is NOT_SUPPORTED:
                continue
        except nv.NVMLError as e:
            return {"error": str(e)}
        state = int(info.state) & 0xFF   # nvml.h: an unsigned char; pynvml reads 4 bytes
        if state == FABRIC_NOT_SUPPORTED:
            return NOT_SUPPORTED
        return {"state": state, "status": int(info.status), "clique_id": int(info.cliqueId),
                "cluster_uuid": str(uuid.UUID(bytes=bytes(info.clusterUuid)))}
    return NOT_SUPPORTED


def fabric_domain(f: Any) -> Tuple[Optional[str], str]:
    """One GPU's fabric registration -> (its NVLink domain, ``<cluster uuid>/<clique id>``, or
    None; why it has none, "" when it has no fabric at all). Only a registration COMPLETED
    with a success status and a cluster UUID that is not all zeros names a domain."""
    if not isinstance(f, dict):
        return None, ""
    if "error" in f:
        return None, f"unreadable ({f['error']})"
    if f["state"] != FABRIC_COMPLETED:
        return None, f"state {FABRIC_STATES.get(f['state'], f['state'])}"
    if f["status"] != 0:
        return None, f"registration failed (NVML status {f['status']})"
    if uuid.UUID(f["cluster_uuid"]).int == 0:
        return None, ""
    return f"{f['cluster_uuid']}/{f['clique_id']}", ""


# -- rules: each takes (gpu readings, cfg) -> (status, message or "", value) -----------------

Rule = Callable[[Dict[str, Any], Dict[str, Any]], Tuple[str, str, Any]]


def rule_ecc(g, cfg):
    vol, agg = g["ecc_volatile"], g["ecc_aggregate"]
    if vol is NOT_SUPPORTED and agg is NOT_SUPPORTED:
        return "skip", "", None
    if vol is not NOT_SUPPORTED and vol > int(cfg.get("ecc_volatile_max", 0)):
        return "fail", f"{vol} uncorrectable ECC errors since driver load: reset the GPU; RMA if they recur", vol
    if agg is not NOT_SUPPORTED and agg > int(cfg.get("ecc_aggregate_max", 0)):
        return "warn", f"{agg} uncorrectable ECC errors in its lifetime: watch it, RMA if the count grows", agg
    return "pass", "", 0 if vol is NOT_SUPPORTED else vol


def rule_row_remap(g, cfg):
    rr = g["remapped_rows"]
    if rr is NOT_SUPPORTED:
        pend = g.get("retired_pages_pending", NOT_SUPPORTED)
        if pend is NOT_SUPPORTED:
            return "skip", "", None
        if int(pend) == 1:
            return "fail", "retired pages pending: reboot (or reset the GPU) to retire them", 1
        return "pass", "", 0
    corr, unc, pending, failure = (int(x) for x in rr)
    if failure:
        return "fail", f"row remapping failed ({unc} rows remapped for uncorrectable errors): RMA the GPU", unc
    if pending:
        return "fail", "row remap pending: reset the GPU (or reboot) to apply it", unc
    return "pass", "", corr + unc


def rule_sram(g, cfg):
    v = g["sram_uncorrected"]
    if v is NOT_SUPPORTED:
        return "skip", "", None
    if v > int(cfg.get("sram_uncorrected_max", 0)):
        return "fail", f"{v} uncorrectable SRAM errors: reset the GPU; RMA if they recur", v
    return "pass", "", v


def rule_temperature(g, cfg):
    t = g["temperature_c"]
    if t is NOT_SUPPORTED:
        return "skip", "", None
    if t >= float(cfg.get("temperature_fail_c", 95)):
        return "fail", f"{t} C: check cooling (fans, airflow, inlet temperature)", t
    if t >= float(cfg.get("temperature_warn_c", 85)):
        return "warn", f"{t} C is running hot: check cooling", t
    return "pass", "", t


def rule_clocks(g, cfg):
    r = g["clock_event_reasons"]
    if r is NOT_SUPPORTED:
        return "skip", "", None
    r = int(r)
    hard = []
    if r & REASON_HW_THERMAL:
        hard.append("HW thermal slowdown")
    if r & REASON_HW_POWER_BRAKE:
        hard.append("HW power brake")
    if r & REASON_HW_SLOWDOWN and not hard:
        hard.append("HW slowdown")
    if hard:
        return "fail", f"clocks held down by {', '.join(hard)}: check cooling and power supply/PSU", hex(r)
    if r & REASON_SW_THERMAL:
        return "warn", "SW thermal slowdown: the GPU is near its temperature limit, check cooling", hex(r)
    return "pass", "", hex(r)


def rule_pcie(g, cfg):
    w, mw, gen, mg = g["pcie_width"], g["pcie_max_width"], g["pcie_gen"], g["pcie_max_gen"]
    if NOT_SUPPORTED in (w, mw):
        return "skip", "", None
    if w < mw:
        return "fail", f"PCIe link x{w} < x{mw}: reseat the GPU/riser or check the slot", f"x{w}"
    busy = g.get("utilization_pct")
    min_busy = float(cfg.get("pcie_gen_busy_pct", 50))
    if gen is not NOT_SUPPORTED and mg is not NOT_SUPPORTED and gen < mg:
        if busy is not None and busy >= min_busy:
            return "fail", (f"PCIe gen{gen} < gen{mg} while {busy}% busy: reseat the GPU or check "
                            "the slot/BIOS link speed"), f"gen{gen} x{w}"
        # Idle GPUs drop the link generation to save power: not a fault by itself.
        return "pass", "", f"gen{gen} x{w} (idle)"
    return "pass", "", f"gen{gen} x{w}"


def rule_nvlink(g, cfg):
    links = g["nvlink"]
    expected = cfg.get("nvlink_links")  # resolved per GPU model; None = as many as the GPU has
    if not links:
        if expected:
            return "fail", f"no NVLink links reported, expected {expected}: check the NVSwitch/fabric manager", 0
        return "skip", "", None
    inactive = [l for l, v in links.items() if not v["active"]]
    active = len(links) - len(inactive)
    if inactive:
        return "fail", (f"NVLink links {','.join(map(str, inactive))} inactive: reset the GPU; "
                        "check fabric manager / RMA if it persists"), active
    if expected and active < int(expected):
        return "fail", f"{active} NVLink links < {expected}: check fabric manager, RMA if it persists", active
    totals = {k: sum(v["errors"].get(k, 0) for v in links.values()) for k in NVLINK_ERRORS}
    if totals["recovery"] > int(cfg.get("nvlink_recovery_max", 0)):
        return "fail", f"{totals['recovery']} NVLink recovery errors: reset the GPU; RMA if they recur", active
    noisy = totals["replay"] + totals["crc_flit"] + totals["crc_data"]
    if noisy > int(cfg.get("nvlink_crc_replay_max", 1000)):
        return "warn", f"{noisy} NVLink CRC/replay errors: a marginal link, watch it", active
    return "pass", "", active


def rule_persistence(g, cfg):
    p = g["persistence"]
    if p is NOT_SUPPORTED:
        return "skip", "", None
    if int(p) != 1:
        level = "fail" if cfg.get("persistence_required") else "warn"
        return level, "persistence mode off: start nvidia-persistenced (or nvidia-smi -pm 1)", "off"
    return "pass", "", "on"


def rule_recovery_action(g, cfg):
    """NVML's advice after a fault (driver 570+): anything but NONE fails, with the action."""
    a = g.get("recovery_action", NOT_SUPPORTED)
    if a is NOT_SUPPORTED:
        return "skip", "", None
    a = int(a)
    if a == 0:
        return "pass", "", "NONE"
    name, todo = RECOVERY_ACTIONS.get(a, (f"action {a}", "see the NVML documentation for this recovery action"))
    return "fail", f"NVML recovery action {name}: {todo}", name


def rule_app_clocks(g, cfg):
    """Application clocks below the GPU's defaults (someone ran ``nvidia-smi -ac`` low), and
    a maximum SM clock below the model's (a power-capped or mis-flashed board)."""
    clk = g.get("clocks_mhz") or {}
    app, dflt = clk.get("app_sm", NOT_SUPPORTED), clk.get("default_app_sm", NOT_SUPPORTED)
    mx, want = clk.get("max_sm", NOT_SUPPORTED), cfg.get("_model_max_sm_mhz")
    if want and mx is not NOT_SUPPORTED and int(mx) < int(want):
        return "fail", f"max SM clock {mx} MHz < the model's {want} MHz: check the VBIOS and power limits", mx
    parts = []
    for kind in ("sm", "mem"):
        a, d = clk.get(f"app_{kind}", NOT_SUPPORTED), clk.get(f"default_app_{kind}", NOT_SUPPORTED)
        if NOT_SUPPORTED not in (a, d) and int(a) < int(d):
            parts.append(f"application {kind.upper()} clock {a} MHz < default {d} MHz")
    if parts:
        return "warn", "; ".join(parts) + ": reset them (nvidia-smi -rac)", app
    if app is NOT_SUPPORTED and dflt is NOT_SUPPORTED and mx is NOT_SUPPORTED:
        return "skip", "", None
    return "pass", "", app if app is not NOT_SUPPORTED else mx


def rule_slowdown(g, cfg):
    """HW thermal and power-brake slowdown time since the last check (local state): any
    warns; above ``slowdown_fail_fraction`` of the time between the checks fails."""
    rise = g.get("_slowdown_rise_s")
    if rise is None:
        return "skip", "", None
    elapsed = g.get("_slowdown_elapsed_s") or 0.0
    total = sum(rise.values())
    if total <= 0:
        return "pass", "", 0.0
    what = ", ".join(f"{k.replace('_', ' ')} {v:.3g} s" for k, v in rise.items() if v > 0)
    frac = float(cfg.get("slowdown_fail_fraction", 0.05))
    if elapsed > 0 and total / elapsed > frac:
        return "fail", (f"clocks held down {total:.3g} s of the last {elapsed:.0f} s ({what}): check cooling "
                        "and the power supply"), round(total, 3)
    return "warn", f"clocks held down {total:.3g} s since the last check ({what})", round(total, 3)


def rule_processes(g, cfg):
    """A compute process that belongs to no Slurm job is a stray; a job's own processes
    (the node is busy: HealthCheckNodeState=ANY runs the check under running jobs) are not."""
    ignore = set(cfg.get("_ignore_pids", ()))
    jobs = cfg.get("_jobs") or {}
    left = [p for p in g["processes"] if p["pid"] not in ignore and not jobs.get(p["pid"])]
    if left:
        pids = " ".join(str(p["pid"]) for p in left)
        level = cfg.get("leftover_process_status", "fail")
        return level, (f"compute processes of no Slurm job on the GPU (pids {pids}): "
                       "kill them (left from an earlier job, or started outside Slurm)"), len(left)
    return "pass", "", 0


RULES: List[Tuple[str, Rule, str]] = [
    ("nvml.ecc", rule_ecc, "errors"),
    ("nvml.row_remap", rule_row_remap, "rows"),
    ("nvml.sram", rule_sram, "errors"),
    ("nvml.temperature", rule_temperature, "C"),
    ("nvml.clocks", rule_clocks, ""),
    ("nvml.pcie", rule_pcie, ""),
    ("nvml.nvlink", rule_nvlink, "links"),
    ("nvml.persistence", rule_persistence, ""),
    ("nvml.recovery_action", rule_recovery_action, ""),
    ("nvml.app_clocks", rule_app_clocks, "MHz"),
    ("nvml.slowdown", rule_slowdown, "s"),
    ("nvml.processes", rule_processes, "processes"),
]

_THRESHOLDS = {
    "nvml.ecc": lambda c: {"volatile_max": c.get("ecc_volatile_max", 0), "aggregate_max": c.get("ecc_aggregate_max", 0)},
    "nvml.sram": lambda c: c.get("sram_uncorrected_max", 0),
    "nvml.temperature": lambda c: {"warn_c": c.get("temperature_warn_c", 85), "fail_c": c.get("temperature_fail_c", 95)},
    "nvml.row_remap": lambda c: "no pending, no failure",
    "nvml.clocks": lambda c: "no HW slowdown/thermal/power brake",
    "nvml.pcie": lambda c: "width and (when busy) gen at max",
    "nvml.nvlink": lambda c: {"links": c.get("nvlink_links"), "recovery_max": c.get("nvlink_recovery_max", 0)},
    "nvml.persistence": lambda c: "on",
    "nvml.recovery_action": lambda c: "NONE",
    "nvml.app_clocks": lambda c: "at the defaults; max SM clock at the model's",
    "nvml.slowdown": lambda c: {"fail_fraction": c.get("slowdown_fail_fraction", 0.05)},
    "nvml.processes": lambda c: 0,
}


def _fold(rule_name: str, unit: str, per_gpu: List[Tuple[Dict[str, Any], str, str, Any]],
          cfg: Dict[str, Any]) -> ProbeResult:
    statuses = [s for _, s, _, _ in per_gpu]
    status = worst(statuses) if statuses else "skip"
    bad = [(g, m) for g, s, m, _ in per_gpu if s in ("fail", "warn", "error") and m]
    data = {f"gpu{g['index']}": {"status": s, "value": v} for g, s, _, v in per_gpu}
    numeric = [v for _, s, _, v in per_gpu if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if rule_name == "nvml.nvlink":
        value = min(numeric) if numeric else None
    elif rule_name == "nvml.recovery_action":   # the action of the first GPU that has one
        acts = [v for _, s, _, v in per_gpu if s == "fail"] or [v for _, _, _, v in per_gpu if v]
        value = acts[0] if acts else None
    else:
        value = max(numeric) if numeric else None
    if bad:
        detail = "; ".join(f"GPU{g['index']} ({g['pci_bus_id'] or g['name']}): {m}" for g, m in bad[:4])
        if len(bad) > 4:
            detail += f"; and {len(bad) - 4} more GPUs"
    elif status == "skip":
        detail = "not supported on these GPUs"
    else:
        detail = f"{len(per_gpu)} GPUs ok"
    return ProbeResult(rule_name, status, value=value, unit=unit, threshold=_THRESHOLDS[rule_name](cfg),
                       detail=detail, data=data)


def rule_versions(driver: str, gpus: List[Dict[str, Any]]) -> ProbeResult:
    """The driver and VBIOS versions, for the sweep's fleet comparison (a node whose
    versions differ from the rest of its partition); GPUs of one node with different
    VBIOS versions warn."""
    vbios = {f"gpu{g['index']}": g["vbios"] for g in gpus if g.get("vbios") not in (None, "", _text(NOT_SUPPORTED))}
    distinct = sorted(set(vbios.values()))
    data = {"driver": driver, "vbios": vbios}
    value = f"driver {driver}, VBIOS {'/'.join(distinct) or 'unknown'}"
    if len(distinct) > 1:
        return ProbeResult("nvml.versions", "warn", value=value, data=data,
                           detail=f"GPUs of this node run different VBIOS versions ({', '.join(distinct)}): "
                                  "flash them to one version")
    return ProbeResult("nvml.versions", "pass", value=value, data=data, detail=value)


def rule_fabric(gpus: List[Dict[str, Any]]) -> ProbeResult:
    """The node's NVLink domain (``data.fabric``) from its GPUs' fabric registrations, for
    the supervisor's choice of a spare. GPUs without a fabric: skip. GPUs that disagree, or
    a registration not completed: warn and no domain (a spare is not placed on a guess);
    nothing here fails a node."""
    said = {g["index"]: fabric_domain(g.get("fabric", NOT_SUPPORTED)) for g in gpus}
    words = {i: domain or why or None for i, (domain, why) in said.items()}
    data: Dict[str, Any] = {"fabric": None, "gpus": {f"gpu{i}": w for i, w in words.items()}}
    distinct = set(words.values())
    if distinct <= {None}:
        return ProbeResult(FABRIC_RESULT, "skip", data=data, detail="no GPU fabric (NVLink domain) on these GPUs")
    check = "check the GPUs' fabric registration (nvidia-smi -q, Fabric) and the NVLink fabric's manager"
    if len(distinct) == 1:
        word = distinct.pop()
        if not any(why for _, why in said.values()):
            data["fabric"] = word
            return ProbeResult(FABRIC_RESULT, "pass", value=word, data=data, detail=f"NVLink domain {word}")
        return ProbeResult(FABRIC_RESULT, "warn", data=data,
                           detail=f"GPU fabric {word} on every GPU, so no NVLink domain: {check}")
    groups: Dict[str, List[str]] = {}
    for i, w in words.items():
        groups.setdefault(w or "no fabric", []).append(str(i))
    parts = "; ".join(f"GPU{','.join(idx)}: {w}" for w, idx in groups.items())
    return ProbeResult(FABRIC_RESULT, "warn", data=data,
                       detail=f"GPUs of this node report different GPU fabrics ({parts}), so no NVLink domain: {check}")


def slowdown_since_last(gpus: List[Dict[str, Any]], cfg: Dict[str, Any], ctx: ProbeContext, now: float) -> None:
    """Set each GPU's ``_slowdown_rise_s`` (HW thermal / power-brake slowdown seconds since
    the previous check, from the node's local state) and ``_slowdown_elapsed_s``. A GPU
    without the counters, or the first check, gets None (the rule skips)."""
    readings = {g["pci_bus_id"] or str(g["index"]): g for g in gpus
                if all(v is not NOT_SUPPORTED for v in (g.get("slowdown_ns") or {"x": NOT_SUPPORTED}).values())}
    for g in gpus:
        g["_slowdown_rise_s"] = None
    if not readings:
        return
    path = Path(cfg["state_file"]) if cfg.get("state_file") else \
        local_state.default_state_file(ctx.state_dir, ctx.env, ctx.node, "nvml")

    def change(saved: Dict[str, Any]) -> None:
        before = saved.get("slowdown_ns") if isinstance(saved.get("slowdown_ns"), dict) else {}
        then = saved.get("time")
        for key, g in readings.items():
            prev = before.get(key)
            if isinstance(prev, dict) and isinstance(then, (int, float)):
                # A counter below its saved value was reset (driver reload): its value is the rise.
                g["_slowdown_rise_s"] = {k: (int(v) - int(prev.get(k, 0)) if int(v) >= int(prev.get(k, 0))
                                             else int(v)) / 1e9 for k, v in g["slowdown_ns"].items()}
                g["_slowdown_elapsed_s"] = max(0.0, now - float(then))
        saved["slowdown_ns"] = {k: {n: int(v) for n, v in g["slowdown_ns"].items()} for k, g in readings.items()}
        saved["time"] = now

    try:
        local_state.update(path, change)
    except OSError:
        for g in gpus:
            g["_slowdown_rise_s"] = None


def local_gpu_evidence(host_root: str = "/") -> List[str]:
    """What on this host says it has NVIDIA GPUs (cheap: two directory listings)."""
    out = []
    try:
        n = len(os.listdir(os.path.join(host_root, "proc/driver/nvidia/gpus")))
        if n:
            out.append(f"{n} GPUs in /proc/driver/nvidia/gpus")
    except OSError:
        pass
    try:
        devs = [d for d in os.listdir(os.path.join(host_root, "dev")) if re.fullmatch(r"nvidia\d+", d)]
        if devs:
            out.append(f"{len(devs)} /dev/nvidiaN devices")
    except OSError:
        pass
    return out


def slurm_gpu_count(node: str, timeout_s: float) -> Optional[int]:
    """GPUs Slurm's gres gives ``node`` (one bounded query; None when Slurm cannot say)."""
    from clusterops.slurm.gres import gpu_count
    from clusterops.slurm.factory import connect

    slurm = connect(timeout_s=timeout_s, read_attempts=1)
    return gpu_count(slurm.node(node).gres)


def _slurm_gpus(cfg: Dict[str, Any], ctx: ProbeContext) -> Tuple[Optional[int], str]:
    """(count or None, why) from Slurm's gres for this node; asked once per check."""
    if "slurm_gpus" not in ctx.cache:
        ask = ctx.slurm_gpus or slurm_gpu_count
        try:
            ctx.cache["slurm_gpus"] = (ask(ctx.node, float(cfg.get("slurm_timeout_s", 2))), "")
        except Exception as e:  # no Slurm here, controller down, node unknown: no expectation
            ctx.cache["slurm_gpus"] = (None, f"{type(e).__name__}: {e}")
    return ctx.cache["slurm_gpus"]


def probe_nvml(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    required = bool(cfg.get("required", ctx.gpus_required))
    nv = load_nvml(ctx)
    if nv is None:
        evidence = local_gpu_evidence(ctx.host_root)
        if evidence:
            # A GPU node that cannot be checked is not healthy: never a silent pass.
            return [ProbeResult("nvml", "error", data={"evidence": evidence},
                                detail=(f"this node has GPUs ({'; '.join(evidence)}) but pynvml is not "
                                        "installed, so no GPU was checked: pip install 'clusterops[gpu]' "
                                        "(nvidia-ml-py) into clusterops' environment"))]
        return [ProbeResult("nvml", "fail" if required else "skip",
                            detail=("pynvml not installed: pip install nvidia-ml-py" if required
                                    else "pynvml not installed; no GPUs checked"))]
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        if _code(e) in (ERR_LIBRARY_NOT_FOUND, ERR_DRIVER_NOT_LOADED):
            evidence = local_gpu_evidence(ctx.host_root)
            if evidence:
                what = ("libnvidia-ml.so.1 not found: install the NVIDIA driver's NVML library "
                        "(the driver package's libnvidia-ml / nvidia-utils) matching the kernel module"
                        if _code(e) == ERR_LIBRARY_NOT_FOUND else
                        "the NVIDIA kernel driver is not loaded: load it (modprobe nvidia) or reinstall the driver")
                return [ProbeResult("nvml", "error", data={"evidence": evidence},
                                    detail=f"this node has GPUs ({'; '.join(evidence)}) but NVML cannot "
                                           f"be loaded, so no GPU was checked: {what}")]
            if not required:
                return [ProbeResult("nvml", "skip", detail="no NVIDIA driver on this node; GPU probes skipped")]
        return [ProbeResult("nvml", "fail", detail=f"NVML init failed ({e}): check the NVIDIA driver "
                                                   "(nvidia-smi, dmesg); reboot if it is wedged")]
    try:
        return _probe(nv, cfg, ctx)
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def _probe(nv, cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    results: List[ProbeResult] = []
    count = int(nv.nvmlDeviceGetCount())
    ctx.cache["gpu_count"] = count  # the local dist test runs one rank per GPU
    want = cfg.get("gpu_count")
    source = "profile"
    if want is None and cfg.get("gpus_from_slurm", True) and (count > 0 or local_gpu_evidence(ctx.host_root)):
        # The node has GPUs: hold it to what Slurm schedules on it (its gres), asked only
        # here so CPU nodes never wait on the controller.
        slurm_n, _why = _slurm_gpus(cfg, ctx)
        if slurm_n:
            want, source = slurm_n, "Slurm gres"
    if want is None and (cfg.get("required", ctx.gpus_required)) and count == 0:
        want = 1
    data = {"expected_from": source if want is not None else None}
    if want is not None and count != int(want):
        results.append(ProbeResult("nvml.gpu_count", "fail", value=count, unit="GPUs", threshold=int(want),
                                   data=data,
                                   detail=f"{count} GPUs visible, expected {want} ({source}): a GPU fell off "
                                          "the bus or is missing; check dmesg for Xid 79, reboot, RMA if it stays"))
    else:
        results.append(ProbeResult("nvml.gpu_count", "pass", value=count, unit="GPUs", threshold=want,
                                   data=data, detail=f"{count} GPUs visible"))
    # Driver version against the profile.
    drv = _text(_call(nv, "nvmlSystemGetDriverVersion"))
    dcfg = cfg.get("driver") or {}
    problems = []
    if dcfg.get("min") and version_tuple(drv) < version_tuple(dcfg["min"]):
        problems.append(f"driver {drv} older than {dcfg['min']}")
    if dcfg.get("exact") and version_tuple(drv) != version_tuple(dcfg["exact"]):
        problems.append(f"driver {drv} is not the fleet's {dcfg['exact']}")
    results.append(ProbeResult("nvml.driver", "fail" if problems else "pass", value=drv,
                               threshold={k: v for k, v in dcfg.items() if v} or None,
                               detail=("; ".join(problems) + ": install the site's driver version") if problems
                               else f"driver {drv}"))
    if count == 0:
        return results

    ignore = {os.getpid()}
    gpus: List[Dict[str, Any]] = []
    lost: List[Tuple[int, str]] = []
    for i in range(count):
        try:
            gpus.append(read_gpu(nv, i))
        except GpuLost as e:
            lost.append((i, str(e)))
    if lost:
        results.append(ProbeResult("nvml.gpu_lost", "fail", value=len(lost), unit="GPUs", threshold=0,
                                   detail="; ".join(f"GPU{i}: {m}" for i, m in lost) +
                                          ": the GPU fell off the bus; reboot the node, RMA if it recurs"))
    # Per-model expectations (NVLink link count) resolved from the profile's gpu_models.
    models = {g["index"]: match_model(g["name"], ctx.gpu_models) for g in gpus}
    if gpus:
        ctx.cache.setdefault("gpu_model", models[gpus[0]["index"]])   # the dist probe's busbw floor
    from clusterops.health.probes.host import job_of_process

    proc_root = os.path.join(ctx.host_root, "proc")
    jobs = {p["pid"]: job_of_process(p["pid"], proc_root) for g in gpus for p in g["processes"]}
    slowdown_since_last(gpus, cfg, ctx, time.time())
    for name, rule, unit in RULES:
        per_gpu = []
        for g in gpus:
            c = dict(cfg, _ignore_pids=ignore, _jobs=jobs)
            spec = ctx.gpu_models.get(models.get(g["index"]) or "") or {}
            if name == "nvml.nvlink" and c.get("nvlink_links") is None:
                c["nvlink_links"] = spec.get("nvlink_links")
            c["_model_max_sm_mhz"] = spec.get("max_sm_clock_mhz")
            status, msg, value = rule(g, c)
            per_gpu.append((g, status, msg, value))
        results.append(_fold(name, unit, per_gpu, cfg))
    results[0].data.update(gpus=[{"index": g["index"], "name": g["name"], "pci_bus_id": g["pci_bus_id"],
                                  "model": models.get(g["index"])} for g in gpus])
    results.append(rule_versions(drv, gpus))
    results.append(rule_fabric(gpus))
    for r in results:
        if r.name == "nvml.processes":
            r.data["job_processes"] = {str(pid): job for pid, job in jobs.items() if job}
    return results
