"""``connect``: the one way the rest of the package gets a Slurm client (``api.SlurmAPI``).

It reads the site's ``settings.SlurmSettings`` (default: from the environment), tightens
them by the caller's overrides (a health check's self-drain, a probe's gres lookup, the
supervisor's one-attempt polls can only wait less than the site allows, never more) and
builds the backend the settings name: the CLI client (``client.Slurm``), slurmrestd
(``rest_backend``, when a URL is set; imported only then), or the pyslurm one
(``pyslurm_backend``, imported only when it may be chosen). It lives apart from
``settings`` so the settings import neither backend (no ``settings`` <-> ``client`` cycle).
"""

from __future__ import annotations

from typing import Any, Optional

from clusterops.slurm.api import SlurmAPI
from clusterops.slurm.client import Slurm
from clusterops.slurm.settings import SlurmSettings


def connect(settings: Optional[SlurmSettings] = None, *, runner=None, **overrides: Any) -> SlurmAPI:
    """The Slurm client for ``settings`` (default: from the environment), tightened by
    ``overrides`` (timeout_s, read_attempts, backoff_s), on the settings' backend: the CLI
    client, slurmrestd (``auto`` or ``rest`` with a URL: the server's newest known plugin
    version; an unknown one or an error is a one-line ``InputError`` naming the URL), or the
    pyslurm one (``auto``: pyslurm where it is installed and matches the controller's
    major.minor). An explicit ``backend="pyslurm"`` that cannot be used raises
    a one-line ``InputError``."""
    s = (settings or SlurmSettings.from_environment()).tightened(**overrides)
    cli = Slurm(runner, settings=s) if runner is not None else Slurm.from_environment(settings=s)
    if s.backend == "cli":
        return cli
    if s.url and s.backend in ("auto", "rest"):
        from clusterops.slurm import rest_backend   # only when slurmrestd is configured

        return rest_backend.connect_rest(cli, s.url, jwt_key=s.jwt_key, ca_file=s.ca_file)
    from clusterops.slurm import pyslurm_backend   # only when pyslurm may be chosen

    return pyslurm_backend.choose(cli, explicit=s.backend == "pyslurm")
