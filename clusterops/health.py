"""Health checks: profile -> probes -> report, exit code, optional self-drain.

Profiles are YAML data (``health/*.yaml``, installed as ``clusterops.health_profiles``):
``fast`` (HealthCheckProgram), ``preflight`` (before training), ``deep`` (burn-in).
A profile may ``extends:`` another; a site config (``--site-config FILE`` or
``$CLUSTEROPS_HEALTH_SITE``) overrides profiles and GPU-model figures without forking:

    gpu_models:               # merged over health/gpu_models.yaml
      H100: {matmul_bf16_tflops: 760}
    defaults:                 # merged into every profile
      gpus: {required: true, count: 8}
    profiles:
      fast:
        probes:
          host.paths: {paths: [{path: /scratch, min_free_gb: 500}]}

Report (the ``--json`` contract): ``{"node", "profile", "status": pass|warn|fail|error,
"exit_code", "duration_s", "results": [ProbeResult...]}``; exit 0 healthy (warnings
allowed), 1 unhealthy (fail or error), 2 bad usage/profile.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from clusterops.errors import InputError, where
from clusterops.probes.base import ProbeContext, ProbeSpec, RunOutcome, overall_status, run_probes

log = logging.getLogger(__name__)

SITE_ENV = "CLUSTEROPS_HEALTH_SITE"
DRAIN_PREFIX = "clusterops:"

# probe name -> (module, function, exclusive)
REGISTRY: Dict[str, Tuple[str, str, bool]] = {
    "nvml": ("clusterops.probes.nvml", "probe_nvml", False),
    "xid": ("clusterops.probes.xid", "probe_xid", False),
    "host.paths": ("clusterops.probes.host", "probe_paths", False),
    "host.mounts": ("clusterops.probes.host", "probe_mounts", False),
    "host.memory": ("clusterops.probes.host", "probe_memory", False),
    "host.cpus": ("clusterops.probes.host", "probe_cpus", False),
    "host.infiniband": ("clusterops.probes.host", "probe_infiniband", False),
    "host.stray_processes": ("clusterops.probes.host", "probe_stray_processes", False),
    "dcgm": ("clusterops.probes.dcgm", "probe_dcgm", True),
    "matmul": ("clusterops.probes.matmul", "probe_matmul", True),
    "dist": ("clusterops.probes.dist", "probe_dist", True),
}
_COMMON = {"timeout_s", "enabled"}
# Settings each probe understands: anything else in a profile is a typo, reported as one.
PROBE_SETTINGS: Dict[str, set] = {
    "nvml": {"required", "gpu_count", "temperature_warn_c", "temperature_fail_c", "ecc_volatile_max",
             "ecc_aggregate_max", "sram_uncorrected_max", "nvlink_recovery_max", "nvlink_crc_replay_max",
             "nvlink_links", "pcie_gen_busy_pct", "persistence_required", "leftover_process_status", "driver"},
    "xid": {"source", "state_file", "log_file", "boot_id_file", "read_timeout_s"},
    "host.paths": {"path_timeout_s", "paths"},
    "host.mounts": {"path_timeout_s", "mounts", "mounts_file"},
    "host.memory": {"min_available_gb", "meminfo_file"},
    "host.cpus": {"min_cpus"},
    "host.infiniband": {"sys_root", "required", "expected_rate_gbps", "min_ports", "infiniband_only"},
    "host.stray_processes": {"status", "slurm_timeout_s"},
    "dcgm": {"level", "required", "dcgmi", "diag_timeout_s", "output_file", "exit_code"},
    "matmul": {"required", "warmup", "iters", "gpu_shapes", "cpu_shapes", "min_fraction", "straggler_pct",
               "cpu_expected_tflops", "flush_l2"},
    "dist": {"test_timeout_s", "cpu_ranks", "local_ranks", "backend", "sizes_bytes", "cpu_sizes_bytes",
             "warmup", "iters", "min_busbw_gbps"},
}
PROFILE_KEYS = {"description", "extends", "gpus", "probes"}
GPUS_KEYS = {"required", "count"}
SITE_KEYS = {"gpu_models", "defaults", "profiles", "history", "notify"}  # history: clusterops.spool; notify: clusterops.notify
DEFAULT_TIMEOUT_S = 10.0


@dataclass
class Profile:
    name: str
    source: str
    description: str = ""
    gpus_required: bool = False
    gpu_count: Optional[int] = None
    probes: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    gpu_models: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    site_config: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "source": self.source, "description": self.description,
                "site_config": self.site_config,
                "gpus": {"required": self.gpus_required, "count": self.gpu_count},
                "probes": self.probes, "gpu_models": self.gpu_models}


# -- loading ------------------------------------------------------------------------------

def builtin_dir() -> Path:
    import clusterops.health_profiles as hp

    return Path(hp.__file__).resolve().parent


def builtin_profiles() -> List[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.yaml") if p.stem != "gpu_models")


def _suggest(word: str, options) -> str:
    m = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _key_lines(text: str) -> Dict[Tuple[str, ...], int]:
    """(key path) -> 1-based line, for error messages."""
    out: Dict[Tuple[str, ...], int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return out

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = path + (str(k.value),)
                out[key] = k.start_mark.line + 1
                walk(v, key)

    walk(root, ())
    return out


def _read_yaml(path: Path) -> Tuple[Dict[str, Any], Dict[Tuple[str, ...], int]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise InputError(f"{where(path, line)}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: a health profile is a YAML mapping")
    return data, _key_lines(text)


def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """Deep merge: mappings merge, anything else (lists included) replaces."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _validate(data: Dict[str, Any], path: Path, lines: Dict[Tuple[str, ...], int], prefix=()) -> None:
    def err(keys, msg):
        raise InputError(f"{where(path, lines.get(prefix + keys), '.'.join(keys))}: {msg}")

    for k in data:
        if k not in PROFILE_KEYS:
            err((k,), f"unknown key{_suggest(k, PROFILE_KEYS)}; valid: {', '.join(sorted(PROFILE_KEYS))}")
    gpus = data.get("gpus") or {}
    if not isinstance(gpus, dict):
        err(("gpus",), "must be a mapping with required/count")
    for k, v in gpus.items():
        if k not in GPUS_KEYS:
            err(("gpus", k), f"unknown key{_suggest(k, GPUS_KEYS)}")
    if gpus.get("count") is not None and (not isinstance(gpus["count"], int) or gpus["count"] < 0):
        err(("gpus", "count"), "must be a whole number >= 0 or null")
    if "required" in gpus and not isinstance(gpus["required"], bool):
        err(("gpus", "required"), "must be true or false")
    probes = data.get("probes") or {}
    if not isinstance(probes, dict):
        err(("probes",), "must be a mapping of probe name -> settings")
    for name, cfg in probes.items():
        if name not in REGISTRY:
            err(("probes", name), f"unknown probe{_suggest(name, REGISTRY)}; known: {', '.join(REGISTRY)}")
        if cfg is not None and cfg is not False and not isinstance(cfg, dict):
            err(("probes", name), "must be a mapping of settings, or false to disable it")
        if isinstance(cfg, dict):
            valid = PROBE_SETTINGS[name] | _COMMON
            for k in cfg:
                if k not in valid:
                    err(("probes", name, k), f"unknown setting{_suggest(k, valid)}")
        if isinstance(cfg, dict) and "timeout_s" in cfg:
            t = cfg["timeout_s"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
                err(("probes", name, "timeout_s"), "must be a number of seconds > 0")


def _find_profile(name: str, search: List[Path]) -> Path:
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        p = Path(name).expanduser()
        if not p.exists():
            raise InputError(f"health profile file {name}: not found")
        return p
    for d in search:
        p = d / f"{name}.yaml"
        if p.exists():
            return p
    raise InputError(f"unknown health profile {name!r}{_suggest(name, builtin_profiles())}; "
                     f"built-in: {', '.join(builtin_profiles())}")


def _load_raw(name: str, search: List[Path], seen: Tuple[str, ...] = ()) -> Tuple[Dict[str, Any], Path]:
    path = _find_profile(name, search)
    key = str(path.resolve())
    if key in seen:
        raise InputError(f"{path}: extends: profile inheritance loops back to itself")
    data, lines = _read_yaml(path)
    _validate(data, path, lines)
    parent = data.get("extends")
    if parent:
        if not isinstance(parent, str):
            raise InputError(f"{where(path, lines.get(('extends',)), 'extends')}: must be a profile name")
        base, _ = _load_raw(parent, [path.parent] + search, seen + (key,))
        base.pop("description", None)
        data = merge(base, {k: v for k, v in data.items() if k != "extends"})
    return data, path


def load_site_config(path: Optional[str]) -> Tuple[Dict[str, Any], Optional[str]]:
    path = path or os.environ.get(SITE_ENV) or None
    if not path:
        return {}, None
    p = Path(path).expanduser()
    data, lines = _read_yaml(p)
    for k in data:
        if k not in SITE_KEYS:
            raise InputError(f"{where(p, lines.get((k,)), k)}: unknown key{_suggest(k, SITE_KEYS)}; "
                             f"valid: {', '.join(sorted(SITE_KEYS))}")
    if data.get("defaults"):
        _validate(data["defaults"], p, lines, ("defaults",))
    for name, prof in (data.get("profiles") or {}).items():
        if not isinstance(prof, dict):
            raise InputError(f"{where(p, lines.get(('profiles', name)), 'profiles.' + name)}: must be a mapping")
        _validate(prof, p, lines, ("profiles", name))
    return data, str(p)


def load_gpu_models(site: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    data, _ = _read_yaml(builtin_dir() / "gpu_models.yaml")
    return merge(data, site.get("gpu_models") or {})


def load_profile(name: str = "fast", site_config: Optional[str] = None) -> Profile:
    """Resolve a profile (built-in name or YAML path) with its parents and the site overrides."""
    site, site_path = load_site_config(site_config)
    data, path = _load_raw(name, [builtin_dir()])
    pname = path.stem
    if site.get("defaults"):
        data = merge(data, site["defaults"])
    over = (site.get("profiles") or {}).get(pname)
    if over:
        data = merge(data, {k: v for k, v in over.items() if k != "extends"})
    gpus = data.get("gpus") or {}
    probes: Dict[str, Dict[str, Any]] = {}
    for pn, cfg in (data.get("probes") or {}).items():
        if cfg is False or (isinstance(cfg, dict) and cfg.get("enabled") is False):
            continue
        probes[pn] = dict(cfg or {})
    return Profile(name=pname, source=str(path), description=str(data.get("description", "")),
                   gpus_required=bool(gpus.get("required", False)), gpu_count=gpus.get("count"),
                   probes=probes, gpu_models=load_gpu_models(site), site_config=site_path)


# -- running --------------------------------------------------------------------------------

def probe_specs(profile: Profile) -> List[ProbeSpec]:
    specs = []
    for name, cfg in profile.probes.items():
        module, fn_name, exclusive = REGISTRY[name]
        cfg = dict(cfg)
        if name == "nvml":
            cfg.setdefault("required", profile.gpus_required)
            if profile.gpu_count is not None:
                cfg.setdefault("gpu_count", profile.gpu_count)
        if name == "matmul":
            cfg.setdefault("required", profile.gpus_required)
        fn = _lazy(module, fn_name)
        specs.append(ProbeSpec(name, fn, cfg, float(cfg.get("timeout_s", DEFAULT_TIMEOUT_S)), exclusive))
    return specs


def _lazy(module: str, fn_name: str):
    def call(cfg, ctx):
        return getattr(importlib.import_module(module), fn_name)(cfg, ctx)

    call.__name__ = fn_name
    return call


@dataclass
class CheckRun:
    report: Dict[str, Any]
    outcome: RunOutcome

    @property
    def exit_code(self) -> int:
        return self.report["exit_code"]


def run_check(profile: Profile, ctx: Optional[ProbeContext] = None) -> CheckRun:
    ctx = ctx or ProbeContext()
    ctx.gpu_models = profile.gpu_models
    ctx.gpus_required = profile.gpus_required
    t0 = time.monotonic()
    outcome = run_probes(probe_specs(profile), ctx)
    status = overall_status(outcome.results)
    report = {"node": ctx.node, "profile": profile.name, "status": status,
              "exit_code": 0 if status in ("pass", "warn") else 1,
              "duration_s": round(time.monotonic() - t0, 3), "time": time.time(),
              "results": [r.to_dict() for r in outcome.results]}
    return CheckRun(report, outcome)


def first_problem(report: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    for wanted in ("fail", "error"):
        for r in report["results"]:
            if r["status"] == wanted:
                return r
    return None


def drain_reason(report: Dict[str, Any], max_len: int = 200) -> str:
    r = first_problem(report) or {"name": "health", "detail": report["status"]}
    reason = f"{DRAIN_PREFIX} {r['name']}: {r['detail']}"
    reason = " ".join(reason.split())
    return reason if len(reason) <= max_len else reason[: max_len - 3] + "..."


# -- self-drain: a pure decision, then the Slurm calls -----------------------------------------

def drain_decision(healthy: bool, drained: bool, down: bool, current_reason: Optional[str],
                   new_reason: str) -> Tuple[str, str]:
    """-> (action, why); action in drain | resume | none. Never touches another's reason."""
    ours = bool(current_reason) and current_reason.startswith(DRAIN_PREFIX)
    foreign = bool(current_reason) and not ours
    if healthy:
        if (drained or down) and ours:
            return "resume", "healthy again; clusterops had drained it"
        if (drained or down) and foreign:
            return "none", f"healthy, but drained by someone else ({current_reason!r}): left alone"
        return "none", "healthy"
    if foreign and (drained or down):
        return "none", f"unhealthy, already drained by someone else ({current_reason!r}): left alone"
    if drained and ours and current_reason == new_reason:
        return "none", "unhealthy, already drained by clusterops for this"
    return "drain", "unhealthy"


def self_drain(report: Dict[str, Any], node: str, *, timeout_s: float = 20.0, slurm=None) -> Dict[str, Any]:
    """Drain or resume ``node`` after a check; bounded by ``timeout_s`` whatever the controller does."""
    box: Dict[str, Any] = {"node": node, "action": "none", "why": "", "ok": False}

    def work():
        from clusterops.slurm import Slurm

        s = slurm or Slurm.from_environment(timeout_s=max(2.0, timeout_s / 3), read_attempts=2, backoff_s=0.5)
        info = s.node(node)
        healthy = report["status"] in ("pass", "warn")
        reason = drain_reason(report)
        action, why = drain_decision(healthy, info.drained, info.is_down, info.reason or None, reason)
        box.update(action=action, why=why, previous_reason=info.reason)
        if action == "drain":
            s.drain([node], reason)
            box["reason"] = reason
        elif action == "resume":
            s.resume([node])
        box["ok"] = True

    def run():
        try:
            work()
        except Exception as e:  # controller down, node unknown...: report, never hang or crash
            box.update(action="none", why=f"Slurm not reachable or refused: {e}", ok=False)

    th = threading.Thread(target=run, daemon=True, name="self-drain")
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        box.update(action="none", why=f"Slurm did not answer within {timeout_s:g}s; node left as it was", ok=False)
    return box


# -- outputs --------------------------------------------------------------------------------

_STATUS_NUM = {"pass": 0, "warn": 1, "fail": 2, "error": 3, "skip": -1}


def prometheus_text(report: Dict[str, Any]) -> str:
    """The check as Prometheus text exposition. Every series appears once: a profile that
    runs one probe name twice gets ``probe="name"``, ``probe="name#2"``, ... in order."""
    return health_metrics(report).text()


def health_metrics(report: Dict[str, Any]):
    """The check's metrics (:mod:`clusterops.metrics`); ``.text()`` or ``.write_textfile()``."""
    from clusterops.metrics import Metrics

    prom = Metrics()
    node, prof = report["node"], report["profile"]
    base = {"node": node, "profile": prof}
    prom.set("clusterops_health_status", base, _STATUS_NUM.get(report["status"], 3))
    prom.set("clusterops_health_check_duration_seconds", base, report["duration_s"])
    t = report.get("time", time.time())
    prom.set("clusterops_health_last_run_timestamp_seconds", base,
             round(t) if isinstance(t, (int, float)) and abs(t) < 1e15 else t)
    if isinstance(report.get("exit_code"), int):
        prom.set("clusterops_health_exit_code", base, report["exit_code"])
    seen: Dict[str, int] = {}
    for r in report["results"]:
        name = str(r["name"])
        seen[name] = seen.get(name, 0) + 1
        probe = name if seen[name] == 1 else f"{name}#{seen[name]}"
        prom.set("clusterops_health_probe_status", {"node": node, "probe": probe},
                 _STATUS_NUM.get(r["status"], 3))
        v = r.get("value")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            prom.set("clusterops_health_probe_value", {"node": node, "probe": probe, "unit": r.get("unit") or ""}, v)
    return prom


def format_table(report: Dict[str, Any]) -> str:
    rows = []
    for r in report["results"]:
        v = r.get("value")
        val = "" if v is None else f"{v}{(' ' + r['unit']) if r.get('unit') else ''}"
        rows.append((r["status"].upper(), r["name"], val, r.get("detail", "")))
    w0 = max([len(x[1]) for x in rows] + [5])
    w1 = max([len(x[2]) for x in rows] + [5])
    w1 = min(w1, 22)
    out = [f"{report['node']}: {report['status'].upper()} (profile {report['profile']}, "
           f"{report['duration_s']:.2f}s)"]
    for st, name, val, detail in rows:
        out.append(f"  {st:<5} {name:<{w0}} {val[:22]:<{w1}} {detail}")
    return "\n".join(out)
