"""DCGM probe: ``dcgmi diag -r <level> -j``, parsed per test and per GPU.

JSON shape (DCGM 2.x/3.x: top key "DCGM GPU Diagnostic"; DCGM 4.x: "DCGM Diagnostic"):

    {"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Integration", "tests": [
            {"name": "PCIe", "results": [
                {"gpu_ids": "0", "status": "Pass"},
                {"gpu_ids": "1", "status": "Fail",
                 "warnings": [{"warning": "...", "error_id": 46}], "info": "..."}]}]}]}}

A diag that aborts (non-zero exit without results, unparsable output, a runtime
error, a timeout, or no test results at all) is a failure, never a pass.
"""

from __future__ import annotations

import json
import shutil
from typing import Any, Dict, List

from clusterops.fsutil import read_regular
from clusterops.health.probes.base import ProbeContext, ProbeResult
from clusterops.runner import CommandNotFound, CommandTimeout

#: A recorded ``dcgmi diag -j`` output (``output_file``) is read up to this size (a level 4
#: diag of 8 GPUs is well under 1 MiB).
OUTPUT_MAX_BYTES = 16 << 20

_STATUS = {"pass": "pass", "fail": "fail", "warn": "warn", "warning": "warn", "skip": "skip",
           "skipped": "skip", "not run": "skip", "notrun": "skip"}


class DiagAborted(Exception):
    pass


def _json_from(text: str) -> Dict[str, Any]:
    # dcgmi may print banner lines before the JSON object.
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        raise DiagAborted("no JSON in dcgmi output")
    try:
        return json.loads(text[start:end + 1])
    except ValueError as e:
        raise DiagAborted(f"unparsable dcgmi JSON ({e})") from None


def parse_diag(text: str) -> List[Dict[str, Any]]:
    """dcgmi diag -j output -> [{category, test, gpus, status, message}] (raises DiagAborted)."""
    doc = _json_from(text)
    body = doc.get("DCGM GPU Diagnostic") or doc.get("DCGM Diagnostic")
    if not isinstance(body, dict):
        raise DiagAborted("no 'DCGM GPU Diagnostic' section in dcgmi output")
    if body.get("runtime_error"):
        raise DiagAborted(f"diag aborted: {body['runtime_error']}")
    rows = []
    for cat in body.get("test_categories") or []:
        for test in cat.get("tests") or []:
            for res in test.get("results") or []:
                raw = str(res.get("status", "")).strip().lower()
                status = _STATUS.get(raw)
                if status is None:
                    status = "fail"  # an unknown status is never a pass
                gpus = res.get("gpu_ids", res.get("gpu_id", ""))
                msgs = [w.get("warning", "") if isinstance(w, dict) else str(w)
                        for w in (res.get("warnings") or [])]
                if isinstance(res.get("warnings"), str):
                    msgs = [res["warnings"]]
                rows.append({"category": cat.get("category", ""), "test": test.get("name", ""),
                             "gpus": str(gpus), "status": status,
                             "message": " ".join(m for m in msgs if m)[:300],
                             "error_ids": [w.get("error_id") for w in (res.get("warnings") or [])
                                           if isinstance(w, dict) and "error_id" in w]})
    if not rows:
        raise DiagAborted("dcgmi diag returned no test results")
    return rows


def judge(rows: List[Dict[str, Any]], level: int) -> ProbeResult:
    fails = [r for r in rows if r["status"] == "fail"]
    warns = [r for r in rows if r["status"] == "warn"]
    ran = [r for r in rows if r["status"] != "skip"]
    data = {"level": level, "tests": rows}
    if fails:
        parts = [f"{r['test']} on GPU {r['gpus']}: {r['message'] or 'failed'}" for r in fails[:3]]
        return ProbeResult("dcgm.diag", "fail", value=len(fails), unit="failed tests", threshold=0, data=data,
                           detail="; ".join(parts) + "; drain, reset the GPU and rerun the diag, RMA if it fails again")
    if not ran:
        return ProbeResult("dcgm.diag", "fail", value=0, unit="failed tests", threshold=0, data=data,
                           detail="every diag test was skipped: the diag did not really run; check DCGM")
    if warns:
        parts = [f"{r['test']} on GPU {r['gpus']}: {r['message'] or 'warning'}" for r in warns[:3]]
        return ProbeResult("dcgm.diag", "warn", value=0, unit="failed tests", threshold=0, data=data,
                           detail="; ".join(parts))
    return ProbeResult("dcgm.diag", "pass", value=0, unit="failed tests", threshold=0, data=data,
                       detail=f"dcgmi diag -r {level}: {len(ran)} test results passed")


def probe_dcgm(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    level = int(cfg.get("level", 1))
    required = bool(cfg.get("required", False))
    dcgmi = cfg.get("dcgmi", "dcgmi")
    if not cfg.get("output_file") and shutil.which(dcgmi, path=ctx.env.get("PATH")) is None:
        return [ProbeResult("dcgm.diag", "fail" if required else "skip",
                            detail=("dcgmi not found but the profile requires DCGM: install datacenter-gpu-manager"
                                    if required else "dcgmi not installed; DCGM diag skipped"))]
    if cfg.get("output_file"):  # recorded output (tests, or a diag run by another tool)
        try:
            raw, cut = read_regular(cfg["output_file"], OUTPUT_MAX_BYTES)
            if cut:
                raise ValueError(f"larger than {OUTPUT_MAX_BYTES >> 20} MiB, not a `dcgmi diag -j` output")
            text, rc = raw.decode("utf-8"), int(cfg.get("exit_code", 0))
        except (OSError, ValueError) as e:
            return [ProbeResult("dcgm.diag", "error", detail=f"cannot read output_file {cfg['output_file']}: "
                                                             f"{getattr(e, 'strerror', None) or e}")]
    else:
        argv = [dcgmi, "diag", "-r", str(level), "-j"]
        try:
            done = ctx.runner.run(argv, timeout_s=float(cfg.get("diag_timeout_s", 900)), check=False)
        except CommandTimeout as e:
            return [ProbeResult("dcgm.diag", "fail", data={"level": level},
                                detail=f"dcgmi diag aborted: {e}; rerun by hand, drain if it hangs again")]
        except CommandNotFound:
            return [ProbeResult("dcgm.diag", "fail" if required else "skip", detail="dcgmi not found")]
        text, rc = done.stdout, done.returncode
        if not text.strip():
            text = done.stderr
    try:
        rows = parse_diag(text)
    except DiagAborted as e:
        return [ProbeResult("dcgm.diag", "fail", data={"level": level, "exit_code": rc},
                            detail=f"{e} (exit {rc}); check nv-hostengine and rerun `dcgmi diag -r {level}`")]
    return [judge(rows, level)]
