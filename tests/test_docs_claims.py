"""Every "only" claim in a docstring was checked, and names the exceptions the code has.

A docstring that says "the one place that ...", "the only code here that ...", "every
path ... goes through ..." is a promise a reader builds on. Each such claim in a
docstring under ``clusterops/`` is in ``REVIEWED`` below (a new claim fails
``test_every_only_claim_was_reviewed`` until someone checks it and adds it). Where the
claim can be read off the source, ``EXCEPTIONS`` computes the places that break it (by
``ast``, nothing imported) and the docstring must name each one; a claim with no
exception today fails the day one appears without the docstring saying so.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "clusterops"

CLAIM = re.compile(
    r"\b(the one (?:\w+ )?(?:place|door|way|loader|table|reader|path|side effect|environment)\b"
    r"|the (?:package's )?only (?:\w+ )?(?:place|code|module|way|path|door|ones?|side effect)\b"
    r"|one door|only from here|nothing else (?:in clusterops )?(?:imports|writes|runs|is touched)"
    r"|no other module|one table for every|is built here"
    r"|every (?:path|place|probe|drain|value)\b[^.;:]{0,60}?\bgoes through"
    r"|the code (?:here )?that changes)", re.I)


def _modules() -> List[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


@functools.lru_cache(maxsize=None)
def _tree(rel: str) -> ast.AST:
    return ast.parse((REPO / rel).read_text())


def docstrings(tree: ast.AST) -> Iterator[Tuple[str, str]]:
    """(owner, docstring flattened to one line) for the module and each class/function."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "name", "<module>"), " ".join(doc.split())


def claims() -> Set[Tuple[str, str, str]]:
    found = set()
    for p in _modules():
        for owner, doc in docstrings(_tree(_rel(p))):
            for m in CLAIM.finditer(doc):
                found.add((_rel(p), owner, " ".join(m.group(0).lower().split())))
    return found


# (module, docstring owner, the claim's words) -> how it was checked
REVIEWED: Dict[Tuple[str, str, str], str] = {
    ("clusterops/exitcodes.py", "<module>", "the one place"):
        "read: health/check.py and sweep/run.py take EXIT_* from it, machine.EXIT_* are Supervise members",
    ("clusterops/slurm/parse.py", "failure_kind", "the only place"):
        "tests/test_vocabulary.py scans the supervisor for srun's words (none outside slurm/parse.py)",
    ("clusterops/supervisor/machine.py", "_enter", "the one place"):
        "tests/test_vocabulary.py: only __init__ and _enter assign self.state (ast)",
    ("clusterops/runner.py", "<module>", "the one place"):
        "true for this host (subprocess: tests/test_layout.py); names clusterops.sweep.ssh (remote hosts)",
    ("clusterops/runner.py", "<module>", "nothing else in clusterops imports"): "tests/test_layout.py",
    ("clusterops/drain_apply.py", "<module>", "every path that drains a node on its own judgement goes through"):
        "EXCEPTIONS: names clusterops.cli.slurmcmd (the operator's drain)",
    ("clusterops/sweep/run.py", "<module>", "the code here that changes"):
        "EXCEPTIONS: names run_sweep and _restore_drains",
    ("clusterops/sweep/__init__.py", "<module>", "the code that changes"): "names run_sweep (the recheck's resume)",
    ("clusterops/sweep/run.py", "apply_sweep_plan", "nothing else is touched"): "within the function: read it",
    ("clusterops/sweep/run.py", "apply_sweep_plan", "every drain goes through"): "within the function: read it",
    ("clusterops/slurm/__init__.py", "<module>", "is built here"):
        "EXCEPTIONS: names templates/ (Slurm commands in generated scripts)",
    ("clusterops/slurm/factory.py", "<module>", "the one way"): "EXCEPTIONS: no client built outside slurm/",
    ("clusterops/slurm/tools.py", "<module>", "the one place"):
        "read: every argv of a Slurm program passes SlurmTools (client, steps, devcluster daemons)",
    ("clusterops/slurm/states.py", "<module>", "one table for every"):
        "read: no job-state set elsewhere (parse.py's sets are node states)",
    ("clusterops/yamlio.py", "<module>", "the one yaml loader"): "EXCEPTIONS: no yaml load outside yamlio",
    ("clusterops/health/profiles.py", "_read_yaml", "the one input loader"): "as yamlio.py",
    ("clusterops/launch/spec.py", "_load", "the one input loader"): "as yamlio.py",
    ("clusterops/launch/render.py", "jinja_environment", "the one jinja environment"):
        "EXCEPTIONS: no jinja2 import outside launch/render.py",
    ("clusterops/launch/render.py", "<module>", "every value that reaches the shell goes through"):
        "tests/test_launch_standin.py runs rendered scripts with hostile values (a canary must not appear)",
    ("clusterops/launch/submit.py", "<module>", "the one side effect"):
        "read: spec.py and render.py write nothing (render is pure)",
    ("clusterops/launch/__init__.py", "<module>", "the package's only side effect"): "as launch/submit.py",
    ("clusterops/metrics.py", "<module>", "nothing else writes"):
        "EXCEPTIONS: no prometheus_client import outside metrics.py",
    ("clusterops/protocol.py", "<module>", "no other module"): "tests/test_protocol.py spells the names",
    ("clusterops/schema.py", "<module>", "the one table"): "read: supervise keys only in schema.SUPERVISE",
    ("clusterops/supervisor/machine.py", "Policy", "the one table"): "as schema.py",
    ("clusterops/supervisor/machine.py", "_requeue", "only from here"): "EXCEPTIONS: Requeue( built only there",
    ("clusterops/health/probes/base.py", "<module>", "every probe goes through"):
        "read: health.check.run_check runs the probes only through run_probes",
    ("clusterops/textsafe.py", "<module>", "every place that prints such text goes through"):
        "tests/test_textsafe.py feeds hostile stored text to the history, timeline and report printers",
    ("clusterops/deploy.py", "<module>", "the only path"): "rendering refuses a file still naming it",
    ("clusterops/integrations/transformers.py", "<module>", "the only ones"):
        "about the Trainer (it installs no signal handlers), not this package",
}


