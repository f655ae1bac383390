"""Template discovery: which Jinja2 launcher templates there are and where each comes from.

Templates are ``<launcher>.sh.j2`` files searched in the ``--templates`` directories, then
``$CLUSTEROPS_TEMPLATES``, then the built-in ``templates/`` (found through
``clusterops.resources``); the first match wins. ``clusterops.launch.spec`` asks it which
site launchers exist and ``clusterops.launch.render`` where to load from; it imports
neither, so the two stay out of each other's way (no render <-> spec cycle).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops.errors import InputError

TEMPLATE_SUFFIX = ".sh.j2"
BASE_TEMPLATE = "base" + TEMPLATE_SUFFIX
TEMPLATES_ENV = "CLUSTEROPS_TEMPLATES"


def builtin_template_dir() -> Path:
    from clusterops.resources import data_dir

    return data_dir("templates")


def template_search_path(site_dirs: Sequence[str | os.PathLike] = (), *,
                         environ: Optional[Mapping[str, str]] = None) -> List[Tuple[Path, str]]:
    """Directories searched for templates, first match wins: [(dir, origin)].

    Order: ``--templates`` directories, then ``$CLUSTEROPS_TEMPLATES`` (os.pathsep
    separated), then the built-in templates.
    """
    environ = os.environ if environ is None else environ
    dirs: List[Tuple[Path, str]] = []
    for d in site_dirs:
        dirs.append((Path(d), "--templates"))
    for d in (environ.get(TEMPLATES_ENV) or "").split(os.pathsep):
        if d.strip():
            dirs.append((Path(d), TEMPLATES_ENV))
    for d, origin in dirs:
        if not d.is_dir():
            raise InputError(f"{origin} {d}: no such templates directory")
    dirs.append((builtin_template_dir(), "built-in"))
    return dirs


def list_templates(site_dirs: Sequence[str | os.PathLike] = (), *,
                   environ: Optional[Mapping[str, str]] = None) -> List[Dict[str, Any]]:
    """Every template name, where it is used from, and what it shadows."""
    seen: Dict[str, Dict[str, Any]] = {}
    for d, origin in template_search_path(site_dirs, environ=environ):
        for p in sorted(d.glob("*" + TEMPLATE_SUFFIX)):
            name = p.name[: -len(TEMPLATE_SUFFIX)]
            if name in seen:
                seen[name]["shadows"].append(str(p))
            else:
                seen[name] = {"name": name, "path": str(p), "origin": origin, "shadows": [],
                              "launcher": name != "base"}
    return sorted(seen.values(), key=lambda t: (t["name"] != "base", t["name"]))
