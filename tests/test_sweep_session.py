"""The sweep as a library: ``SweepSession`` (lock, history, webhooks, report files) returns a
``SweepOutcome``; ``clusterops sweep`` only parses flags, makes that call and prints. And the
sweep package keeps its import order one way (``pairs`` and ``options`` never import ``run``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clusterops.errors import InputError
from clusterops.sweep.lock import FileLock
from clusterops.sweep.options import SweepOptions
from clusterops.sweep.session import SweepOutcome, SweepSession, check_output

PKG = Path(__file__).resolve().parent.parent / "clusterops"


class _Progress:
    def __init__(self):
        self.calls = []

    def targets(self, n):
        self.calls.append(("targets", n))

    def result(self, r):
        self.calls.append(("result", r.node))

    def close(self):
        self.calls.append(("close",))


def _ssh_opts(**kw) -> SweepOptions:
    # Via SSH without --drain: the session asks Slurm nothing before the lock.
    return SweepOptions(nodes="node[1-2]", via="ssh", **kw)


def test_a_held_lock_is_an_outcome_with_exit_4_and_nothing_swept(tmp_path, monkeypatch):
    monkeypatch.delenv("CLUSTEROPS_HEALTH_SITE", raising=False)
    db = tmp_path / "sweep.db"
    progress = _Progress()
    with FileLock(db.with_name(db.name + ".lock")):
        out = SweepSession(_ssh_opts(), db=str(db)).run(progress)
    assert isinstance(out, SweepOutcome)
    assert out.exit_code == 4 and out.doc is None and out.report is None
    assert out.locked.startswith("another sweep is running (lock ") and f"{db}.lock held: pid " in out.locked
    assert "\n" not in out.locked
    assert progress.calls == [] and not db.exists()   # no history opened, no check run


@pytest.mark.parametrize("kw,word", [
    ({"retention_days": 0}, "--retention-days: must be positive"),
    ({"report_path": "REPORT_DIR"}, "--report "),
    ({"prom_path": "/dev/null"}, "--prometheus "),
])
def test_bad_session_inputs_are_exit_2_before_the_lock(tmp_path, monkeypatch, kw, word):
    monkeypatch.delenv("CLUSTEROPS_HEALTH_SITE", raising=False)
    if kw.get("report_path") == "REPORT_DIR":
        kw = {"report_path": str(tmp_path)}     # a directory is no report file
    db = tmp_path / "sweep.db"
    with pytest.raises(InputError) as e:
        SweepSession(_ssh_opts(), db=str(db), **kw).run()
    assert word in e.value.message and e.value.exit_code == 2
    assert not db.with_name(db.name + ".lock").exists()


def test_check_output_names_the_flag_and_a_parent_that_is_no_directory(tmp_path):
    check_output("--report", str(tmp_path / "new" / "r.html"))   # a parent that can be made is fine
    (tmp_path / "plain").write_text("")
    with pytest.raises(InputError, match=r"^--prometheus \S*plain/x\.prom: "):
        check_output("--prometheus", str(tmp_path / "plain" / "x.prom"))


def _imports(path: Path):
    """Every module ``path`` imports, at any level (function bodies, TYPE_CHECKING too)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


@pytest.mark.parametrize("module", ["pairs", "options", "ssh", "results", "policy", "scripts", "slurm_fanout"])
def test_the_pieces_a_sweep_drives_never_import_the_driver(module):
    got = set(_imports(PKG / "sweep" / f"{module}.py"))
    assert not got & {"clusterops.sweep.run", "clusterops.sweep.session"}, got


@pytest.mark.parametrize("command", ["sweep", "health"])
def test_the_sweep_and_health_commands_hold_no_flow_of_their_own(command):
    """The lock, the history, the webhooks, the report files, the spool and Slurm are the
    library's (``sweep.session``, ``health.flow``): the command module names none of them."""
    got = set(_imports(PKG / "cli" / f"{command}.py"))
    flow = {"clusterops.history", "clusterops.notify", "clusterops.report", "clusterops.sweep.lock",
            "clusterops.spool", "clusterops.fsutil", "clusterops.slurm", "clusterops.slurm.settings",
            "clusterops.slurm.privilege", "clusterops.drain_apply"}
    assert not {m for m in got if m in flow or any(m.startswith(f + ".") for f in flow)}, got