def test_every_only_claim_was_reviewed():
    found = claims()
    new = sorted(found - set(REVIEWED))
    gone = sorted(set(REVIEWED) - found)
    assert not new, "unreviewed 'only' claims (check each, name its exception, add it to REVIEWED):\n" + \
        "\n".join(f"  {m} ({o}): {c!r}" for m, o, c in new)
    assert not gone, "REVIEWED lists claims no docstring makes any more:\n" + \
        "\n".join(f"  {m} ({o}): {c!r}" for m, o, c in gone)


# -- the exceptions, read off the source ---------------------------------------------
def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    return (n for n in ast.walk(tree) if isinstance(n, ast.Call))


def _attr_calls(tree: ast.AST, names: Set[str]) -> bool:
    return any(isinstance(c.func, ast.Attribute) and c.func.attr in names for c in _calls(tree))


def _imports(tree: ast.AST, top: str) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == top for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == top:
            return True
    return False


def _dotted(rel: str) -> str:
    return rel[:-3].replace("/", ".").removesuffix(".__init__")


def _modules_where(pred: Callable[[ast.AST], bool], skip: Callable[[str], bool]) -> Set[str]:
    return {_dotted(_rel(p)) for p in _modules() if not skip(_rel(p)) and pred(_tree(_rel(p)))}


def remote_program_starts() -> Set[str]:
    """Modules that start programs other than through the runner: paramiko's exec_command."""
    return _modules_where(lambda t: _attr_calls(t, {"exec_command", "invoke_shell"}),
                          lambda r: r == "clusterops/runner.py")


def direct_drains() -> Set[str]:
    """Modules outside the Slurm layer and drain_apply that call a client's ``drain``."""
    return _modules_where(lambda t: _attr_calls(t, {"drain"}),
                          lambda r: r.startswith("clusterops/slurm/") or r == "clusterops/drain_apply.py")


def sweep_state_changers() -> Set[str]:
    """Functions of sweep/run.py that drain or resume nodes (other than apply_sweep_plan)."""
    out = set()
    for fn in ast.walk(_tree("clusterops/sweep/run.py")):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for c in _calls(fn):
                name = c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
                if name in {"drain", "resume", "apply_drain"}:
                    out.add(fn.name)
    return out - {"apply_sweep_plan"}


