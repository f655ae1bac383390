"""Running a health check: the probe table, profile -> probes -> report, and exit codes.

``REGISTRY`` is the explicit table of probes (name -> function, and whether it runs
alone: the GPU-heavy and timing-sensitive ones). ``run_check`` runs a resolved profile's
probes (``clusterops.health.probes.base.run_probes``: each under its own deadline) and
builds the report, the ``--json`` contract: ``{"node", "profile", "status":
pass|warn|fail|error, "exit_code", "duration_s", "time", "results": [ProbeResult...
+ "probe"]}`` (each result names the probe that produced it). Exit codes (``EXIT_*``):
0 healthy (warnings allowed), 1 unhealthy (a probe failed), 2 bad usage/profile/site
config (nothing run, nothing drained), 3 unhealthy but the fleet guard refused the
self-drain (node left in service), 4 ``error``: a probe crashed, timed out or could not
check (reported loudly, never drained).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from clusterops.health.probes import amd, copybw, dcgm, dist, fabric, host, matmul, nvml, sdc, xid
from clusterops.health.probes.base import (ProbeContext, ProbeResult, ProbeSpec, RunOutcome, overall_status,
                                           run_probes)
from clusterops.health.profiles import Profile

from clusterops.exitcodes import HealthCheck as _Exit  # noqa: E402 - the codes are written there

EXIT_HEALTHY = int(_Exit.HEALTHY)
EXIT_UNHEALTHY = int(_Exit.UNHEALTHY)
EXIT_USAGE = int(_Exit.USAGE)
EXIT_GUARD = int(_Exit.GUARD)      # failing, but the fleet guard refused the self-drain
EXIT_ERROR = int(_Exit.ERROR)      # the check could not decide (a probe raised or timed out): never drained

ProbeFn = Callable[[Dict[str, Any], ProbeContext], List[ProbeResult]]


@dataclass(frozen=True)
class ProbeEntry:
    fn: ProbeFn
    exclusive: bool = False   # runs alone, after the light probes (GPU load, timing)


# Every probe a profile can name. Settings each probe understands, with types and ranges:
# clusterops/schema.py (PROBE_SETTINGS, keyed by the same names).
REGISTRY: Dict[str, ProbeEntry] = {
    "nvml": ProbeEntry(nvml.probe_nvml),
    "xid": ProbeEntry(xid.probe_xid),
    "amd": ProbeEntry(amd.probe_amd),
    "host.paths": ProbeEntry(host.probe_paths),
    "host.mounts": ProbeEntry(host.probe_mounts),
    "host.memory": ProbeEntry(host.probe_memory),
    "host.cpus": ProbeEntry(host.probe_cpus),
    "host.infiniband": ProbeEntry(host.probe_infiniband),
    "host.stray_processes": ProbeEntry(host.probe_stray_processes),
    "fabric": ProbeEntry(fabric.probe_fabric),
    "dcgm": ProbeEntry(dcgm.probe_dcgm, exclusive=True),
    "matmul": ProbeEntry(matmul.probe_matmul, exclusive=True),
    "dist": ProbeEntry(dist.probe_dist, exclusive=True),
    "copybw": ProbeEntry(copybw.probe_copybw, exclusive=True),
    "sdc": ProbeEntry(sdc.probe_sdc, exclusive=True),
}
DEFAULT_TIMEOUT_S = 10.0
# Probes a profile configures that `health check` does not run: the sweep's pair mode runs
# them between two nodes (name -> the module that reads their settings).
PAIR_PROBES: Dict[str, str] = {"ibbw": "clusterops.health.probes.ibbw"}


def probe_specs(profile: Profile) -> List[ProbeSpec]:
    specs = []
    for name, cfg in profile.probes.items():
        if name in PAIR_PROBES:
            continue
        entry = REGISTRY[name]
        cfg = dict(cfg)
        if name == "nvml":
            cfg.setdefault("required", profile.gpus_required)
            if profile.gpu_count is not None:
                cfg.setdefault("gpu_count", profile.gpu_count)
        if name == "amd" and profile.gpu_count is not None:
            cfg.setdefault("gpu_count", profile.gpu_count)
        if name in ("matmul", "copybw", "sdc"):
            cfg.setdefault("required", profile.gpus_required)
        specs.append(ProbeSpec(name, _named(name, entry.fn), cfg, float(cfg.get("timeout_s", DEFAULT_TIMEOUT_S)),
                               entry.exclusive))
    return specs


def _named(name: str, fn: ProbeFn) -> ProbeFn:
    """``fn`` with each of its results stamped with the probe that made it (a drain names
    the probe; a probe's results may carry other names)."""
    def call(cfg, ctx):
        results = fn(cfg, ctx)
        for r in results or ():
            r.probe = name
        return results

    call.__name__ = fn.__name__
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
        # "undone": drained at the same moment as too many others, then lifted by the guard.
        return EXIT_GUARD if drain and drain.get("action") in ("refused", "undone") else EXIT_UNHEALTHY
    return EXIT_ERROR


def first_problem(report: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    for wanted in ("fail", "error"):
        for r in report["results"]:
            if r["status"] == wanted:
                return r
    return None
