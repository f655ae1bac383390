"""The ``amd`` probe's second source: AMD's ``amd-smi`` command-line tool, for a node that
has ROCm's CLI but not the ``amdsmi`` Python library in the checker's environment.

:class:`AmdSmiCli` answers the amdsmi calls the probe makes (``amdsmi_get_gpu_total_ecc_count``,
``amdsmi_get_pcie_info``...) from the JSON of four commands, each run once through the
runner when the probe calls ``amdsmi_init``:

- ``amd-smi static --json``: ``asic.market_name``, ``bus`` (``bdf``, ``max_pcie_width``,
  ``max_pcie_speed`` in GT/s), ``limit.socket_power`` (the power cap, W);
- ``amd-smi metric --json``: ``usage.gfx_activity``, ``power`` (``socket_power``,
  ``throttle_status`` THROTTLED / UNTHROTTLED), ``temperature`` (``hotspot``, ``mem``),
  ``pcie`` (``width``, ``speed`` in GT/s), ``ecc`` (``total_correctable_count``,
  ``total_uncorrectable_count``, ``total_deferred_count``), ``ecc_blocks`` (per RAS block:
  ``correctable_count``, ``uncorrectable_count``, ``deferred_count``), ``xgmi_err`` (the
  ``amdsmi_xgmi_status_t`` name, ``AMDSMI_XGMI_STATUS_NO_ERRORS``...);
- ``amd-smi bad-pages --json``: ``retired``, ``pending``, ``un_res`` (a page, a list of
  pages, or the text "No bad pages found.");
- ``amd-smi topology -a -t --json``: per GPU, ``links`` to every other GPU with
  ``link_type`` (XGMI, PCIE...) and ``link_status`` (ENABLED when the peer is reachable).

Each document is a list with one object per GPU (``{"gpu": 0, ...}``; newer releases wrap
it as ``{"gpu_data": [...]}``, read too); a figure is a number or ``{"value", "unit"}``;
``"N/A"`` is a query the GPU does not support (the probe's ``skip`` for that rule).
What the CLI says differently from the library, and how it is mapped:

- RAS state per block: the CLI gives error counts per block, not the library's state; a
  block with uncorrectable errors reads as ``MULT_UC``, with deferred (poisoned) errors as
  ``POISON``, with correctable ones as ``SING_C``, else ``NONE``;
- XGMI links: a peer reached over XGMI and reachable is a link ``UP``, a peer whose XGMI
  link is not reachable one ``DOWN``; a peer reached over PCIe is no XGMI link (so with
  ``xgmi_links`` set, a link that fell back to PCIe shows as too few links up).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from clusterops.runner import Runner

PROGRAM = "amd-smi"
COMMANDS = {
    "static": ["static", "--json"],
    "metric": ["metric", "--json"],
    "bad_pages": ["bad-pages", "--json"],
    "topology": ["topology", "-a", "-t", "--json"],
}
MAX_OUTPUT = 16 << 20      # a JSON document bigger than this is not amd-smi's


class AmdSmiLibraryException(Exception):
    """What the probe's ``_call`` reads as "not supported" (the library's exception name)."""

    def __init__(self, what: str = "N/A"):
        super().__init__(what)
        self.err_code = 2   # AMDSMI_STATUS_NOT_SUPPORTED


class AmdSmiCliError(Exception):
    """amd-smi did not give a usable answer (exit status, no JSON, a JSON of another shape)."""


def value(x: Any) -> Any:
    """A figure from the CLI's JSON: ``{"value": v, "unit": u}`` -> v; ``"N/A"`` -> None."""
    if isinstance(x, dict) and "value" in x:
        x = x["value"]
    if x is None or (isinstance(x, str) and x.strip().upper() in ("N/A", "NA", "")):
        return None
    return x


def _num(x: Any) -> Optional[float]:
    v = value(x)
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    try:
        return float(str(v).split()[0])
    except (ValueError, IndexError):
        return None


