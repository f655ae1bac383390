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

The host engine (``nv-hostengine``) is asked first, with a short deadline
(``dcgmi discovery -l``, ``hostengine_timeout_s``): an engine that does not answer, or
that dcgmi cannot reach, is an ``error`` (exit 4: reported, never drained) and no diag
is started. A hung engine says nothing about the GPUs: Google's cluster toolkit learned
that when hung engines drained healthy nodes. The same holds for a diag that times out
while the engine has stopped answering, and for recorded output that only says the
engine was unreachable.

With ``health: true`` the probe also reads DCGM's background health watches
(``dcgmi health -g GROUP -s a`` to make sure they are on, then ``dcgmi health -g GROUP
-c -j``): ``dcgm.health`` fails on a ``Failure`` incident, warns on a ``Warning``, and
names the GPU and the system (PCIe, NVLink, memory, thermal, power, ...). The JSON is
dcgmi's ``DcgmiOutputJson`` of the "Health Monitor Report" (dcgmi/Health.cpp: an
"Overall Health" entry, then one entry per entity group and entity with its "Errors"
per system); the parser walks it by those names and does not rely on the nesting.
"""

from __future__ import annotations

import json
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

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


# What dcgmi prints when it cannot reach nv-hostengine (DCGM 2.x-4.x wording).
_NO_ENGINE = re.compile(r"unable to establish a connection|unable to connect to host engine|"
                        r"host engine connection invalid|is the host engine running", re.I)
_HEALTH = {"healthy": "pass", "warning": "warn", "failure": "fail"}


def engine_unreachable(text: str) -> bool:
    return bool(_NO_ENGINE.search(text or ""))


def hostengine_alive(cfg: Dict[str, Any], ctx: ProbeContext) -> Optional[str]:
    """None when nv-hostengine answers ``dcgmi discovery -l`` in time, else why not."""
    t = float(cfg.get("hostengine_timeout_s", 10))
    try:
        done = ctx.runner.run([cfg.get("dcgmi", "dcgmi"), "discovery", "-l"], timeout_s=t, check=False)
    except CommandTimeout:
        return f"nv-hostengine did not answer `dcgmi discovery -l` within {t:g}s (hung host engine)"
    except CommandNotFound:
        return "dcgmi not found"
    if engine_unreachable(done.stdout + "\n" + done.stderr):
        return "dcgmi cannot reach nv-hostengine (not running, or its socket is gone)"
    return None


_ENGINE_ADVICE = ("; restart the host engine (systemctl restart nvidia-dcgm, or nv-hostengine) and rerun; "
                  "the GPUs were not judged")


def parse_health(text: str) -> Dict[str, Any]:
    """``dcgmi health -c -j`` output -> {"overall": pass|warn|fail|error, "incidents":
    [{"entity", "system", "status", "message"}]} (raises DiagAborted when there is no report)."""
    doc = _json_from(text)
    overall: List[str] = []
    incidents: List[Dict[str, Any]] = []

    def text_of(v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, dict):
            for k in ("value", "Value"):
                if isinstance(v.get(k), str):
                    return v[k]
        return ""

    def messages(v: Any) -> List[str]:
        out: List[str] = []
        if isinstance(v, dict):
            for k, x in v.items():
                if k in ("value", "Value"):
                    continue
                out += messages(x)
        elif isinstance(v, list):     # overflow: the message's parts, as strings or {"value": ...}
            for x in v:
                out += [x] if isinstance(x, str) else ([text_of(x)] if text_of(x) else messages(x))
        elif isinstance(v, str) and v.lower() not in _HEALTH:
            out.append(v)
        return out

    def walk(node: Any, path: Tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            if k == "Overall Health":
                overall.append(text_of(v))
                continue
            if "Errors" in path and text_of(v).lower() in _HEALTH:
                entity = "/".join(p for p in path if p not in ("Errors", "children", "body"))
                incidents.append({"entity": entity, "system": k, "status": _HEALTH[text_of(v).lower()],
                                  "message": " ".join(messages(v))[:300]})
                continue
            walk(v, path + (k,))

    walk(doc, ())
    if not overall:
        raise DiagAborted("no 'Overall Health' in dcgmi health output")
    return {"overall": _HEALTH.get(overall[0].strip().lower(), "error"), "incidents": incidents}


def judge_health(report: Dict[str, Any]) -> ProbeResult:
    inc = report["incidents"]
    data = {"overall": report["overall"], "incidents": inc}
    bad = [i for i in inc if i["status"] == "fail"] or [i for i in inc if i["status"] == "warn"]
    parts = [f"{i['entity'] or 'node'} {i['system']}: {i['message'] or i['status']}" for i in bad[:3]]
    status = report["overall"]
    if status == "fail" or any(i["status"] == "fail" for i in inc):
        return ProbeResult("dcgm.health", "fail", value=len(inc), unit="incidents", threshold=0, data=data,
                           detail="; ".join(parts or ["DCGM health: Failure"]) + "; drain, reset the GPU, "
                                  "RMA if it recurs")
    if status == "error":
        return ProbeResult("dcgm.health", "error", value=len(inc), unit="incidents", data=data,
                           detail="DCGM health watch reported an internal error; check nv-hostengine")
    if status == "warn" or inc:
        return ProbeResult("dcgm.health", "warn", value=len(inc), unit="incidents", threshold=0, data=data,
                           detail="; ".join(parts or ["DCGM health: Warning"]))
    return ProbeResult("dcgm.health", "pass", value=0, unit="incidents", threshold=0, data=data,
                       detail="DCGM health watches: Healthy")


def _read_recorded(path: str) -> str:
    raw, cut = read_regular(path, OUTPUT_MAX_BYTES)
    if cut:
        raise ValueError(f"larger than {OUTPUT_MAX_BYTES >> 20} MiB, not a dcgmi output")
    return raw.decode("utf-8")


def probe_health(cfg: Dict[str, Any], ctx: ProbeContext) -> ProbeResult:
    """``dcgm.health`` from the recorded ``health_output_file`` or from dcgmi itself."""
    if cfg.get("health_output_file"):
        try:
            text = _read_recorded(cfg["health_output_file"])
        except (OSError, ValueError) as e:
            return ProbeResult("dcgm.health", "error", detail=f"cannot read health_output_file "
                                                              f"{cfg['health_output_file']}: "
                                                              f"{getattr(e, 'strerror', None) or e}")
    else:
        dcgmi, group, t = cfg.get("dcgmi", "dcgmi"), str(cfg.get("health_group", 0)), \
            float(cfg.get("hostengine_timeout_s", 10))
        try:
            # Watches on (idempotent; they then accumulate between checks), then the check.
            ctx.runner.run([dcgmi, "health", "-g", group, "-s", "a"], timeout_s=t, check=False)
            done = ctx.runner.run([dcgmi, "health", "-g", group, "-c", "-j"], timeout_s=t, check=False)
        except CommandTimeout as e:
            return ProbeResult("dcgm.health", "error", detail=f"{e} (hung host engine?)" + _ENGINE_ADVICE)
        except CommandNotFound:
            return ProbeResult("dcgm.health", "skip", detail="dcgmi not found")
        text = done.stdout if done.stdout.strip() else done.stderr
    if engine_unreachable(text):
        return ProbeResult("dcgm.health", "error", detail="dcgmi cannot reach nv-hostengine" + _ENGINE_ADVICE)
    try:
        return judge_health(parse_health(text))
    except DiagAborted as e:
        return ProbeResult("dcgm.health", "error", detail=f"{e}: {' '.join(text.split())[:160]}")


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
    recorded = bool(cfg.get("output_file"))
    if not recorded and shutil.which(dcgmi, path=ctx.env.get("PATH")) is None:
        return [ProbeResult("dcgm.diag", "fail" if required else "skip",
                            detail=("dcgmi not found but the profile requires DCGM: install datacenter-gpu-manager"
                                    if required else "dcgmi not installed; DCGM diag skipped"))]
    if not recorded:
        why = hostengine_alive(cfg, ctx)
        if why is not None:
            return [ProbeResult("dcgm.hostengine", "error", detail=why + _ENGINE_ADVICE)]
    results: List[ProbeResult] = []
    if cfg.get("health") or cfg.get("health_output_file"):
        results.append(probe_health(cfg, ctx))
    if recorded:  # recorded output (tests, or a diag run by another tool)
        try:
            text, rc = _read_recorded(cfg["output_file"]), int(cfg.get("exit_code", 0))
        except (OSError, ValueError) as e:
            return results + [ProbeResult("dcgm.diag", "error", detail=f"cannot read output_file "
                                                                       f"{cfg['output_file']}: "
                                                                       f"{getattr(e, 'strerror', None) or e}")]
    else:
        argv = [dcgmi, "diag", "-r", str(level), "-j"]
        try:
            done = ctx.runner.run(argv, timeout_s=float(cfg.get("diag_timeout_s", 900)), check=False)
        except CommandTimeout as e:
            # The diag hung: the GPU, or the engine under it? Ask the engine again.
            why = hostengine_alive(cfg, ctx)
            if why is not None:
                return results + [ProbeResult("dcgm.hostengine", "error", data={"level": level},
                                              detail=f"dcgmi diag timed out and {why}" + _ENGINE_ADVICE)]
            return results + [ProbeResult("dcgm.diag", "fail", data={"level": level},
                                          detail=f"dcgmi diag aborted: {e}; rerun by hand, drain if it hangs again")]
        except CommandNotFound:
            return results + [ProbeResult("dcgm.diag", "fail" if required else "skip", detail="dcgmi not found")]
        text, rc = done.stdout, done.returncode
        if not text.strip():
            text = done.stderr
    try:
        rows = parse_diag(text)
    except DiagAborted as e:
        if engine_unreachable(text):
            return results + [ProbeResult("dcgm.hostengine", "error", data={"level": level, "exit_code": rc},
                                          detail="dcgmi diag could not reach nv-hostengine" + _ENGINE_ADVICE)]
        return results + [ProbeResult("dcgm.diag", "fail", data={"level": level, "exit_code": rc},
                                      detail=f"{e} (exit {rc}); check nv-hostengine and rerun `dcgmi diag -r {level}`")]
    return results + [judge(rows, level)]
