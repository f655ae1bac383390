"""Health checks: profile -> probes -> report, exit code, optional self-drain.

Profiles are YAML data (``health/*.yaml``, installed as ``clusterops.health_profiles``):
``fast`` (HealthCheckProgram), ``preflight`` (before training), ``deep`` (burn-in).
A profile may ``extends:`` another; a site config (``--site-config FILE`` or
``$CLUSTEROPS_HEALTH_SITE``) overrides profiles and GPU-model figures without forking, and
holds the fleet guard's ``drain:`` settings (``site_drain_settings``):

    gpu_models:               # merged over health/gpu_models.yaml
      H100: {matmul_bf16_tflops: 760}
    defaults:                 # merged into every profile
      gpus: {required: true, count: 8}
    profiles:
      fast:
        probes:
          host.paths: {paths: [{path: /scratch, min_free_gb: 500}]}
    drain: {max_drained_fraction: 0.1, partition: gpu}

Every input is read by ``clusterops.yamlio`` and validated completely against the field
tables in ``clusterops.schema`` before anything runs (exit 2, one line: file, line, key).

Report (the ``--json`` contract): ``{"node", "profile", "status": pass|warn|fail|error,
"exit_code", "duration_s", "results": [ProbeResult... + "probe"]}`` (each result names the
probe that produced it). Exit codes (``EXIT_*`` below): 0 healthy (warnings allowed), 1
unhealthy (a probe failed), 2 bad usage/profile/site config (nothing run, nothing
drained), 3 unhealthy but the fleet guard refused the self-drain (node left in service),
4 ``error``: a probe crashed, timed out or could not check (reported loudly, never drained).
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from clusterops import drains, schema, yamlio
from clusterops.errors import InputError, where
from clusterops.health.probes.base import ProbeContext, ProbeSpec, RunOutcome, overall_status, run_probes

log = logging.getLogger(__name__)

SITE_ENV = "CLUSTEROPS_HEALTH_SITE"
DRAIN_PREFIX = drains.PREFIX

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
EXIT_GUARD = 3      # failing, but the fleet guard refused the self-drain
EXIT_ERROR = 4      # the check could not decide (a probe raised or timed out): never drained
EXIT_CODES = {
    EXIT_HEALTHY: "healthy (pass or warn)",
    EXIT_UNHEALTHY: "unhealthy: a probe failed (drained with --drain-on-fail)",
    EXIT_USAGE: "bad usage, profile or site config: nothing run, nothing drained",
    EXIT_GUARD: "unhealthy, but the fleet guard refused the drain: node left in service",
    EXIT_ERROR: "error: a probe crashed, timed out or could not check: node left in service",
}

# probe name -> (module, function, exclusive)
REGISTRY: Dict[str, Tuple[str, str, bool]] = {
    "nvml": ("clusterops.health.probes.nvml", "probe_nvml", False),
    "xid": ("clusterops.health.probes.xid", "probe_xid", False),
    "host.paths": ("clusterops.health.probes.host", "probe_paths", False),
    "host.mounts": ("clusterops.health.probes.host", "probe_mounts", False),
    "host.memory": ("clusterops.health.probes.host", "probe_memory", False),
    "host.cpus": ("clusterops.health.probes.host", "probe_cpus", False),
    "host.infiniband": ("clusterops.health.probes.host", "probe_infiniband", False),
    "host.stray_processes": ("clusterops.health.probes.host", "probe_stray_processes", False),
    "dcgm": ("clusterops.health.probes.dcgm", "probe_dcgm", True),
    "matmul": ("clusterops.health.probes.matmul", "probe_matmul", True),
    "dist": ("clusterops.health.probes.dist", "probe_dist", True),
}
# Settings each probe understands, with types and ranges: clusterops/schema.py (PROBE_SETTINGS).
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
    from clusterops.resources import data_dir

    return data_dir("health_profiles")


def builtin_profiles() -> List[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.yaml") if p.stem != "gpu_models")


def _suggest(word: str, options) -> str:
    return schema.suggest(word, list(options))


def _read_yaml(path: Path, what: str = "health profile") -> Tuple[Dict[str, Any], Dict[Tuple, int]]:
    """Read a profile or site file through the one input loader (clusterops.yamlio)."""
    data, lines = yamlio.load_file(path, what)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: a {what} is a YAML mapping of keys")
    return data, lines


def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """Deep merge: mappings merge, anything else (lists included) replaces."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if v is None and isinstance(out.get(k), dict):
            continue  # an empty section (`nvml:` with nothing under it) changes nothing
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _validate(data: Dict[str, Any], path: Path, lines: Dict[Tuple, int], prefix=()) -> None:
    schema.validate(data, schema.PROFILE, str(path), lines, prefix)