def slurm_commands_in_templates() -> Set[str]:
    words = re.compile(r"^(?!\s*#)(?!#SBATCH).*\b(srun|scontrol|sbatch|squeue|sinfo|scancel)\b", re.M)
    hits = {p.relative_to(REPO).as_posix() for p in (REPO / "templates").rglob("*.j2") if words.search(p.read_text())}
    return {"templates/"} if hits else set()


def clients_built_outside_slurm() -> Set[str]:
    def builds(t):
        for c in _calls(t):
            f = c.func
            if isinstance(f, ast.Name) and f.id in {"Slurm", "PyslurmSlurm"}:
                return True
            if isinstance(f, ast.Attribute) and (f.attr in {"Slurm", "PyslurmSlurm"} or (
                    f.attr == "from_environment" and isinstance(f.value, ast.Name) and f.value.id == "Slurm")):
                return True
        return False
    return _modules_where(builds, lambda r: r.startswith("clusterops/slurm/"))


def yaml_loads_outside_yamlio() -> Set[str]:
    names = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all", "compose", "compose_all"}
    def loads(t):
        return any(isinstance(c.func, ast.Attribute) and c.func.attr in names and isinstance(c.func.value, ast.Name)
                   and c.func.value.id == "yaml" for c in _calls(t))
    return _modules_where(loads, lambda r: r == "clusterops/yamlio.py")


def jinja_outside_render() -> Set[str]:
    return _modules_where(lambda t: _imports(t, "jinja2"), lambda r: r == "clusterops/launch/render.py")


def prometheus_outside_metrics() -> Set[str]:
    return _modules_where(lambda t: _imports(t, "prometheus_client"), lambda r: r == "clusterops/metrics.py")


def requeue_built_outside_requeue() -> Set[str]:
    out = set()
    for fn in ast.walk(_tree("clusterops/supervisor/machine.py")):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != "_requeue":
            if any(isinstance(c.func, ast.Name) and c.func.id == "Requeue" for c in _calls(fn)):
                out.add(fn.name)
    return out


# (module, docstring owner, finder): the docstring must name each place the finder returns.
EXCEPTIONS = [
    ("clusterops/runner.py", "<module>", remote_program_starts),
    ("clusterops/drain_apply.py", "<module>", direct_drains),
    ("clusterops/sweep/run.py", "<module>", sweep_state_changers),
    ("clusterops/slurm/__init__.py", "<module>", slurm_commands_in_templates),
    ("clusterops/slurm/factory.py", "<module>", clients_built_outside_slurm),
    ("clusterops/yamlio.py", "<module>", yaml_loads_outside_yamlio),
    ("clusterops/launch/render.py", "jinja_environment", jinja_outside_render),
    ("clusterops/metrics.py", "<module>", prometheus_outside_metrics),
    ("clusterops/supervisor/machine.py", "_requeue", requeue_built_outside_requeue),
]


@pytest.mark.parametrize("module, owner, finder", EXCEPTIONS, ids=[f"{m}:{o}" for m, o, _ in EXCEPTIONS])
def test_only_claim_names_its_exceptions(module, owner, finder):
    doc = dict(docstrings(_tree(module)))[owner]
    assert CLAIM.search(doc), f"{module} ({owner}) makes no 'only' claim any more: drop it from EXCEPTIONS"
    unnamed = sorted(e for e in finder() if e not in doc)
    assert not unnamed, f"{module} ({owner}) claims to be the only one, but its docstring does not name: " + \
        ", ".join(unnamed)


def test_the_finders_see_todays_exceptions():
    # The finders are not blind: the exceptions the code has today are found.
    assert remote_program_starts() == {"clusterops.sweep.ssh"}
    assert direct_drains() == {"clusterops.cli.slurmcmd"}
    assert sweep_state_changers()   # today run_sweep and _restore_drains (their names may change with a split)
    assert slurm_commands_in_templates() == {"templates/"}


def test_claim_pattern():
    assert CLAIM.search("The one place that runs external programs")
    assert CLAIM.search("the only code here that changes node states")
    assert CLAIM.search("Every path that drains a node goes through apply_drain")
    assert not CLAIM.search("one place for each node; only once")
