"""The module maps name every module that exists, and nothing that does not.

Three maps describe the package and a newcomer reads all three: the README's layout, the
module map in docs/foundation.md, and the map in each package's ``__init__`` docstring.
Each is compared with the tree under ``clusterops/`` both ways, and a failure names the
module that is missing from a map or the name a map keeps for a module that is gone.

How each map names a module (the rules a map's author keeps):

- README.md, the code block under "## Layout": inside the ``clusterops/`` entry, a module
  is written with its ``.py`` (``runner.py``), relative to the package whose line it is on
  (a line starting with ``slurm/`` two spaces in opens that package; a line starting with
  a module opens ``clusterops/`` again; deeper-indented lines continue the entry above).
  A sub-package's modules carry its folder (``probes/base.py``).
- docs/foundation.md, the section "## Module map": every module as its full path in
  backticks (``clusterops/slurm/client.py``).
- a package's ``__init__`` docstring: every module of the package as ````name````
  or ``:mod:`~clusterops.pkg.name``` followed by a colon (``- ``client``: ...``), a
  sub-package as ````name/````.

Anywhere in README.md and docs/*.md, a path ``clusterops/...py`` must exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Set, Tuple

import ast

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "clusterops"

# Packages whose __init__ docstring carries a module map.
MAPPED_PACKAGES = ("checkpoint", "health", "launch", "slurm", "supervisor", "sweep")


def tree_modules() -> Set[str]:
    """Every module under clusterops/ as a repo-relative path, ``__init__.py`` left out."""
    return {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts and p.name != "__init__.py"}


def tree_packages() -> Set[str]:
    return {p.parent.relative_to(REPO).as_posix() + "/" for p in PACKAGE.rglob("__init__.py")
            if "__pycache__" not in p.parts}


def _compare(where: str, named: Set[str], expected: Set[str]) -> List[str]:
    out = [f"{where} does not name {m} (add it to the map)" for m in sorted(expected - named)]
    out += [f"{where} names {m}, which does not exist (stale: remove or rename it)" for m in sorted(named - expected)]
    return out


# -- README.md ----------------------------------------------------------------------
def readme_layout_block(text: str) -> List[str]:
    m = re.search(r"^## Layout\s*\n+```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no '## Layout' section with a code block"
    return m.group(1).splitlines()


PY_TOKEN = re.compile(r"(?<![\w./-])([A-Za-z_][\w/]*\.py)\b")


def readme_named(lines: List[str]) -> Tuple[Set[str], Set[str]]:
    """(modules, packages) the layout block names, as repo-relative paths."""
    modules: Set[str] = set()
    packages: Set[str] = set()
    top = None            # the top-level entry (e.g. "clusterops/") the line belongs to
    ctx = ""              # the package a module token is relative to
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        first = line.split()[0].rstrip(",")
        rest = line
        if indent == 0:
            top = first if first == "clusterops/" else None
            ctx = "clusterops/"
            rest = line[len(line.split()[0]):]
        elif top and indent == 2:
            if first.endswith("/"):
                packages.add("clusterops/" + first)
                ctx = "clusterops/" + first
                rest = line[indent + len(first):]
            else:
                ctx = "clusterops/"
        if not top:
            continue
        for tok in PY_TOKEN.findall(rest):
            path = ctx + tok
            modules.add(path)
            parent = path.rsplit("/", 1)[0] + "/"
            while parent != "clusterops/":
                packages.add(parent)
                parent = parent[:-1].rsplit("/", 1)[0] + "/"
    return modules, packages


def test_readme_layout_names_every_module():
    mods, pkgs = readme_named(readme_layout_block((REPO / "README.md").read_text()))
    problems = _compare("README.md's layout", mods, tree_modules())
    problems += _compare("README.md's layout", pkgs, tree_packages() - {"clusterops/"})
    assert not problems, "\n".join(problems)


# -- docs/foundation.md -------------------------------------------------------------
def foundation_named(text: str) -> Set[str]:
    m = re.search(r"^## Module map\s*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/foundation.md has no '## Module map' section"
    return set(re.findall(r"`(clusterops/[\w/]+\.py)`", m.group(1)))


def test_foundation_module_map_names_every_module():
    named = foundation_named((REPO / "docs" / "foundation.md").read_text())
    problems = _compare("docs/foundation.md's module map", named, tree_modules())
    assert not problems, "\n".join(problems)


# -- package docstrings --------------------------------------------------------------
MAP_ENTRY = re.compile(r"(?:``(\w+/?)``|:mod:`~?[\w.]*?\.?(\w+)`):")


def docstring_named(doc: str) -> Set[str]:
    return {a or b for a, b in MAP_ENTRY.findall(doc)}


def package_members(pkg: Path) -> Set[str]:
    names = {p.stem for p in pkg.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    return names


@pytest.mark.parametrize("pkg", MAPPED_PACKAGES)
def test_package_docstring_maps_every_module(pkg):
    path = PACKAGE / pkg / "__init__.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    problems = _compare(f"the map in clusterops/{pkg}/__init__.py", docstring_named(doc),
                        package_members(PACKAGE / pkg))
    assert not problems, "\n".join(problems)


def test_every_package_with_modules_has_a_map_or_is_listed_as_without():
    # A new package gets a map, or is named here as one whose docstring says it otherwise.
    without = {"clusterops/cli/", "clusterops/integrations/", "clusterops/health/probes/"}
    pkgs = {p for p in tree_packages() if p != "clusterops/"}
    mapped = {f"clusterops/{p}/" for p in MAPPED_PACKAGES}
    assert pkgs - mapped - without == set(), "packages without a module map: " + ", ".join(sorted(pkgs - mapped - without))
    assert (mapped | without) - pkgs == set(), "listed packages that do not exist: " + ", ".join(sorted((mapped | without) - pkgs))


# -- every path the docs spell -----------------------------------------------------
def test_every_module_path_in_the_docs_exists():
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in re.findall(r"(?<![\w/.])(clusterops/[\w/]+\.py)\b", line):
                if not (REPO / path).is_file():
                    bad.append(f"{doc.relative_to(REPO)}:{n}: {path} does not exist")
    assert not bad, "\n".join(bad)


# -- the checkers themselves catch what they should --------------------------------
def test_readme_parser_reads_packages_modules_and_subpackages():
    lines = ["setup.py     not ours",
             "clusterops/  the library",
             "  runner.py  the door; mentions templates/ and srun/sbatch",
             "  slurm/     client.py, parse.py (pure)",
             "             states.py",
             "  health/    check.py; probes/base.py",
             "  jsonout.py, yamlio.py   two modules",
             "tests/       x.py is not in the package"]
    mods, pkgs = readme_named(lines)
    assert mods == {"clusterops/runner.py", "clusterops/slurm/client.py", "clusterops/slurm/parse.py",
                    "clusterops/slurm/states.py", "clusterops/health/check.py",
                    "clusterops/health/probes/base.py", "clusterops/jsonout.py", "clusterops/yamlio.py"}
    assert pkgs == {"clusterops/slurm/", "clusterops/health/", "clusterops/health/probes/"}


def test_compare_names_missing_and_stale():
    out = _compare("the map", {"a.py", "gone.py"}, {"a.py", "new.py"})
    assert out == ["the map does not name new.py (add it to the map)",
                   "the map names gone.py, which does not exist (stale: remove or rename it)"]


def test_docstring_map_entries():
    doc = ("- ``client``: ``Slurm`` (``run``) and ``x`` more;\n"
           "- :mod:`~clusterops.checkpoint.format`: names; ``probes/``: a folder")
    assert docstring_named(doc) == {"client", "format", "probes/"}
