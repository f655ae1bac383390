"""Property tests: generated and mutated profiles, site configs and hostile YAML thrown at the
loader, the validator, `health profiles --check` and `health check --site-config`.

Every case must end in exit 0/1/2 with a one-line error or a correct result — never a
traceback — and quickly (hypothesis' deadline). Valid documents are generated from the
schema tables themselves, so a table that says more than the validator accepts (or the
other way round) shows up here.
"""

from __future__ import annotations

import copy
import os
import string
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict

import click
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterops import schema, yamlio
from clusterops.cli import cli
from clusterops.errors import ClusteropsError, InputError

SETTINGS = settings(max_examples=int(os.environ.get("CLUSTEROPS_PROP_EXAMPLES", 40)), deadline=timedelta(seconds=3), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])
WORK = Path(tempfile.mkdtemp(prefix="clusterops-prop-"))
_names = st.text(alphabet=string.ascii_letters + "_-", min_size=1, max_size=8)


# -- valid values from the schema tables -----------------------------------------------------------

def valid(f: schema.Field) -> st.SearchStrategy:
    k = f.kind
    if k == "bool":
        s = st.booleans()
    elif k == "int":
        lo = int(f.min if f.min is not None else -10**6) + (1 if f.gt else 0)
        s = st.integers(lo, int(min(f.max if f.max is not None else 10**6, 10**6)))
    elif k == "number":
        lo = f.min if f.min is not None else -1e6
        hi = min(f.max if f.max is not None else 1e6, 1e6)
        s = st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min=f.gt) | \
            st.integers(int(lo) + 1, int(hi))
    elif k == "str":
        s = st.text(alphabet=string.ascii_letters + string.digits + "/_-.", min_size=1, max_size=12)
    elif k == "url":
        s = st.builds(lambda scheme, host, port, path: f"{scheme}://{host}{port}/{path}",
                      st.sampled_from(["http", "https"]), st.sampled_from(["hooks.example", "127.0.0.1", "h"]),
                      st.sampled_from(["", ":1", ":8080", ":65535"]),
                      st.text(alphabet=string.ascii_letters + string.digits + "/_-.", max_size=12))
    elif k == "enum":
        s = st.sampled_from(f.choices)
    elif k == "version":
        s = st.from_regex(r"\A[0-9]{1,3}(\.[0-9]{1,3}){0,2}\Z").filter(lambda v: v.strip())
    elif k == "regex":
        s = st.sampled_from(["H100", "A100.*PCIe", "^B200", "L4$"])
    elif k == "list":
        s = st.lists(valid(f.item), min_size=f.min_len, max_size=min(f.max_len or 3, 3))
    elif k in ("map", "probe"):
        req = {x.name: valid(x) for x in f.fields if x.required}
        opt = {x.name: valid(x) for x in f.fields if not x.required}
        s = st.fixed_dictionaries(req, optional=opt)
        if k == "probe":
            s = s | st.just(False) | st.none()
    elif k == "dict":
        s = st.dictionaries(_names, valid(f.item), max_size=2)
    elif k == "union":
        s = st.one_of(*[valid(o) for o in f.options])
    else:
        raise AssertionError(f"no strategy for {k}")
    return (st.none() | s) if f.nullable else s


