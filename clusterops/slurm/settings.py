"""How clusterops talks to Slurm: one validated settings object, read once, passed in.

``SlurmSettings`` holds the site knobs (timeout per command, read attempts and backoff
for a flaky controller, the Slurm installation prefix, the backend). ``SlurmSettings.from_environment``
reads them from ``CLUSTEROPS_SLURM_TIMEOUT_S``, ``CLUSTEROPS_SLURM_READ_ATTEMPTS``,
``CLUSTEROPS_SLURM_BACKOFF_S``, ``CLUSTEROPS_SLURM_PREFIX`` and ``CLUSTEROPS_SLURM_BACKEND``;
a bad value is a one-line ``InputError`` (exit 2), never a traceback. ``tightened`` is how
callers that need a tighter bound (a health check's self-drain, a probe's gres lookup) get
one: they can only tighten the site's timeout, never loosen it. ``factory.connect`` builds a
client from these settings; this module imports no backend.

The backend: ``cli`` runs Slurm's command-line tools (``client.Slurm``); ``pyslurm`` talks
to the controller through the ``pyslurm`` library (``pyslurm_backend``, imported only when
chosen; the ``clusterops[pyslurm]`` extra); ``rest`` talks to slurmrestd at ``url``
(``CLUSTEROPS_SLURM_URL``; ``rest_backend``), with tokens signed with ``jwt_key``
(``CLUSTEROPS_SLURM_JWT_KEY``) or taken from ``SLURM_JWT`` or ``scontrol token``, and an
https URL's certificate checked against ``ca_file`` (``CLUSTEROPS_SLURM_CA_FILE``) when set; ``auto``
(the default) takes rest when a URL is set, else pyslurm when it is installed and its
major.minor matches the controller's, else the CLI, saying why at info level. An explicit
``pyslurm`` that cannot be used is one line and exit 2.

The dev cluster's well-known places (its default state folder and the ``cluster.json``
that records the prefix it was started with) are defined here, so the Slurm layer finds a
dev cluster without importing the dev-cluster code.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from clusterops.errors import InputError

TIMEOUT_ENV = "CLUSTEROPS_SLURM_TIMEOUT_S"
ATTEMPTS_ENV = "CLUSTEROPS_SLURM_READ_ATTEMPTS"
BACKOFF_ENV = "CLUSTEROPS_SLURM_BACKOFF_S"
PREFIX_ENV = "CLUSTEROPS_SLURM_PREFIX"
BACKEND_ENV = "CLUSTEROPS_SLURM_BACKEND"
URL_ENV = "CLUSTEROPS_SLURM_URL"
JWT_KEY_ENV = "CLUSTEROPS_SLURM_JWT_KEY"
CA_FILE_ENV = "CLUSTEROPS_SLURM_CA_FILE"
BACKENDS = ("auto", "cli", "pyslurm", "rest")
SITE_ENV = "CLUSTEROPS_HEALTH_SITE"   # the site config (clusterops.health.profiles reads it too)
DEVCLUSTER_DIR_ENV = "CLUSTEROPS_DEVCLUSTER_DIR"
DEFAULT_DEVCLUSTER_DIR = "/tmp/clusterops-devcluster"
DEVCLUSTER_INFO = "cluster.json"   # beside the dev cluster's slurm.conf


@dataclass(frozen=True)
class SlurmSettings:
    timeout_s: float = 30.0        # one Slurm command, wall time
    read_attempts: int = 4         # reads are retried; writes never are
    backoff_s: float = 0.5         # first pause between read attempts (doubles)
    prefix: Optional[str] = None   # Slurm installed under PREFIX/bin, PREFIX/sbin
    backend: str = "auto"          # auto | cli | pyslurm | rest
    url: Optional[str] = None      # slurmrestd: http(s)://HOST:PORT or unix:///PATH
    jwt_key: Optional[str] = None  # slurmrestd: sign tokens with this HS256 key file
    ca_file: Optional[str] = None  # slurmrestd over https: trust this CA bundle (PEM), not the system's

    def __post_init__(self) -> None:
        _positive(self.timeout_s, "timeout_s", upper=86400.0)
        if isinstance(self.read_attempts, bool) or not isinstance(self.read_attempts, int) \
                or not 1 <= self.read_attempts <= 100:
            raise InputError(f"Slurm settings: read_attempts: must be an integer in [1, 100], "
                             f"got {self.read_attempts!r}")
        _positive(self.backoff_s, "backoff_s", upper=3600.0, zero_ok=True)
        if self.backend not in BACKENDS:
            raise InputError(f"Slurm settings: backend: must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.backend == "rest" and not self.url:
            raise InputError(f"Slurm settings: backend rest needs the slurmrestd URL (${URL_ENV})")

    @classmethod
    def from_environment(cls, env: Optional[Mapping[str, str]] = None) -> "SlurmSettings":
        """The variables, over the site config's ``slurm:`` block (``$CLUSTEROPS_HEALTH_SITE``)."""
        env = os.environ if env is None else env
        kw: dict = site_slurm_block(env.get(SITE_ENV, "").strip() or None)
        for var, key, conv in ((TIMEOUT_ENV, "timeout_s", float), (ATTEMPTS_ENV, "read_attempts", int),
                               (BACKOFF_ENV, "backoff_s", float)):
            raw = env.get(var, "").strip()
            if raw:
                try:
                    kw[key] = conv(raw)
                except ValueError:
                    raise InputError(f"${var}={raw}: not a number") from None
        if env.get(PREFIX_ENV, "").strip():
            kw["prefix"] = env[PREFIX_ENV].strip()
        if env.get(BACKEND_ENV, "").strip():
            kw["backend"] = env[BACKEND_ENV].strip().lower()
        for var, key in ((URL_ENV, "url"), (JWT_KEY_ENV, "jwt_key"), (CA_FILE_ENV, "ca_file")):
            if env.get(var, "").strip():
                kw[key] = env[var].strip()
        try:
            return cls(**kw)
        except InputError as e:
            raise InputError(f"environment: {e.message}") from None

    def tightened(self, **overrides: Any) -> "SlurmSettings":
        """A copy bounded by ``overrides``: a caller may wait less than the site allows,
        or try fewer times, never more."""
        if overrides.get("timeout_s") is not None:
            overrides["timeout_s"] = min(float(overrides["timeout_s"]), self.timeout_s)
        if overrides.get("read_attempts") is not None:
            overrides["read_attempts"] = min(int(overrides["read_attempts"]), self.read_attempts)
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def site_slurm_block(path: Optional[str]) -> dict:
    """The ``slurm:`` block of the site config at ``path`` (validated whole against
    ``schema.SITE``: a bad file is a one-line ``InputError`` naming its line); {} without one."""
    if not path:
        return {}
    from clusterops import schema, yamlio

    p = Path(path).expanduser()
    data, lines = yamlio.load_file(p, "health site config")
    if not isinstance(data, dict):
        return {}
    schema.validate(data, schema.SITE, str(p), lines)
    block = data.get("slurm") or {}
    return {k: (str(Path(str(v)).expanduser()) if k in ("jwt_key", "ca_file") else v)
            for k, v in block.items() if v is not None}


def _positive(value: Any, name: str, *, upper: float, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if zero_ok else value > 0) and value <= upper
    if not ok:
        raise InputError(f"Slurm settings: {name}: must be a number in {'[0' if zero_ok else '(0'}, "
                         f"{upper:g}], got {value!r}")


def devcluster_conf(env: Optional[Mapping[str, str]] = None) -> Path:
    """Where the default dev cluster keeps its slurm.conf."""
    env = os.environ if env is None else env
    return Path(env.get(DEVCLUSTER_DIR_ENV) or DEFAULT_DEVCLUSTER_DIR) / "slurm.conf"


def recorded_prefix(conf_path: str | os.PathLike) -> Optional[str]:
    """The Slurm prefix a dev cluster was started with, read from the cluster.json beside
    its slurm.conf; None for any other slurm.conf, or a cluster run from PATH."""
    try:
        info = json.loads((Path(conf_path).parent / DEVCLUSTER_INFO).read_text())
    except (OSError, ValueError):
        return None
    cfg = info.get("config") if isinstance(info, dict) else None
    prefix = cfg.get("slurm_prefix") if isinstance(cfg, dict) else None
    return prefix if isinstance(prefix, str) and prefix else None
