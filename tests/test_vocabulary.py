"""The named vocabulary: timeline event kinds, step-exit causes and supervisor states are
``str`` enums (the JSON keeps the plain words), states move only through one checked
transition table, srun's wording is read in ``clusterops.slurm.parse`` alone, and the exit
codes of every command are one ``IntEnum`` from which the ``--help`` epilogs and the docs
tables are generated."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from clusterops import exitcodes
from clusterops.slurm.parse import FailureKind, TaskFailure, failure_kind, parse_srun_failures
from clusterops.supervisor import machine as sv
from clusterops.supervisor.timeline import Cause, EventKind, Timeline, read

REPO = Path(__file__).resolve().parent.parent
MACHINE = REPO / "clusterops" / "supervisor" / "machine.py"


# ------------------------------------------------------------------------- states
def test_every_state_has_a_row_and_done_is_final():
    assert set(sv.TRANSITIONS) == set(sv.State)
    assert sv.TRANSITIONS[sv.DONE] == frozenset()
    for state, nexts in sv.TRANSITIONS.items():
        assert nexts <= set(sv.State), state
        if state is not sv.DONE:
            assert sv.DONE in nexts, f"{state} cannot end"


def test_the_state_changes_only_in_enter():
    # One place moves the state (and checks the move): __init__ sets the first one.
    tree = ast.parse(MACHINE.read_text())
    writers = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == "state" and getattr(t.value, "id", "") == "self":
                        writers.add(fn.name)
    assert writers == {"__init__", "_enter"}


@pytest.mark.parametrize("start,to", [(sv.DONE, sv.RUNNING), (sv.REQUEUEING, sv.RUNNING),
                                      (sv.PREFLIGHT, sv.KILLING), (sv.IDLE, sv.STOPPING)])
def test_a_move_outside_the_table_is_refused(start, to):
    s = sv.Supervisor(sv.Policy(nodes=1), ["n1"])
    s.state = start
    with pytest.raises(sv.IllegalTransition, match=f"{start.value} -> {to.value}"):
        s._enter(to)
    assert s.state is start


def test_a_whole_run_moves_through_allowed_states_and_records_plain_words(tmp_path):
    # preflight -> running -> a rank killed -> restart -> stop -> requeue, written to a real
    # timeline file: every event and cause is a plain JSON string, one of the enums' words.
    s = sv.Supervisor(sv.Policy(nodes=2, spare_nodes=1, preflight="quick", max_restarts=2, ranks_per_node=1,
                                liveness_check=False),
                      ["n1", "n2", "n3"])
    tl = Timeline(tmp_path, job_id="7")
    seen = [s.state]
    acts = s.start(0.0)
    acts += s.handle(sv.PreflightDone(1.0, statuses={"n1": "pass", "n2": "pass", "n3": "pass"}))
    seen.append(s.state)
    acts += s.handle(sv.StepExited(5.0, returncode=1, failures=(sv.RankFailure("n1", 0, "Killed"),)))
    seen.append(s.state)
    acts += s.handle(sv.StopRequested(6.0, reason="preemption"))
    seen.append(s.state)
    acts += s.handle(sv.StepExited(7.0, returncode=0))
    seen.append(s.state)
    assert seen == [sv.IDLE, sv.RUNNING, sv.RUNNING, sv.STOPPING, sv.REQUEUEING]
    for a in acts:
        if isinstance(a, sv.Record):
            assert isinstance(a.kind, EventKind), a
            tl.append(a.kind, dict(a.data), t=1.0)
    text = (tmp_path / "timeline.jsonl").read_text()
    recs = read(tmp_path)
    assert [type(r["event"]) for r in recs] == [str] * len(recs)
    assert {r["event"] for r in recs} <= {k.value for k in EventKind}
    exits = [r for r in recs if r["event"] == "step_exit"]
    assert [r["cause"] for r in exits] == ["rank_killed"]
    assert '"event": "step_exit"' in text and '"cause": "rank_killed"' in text
    assert "EventKind" not in text and "Cause." not in text and "State." not in text
    assert json.loads(text.splitlines()[0])["event"] == "start"


def test_kill_causes_and_stop_reasons_are_named():
    s = sv.Supervisor(sv.Policy(nodes=1, ranks_per_node=1, hang_timeout_s=10.0, startup_timeout_s=5.0,
                                preflight=None), ["n1"])
    s.start(0.0)
    kills = [a for a in s.handle(sv.Heartbeats(100.0, beats={0: (3, 50.0)})) if isinstance(a, sv.KillStep)]
    assert kills == [sv.KillStep(sv.KillCause.HANG)] and s.state is sv.KILLING
    stops = [a for a in sv.Supervisor(sv.Policy(nodes=1), ["n1"]).handle(sv.Tick(0.0))]
    assert stops == []
    s2 = sv.Supervisor(sv.Policy(nodes=1, preflight=None), ["n1"])
    s2.start(0.0)
    acts = s2.handle(sv.StopRequested(1.0, reason=sv.StopReason.PREEMPTION))
    assert sv.RequestStop("preemption") in acts and s2.state is sv.STOPPING


def test_enum_members_read_as_their_words():
    assert f"{sv.State.RUNNING}" == "running" == str(sv.State.RUNNING)
    assert f"{EventKind.GIVE_UP}" == "give_up" and f"{Cause.NODE_LOST}" == "node_lost"
    assert json.dumps({EventKind.DONE: [Cause.HANG, sv.State.DONE]}) == '{"done": ["hang", "done"]}'


# ------------------------------------------------------------------------- srun's wording
@pytest.mark.parametrize("reason,kind", [
    ("Killed", FailureKind.KILLED), ("Segmentation fault", FailureKind.KILLED),
    ("Aborted", FailureKind.KILLED), ("Killed by signal 9", FailureKind.KILLED),
    ("Exited with exit code 3", FailureKind.EXITED), ("Terminated", FailureKind.OTHER),
    ("Node failure", FailureKind.OTHER), ("", FailureKind.OTHER)])
def test_srun_wording_is_classified_in_parse(reason, kind):
    assert failure_kind(reason) is kind
    assert TaskFailure("n1", 0, reason).kind is kind


def test_one_failure_dataclass():
    assert sv.RankFailure is TaskFailure
    fails, _ = parse_srun_failures("srun: error: n2: task 3: Exited with exit code 1\n")
    assert fails == [sv.RankFailure("n2", 3, "Exited with exit code 1")]
    assert fails[0].kind is FailureKind.EXITED


def _strings(tree: ast.AST):
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_the_machine_never_reads_srun_text():
    words = ("exit code", "killed", "signal", "segmentation", "aborted", "terminated")
    hits = [(n.lineno, n.value) for n in _strings(ast.parse(MACHINE.read_text()))
            if any(w in n.value.lower() for w in words) and n.value not in set(sv.StopReason)]
    assert hits == []
    assert ".reason.lower()" not in MACHINE.read_text()


def test_the_srun_scan_finds_a_grep():
    # The check above is real: a machine that greps srun's wording is caught.
    tree = ast.parse('def classify(f):\n    """Read exit code."""\n    return "exit code" in f.reason.lower()\n')
    assert [n.value for n in _strings(tree)] == ["exit code"]


# ------------------------------------------------------------------------- exit codes
def test_exit_code_tables_match_the_docs(tmp_path, capsys):
    assert exitcodes.main(["--check", str(REPO)]) == 0
    for _, rel, _ in exitcodes.TABLES.values():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text().replace(
            "| 4 | requeue budget spent", "| 4 | the requeue budget is spent"))
    assert exitcodes.main(["--check", str(tmp_path)]) == 1
    assert capsys.readouterr().out.strip() == "differs: docs/supervisor.md: exitcodes:supervise"
    assert exitcodes.main(["--write", str(tmp_path)]) == 0
    assert exitcodes.main(["--check", str(tmp_path)]) == 0


def test_a_docs_file_without_its_table_is_reported(tmp_path):
    for _, rel, _ in exitcodes.TABLES.values():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    (tmp_path / "docs/launch.md").write_text("# launch\n")
    assert exitcodes.drift(tmp_path) == ["missing: docs/launch.md: no <!-- exitcodes:launch --> table"]


HELPS = [([], exitcodes.Common), (["supervise"], exitcodes.Supervise), (["health", "check"], exitcodes.HealthCheck),
         (["sweep"], exitcodes.Sweep), (["ckpt"], exitcodes.Ckpt), (["launch"], exitcodes.Launch),
         (["deploy", "files"], exitcodes.Deploy)]


@pytest.mark.parametrize("argv,codes", HELPS, ids=lambda v: " ".join(["clusterops"] + v) if isinstance(v, list) else "")
def test_help_epilog_is_generated_from_the_enum(argv, codes):
    from clusterops.cli import cli

    r = CliRunner().invoke(cli, argv + ["--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert out.count("Exit codes:") == 1, r.output   # from the epilog only, not a docstring too
    for c in codes:
        assert f"{int(c)} {' '.join(c.short.split())}" in out, (c, r.output)


def test_the_commands_use_the_enums():
    from clusterops import health, sweep

    assert sv.EXIT_NO_PROGRESS is exitcodes.Supervise.NO_PROGRESS and sv.ExitCode is exitcodes.Supervise
    assert [health.EXIT_HEALTHY, health.EXIT_UNHEALTHY, health.EXIT_USAGE, health.EXIT_GUARD,
            health.EXIT_ERROR] == list(exitcodes.HealthCheck)
    assert [sweep.EXIT_OK, sweep.EXIT_UNHEALTHY, sweep.EXIT_GUARD, sweep.EXIT_LOCKED, sweep.EXIT_CANNOT_RUN] == [
        exitcodes.Sweep.OK, exitcodes.Sweep.UNHEALTHY, exitcodes.Sweep.GUARD, exitcodes.Sweep.LOCKED,
        exitcodes.Sweep.CANNOT_RUN]


def test_exit_codes_are_distinct_and_in_range():
    for codes, _, _ in exitcodes.TABLES.values():
        values = [int(c) for c in codes]
        assert len(set(values)) == len(values) and all(0 <= v <= 255 for v in values), codes
        assert all(c.short and c.meaning for c in codes)


# ------------------------------------------------------------------------- short functions
@pytest.mark.parametrize("rel,name", [("supervisor/timeline.py", "goodput_report"),
                                      ("supervisor/timeline.py", "render_svg"),
                                      ("supervisor/machine.py", "_on_step_exited")])
def test_the_long_functions_are_split(rel, name):
    tree = ast.parse((REPO / "clusterops" / rel).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body   # the docstring aside
    assert body[-1].end_lineno - body[0].lineno + 1 <= 30, name