def _settle(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Make a generated document meet the rules between settings (checked after merging)."""
    doc = copy.deepcopy(doc)
    for probes in _probe_sections(doc):
        nv = probes.get("nvml")
        if isinstance(nv, dict):
            nv["temperature_warn_c"], nv["temperature_fail_c"] = 80, 90
        ib = probes.get("ibbw")
        if isinstance(ib, dict):
            ib["warn_fraction"], ib["fail_fraction"] = 0.95, 0.9
            for fl in (ib.get("floors") or {}).values():
                if isinstance(fl, dict):
                    fl["warn"], fl["fail"] = 200, 100
        xid = probes.get("xid")
        if isinstance(xid, dict) and xid.get("source") == "file":
            xid["log_file"] = "/var/log/kern.log"
    return doc


def _probe_sections(doc):
    if isinstance(doc.get("probes"), dict):
        yield doc["probes"]
    if isinstance(doc.get("defaults"), dict) and isinstance(doc["defaults"].get("probes"), dict):
        yield doc["defaults"]["probes"]
    for prof in (doc.get("profiles") or {}).values():
        if isinstance(prof, dict) and isinstance(prof.get("probes"), dict):
            yield prof["probes"]


profiles = valid(schema.PROFILE).map(
    lambda d: {k: v for k, v in d.items() if k != "extends"}).flatmap(
    lambda d: st.sampled_from([None, "fast", "preflight", "deep"]).map(
        lambda parent: _settle(dict(d, extends=parent) if parent else d)))
sites = valid(schema.SITE).map(_settle)

# -- mutation: any place in a document gets junk, an unknown key, or loses a key -------------------

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw, base):
    doc = draw(base)
    paths = list(_paths(doc))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        if not path:
            continue
        parent = doc
        try:
            for p in path[:-1]:
                parent = parent[p]
            op = draw(st.sampled_from(["junk", "unknown", "delete"]))
            if op == "junk":
                parent[path[-1]] = draw(junk)
            elif op == "unknown" and isinstance(parent, dict):
                parent[draw(_names)] = draw(junk)
            elif op == "delete" and isinstance(parent, dict):
                parent.pop(path[-1], None)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation changed the shape under this path
    return doc


# -- the CLI under the project's error contract ---------------------------------------------------

def invoke(args):
    """Run the CLI in-process as `clusterops` does -> (exit code, stdout, error line)."""
    r = CliRunner().invoke(cli, args, standalone_mode=False, catch_exceptions=True)
    e = r.exception
    if e is None:
        rv = r.return_value
        return (rv if isinstance(rv, int) else 0), r.output, ""
    if isinstance(e, ClusteropsError):
        return e.exit_code, r.output, e.message
    if isinstance(e, click.UsageError):
        return 2, r.output, e.format_message()
    if isinstance(e, SystemExit):
        return e.code, r.output, ""
    raise AssertionError(f"traceback for {args}: {type(e).__name__}: {e}") from e


def _write(text: str, name: str = "doc.yaml") -> Path:
    d = Path(tempfile.mkdtemp(dir=WORK))
    p = d / name
    p.write_text(text)
    return p


def _dump(doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def _assert_one_line_error(code, err, path):
    assert code == 2, (code, err)
    assert err and "\n" not in err and str(path) in err, err


# -- properties ------------------------------------------------------------------------------------

@SETTINGS
@given(profiles)
def test_generated_valid_profiles_pass_profiles_check(doc):
    p = _write(_dump(doc))
    t0 = time.monotonic()
    code, out, err = invoke(["health", "profiles", "--check", str(p)])
    assert code == 0, (err, doc)
    assert out.strip() == f"{p}: ok (profile)"
    assert time.monotonic() - t0 < 3


@SETTINGS
@given(sites)
def test_generated_valid_site_configs_pass_profiles_check(doc):
    if not doc:
        return  # an empty file reads as an empty profile; covered by the profile test
    p = _write(_dump(doc))
    code, out, err = invoke(["health", "profiles", "--check", str(p)])
    assert code == 0, (err, doc)
    assert out.strip() == f"{p}: ok (site config)"


@SETTINGS
@given(mutated(profiles))
def test_mutated_profiles_exit_0_or_2_with_one_line(doc):
    p = _write(_dump(doc))
    code, out, err = invoke(["health", "profiles", "--check", str(p)])
    assert code in (0, 2)
    if code == 2:
        _assert_one_line_error(code, err, p.parent if "extends" in err or "profile" in err else p)


@SETTINGS
@given(mutated(sites))
def test_mutated_site_configs_exit_0_or_2_with_one_line(doc):
    p = _write(_dump(doc))
    code, out, err = invoke(["health", "profiles", "--check", str(p)])
    assert code in (0, 2)
    if code == 2:
        assert err and "\n" not in err, err


LIGHT = _write("description: light\nprobes:\n  host.cpus: {}\n  host.memory: {min_available_gb: 0}\n",
               "light.yaml")


def _light(name: str) -> schema.Field:
    # Real files only, and deadlines a loaded test machine meets (a probe past its deadline
    # makes the CLI leave with os._exit, which would end the test process too).
    keep = [f for f in schema.probe_field(name).fields if f.name not in ("meminfo_file", "timeout_s")]
    return schema.Field(name, "probe", fields=tuple(keep) + (schema.Field("timeout_s", "number", min=5, max=60),))


light_sites = valid(schema.Field("site", "map", fields=(
    schema.Field("gpu_models", "dict", item=schema.GPU_MODEL), schema.DRAIN,
    schema.Field("defaults", "map", fields=(schema.Field("probes", "map", fields=(
        _light("host.cpus"), _light("host.memory"))),)),
)))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 2))
@given(st.one_of(light_sites, mutated(light_sites)))
def test_health_check_with_generated_site_config(doc):
    """`health check --site-config`: a bad site config is exit 2 before any probe runs; a good
    one runs the check and the result honours it (host.memory's minimum from the site)."""
    p = _write(_dump(doc))
    code, out, err = invoke(["health", "check", "--profile", str(LIGHT), "--site-config", str(p), "--json"])
    assert code in (0, 1, 2, 4), (code, err)
    try:
        yamlio.load_file(p)
        from clusterops.health import load_site_config
        load_site_config(str(p))
        valid_doc = True
    except InputError:
        valid_doc = False
    if not valid_doc:
        assert code == 2 and out == "" and "\n" not in err
        return
    import json

    rep = json.loads(out)
    mem = [r for r in rep["results"] if r["name"] == "host.memory"]
    want = (((doc.get("defaults") or {}).get("probes") or {}).get("host.memory"))
    if want is False or (isinstance(want, dict) and want.get("enabled") is False):
        assert mem == []
    else:
        floor = (want or {}).get("min_available_gb") if isinstance(want, dict) else None
        floor = 0 if floor is None else floor
        assert mem and mem[0]["threshold"] == float(floor)
        assert (mem[0]["status"] == "pass") == (mem[0]["value"] >= floor)
        assert code == (0 if rep["status"] in ("pass", "warn") else 1)


# -- hostile YAML: aliases, merge keys, deep nesting, arbitrary text -------------------------------

@st.composite
def hostile_yaml(draw):
    kind = draw(st.sampled_from(["laughs", "merge", "deep", "self", "text", "tags", "dupes"]))
    n = draw(st.integers(1, 12))
    if kind == "laughs":
        lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
        for i in range(1, n):
            lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
        return "\n".join(lines) + "\n"
    if kind == "merge":
        return f"base: &b {{timeout_s: 1}}\nprobes:\n  nvml:\n    <<: *b\n    x{n}: 1\n"
    if kind == "deep":
        depth = draw(st.integers(1, 3000))
        opener = draw(st.sampled_from(["[", "{a: ", "- "]))
        if opener == "- ":
            return "".join("  " * i + "-\n" for i in range(min(depth, 400))) + "  " * min(depth, 400) + "x\n"
        closer = "]" if opener == "[" else "}"
        return "probes: " + opener * depth + "1" + closer * depth + "\n"
    if kind == "self":
        return "a: &a [*a]\n"
    if kind == "tags":
        tag = draw(st.sampled_from(["!!python/object/apply:os.system", "!!set", "!!omap", "!foo", "!!binary",
                                    "!!timestamp", "!!float"]))
        return f"description: {tag} {draw(st.sampled_from(['x', '[1]', '{a: 1}', 'AAAA', '2020-99-01']))}\n"
    if kind == "dupes":
        return "probes:\n" + "".join("  nvml: {}\n" for _ in range(n))
    return draw(st.text(max_size=300))


@SETTINGS
@given(hostile_yaml())
def test_hostile_yaml_is_refused_or_loaded_never_crashes(text):
    t0 = time.monotonic()
    try:
        yamlio.load_text(text, "h.yaml")
    except InputError as e:
        assert "\n" not in str(e) and str(e).startswith("h.yaml")
    assert time.monotonic() - t0 < 2
    from clusterops.launch import parse_spec_text

    try:  # the job-spec loader goes through the same loader
        parse_spec_text(text, "job.yaml")
    except InputError as e:
        assert "\n" not in str(e) and str(e).startswith("job.yaml")
    p = _write(text)
    for args in (["health", "profiles", "--check", str(p)],
                 ["health", "check", "--profile", str(LIGHT), "--site-config", str(p)]):
        code, out, err = invoke(args)
        assert code in (0, 1, 2, 4), (code, err)
        if code == 2:
            assert err and "\n" not in err


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_as_a_profile(raw):
    d = Path(tempfile.mkdtemp(dir=WORK))
    p = d / "b.yaml"
    p.write_bytes(raw)
    code, out, err = invoke(["health", "profiles", "--check", str(p)])
    assert code in (0, 2)
    if code == 2:
        assert "\n" not in err and str(p) in err


def test_billion_laughs_in_a_job_spec_is_refused_quickly(tmp_path):
    from clusterops.launch import load_spec

    text = 'name: t\nscript: x.py\na0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"job.yaml:3: YAML anchors \(&a0\)"):
        load_spec(spec)
    assert time.monotonic() - t0 < 1


# -- what the schema accepts, the probes handle: generated settings never crash a probe ----------

FIX = Path(__file__).parent / "fixtures" / "nvml"
_RUNNABLE = ("nvml", "host.memory", "host.cpus", "host.infiniband", "host.mounts", "dcgm", "xid", "fabric")


@st.composite
def probe_settings(draw):
    name = draw(st.sampled_from(_RUNNABLE))
    fields = tuple(f for f in schema.PROBE_SETTINGS[name] if f.name not in ("meminfo_file",))
    cfg = draw(valid(schema.Field(name, "map", fields=fields)))
    return name, _settle({"probes": {name: cfg}})["probes"][name]


@settings(SETTINGS, max_examples=max(20, SETTINGS.max_examples))
@given(probe_settings())
def test_valid_settings_never_crash_a_probe(case):
    """Any value the schema accepts is one the probe's code handles: a result, never
    `probe raised ...` (a probe bug reported as an error)."""
    import json as _json

    from clusterops.health import REGISTRY, load_gpu_models
    from clusterops.health.probes.base import ProbeContext
    from clusterops.health.probes.nvml_standin import StandinNVML

    name, cfg = case
    work = Path(tempfile.mkdtemp(dir=WORK))
    if name == "xid":
        cfg = dict(cfg, state_file=str(work / "xid.json"))
        if cfg.get("log_file"):
            cfg["log_file"] = str(work / "kern.log")
    if name == "fabric":  # a recorded tree with counters, twice: the second check judges rises
        cfg = dict(cfg, state_file=str(work / "fabric.json"),
                   sys_root=str(Path(__file__).parent / "fixtures" / "fabric" / "counters_rising" / "t0"))
        REGISTRY[name].fn(dict(cfg), ProbeContext(node="prop1", state_dir=str(work)))
        cfg["sys_root"] = cfg["sys_root"][:-2] + "t1"
    if name == "host.mounts":  # keep the write tests off real filesystems
        cfg["mounts"] = [m for m in cfg.get("mounts") or [] if (m if isinstance(m, str) else m["path"]) != "/"]
    ctx = ProbeContext(env={"PATH": "/nonexistent"}, node="prop1", state_dir=str(work), host_root=str(work),
                       nvml=StandinNVML(_json.loads((FIX / "h100_sxm_8gpu_idle.json").read_text())),
                       gpu_models=load_gpu_models({}), slurm_gpus=lambda node, t: 8)
    results = REGISTRY[name].fn(dict(cfg), ctx)
    assert results or (name == "host.mounts" and not cfg.get("mounts")), (name, cfg)
    for r in results:
        assert "probe raised" not in r.detail, (name, cfg, r.detail)


@settings(SETTINGS, max_examples=max(20, SETTINGS.max_examples))
@given(valid(schema.Field("ibbw", "map", fields=schema.PROBE_SETTINGS["ibbw"] + schema.COMMON_SETTINGS)))
def test_valid_ibbw_settings_give_rails_floors_and_argvs(cfg):
    """The sweep's pair test with any ibbw settings the schema accepts (on a recorded RoCE
    tree): options, rails, floors and both sides' argv, never an exception."""
    from hypothesis import assume

    from clusterops.health.probes import ibbw
    from clusterops.health.profiles import _check_resolved

    try:   # the rules between settings, as loading a profile applies them
        _check_resolved({"probes": {"ibbw": cfg}}, "p.yaml")
    except InputError:
        assume(False)
    cfg = dict(_settle({"probes": {"ibbw": cfg}})["probes"]["ibbw"],
               sys_root=str(Path(__file__).parent / "fixtures" / "fabric" / "roce" / "t0"))
    opts = ibbw.options_from_profile(cfg, str(WORK))
    rails, seen = ibbw.pick_rails(Path(opts.sysfs_root), devices=opts.devices, link_layers=opts.link_layers,
                                  all_rails=opts.all_rails, gid=opts.gid_index)
    assert seen <= 4 and len(rails) <= seen and (opts.all_rails or len(rails) <= 1)
    for i, r in enumerate(rails):
        floors = ibbw.floors_for(r["rate"], r["rate_gbps"], opts.floors)
        assert floors["fail"] is None or floors["warn"] is None or floors["fail"] <= floors["warn"] + 1e-9
        s = ibbw.perftest_argv("server", device=r["device"], ib_port=int(r["ib_port"]), tcp_port=opts.tcp_port + i,
                               size_bytes=opts.size_bytes, iters=opts.iters, gid_index=r["gid_index"])
        c = ibbw.perftest_argv("client", device=r["device"], ib_port=int(r["ib_port"]), tcp_port=opts.tcp_port + i,
                               size_bytes=opts.size_bytes, iters=opts.iters, gid_index=r["gid_index"], peer="10.0.0.1")
        assert c[:len(s)] == s and ("-x" in s) == (r["link_layer"] == "Ethernet" and r["gid_index"] is not None)
