"""Property tests: generated and mutated job specs thrown at `clusterops launch render`.
Every case ends in exit 0 (a script) or 2 (one line), never a traceback."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from support.props_harness import PROPS, dump_yaml, run_cli, values

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
BASES = [yaml.safe_load(p.read_text()) for p in EXAMPLES]
KNOWN_KEYS = sorted({k for b in BASES for k in b} | {"partition", "account", "gpus_per_node", "mem",
                                                     "workdir", "log_dir", "supervise", "container"})


def _paths(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value


def _delete(doc, path):
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    del cur[path[-1]]


@st.composite
def mutated_specs(draw):
    base = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["replace", "replace", "unknown_key", "delete", "known_key"]))
        paths = list(_paths(base)) if isinstance(base, (dict, list)) else []
        if kind == "replace" and paths:
            _set(base, draw(st.sampled_from(paths)), draw(values))
        elif kind == "delete" and paths:
            _delete(base, draw(st.sampled_from(paths)))
        elif kind == "unknown_key" and isinstance(base, dict):
            base[draw(st.text(min_size=1, max_size=12))] = draw(values)
        elif kind == "known_key" and isinstance(base, dict):
            base[draw(st.sampled_from(KNOWN_KEYS))] = draw(values)
    return base


documents = st.one_of(
    mutated_specs().map(dump_yaml),
    values.map(dump_yaml),                                   # lists, scalars, random mappings
    st.sampled_from(["", "---\n", "null\n", "[]\n", "- 1\n- 2\n", "42\n", "'x'\n", "{\n", "a: [\n",
                     "name: x\nname: y\n", "\t- tab\n", "---\na: 1\n---\nb: 2\n", ": :\n"]),
    st.text(max_size=200),
)


@PROPS
@given(doc=documents, to_file=st.booleans())
def test_render_never_tracebacks(tmp_path_factory, doc, to_file):
    d = tmp_path_factory.mktemp("spec")
    spec = d / "job.yaml"
    try:
        spec.write_text(doc)
    except UnicodeEncodeError:
        spec.write_bytes(doc.encode("utf-8", errors="surrogatepass"))
    (d / "dist_check.py").write_text("print('x')\n")
    (d / "train.py").write_text("print('x')\n")
    args = ["launch", "render", str(spec)]
    out = d / "out.sh"
    if to_file:
        args += ["-o", str(out)]
    o = run_cli(args)
    assert o.code in (0, 2)
    if o.code == 0:
        text = out.read_text() if to_file else o.stdout
        assert text.startswith("#!"), text[:200]
    elif to_file:
        assert not out.exists()          # nothing half-done


@PROPS
@given(raw=st.binary(max_size=300))
def test_render_garbage_bytes(tmp_path_factory, raw):
    spec = tmp_path_factory.mktemp("spec") / "job.yaml"
    spec.write_bytes(raw)
    o = run_cli(["launch", "render", str(spec)])
    assert o.code in (0, 2)


@PROPS
@given(overrides=st.lists(st.one_of(st.text(max_size=30),
                                    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KNOWN_KEYS + ["a.b.c"]),
                                              st.text(max_size=20))), max_size=3))
def test_render_overrides(tmp_path_factory, overrides):
    args = ["launch", "render", str(REPO / "examples" / "torchrun.yaml")]
    for ov in overrides:
        args += ["--set", ov]
    o = run_cli(args)
    assert o.code in (0, 2)
