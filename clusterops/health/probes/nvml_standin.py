"""A stand-in for the pynvml module, fed with recorded values (tests, demos, the dev cluster).

It has the same function names as nvidia-ml-py and raises the real pynvml exception
classes (``NVMLError_NotSupported`` ...), so the NVML probe runs unchanged against it.
Values come from a JSON document (see tests/fixtures/nvml/):

    {"driver_version": "550.54.15",
     "count": 8,                       # optional, defaults to len(gpus) after expansion
     "template": { ...one GPU... },    # optional, copied for every GPU
     "gpus": [ {...}, ... ] | {"3": {...overrides for GPU 3...}}}

A GPU value of ``"not_supported"`` raises NVMLError_NotSupported, ``"gpu_lost"`` raises
NVMLError_GpuIsLost, ``"function_not_found"`` raises NVMLError_FunctionNotFound (a driver
older than the call), and ``"hang"`` blocks forever (a wedged driver call).

A GPU's ``"fabric"`` is what ``nvmlDeviceGetGpuFabricInfo[V]`` fills in:
``{"state": 3, "status": 0, "cluster_uuid": "<8-4-4-4-12 hex>", "clique_id": 1}`` (state
and status as nvml.h numbers them); unrecorded, the GPU has no fabric (NOT_SUPPORTED, as
on H100/H200 HGX). ``"fabric_v"`` overrides what the versioned call alone answers.

Set ``CLUSTEROPS_NVML_STANDIN=<file.json>`` to make the NVML probe use it.
"""

from __future__ import annotations

import copy
import ctypes
import json
import threading
import uuid
from types import SimpleNamespace
from typing import Any, Dict, List

try:  # the real error classes and constants, when nvidia-ml-py is installed
    import pynvml as _real
except ImportError:  # pragma: no cover - the gpu extra is a test dependency
    _real = None


class _NVMLError(Exception):
    """Used only when nvidia-ml-py is missing: mirrors pynvml.NVMLError(value)."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value


_CODES = {"not_supported": 3, "gpu_lost": 15, "driver_not_loaded": 9, "library_not_found": 12,
          "function_not_found": 13, "unknown": 999}


class FabricInfo(ctypes.Structure):
    """nvml.h's ``nvmlGpuFabricInfo_t``, the fields the probe reads (both fabric calls fill it)."""

    _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint)]


def _error(kind: str) -> Exception:
    code = _CODES[kind]
    if _real is not None:
        return _real.NVMLError(code)  # pynvml maps the code to its subclass
    return _NVMLError(code)


