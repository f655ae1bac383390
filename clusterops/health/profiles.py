"""Health profiles and the site config: find, load, merge, validate (pure apart from reading files).

A profile is YAML data: a built-in name (``health/*.yaml``, installed as
``clusterops.health_profiles``, found through ``builtin_dir``) or a file. A profile may
``extends:`` another (a relative file name is relative to the profile naming it); the
site config (``--site-config FILE`` or ``$CLUSTEROPS_HEALTH_SITE``) overrides profiles
and GPU-model figures without forking them, and holds the fleet guard's ``drain:``
settings (``site_drain_settings``, ``drain_settings``):

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
tables in ``clusterops.schema`` before anything runs (``InputError``, exit 2: one line
naming file, line and key). ``load_profile`` returns the resolved :class:`Profile`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from clusterops import drains, schema, yamlio
from clusterops.errors import InputError, where

SITE_ENV = "CLUSTEROPS_HEALTH_SITE"


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


def builtin_dir() -> Path:
    from clusterops.resources import data_dir

    return data_dir("health_profiles")


def builtin_profiles() -> List[str]:
    # Data files beside the profiles (not profiles): GPU model figures, recorded sdc digests.
    return sorted(p.stem for p in builtin_dir().glob("*.yaml") if p.stem not in ("gpu_models", "sdc_digests"))


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
    ib = probes.get("ibbw") if isinstance(probes.get("ibbw"), dict) else {}
    if ib.get("floors"):
        from clusterops.health.probes.ibbw import FLOORS_GBPS   # the built-in floors a rate's settle over

        for rate, fl in ib["floors"].items():
            both = dict(FLOORS_GBPS.get(rate) or {}, **{k: v for k, v in (fl or {}).items() if k in ("fail", "warn")})
            if both.get("fail") is not None and both.get("warn") is not None and both["warn"] < both["fail"]:
                raise InputError(f"{source}: probes.ibbw.floors.{rate}.warn: {both['warn']:g} is below "
                                 f"fail {both['fail']:g}")
    if ib.get("warn_fraction", 0.95) < ib.get("fail_fraction", 0.9):
        raise InputError(f"{source}: probes.ibbw.warn_fraction: {ib.get('warn_fraction', 0.95):g} is below "
                         f"fail_fraction {ib.get('fail_fraction', 0.9):g}")
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


def drain_settings(site_config: Optional[str] = None) -> drains.GuardSettings:
    """The fleet guard's settings from the site config's ``drain:`` block and the environment."""
    s = site_drain_settings(site_config)
    return drains.GuardSettings(s["max_drained_fraction"], s["partition"])
