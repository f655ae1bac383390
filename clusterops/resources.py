"""Where the package's data lives: the Jinja templates, the health profiles, the Slurm-side
files and the Grafana/Prometheus files.

All sit at the top of the repository (``templates/``, ``health/``, ``slurm/``, ``deploy/``)
and are installed inside the package as ``clusterops.templates``,
``clusterops.health_profiles``, ``clusterops.site_files`` and ``clusterops.deploy_files``
(setup.cfg's ``package_dir``). From a
wheel or an editable install those packages import; from a source tree that shadows an
installed clusterops (``python -m clusterops`` run in the repository root) they do not,
so the repository's own folders are used. One lookup for all, so every way of running
clusterops finds the same files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# installed package name -> folder at the top of the repository
_DATA = {"templates": "templates", "health_profiles": "health", "site_files": "slurm", "deploy_files": "deploy"}


def data_dir(name: str) -> Path:
    """The folder holding ``clusterops.<name>``'s files (a key of ``_DATA``)."""
    folder = _DATA[name]
    try:
        spec = importlib.util.find_spec(f"clusterops.{name}")
    except ImportError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if Path(loc).is_dir():
                return Path(loc).resolve()
    source_tree = Path(__file__).resolve().parent.parent / folder
    if source_tree.is_dir():
        return source_tree
    raise FileNotFoundError(f"clusterops is installed without its {folder}/ data (clusterops.{name})")