def _merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def expand(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Resolve template/overrides into a plain list of GPUs."""
    doc = copy.deepcopy(doc)
    gpus = doc.get("gpus", [])
    template = doc.get("template")
    if isinstance(gpus, dict) or template is not None:
        n = int(doc.get("count", len(gpus) if isinstance(gpus, list) else 0))
        overrides = gpus if isinstance(gpus, dict) else {str(i): g for i, g in enumerate(gpus)}
        gpus = [_merge(template or {}, overrides.get(str(i), {})) for i in range(n)]
    doc["gpus"] = gpus
    return doc


class StandinNVML:
    """pynvml-shaped object over recorded values."""

    c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfoV_t = FabricInfo

    def __init__(self, doc: Dict[str, Any]):
        self.doc = expand(doc)
        self.gpus: List[Dict[str, Any]] = self.doc["gpus"]
        self.NVMLError = _real.NVMLError if _real is not None else _NVMLError
        self.calls: List[str] = []

    def __getattr__(self, name):  # constants such as NVML_TEMPERATURE_GPU
        if _real is not None and name.startswith(("NVML_", "nvmlClocks")):
            return getattr(_real, name)
        raise AttributeError(name)

    # -- helpers ------------------------------------------------------------------
    def _v(self, value):
        if isinstance(value, str) and value in _CODES:
            raise _error(value)
        if value == "hang":
            threading.Event().wait()  # never returns: a wedged driver call
        return value

    def _g(self, h, key, default="not_supported"):
        self.calls.append(key)
        return self._v(self.gpus[h].get(key, default))

    # -- library ------------------------------------------------------------------
    def nvmlInit(self):
        self._v(self.doc.get("init", None))

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return self._v(self.doc.get("driver_version", "550.54.15"))

    def nvmlDeviceGetCount(self):
        return self._v(self.doc.get("count_visible", len(self.gpus)))

    def nvmlDeviceGetHandleByIndex(self, i):
        if i >= len(self.gpus):
            raise _error("unknown")
        self._v(self.gpus[i].get("handle", None))
        return i

    def nvmlDeviceGetName(self, h):
        return self._g(h, "name", "NVIDIA H100 80GB HBM3")

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._g(h, "pci_bus_id", f"00000000:{h:02x}:00.0"))

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        ecc = self._g(h, "ecc", {})
        return self._v(ecc.get("volatile" if counter_type == 0 else "aggregate", "not_supported"))

    def nvmlDeviceGetRemappedRows(self, h):
        return tuple(self._g(h, "remapped_rows"))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._g(h, "retired_pages_pending")

    def nvmlDeviceGetMemoryErrorCounter(self, h, error_type, counter_type, location):
        return self._g(h, "sram_uncorrected")

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._g(h, "temperature_c")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._g(h, "clock_event_reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._g(h, "clock_event_reasons")

    def _pcie(self, h, key):
        return self._v(self._g(h, "pcie", {}).get(key, "not_supported"))

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._pcie(h, "width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._pcie(h, "max_width")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._pcie(h, "gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._pcie(h, "max_gen")

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._g(h, "utilization_pct", 0), memory=0)

    def nvmlDeviceGetNvLinkState(self, h, link):
        nvl = self._g(h, "nvlink", {})
        n = nvl.get("links", 0)
        if link >= n:
            raise _error("not_supported")
        return 0 if link in nvl.get("inactive", []) else 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        nvl = self._g(h, "nvlink", {})
        errs = nvl.get("errors", {})
        if errs == "not_supported":
            raise _error("not_supported")
        name = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}[counter]
        return int(errs.get(str(link), {}).get(name, 0))

    @staticmethod
    def _fill_fabric(value, ptr) -> int:
        """Write a recorded fabric into the caller's struct, as the driver does."""
        info = ptr.contents
        info.state, info.status = int(value.get("state", 0)), int(value.get("status", 0))
        info.cliqueId = int(value.get("clique_id", 0))
        info.clusterUuid[:] = uuid.UUID(value.get("cluster_uuid", str(uuid.UUID(int=0)))).bytes
        return 0

    def nvmlDeviceGetGpuFabricInfo(self, h, ptr):
        return self._fill_fabric(self._g(h, "fabric"), ptr)

    def nvmlDeviceGetGpuFabricInfoV(self, h, ptr):
        return self._fill_fabric(self._g(h, "fabric_v", self.gpus[h].get("fabric", "not_supported")), ptr)

    def nvmlDeviceGetPersistenceMode(self, h):
        return self._g(h, "persistence", 1)

    def nvmlDeviceGetFieldValues(self, h, ids):
        """``"fields": {"230": 1, ...}`` (field id -> value); an id not recorded answers as
        the driver does for a field it does not know: that value's nvmlReturn is NOT_SUPPORTED."""
        fields = self._g(h, "fields", {})
        out = []
        for fid in ids:
            v = fields.get(str(fid))
            out.append(SimpleNamespace(fieldId=fid, nvmlReturn=0 if v is not None else 3, valueType=3,
                                       value=SimpleNamespace(ullVal=int(self._v(v) or 0))))
        return out

    def nvmlDeviceGetVbiosVersion(self, h):
        return self._g(h, "vbios")

    def _clock(self, h, key):
        return self._v(self._g(h, "clocks_mhz", {}).get(key, "not_supported"))

    def nvmlDeviceGetApplicationsClock(self, h, kind):
        return self._clock(h, "app_sm" if kind == 1 else "app_mem")

    def nvmlDeviceGetDefaultApplicationsClock(self, h, kind):
        return self._clock(h, "default_app_sm" if kind == 1 else "default_app_mem")

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return self._clock(h, "max_sm" if kind == 1 else "max_mem")

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._clock(h, "sm" if kind == 1 else "mem")

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        procs = self._g(h, "processes", [])
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used_bytes")) for p in procs]


def load(path: str) -> StandinNVML:
    with open(path) as f:
        return StandinNVML(json.load(f))