def _find_profile(name: str, search: List[Path], base_dir: Optional[Path] = None) -> Path:
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        p = Path(name).expanduser()
        if base_dir is not None and not p.is_absolute() and (base_dir / p).is_file():
            p = base_dir / p
        if not p.is_file():
            raise InputError(f"health profile file {schema.key_text(name)}: "
                             f"{'not found' if not p.exists() else 'not a file'}")
        return p
    for d in search:
        p = d / f"{name}.yaml"
        if p.exists():
            return p
    raise InputError(f"unknown health profile {name[:60]!r}{_suggest(name, builtin_profiles())}; "
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
        try:
            # A relative file name is relative to the profile that names it.
            ppath = _find_profile(parent, [path.parent] + search, base_dir=path.parent)
        except InputError as e:
            raise InputError(f"{where(path, lines.get(('extends',)), 'extends')}: {e.message}") from None
        base, _ = _load_raw(str(ppath), [path.parent] + search, seen + (key,))
        base.pop("description", None)
        data = merge(base, {k: v for k, v in data.items() if k != "extends"})
    return data, path


def load_site_config(path: Optional[str]) -> Tuple[Dict[str, Any], Optional[str]]:
    """The health site config (``--site-config`` or ``$CLUSTEROPS_HEALTH_SITE``), validated
    completely against ``schema.SITE``; ({}, None) when there is none."""
    path = path or os.environ.get(SITE_ENV) or None
    if not path:
        return {}, None
    p = Path(path).expanduser()
    data, lines = _read_yaml(p, "health site config")
    schema.validate(data, schema.SITE, str(p), lines)
    return data, str(p)


DRAIN_FRACTION_ENV = drains.FRACTION_ENV


def site_drain_settings(site: Any = None, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The fleet guard's settings: ``{"max_drained_fraction": float, "partition": str|None}``.

    ``site`` is the mapping load_site_config returned, or a site-config path (loaded and
    validated here; None/"" -> ``$CLUSTEROPS_HEALTH_SITE`` if set). Values come from its
    ``drain:`` section, defaults from ``schema.DRAIN``; ``$CLUSTEROPS_MAX_DRAINED_FRACTION``
    overrides the fraction. Bad values raise InputError (exit 2).
    """
    path = None
    if site is None or isinstance(site, (str, os.PathLike)):
        site, path = load_site_config(os.fspath(site) if site else None)
    g = drains.guard_settings(site, path, env)   # the one reader of the block and the env override
    return {"max_drained_fraction": g.max_drained_fraction, "partition": g.partition}


def check_file(path: str) -> str:
    """Validate a profile or a site config file without running anything -> what it is.

    A file with ``probes``/``gpus``/``extends``/``description`` at the top is a profile
    (its parents are loaded and checked too); one with ``gpu_models``/``defaults``/
    ``profiles``/``drain`` is a site config. Raises InputError naming file, line and key.
    """
    p = Path(path).expanduser()
    data, lines = _read_yaml(p, "health profile or site config")
    site_keys = {f.name for f in schema.SITE.fields}
    if data and set(data) <= site_keys:
        load_site_config(str(p))
        return "site config"
    if data and set(data) & site_keys:
        schema.validate(data, schema.SITE, str(p), lines)  # names the first key that is neither
    data, _ = _load_raw(str(p), [builtin_dir()])
    _check_resolved(data, str(p))
    return "profile"


def load_gpu_models(site: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    data, _ = _read_yaml(builtin_dir() / "gpu_models.yaml", "GPU model table")
    return {k: v for k, v in merge(data, site.get("gpu_models") or {}).items() if isinstance(v, dict)}


def _check_resolved(data: Dict[str, Any], source: str) -> None:
    """Rules between settings, checked once the profile, its parents and the site are merged."""
    probes = data.get("probes") or {}
    nv = probes.get("nvml") if isinstance(probes.get("nvml"), dict) else {}
    warn_c, fail_c = nv.get("temperature_warn_c", 85), nv.get("temperature_fail_c", 95)
    if warn_c > fail_c:
        raise InputError(f"{source}: probes.nvml.temperature_warn_c: {warn_c} is above "
                         f"temperature_fail_c {fail_c}")
    xid = probes.get("xid") if isinstance(probes.get("xid"), dict) else {}
    if xid.get("source") == "file" and not xid.get("log_file"):
        raise InputError(f"{source}: probes.xid.source: 'file' needs probes.xid.log_file")


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
    _check_resolved(data, str(path) if not site_path else f"{path} (with site config {site_path})")
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
        fn = _lazy(module, fn_name, name)
        specs.append(ProbeSpec(name, fn, cfg, float(cfg.get("timeout_s", DEFAULT_TIMEOUT_S)), exclusive))
    return specs


def _lazy(module: str, fn_name: str, name: str = ""):
    def call(cfg, ctx):
        results = getattr(importlib.import_module(module), fn_name)(cfg, ctx)
        for r in results or ():
            r.probe = name   # which probe made it: a drain names the probe, results may differ
        return results

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
    results = []
    for r in outcome.results:
        d = r.to_dict()
        d["probe"] = getattr(r, "probe", "") or r.name   # a raise/timeout result is named after its probe
        results.append(d)
    report = {"node": ctx.node, "profile": profile.name, "status": status,
              "exit_code": exit_code(status),
              "duration_s": round(time.monotonic() - t0, 3), "time": time.time(),
              "results": results}
    return CheckRun(report, outcome)


def exit_code(status: str, drain: Optional[Dict[str, Any]] = None) -> int:
    """The check's exit code from its status and, with --drain-on-fail, what Slurm was asked."""
    if status in ("pass", "warn"):
        return EXIT_HEALTHY
    if status == "fail":
        return EXIT_GUARD if drain and drain.get("action") == "refused" else EXIT_UNHEALTHY
    return EXIT_ERROR


def first_problem(report: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    for wanted in ("fail", "error"):
        for r in report["results"]:
            if r["status"] == wanted:
                return r
    return None


def drain_reason(report: Dict[str, Any], max_len: int = drains.MAX_REASON_CHARS) -> str:
    """``clusterops:health:<profile>: <probe>: [<result>: ]<detail>`` for the first failure."""
    r = first_problem(report) or {"name": "health", "detail": report["status"]}
    probe = r.get("probe") or r["name"]
    detail = r.get("detail") or r.get("status", "")
    if r["name"] != probe:
        detail = f"{r['name']}: {detail}"
    return drains.make_reason(drains.HEALTH, probe, detail, profile=str(report["profile"]), max_chars=max_len)


# -- self-drain: a pure decision, then the Slurm calls -----------------------------------------

def drain_decision(report: Dict[str, Any], drained: bool, down: bool,
                   current_reason: Optional[str]) -> Tuple[str, str]:
    """-> (action, why); action in drain | resume | none. Pure.

    Only a ``fail`` drains; an ``error`` touches nothing. A passing check lifts only a drain
    whose cause it has just re-checked (``drains.may_resume``). A failing check does not
    relabel a clusterops drain it could not lift itself (a supervisor's, a deeper profile's),
    and never touches someone else's. The fleet guard is applied after this, by the caller.
    """
    status = report["status"]
    profile = str(report["profile"])
    ours = drains.parse_reason(current_reason)
    foreign = drains.is_foreign(current_reason)
    held = drained or down
    if status in ("pass", "warn"):
        if held and foreign:
            return "none", f"healthy, but drained by someone else ({current_reason!r}): left alone"
        if held and ours:
            ok, why = drains.may_resume(current_reason, drains.Resumer(
                drains.BY_HEALTH, profile, drains.rechecked_probes(report["results"])))
            return ("resume", f"healthy again: {why}") if ok else ("none", f"healthy, but {why}")
        return "none", "healthy"
    if status != "fail":
        return "none", (f"check status {status}: it could not decide, so the node is left as it is "
                        "(an error never drains)")
    if held and foreign:
        return "none", f"unhealthy, already drained by someone else ({current_reason!r}): left alone"
    new_reason = drain_reason(report)
    if drained and ours:
        if current_reason == new_reason:
            return "none", "unhealthy, already drained by clusterops for this"
        mine, _ = drains.may_resume(current_reason, drains.Resumer(drains.BY_HEALTH, profile, drains.probes_ran(report["results"])))
        if not mine:
            return "none", f"unhealthy, already drained by clusterops ({ours.origin}): reason kept"
        return "drain", "unhealthy (reason updated)"
    return "drain", "unhealthy"


def self_drain(report: Dict[str, Any], node: str, *, timeout_s: float = 20.0, slurm=None,
               guard: Optional[drains.GuardSettings] = None) -> Dict[str, Any]:
    """Drain or resume ``node`` after a check; bounded by ``timeout_s`` whatever the controller does.

    A new drain first asks the fleet guard (``drains.guard_drain``) with Slurm's view of the
    node's partition(s): past ``guard.max_drained_fraction`` the node stays in service and
    the action is ``refused``."""
    box: Dict[str, Any] = {"node": node, "action": "none", "why": "", "ok": False}
    guard = guard or drains.GuardSettings()

    if report["status"] not in ("pass", "warn", "fail"):
        # An error decides nothing: Slurm is not even asked.
        action, why = drain_decision(report, False, False, None)
        box.update(action=action, why=why, ok=True)
        return box

    def work():
        from clusterops.slurm import Slurm

        s = slurm or Slurm.from_environment(timeout_s=max(2.0, timeout_s / 3), read_attempts=2, backoff_s=0.5)
        info = s.node(node)
        action, why = drain_decision(report, info.drained, info.is_down, info.reason or None)
        box.update(action=action, why=why, previous_reason=info.reason)
        if action == "drain":
            reason = drain_reason(report)
            already = info.drained and drains.is_ours(info.reason)
            if not already:
                verdict = drains.guard_drain(node, s.nodes(), guard)
                box["guard"] = verdict.to_dict()
                if not verdict.allowed:
                    box.update(action="refused", why=verdict.message, ok=True)
                    return
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


def drain_settings(site_config: Optional[str] = None) -> drains.GuardSettings:
    """The fleet guard's settings from the site config's ``drain:`` block and the environment."""
    s = site_drain_settings(site_config)
    return drains.GuardSettings(s["max_drained_fraction"], s["partition"])


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