def per_gpu(doc: Any, what: str) -> Dict[int, Dict[str, Any]]:
    """One amd-smi JSON document -> {gpu index: its object}."""
    if isinstance(doc, dict) and isinstance(doc.get("gpu_data"), list):
        doc = doc["gpu_data"]
    if isinstance(doc, dict) and "gpu" in doc:
        doc = [doc]
    if not isinstance(doc, list):
        raise AmdSmiCliError(f"amd-smi {what} --json: expected a list of GPUs, got {type(doc).__name__}")
    out: Dict[int, Dict[str, Any]] = {}
    for item in doc:
        if isinstance(item, dict) and isinstance(item.get("gpu"), int) and not isinstance(item.get("gpu"), bool):
            out[item["gpu"]] = item
    return out


class AmdSmiCli:
    """An amdsmi-shaped view of the ``amd-smi`` CLI's JSON (see the module's text).
    ``docs`` gives the four documents directly (tests); otherwise ``amdsmi_init`` runs
    the commands through ``runner``."""

    def __init__(self, runner: Optional[Runner] = None, *, program: str = PROGRAM, timeout_s: float = 30.0,
                 docs: Optional[Dict[str, Any]] = None):
        self.runner = runner or Runner()
        self.program = program
        self.timeout_s = timeout_s
        self._docs = docs
        self.gpus: Dict[str, Dict[int, Dict[str, Any]]] = {}
        self.order: List[int] = []

    # -- what the probe calls ---------------------------------------------------------------

    def amdsmi_init(self, *flags) -> None:
        docs = self._docs if self._docs is not None else {k: self._run(k) for k in COMMANDS}
        self.gpus = {k: per_gpu(docs.get(k, []), k.replace("_", "-")) for k in COMMANDS}
        self.order = sorted(self.gpus["static"] or self.gpus["metric"])

    def amdsmi_shut_down(self) -> None:
        pass

    def amdsmi_get_processor_handles(self) -> List[int]:
        return list(self.order)

    def _get(self, doc: str, h: int, *path: str) -> Any:
        cur: Any = self.gpus.get(doc, {}).get(h)
        for key in path:
            if not isinstance(cur, dict) or key not in cur:
                raise AmdSmiLibraryException(f"{doc}: no {'.'.join(path)}")
            cur = cur[key]
        if (isinstance(cur, dict) and "value" in cur or not isinstance(cur, (dict, list))) and value(cur) is None:
            raise AmdSmiLibraryException(f"{doc}: {'.'.join(path)} N/A")
        return cur

    def amdsmi_get_gpu_asic_info(self, h: int) -> Dict[str, Any]:
        return {"market_name": str(value(self._get("static", h, "asic", "market_name")))}

    def amdsmi_get_gpu_device_bdf(self, h: int) -> str:
        return str(value(self._get("static", h, "bus", "bdf")))

    def amdsmi_get_gpu_total_ecc_count(self, h: int) -> Dict[str, Any]:
        ecc = self._get("metric", h, "ecc")
        counts = {k: _num(ecc.get(f"total_{k}")) if isinstance(ecc, dict) else None
                  for k in ("correctable_count", "uncorrectable_count", "deferred_count")}
        if counts["correctable_count"] is None and counts["uncorrectable_count"] is None:
            raise AmdSmiLibraryException("ecc N/A")
        return {k: int(v or 0) for k, v in counts.items()}

    def amdsmi_get_gpu_ecc_status(self, h: int, block: Any) -> str:
        name = str(getattr(block, "name", block))
        blocks = self._get("metric", h, "ecc_blocks")
        counts = blocks.get(name) if isinstance(blocks, dict) else None
        if not isinstance(counts, dict):
            raise AmdSmiLibraryException(f"no RAS block {name}")
        unc, dfr, cor = (_num(counts.get(k)) for k in ("uncorrectable_count", "deferred_count", "correctable_count"))
        if unc is None and dfr is None and cor is None:
            raise AmdSmiLibraryException(f"RAS block {name} N/A")
        if unc:
            return "MULT_UC"
        if dfr:
            return "POISON"
        if cor:
            return "SING_C"
        return "NONE"

    def amdsmi_get_gpu_bad_page_info(self, h: int) -> List[Dict[str, Any]]:
        doc = self.gpus.get("bad_pages", {}).get(h)
        if not isinstance(doc, dict):
            raise AmdSmiLibraryException("bad-pages: no entry")
        pages: List[Dict[str, Any]] = []
        na = 0
        for key, status in (("retired", "RESERVED"), ("pending", "PENDING"), ("un_res", "UNRESERVABLE")):
            v = doc.get(key)
            if isinstance(v, dict):
                v = [v]
            if isinstance(v, list):
                pages += [dict(p, status=str(p.get("status") or status).upper()) for p in v if isinstance(p, dict)]
            elif value(v) is None:
                na += 1
        if na == 3:
            raise AmdSmiLibraryException("bad-pages N/A")
        return pages

    def amdsmi_get_gpu_xgmi_link_status(self, h: int) -> Dict[str, Any]:
        links = self._get("topology", h, "links")
        status = []
        for link in links if isinstance(links, list) else []:
            if not isinstance(link, dict) or str(link.get("link_type", "")).upper() != "XGMI":
                continue
            status.append("UP" if str(link.get("link_status", "")).upper() == "ENABLED" else "DOWN")
        if not status:
            raise AmdSmiLibraryException("no XGMI links")
        return {"status": status, "total_links": len(status)}

    def amdsmi_gpu_xgmi_error_status(self, h: int) -> str:
        return str(value(self._get("metric", h, "xgmi_err"))).upper().replace("AMDSMI_XGMI_STATUS_", "")

    def amdsmi_get_pcie_info(self, h: int) -> Dict[str, Any]:
        bus = self._get("static", h, "bus")
        pcie = self._get("metric", h, "pcie")

        def mts(x: Any) -> Optional[int]:     # the CLI's GT/s -> the library's MT/s
            v = _num(x)
            return None if v is None else int(round(v * 1000))

        def lanes(x: Any) -> Optional[int]:
            v = _num(x)
            return None if v is None else int(v)

        return {"pcie_static": {"max_pcie_width": lanes(bus.get("max_pcie_width")),
                                "max_pcie_speed": mts(bus.get("max_pcie_speed"))},
                "pcie_metric": {"pcie_width": lanes(pcie.get("width")), "pcie_speed": mts(pcie.get("speed"))}}

    def amdsmi_get_gpu_metrics_info(self, h: int) -> Dict[str, Any]:
        temps = self._get("metric", h, "temperature")
        power = self.gpus.get("metric", {}).get(h, {}).get("power")
        power = power if isinstance(power, dict) else {}
        throttle = str(value(power.get("throttle_status")) or "N/A").upper()
        return {"temperature_hotspot": _num(temps.get("hotspot")), "temperature_mem": _num(temps.get("mem")),
                "current_socket_power": _num(power.get("socket_power")),
                "throttle_status": {"THROTTLED": 1, "UNTHROTTLED": 0}.get(throttle, "N/A")}

    def amdsmi_get_power_cap_info(self, h: int) -> Dict[str, Any]:
        return {"power_cap": _num(self._get("static", h, "limit", "socket_power"))}

    def amdsmi_get_gpu_activity(self, h: int) -> Dict[str, Any]:
        return {"gfx_activity": _num(self._get("metric", h, "usage", "gfx_activity"))}

    # -- running amd-smi ----------------------------------------------------------------------

    def _run(self, key: str) -> Any:
        argv = [self.program] + COMMANDS[key]
        done = self.runner.run(argv, timeout_s=self.timeout_s, check=False)   # CommandNotFound: the caller's
        text = done.stdout or ""
        if done.returncode != 0:
            tail = ((done.stderr or "") + text).strip().splitlines()[-1:] or [""]
            raise AmdSmiCliError(f"{' '.join(argv)}: exit {done.returncode}: {tail[0][:200]}")
        if len(text) > MAX_OUTPUT:
            raise AmdSmiCliError(f"{' '.join(argv)}: {len(text)} bytes of output, not amd-smi's JSON")
        start = min([i for i in (text.find("["), text.find("{")) if i >= 0] or [0])
        try:
            return json.loads(text[start:])   # older releases print a warning line before the JSON
        except ValueError as e:
            raise AmdSmiCliError(f"{' '.join(argv)}: no JSON in its output ({e})") from None
