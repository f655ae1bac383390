"""One interpreter of the field kinds (issue 19, point 4): every table is walked by
``schema.Checker.check`` through a registry, and each registry has every kind its tables use."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clusterops import schema
from clusterops.errors import InputError
from clusterops.launch import spec as spec_mod
from clusterops.supervisor import config

ROOT = Path(__file__).resolve().parents[1]


def _kinds(f: schema.Field) -> set:
    out = {f.kind}
    for sub in (f.item,) + f.fields + f.options:
        if sub is not None:
            out |= _kinds(sub)
    return out


def test_every_kind_of_a_table_is_in_the_registry_that_walks_it():
    health = _kinds(schema.PROFILE) | _kinds(schema.SITE)
    assert health <= set(schema.KINDS), health - set(schema.KINDS)
    job = _kinds(schema.JOB_SPEC)
    assert job <= set(spec_mod.SPEC_KINDS), job - set(spec_mod.SPEC_KINDS)
    policy = {f.kind for f in schema.policy_fields()}
    assert policy <= set(schema.POLICY_KINDS) and policy <= set(config.COERCE_KINDS)


def test_the_job_spec_registry_extends_the_schema_one():
    assert set(schema.KINDS) <= set(spec_mod.SPEC_KINDS)
    # The job spec's own kinds are its alone.
    assert {"path", "hostlist", "time", "mem", "lines", "text"} <= set(spec_mod.SPEC_KINDS) - set(schema.KINDS)


def test_a_kind_registered_once_is_checked_where_it_is_used(tmp_path, monkeypatch):
    """A new kind is one function: registered in ``schema.KINDS``, a table field of that kind
    is checked by it through the same walk (lists, maps, unions)."""
    seen = []

    def even(c, v, f, path):
        seen.append(path)
        if not isinstance(v, int) or v % 2:
            raise c.error(path, f"must be even, got {v!r}")
        return v

    monkeypatch.setitem(schema.KINDS, "even", even)
    table = schema.Field("t", "map", fields=(schema.Field("xs", "list", item=schema.Field("x", "even")),))
    schema.validate({"xs": [2, 4]}, table, "t.yaml", {("xs",): 1})
    assert seen == [("xs", 0), ("xs", 1)]
    with pytest.raises(InputError, match=r"^t.yaml:1: xs\[1\]: must be even, got 3$"):
        schema.validate({"xs": [2, 3]}, table, "t.yaml", {("xs",): 1})
    with pytest.raises(AssertionError, match="no check for kind 'odd'"):
        schema.validate({"xs": [1]}, schema.Field("t", "map", fields=(
            schema.Field("xs", "list", item=schema.Field("x", "odd")),)), "t.yaml")


def test_policy_problems_and_the_spec_coercion_go_through_the_interpreter():
    class P:
        nodes, hang_timeout_s, preflight = 0, float("nan"), ""

    fields = [f for f in schema.policy_fields() if f.name in ("nodes", "hang_timeout_s", "preflight")]
    assert schema.problems(P(), fields) == [
        "nodes: must be a whole number in [1, 100000], got 0",
        "hang_timeout_s: must be a number > 0, got nan",
        "preflight: must be a non-empty string, got ''",
    ]
    f = schema.supervise_field("max_restarts")
    assert config.coerce(f, 4.0, ("supervise", "max_restarts")) == 4
    with pytest.raises(InputError, match=r"^spec: supervise.max_restarts: must be int \[0, 100000\], got 4.5$"):
        config.coerce(f, 4.5, ("supervise", "max_restarts"))
    assert config.coerce(schema.supervise_field("preflight"), "none") is None


def _imports(path: Path) -> set:
    """Every clusterops module ``path`` imports, at any level (functions, TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_template_discovery_cuts_the_render_spec_cycle():
    launch = ROOT / "clusterops" / "launch"
    assert "clusterops.launch.render" not in _imports(launch / "spec.py")
    assert "clusterops.launch.templates" in _imports(launch / "spec.py")
    templates = _imports(launch / "templates.py")
    assert not {m for m in templates if m.startswith("clusterops.launch")}, templates
