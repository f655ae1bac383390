"""The source tree keeps its own promises (read with ``ast``, nothing imported or run).

1. The Slurm boundary: no module under ``clusterops/`` outside ``clusterops/slurm/`` spells
   a Slurm client program (``SLURM_PROGRAMS``) in an argv. "In an argv" means, precisely:
   a string constant equal to the program's name, or a path ending in ``/<name>``,
   - as the first element of a list or tuple display (``["srun", ...]``, ``("sinfo",)``,
     ``["squeue"] + more``): where an argv names its program, or
   - as the first positional argument of a call to ``run``, ``spawn``, ``argv``, ``exe``,
     ``Popen``, ``call``, ``check_call``, ``check_output`` or ``execvp``.
   Elsewhere the names may appear: in docstrings and comments, in messages, later in a
   tuple of names (the launch styles ``(..., "srun")``), as dict keys (the dev cluster's
   table of programs an install must provide, checked with ``shutil.which``), and inside
   the text of a generated script (shell lines are the templates' business).
   The dev cluster's daemons are started by the dev cluster itself, by path through
   ``SlurmTools`` (``tools.argv(["slurmctld", ...])``): starting a cluster is its job,
   and the daemon names (``slurmctld``, ``slurmd``, ``munged``) are not client programs,
   so they are not in ``SLURM_PROGRAMS``. Every *query* of a running cluster, the dev
   cluster's included, goes through ``clusterops.slurm``.
2. The runner is the one door: no module but ``clusterops/runner.py`` imports
   ``subprocess`` (or starts programs with ``os.system``/``os.popen``/``os.exec*``/
   ``os.spawn*``/``os.posix_spawn*``).
3. Every module under ``clusterops/`` has a module docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "clusterops"
SLURM_PROGRAMS = frozenset({"sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel", "sacct", "salloc"})
ARGV_CALLS = frozenset({"run", "spawn", "argv", "exe", "Popen", "call", "check_call", "check_output", "execvp"})
OS_PROCESS_CALLS = ("system", "popen", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
                    "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp",
                    "spawnvpe", "posix_spawn", "posix_spawnp")


def _modules() -> List[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def _is_program(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    name = node.value
    return name in SLURM_PROGRAMS or ("/" in name and name.rsplit("/", 1)[-1] in SLURM_PROGRAMS)


def _call_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return ""


def slurm_argv_spellings(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, program) for each Slurm program spelled in an argv position (rule 1)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            if node.elts and _is_program(node.elts[0]):
                yield node.elts[0].lineno, node.elts[0].value
        elif isinstance(node, ast.Call) and _call_name(node) in ARGV_CALLS and node.args:
            if _is_program(node.args[0]):
                yield node.args[0].lineno, node.args[0].value


def process_escapes(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, what) for each import of subprocess or os-level program start (rule 2)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "subprocess":
                    yield node.lineno, "import subprocess"
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] == "subprocess":
                yield node.lineno, "from subprocess import ..."
            if node.module == "os" and any(a.name in OS_PROCESS_CALLS for a in node.names):
                yield node.lineno, "from os import <program start>"
        elif isinstance(node, ast.Attribute) and node.attr in OS_PROCESS_CALLS \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            yield node.lineno, f"os.{node.attr}"


def _parse(p: Path) -> ast.AST:
    return ast.parse(p.read_text(), filename=str(p))


# -- the checkers catch what they should (so the tree tests below can fail) -----------
@pytest.mark.parametrize("src", [
    'argv = ["srun", "--overlap", cmd]',
    'runner.run(("scontrol", "show", "node"))',
    'self.runner.spawn(["/opt/slurm/bin/sbatch", script], log_path=p)',
    'tools.argv(["sinfo", "--noheader"])',
    'Runner().run(["squeue"] + extra)',
    'argv = ("scancel",)',
    'runner.exe("sacct")',
])
def test_checker_flags_an_argv_spelling(src):
    assert list(slurm_argv_spellings(ast.parse(src)))


@pytest.mark.parametrize("src", [
    '"""Runs srun steps."""',
    'msg = f"srun failed on {node}"',
    'REQUIRED = {"sinfo": "slurm-client"}',
    'shutil.which("sinfo")',
    'tools.argv(["slurmctld", "-D"])',
    'script = "srun --label python train.py"',
    'argv = srun_argv(cmd, nodes=nodes)',
    'names = ["srunner", "sbatchy"]',
    'LAUNCHERS = ("torchrun", "accelerate", "srun")',
])
def test_checker_passes_what_is_not_an_argv(src):
    assert not list(slurm_argv_spellings(ast.parse(src)))


@pytest.mark.parametrize("src, found", [
    ("import subprocess", True),
    ("import subprocess as sp", True),
    ("from subprocess import run", True),
    ("os.system('ls')", True),
    ("from os import execvp", True),
    ("import os\nos.kill(1, 0)", False),
    ("from clusterops.runner import Runner", False),
])
def test_process_checker(src, found):
    assert bool(list(process_escapes(ast.parse(src)))) is found


# -- the tree ----------------------------------------------------------------------
def test_tree_has_modules_to_read():
    mods = [_rel(p) for p in _modules()]
    assert "clusterops/runner.py" in mods and "clusterops/slurm/client.py" in mods and len(mods) > 20


def test_no_slurm_program_in_an_argv_outside_the_slurm_layer():
    bad = []
    for p in _modules():
        if p.is_relative_to(PACKAGE / "slurm"):
            continue
        bad += [f"{_rel(p)}:{line}: {prog!r} in an argv (build it in clusterops/slurm/)"
                for line, prog in slurm_argv_spellings(_parse(p))]
    assert not bad, "\n".join(bad)


def test_the_slurm_layer_itself_is_read_and_does_spell_them():
    # The rule is scoped, not vacuous: the layer that owns the argv lists does spell them.
    found = {prog for p in (PACKAGE / "slurm").glob("*.py") for _, prog in slurm_argv_spellings(_parse(p))}
    assert {"sbatch", "srun", "squeue", "scontrol", "scancel"} <= found


def test_only_the_runner_starts_programs():
    bad = []
    for p in _modules():
        if p == PACKAGE / "runner.py":
            continue
        bad += [f"{_rel(p)}:{line}: {what} (run programs through clusterops.runner)"
                for line, what in process_escapes(_parse(p))]
    assert not bad, "\n".join(bad)
    assert list(process_escapes(_parse(PACKAGE / "runner.py"))), "the runner itself imports subprocess"


def test_every_module_has_a_docstring():
    missing = [_rel(p) for p in _modules() if not ast.get_docstring(_parse(p))]
    assert not missing, "modules without a docstring: " + ", ".join(missing)


# ------------------------------------------------------------ the declared Slurm interface
# These import the Slurm layer (still nothing runs): every Slurm client, both backends and
# every fake of tests/support/fakes.py, has each ``SlurmAPI`` method with the Protocol's
# parameters (names, kinds, defaults); the pyslurm backend composes the CLI client and
# forwards exactly ``FORWARDED_TO_CLI``; and ``slurm/settings.py`` imports no backend (the
# settings <-> client <-> pyslurm_backend cycle stays cut, function-level imports included).
def _params(fn) -> List[Tuple[str, object, object]]:
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _slurm_clients():
    from support import fakes

    from clusterops.slurm.client import Slurm
    from clusterops.slurm.pyslurm_backend import PyslurmSlurm
    from clusterops.slurm.rest_backend import RestSlurm

    return [Slurm, PyslurmSlurm, RestSlurm, *fakes.SLURM_FAKES]


def _mismatches(cls) -> List[str]:
    from clusterops.slurm.api import SlurmAPI, api_methods

    bad = []
    for name in api_methods():
        method, want = getattr(cls, name, None), getattr(SlurmAPI, name)
        if not callable(method):
            bad.append(f"{cls.__name__}.{name}: missing")
        elif _params(method) != _params(want):
            bad.append(f"{cls.__name__}.{name}{_params(method)} != SlurmAPI.{name}{_params(want)}")
    return bad


@pytest.mark.parametrize("cls", _slurm_clients(), ids=lambda c: c.__name__)
def test_every_slurm_client_has_the_protocols_signatures(cls):
    from clusterops.slurm.api import api_methods

    names = api_methods()
    assert len(names) > 20 and "drain" in names and "resume" in names
    bad = _mismatches(cls)
    assert not bad, "\n".join(bad)
    assert isinstance(getattr(cls, "backend", None), str)


def test_the_signature_check_sees_a_fake_that_drifted():
    from support.fakes import FakeSlurm

    class Drifted(FakeSlurm):      # the shape the sweep's old fake had
        def submit(self, script, args=()):
            return 1

    empty = type("Empty", (), {})
    assert _mismatches(Drifted) == [f"Drifted.submit{_params(Drifted.submit)} != SlurmAPI.submit"
                                    f"{_params(FakeSlurm.submit)}"]
    assert len(_mismatches(empty)) > 20


def test_the_runner_fakes_have_the_runners_signatures():
    from support import fakes

    from clusterops.runner import Runner

    for cls in fakes.RUNNER_FAKES:
        for name in ("run", "spawn"):
            assert _params(getattr(cls, name)) == _params(getattr(Runner, name)), (cls.__name__, name)


def test_the_pyslurm_backend_composes_the_cli_client_and_names_what_it_forwards():
    from clusterops.slurm.api import api_methods
    from clusterops.slurm.client import Slurm
    from clusterops.slurm.pyslurm_backend import FORWARDED_TO_CLI, PyslurmSlurm

    assert not issubclass(PyslurmSlurm, Slurm)
    own = {k for k, v in vars(PyslurmSlurm).items() if callable(v) and not k.startswith("_")} - set(FORWARDED_TO_CLI)
    assert set(FORWARDED_TO_CLI) <= set(api_methods())
    assert set(api_methods()) == own | set(FORWARDED_TO_CLI) and not own & set(FORWARDED_TO_CLI)
    for name in FORWARDED_TO_CLI:
        assert getattr(PyslurmSlurm, name).__wrapped__ is getattr(Slurm, name)


def test_the_rest_backend_composes_the_cli_client_and_names_what_it_always_forwards():
    # Its own methods decide per plugin version what goes to the CLI client (the adapter's
    # capabilities); ALWAYS_FORWARDED are the ones made as plain forwards.
    from clusterops.slurm.api import api_methods
    from clusterops.slurm.client import Slurm
    from clusterops.slurm.rest_backend import ALWAYS_FORWARDED, RestSlurm

    assert not issubclass(RestSlurm, Slurm)
    own = {k for k, v in vars(RestSlurm).items() if callable(v) and not k.startswith("_")} - set(ALWAYS_FORWARDED)
    assert set(ALWAYS_FORWARDED) <= set(api_methods())
    assert set(api_methods()) == own | set(ALWAYS_FORWARDED) and not own & set(ALWAYS_FORWARDED)
    for name in ALWAYS_FORWARDED:
        assert getattr(RestSlurm, name).__wrapped__ is getattr(Slurm, name)


def _imported_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):   # every level: module, function, ``if TYPE_CHECKING``
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_slurm_settings_import_no_backend():
    found = set(_imported_modules(_parse(PACKAGE / "slurm" / "settings.py")))
    backends = {"clusterops.slurm.client", "clusterops.slurm.pyslurm_backend", "clusterops.slurm.factory",
                "clusterops.slurm.rest_backend", "clusterops.slurm.restd"}
    assert not found & backends, sorted(found & backends)
    # The interface is the base both backends build on: it imports neither.
    found = set(_imported_modules(_parse(PACKAGE / "slurm" / "api.py")))
    assert not found & (backends | {"clusterops.slurm.settings"}), sorted(found & backends)


def _import_graph():
    """Module -> the clusterops modules it imports, at any level of the file: top level,
    inside functions, under ``if TYPE_CHECKING:`` (an import put off is still an arrow)."""
    root = REPO / "clusterops"
    mods = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    modname = ".".join(base + ([node.module] if node.module else []))
                else:
                    modname = node.module or ""
                targets = [f"{modname}.{a.name}" if f"{modname}.{a.name}" in mods else modname for a in node.names]
            for t in targets:
                if t.startswith("clusterops"):
                    r = resolve(t)
                    if r and r != m:
                        graph[m].add(r)
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop(); on.discard(x); comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_counting_function_level_and_type_checking_imports():
    """Issue 19: no two modules of the package import each other, directly or round a loop,
    whether the import is at the top, inside a function or under TYPE_CHECKING. (A package's
    __init__ re-exporting its own modules is not an arrow back: its modules import the
    modules, not the package.)"""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# -- one naming scheme for property tests ------------------------------------------------
def _property_test_files():
    """Test files whose every test is a hypothesis property test (a @given on each)."""
    import ast

    found = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        given = [n for n in tests if any("given" in ast.unparse(d) for d in n.decorator_list)]
        if tests and given and len(given) * 2 > len(tests):
            found.append(path.name)
    return found


def test_property_test_files_are_named_test_props_area():
    """A file of (mostly) property tests is tests/test_props_<area>.py, and a file so named
    holds property tests: a newcomer finds the generated-input tests of an area by name."""
    mostly = set(_property_test_files())
    named = {p.name for p in (REPO / "tests").glob("test_props_*.py")}
    assert mostly <= named, f"property-test files not named test_props_<area>.py: {sorted(mostly - named)}"
    stray = sorted(p.name for p in (REPO / "tests").glob("test_*prop*.py") if p.name not in named)
    assert not stray, f"use the test_props_<area>.py scheme: {stray}"
    for name in named:
        assert "@given" in (REPO / "tests" / name).read_text(), f"{name} has no property test"
