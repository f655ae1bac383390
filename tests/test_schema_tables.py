"""The supervise keys live in one table (clusterops.schema): the job-spec validation, the
supervisor's Policy, the flags of `clusterops supervise` and the docs all come from it.
These tests read the source tree and the objects made from the table."""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from clusterops import launch, schema
from clusterops.errors import InputError
from clusterops.supervisor import Policy

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "clusterops"
SUPERVISE_NAMES = {f.name for f in schema.SUPERVISE.fields}


def _literal_names(node: ast.AST) -> set:
    """Supervise keys written as string constants in a dict's keys or a set/list/tuple's items,
    when they make up most of it (a table of them). A dict entry ``"k": obj.k`` reads a
    value by its name (a record of a Policy), it does not define the key: not counted."""
    if isinstance(node, ast.Dict):
        items = [k for k, v in zip(node.keys, node.values)
                 if not (isinstance(k, ast.Constant) and isinstance(v, ast.Attribute) and v.attr == k.value)]
        total = len(node.keys)
    else:
        items = getattr(node, "elts", [])
        total = len(items)
    names = {x.value for x in items if isinstance(x, ast.Constant) and x.value in SUPERVISE_NAMES}
    return names if len(names) >= 2 and 2 * len(names) > total else set()


def test_supervise_keys_are_written_down_only_in_the_schema():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        for old in ("SUPERVISE_KEYS", "SUPERVISE_DOCS", "KEY_DOCS", "_LITERAL_SUPERVISE"):
            if old in text:
                offenders.append(f"{rel}: {old}")
        if rel == "clusterops/schema.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Dict, ast.Set, ast.List, ast.Tuple)):
                names = _literal_names(node)
                if names:
                    offenders.append(f"{rel}:{node.lineno}: {sorted(names)}")
    assert offenders == []


def test_the_scan_finds_a_second_table():
    # The check above is real: a table of supervise keys in a module is found.
    tree = ast.parse(textwrap.dedent('''
        KEYS = {"hang_timeout_s": float, "max_restarts": int}
        ORDER = ("spare_nodes", "min_nodes", "nodes")
        STATES = ("idle", "preflight", "postmortem", "running", "done")
        RECORD = {"spare_nodes": policy.spare_nodes, "min_nodes": policy.min_nodes}
    '''))
    found = [_literal_names(n) for n in ast.walk(tree) if isinstance(n, (ast.Dict, ast.Tuple))]
    assert [f for f in found if f] == [{"hang_timeout_s", "max_restarts"}, {"spare_nodes", "min_nodes"}]


def test_policy_is_made_from_the_table():
    fields = dataclasses.fields(Policy)
    assert [f.name for f in fields] == [f.name for f in schema.policy_fields()]
    assert {f.name: f.default for f in fields} == {f.name: f.default for f in schema.policy_fields()}
    # Every supervise key is a Policy field, or one of the run's own settings.
    run_only = {f.name for f in schema.SUPERVISE.fields if not f.policy}
    assert run_only == {"ckpt_dir", "job_dir", "job_dir_mode", "verify_deep", "step_wait_s",
                        "progress", "checkpoint_glob", "resume_args",   # these three: no-SDK scripts
                        "stability",    # the stability guard's own settings (StabilityConfig)
                        "inprocess",   # in-process recovery: the run's rendezvous (supervisor/rendezvous.py)
                        "exit_codes",   # the exit-code contract (code -> action, merged over the defaults)
                        "trackers"}     # experiment trackers: a sink of the timeline (clusterops/trackers.py)
    assert SUPERVISE_NAMES - run_only <= {f.name for f in fields}
    # ... and the class spells none of them itself.
    tree = ast.parse((PACKAGE / "supervisor" / "machine.py").read_text())
    policy = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Policy")
    assert not [n for n in policy.body if isinstance(n, (ast.AnnAssign, ast.Assign))]


def test_supervise_flags_are_made_from_the_table():
    from clusterops.cli.supervise import supervise

    params = {p.name: p for p in supervise.params}
    table = {f.name: f for f in schema.SUPERVISE.fields + schema.POLICY_ONLY}
    assert set(params) - {"spec_json", "spec_file", "command"} == set(table)
    for name, f in table.items():
        assert set(schema.cli_flags(f)) <= set(params[name].opts), name


@pytest.mark.parametrize("value,ok", [(0, True), (1, True), (-1, False)])
def test_no_progress_restarts_has_one_bound_everywhere(tmp_path, value, ok):
    # 0 is valid in a spec, in a Policy and on the command line: give up at the first
    # failure that saved nothing new. Below 0 is refused by all three.
    (tmp_path / "t.py").write_text("pass\n")
    (tmp_path / "job.yaml").write_text(f"name: t\nnodes: 1\nlauncher: srun\nscript: t.py\n"
                                       f"supervise: {{no_progress_restarts: {value}}}\n")
    if ok:
        spec = launch.load_spec(tmp_path / "job.yaml")
        assert spec.supervise_dict["no_progress_restarts"] == value
    else:
        with pytest.raises(InputError, match=r"job.yaml:5: supervise.no_progress_restarts: must be an integer "
                                             r"from 0 to 100000, got -1"):
            launch.load_spec(tmp_path / "job.yaml")
    assert (Policy(no_progress_restarts=value).validate() == []) is ok
    from clusterops.cli import cli

    r = CliRunner().invoke(cli, ["supervise", "--no-progress-restarts", str(value), "--nodes", "0", "--", "true"])
    assert r.exit_code == 2
    # --nodes 0 is refused too; which comes first says whether the bound let the value in.
    assert ("--no-progress-restarts" in r.output) is (not ok), r.output


def test_policy_validation_messages_come_from_the_bounds():
    assert Policy(hang_timeout_s=0).validate() == ["hang_timeout_s: must be a number > 0, got 0"]
    assert Policy(node_fail_threshold=0).validate() == [
        "node_fail_threshold: must be a whole number in [1, 100000], got 0"]
    assert Policy(nodes=2, min_nodes=3).validate() == ["min_nodes: must be from 1 to nodes (2), got 3"]
    assert Policy(drain_bad_nodes="yes").validate() == ["drain_bad_nodes: must be true or false, got 'yes'"]


def test_schema_check_command(tmp_path, capsys):
    assert schema.main(["--check", str(REPO)]) == 0
    for rel in schema.DOC_TABLES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text().replace("| `nodes` | int [1, 100000] | required |",
                                                                      "| `nodes` | int | required |"))
    assert schema.main(["--check", str(tmp_path)]) == 1
    assert "differs: docs/launch.md: schema:job-spec" in capsys.readouterr().out
