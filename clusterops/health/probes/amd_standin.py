"""A stand-in for AMD's ``amdsmi`` Python module, fed with recorded return values (tests,
demos). Same function names as amdsmi (ROCm 6.x); each GPU's entry in the JSON document
holds what each function returned on that GPU (see tests/fixtures/amd/):

    {"template": {"amdsmi_get_gpu_asic_info": {"market_name": "AMD Instinct MI300X"}, ...},
     "count": 8, "gpus": {"3": {...overrides for GPU 3...}}}

A value ``"not_supported"`` raises ``AmdSmiLibraryException`` (what amdsmi raises for a
query the GPU or firmware does not support); ``amdsmi_get_gpu_ecc_status`` reads
``{"UMC": "NONE", ...}`` per block. ``CLUSTEROPS_AMDSMI_STANDIN=<file.json>`` makes the
``amd`` probe use it.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from clusterops.health.probes.nvml_standin import expand


class AmdSmiLibraryException(Exception):
    def __init__(self, err_code: int = 2):   # AMDSMI_STATUS_NOT_SUPPORTED
        super().__init__(f"amdsmi error {err_code}")
        self.err_code = err_code


class StandinAMDSMI:
    def __init__(self, doc: Dict[str, Any]):
        self.doc = expand(doc)
        self.gpus = self.doc["gpus"]

    def _v(self, h: int, name: str, default: Any = "not_supported") -> Any:
        v = self.gpus[h].get(name, default)
        if v == "not_supported":
            raise AmdSmiLibraryException()
        return v

    def amdsmi_init(self, *flags):
        if self.doc.get("init") == "fail":
            raise AmdSmiLibraryException(8)   # AMDSMI_STATUS_DRIVER_NOT_LOADED-like

    def amdsmi_shut_down(self):
        pass

    def amdsmi_get_processor_handles(self):
        return list(range(len(self.gpus)))

    def amdsmi_get_gpu_ecc_status(self, h, block):
        per = self._v(h, "amdsmi_get_gpu_ecc_status")
        name = str(getattr(block, "name", block))
        if name not in per:
            raise AmdSmiLibraryException()
        return per[name]

    def __getattr__(self, name: str):
        if not name.startswith("amdsmi_"):
            raise AttributeError(name)
        return lambda h, *args: self._v(h, name)


def load(path: str) -> StandinAMDSMI:
    with open(path) as f:
        return StandinAMDSMI(json.load(f))
