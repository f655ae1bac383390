"""Health inputs: the one YAML loader, the schema tables, complete validation of profiles and
site config, `health profiles --check`, the drain: section, and docs kept in step."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from clusterops import schema, yamlio
from clusterops.cli.health import health
from clusterops.errors import InputError
from clusterops.health import (REGISTRY, builtin_dir, check_file, load_profile, load_site_config,
                               site_drain_settings)

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "clusterops"]


def write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


# -- yamlio ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,msg", [
    ("a: &x 1\nb: *x\n", "f.yaml:1: YAML anchors (&x) are not supported"),
    ("a: 1\nb: *x\n", "f.yaml:2: YAML aliases (*x) are not supported"),
    ("a:\n  <<: {b: 1}\n", "f.yaml:2: YAML merge keys (<<) are not supported"),
    ("a: 1\nb: 2\na: 3\n", "f.yaml:3: a: duplicate key (first at line 1)"),
    ("x: " + "[" * 100 + "]" * 100 + "\n", "nested deeper than 64 levels"),
    ("a: 1\n---\nb: 2\n", "f.yaml:2: more than one YAML document"),
    ("? [1, 2]\n: x\n", "f.yaml:1: top level: keys must be plain names"),
    ("x: !!python/object/apply:os.system [true]\n", "f.yaml:1: YAML tag tag:yaml.org,2002:python/object/apply:os.system is not supported"),
    ("x: !!python/name:os.system ''\n", "f.yaml:1: x: could not determine a constructor"),
    ("a: [1,\n", "f.yaml:2: YAML error"),
])
def test_yamlio_refuses_with_file_and_line(text, msg):
    with pytest.raises(InputError) as e:
        yamlio.load_text(text, "f.yaml")
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_yamlio_billion_laughs_is_refused_at_once():
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    with pytest.raises(InputError, match="f.yaml:1: YAML anchors"):
        yamlio.load_text(text, "f.yaml")


def test_yamlio_size_bound(tmp_path):
    big = write(tmp_path / "big.yaml", "a: " + "x" * (yamlio.MAX_BYTES + 10) + "\n")
    with pytest.raises(InputError, match="big.yaml: larger than 256 KiB"):
        yamlio.load_file(big)


def test_yamlio_values_and_lines():
    data, lines = yamlio.load_text("a: 1\nb:\n  - {c: 2.5}\n  - on\nd: null\n", "f.yaml")
    assert data == {"a": 1, "b": [{"c": 2.5}, True], "d": None}
    assert lines[("b",)] == 2 and lines[("b", 1)] == 4 and lines[("b", 0, "c")] == 3


def test_job_spec_with_anchor_exits_2_naming_file_and_line(tmp_path):
    spec = write(tmp_path / "job.yaml", "name: t\nnodes: &n 2\ngpus_per_node: *n\nscript: train.py\n")
    r = subprocess.run(CLI + ["launch", "render", str(spec)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert f"{spec}:2: YAML anchors (&n) are not supported" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# -- schema: each probe's table matches what the probe's code reads ------------------------------

def _cfg_keys(module_path: Path) -> set:
    """Every literal key read from a variable named cfg: cfg.get("k"...) and cfg["k"]."""
    keys = set()
    for node in ast.walk(ast.parse(module_path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("cfg", "c")
                and node.args and isinstance(node.args[0], ast.Constant)):
            keys.add(node.args[0].value)
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "cfg"
                and isinstance(node.slice, ast.Constant)):
            keys.add(node.slice.value)
    return {k for k in keys if isinstance(k, str) and not k.startswith("_")}


def test_schema_lists_exactly_the_settings_each_probe_module_reads():
    from clusterops.health.check import PAIR_PROBES

    modules = {}
    for name, entry in REGISTRY.items():
        modules.setdefault(entry.fn.__module__, set()).add(name)
    for name, module in PAIR_PROBES.items():
        modules.setdefault(module, set()).add(name)
    for module, names in modules.items():
        path = REPO / (module.replace(".", "/") + ".py")
        read = _cfg_keys(path)
        declared = {f.name for n in names for f in schema.PROBE_SETTINGS[n]}
        common = {f.name for f in schema.COMMON_SETTINGS}
        assert read - declared - common == set(), (module, "read but not in the schema")
        assert declared - read == set(), (module, "in the schema but never read")


def test_builtin_profiles_and_gpu_models_are_valid():
    for p in builtin_dir().glob("*.yaml"):
        data, lines = yamlio.load_file(p)
        if p.stem == "gpu_models":
            schema.validate(data, schema.Field("gpu_models", "dict", item=schema.GPU_MODEL), str(p), lines)
        elif p.stem == "sdc_digests":
            from clusterops.health.probes.sdc import load_recorded

            assert load_recorded(str(p))      # the recorded digests, checked by their own schema
        else:
            assert check_file(str(p)) == "profile"


@pytest.mark.parametrize("text,msg", [
    ("gpus: {count: 8.5}\n", "p.yaml:1: gpus.count: must be a whole number in [0, 1024], got 8.5"),
    ("gpus: {required: yes please}\n", "p.yaml:1: gpus.required: must be true or false, got 'yes please'"),
    ("gpus: [1]\n", "p.yaml:1: gpus: must be a mapping, got a list"),
    ("probes:\n  nvml:\n    leftover_process_status: kill\n",
     "p.yaml:3: probes.nvml.leftover_process_status: must be one of fail, warn, got 'kill'"),
    ("probes:\n  nvml:\n    temperature_fail_c: .inf\n", "p.yaml:3: probes.nvml.temperature_fail_c: must be a number"),
    ("probes:\n  nvml:\n    driver: {min: 535.104.05.x}\n", "p.yaml:3: probes.nvml.driver.min: must be a version"),
    ("probes:\n  nvml:\n    driver: {mni: \"535\"}\n", "p.yaml:3: probes.nvml.driver.mni: unknown key (did you mean 'min'?)"),
    ("probes:\n  host.paths:\n    paths:\n      - {path: /x}\n      - {min_free_gb: 3}\n",
     "p.yaml:5: probes.host.paths.paths[1]: missing path"),
    ("probes:\n  host.paths:\n    paths:\n      - {path: /x, writable: 1}\n",
     "p.yaml:4: probes.host.paths.paths[0].writable: must be true or false, got 1"),
    ("probes:\n  host.mounts:\n    mounts: [/a, {path: /b, fstyp: nfs}]\n",
     "p.yaml:3: probes.host.mounts.mounts[1].fstyp: unknown key (did you mean 'fstype'?)"),
    ("probes:\n  host.mounts:\n    mounts: [3]\n", "p.yaml:3: probes.host.mounts.mounts[0]: must be str or mapping, got 3"),
    ("probes:\n  matmul:\n    gpu_shapes: [[1, 2]]\n",
     "p.yaml:3: probes.matmul.gpu_shapes[0]: must have exactly 3 items, got 2"),
    ("probes:\n  matmul:\n    min_fraction: 1.5\n", "p.yaml:3: probes.matmul.min_fraction: must be a number in [0, 1], got 1.5"),
    ("probes:\n  dist:\n    backend: mpi\n", "p.yaml:3: probes.dist.backend: must be one of auto, nccl, gloo, got 'mpi'"),
    ("probes:\n  dist:\n    sizes_bytes: [0]\n", "p.yaml:3: probes.dist.sizes_bytes[0]: must be a whole number"),
    ("probes:\n  dcgm:\n    level: 5\n", "p.yaml:3: probes.dcgm.level: must be a whole number in [1, 4], got 5"),
    ("probes:\n  xid:\n    source: file\n", "probes.xid.source: 'file' needs probes.xid.log_file"),
    ("probes:\n  host.cpus: 4\n", "p.yaml:2: probes.host.cpus: must be a mapping of settings, or false"),
    ("probes:\n  nvml:\n    timeout_s: 1e9\n", "p.yaml:3: probes.nvml.timeout_s: must be a number in [0.1, 86400]"),
    ("probes:\n  host.stray_processes: {status: pass}\n",
     "p.yaml:2: probes.host.stray_processes.status: must be one of warn, fail, got 'pass'"),
    # ibbw: the sweep's pair test, validated like any probe's settings
    ("probes:\n  ibbw:\n    floors:\n      NDR: {fail: -1}\n",
     "p.yaml:4: probes.ibbw.floors.NDR.fail: must be a number in [0, 1e+06], got -1"),
    ("probes:\n  ibbw:\n    floors:\n      NRD: {fail: 300}\n",
     "p.yaml:4: probes.ibbw.floors.NRD: unknown key (did you mean 'NDR'?)"),
    ("probes:\n  ibbw:\n    floors:\n      HDR: {fail: 190, warn: 180}\n",
     "probes.ibbw.floors.HDR.warn: 180 is below fail 190"),
    ("probes:\n  ibbw:\n    floors:\n      NDR: {warn: 300}\n",
     "probes.ibbw.floors.NDR.warn: 300 is below fail 380"),
    ("probes:\n  ibbw:\n    gpudirect: sometimes\n",
     "p.yaml:3: probes.ibbw.gpudirect: must be true or false, got 'sometimes'"),
    ("probes:\n  ibbw:\n    tcp_port: 80\n", "p.yaml:3: probes.ibbw.tcp_port: must be a whole number in [1024, 65000], got 80"),
    ("probes:\n  ibbw:\n    gid_index: -1\n", "p.yaml:3: probes.ibbw.gid_index: must be a whole number in [0, 1023], got -1"),
    ("probes:\n  ibbw:\n    link_layers: [RoCE]\n",
     "p.yaml:3: probes.ibbw.link_layers[0]: must be one of InfiniBand, Ethernet, got 'RoCE'"),
    ("probes:\n  ibbw:\n    size_bytes: 0\n", "p.yaml:3: probes.ibbw.size_bytes: must be a whole number in [1, "),
    ("probes:\n  ibbw:\n    all_rail: true\n", "p.yaml:3: probes.ibbw.all_rail: unknown setting (did you mean 'all_rails'?)"),
    ("probes:\n  ibbw:\n    fail_fraction: 0.9\n    warn_fraction: 0.5\n",
     "probes.ibbw.warn_fraction: 0.5 is below fail_fraction 0.9"),
    ("probes:\n  ibbw:\n    timeout_s: 0\n", "p.yaml:3: probes.ibbw.timeout_s: must be a number in [0.1, 86400]"),
    ("- a\n- b\n", "p.yaml: a health profile or site config is a YAML mapping"),
    ("extends: [fast]\n", "p.yaml:1: extends: must be a string, got a list"),
])
def test_profile_validation_names_file_line_and_key(tmp_path, text, msg):
    p = write(tmp_path / "p.yaml", text)
    with pytest.raises(InputError) as e:
        check_file(str(p))
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    r = CliRunner().invoke(health, ["profiles", "--check", str(p)])
    assert isinstance(r.exception, InputError) and r.exception.exit_code == 2


@pytest.mark.parametrize("text,msg", [
    ("drain:\n  max_drained_fraction: 1.5\n", "s.yaml:2: drain.max_drained_fraction: must be a number in [0, 1], got 1.5"),
    ("drain:\n  max_drained_fraction: \"10%\"\n", "s.yaml:2: drain.max_drained_fraction: must be a number"),
    ("drain:\n  partiton: gpu\n", "s.yaml:2: drain.partiton: unknown key (did you mean 'partition'?)"),
    ("drain: {partition: \"\"}\n", "s.yaml:1: drain.partition: must not be empty"),
    ("gpu_models:\n  H100:\n    match: [\"H100(\"]\n", "s.yaml:3: gpu_models.H100.match[0]: bad regular expression"),
    ("gpu_models:\n  H100: {matmul_bf16_tflops: -5}\n", "s.yaml:2: gpu_models.H100.matmul_bf16_tflops: must be a number in (0, 1e+06], got -5"),
    ("defaults:\n  extends: fast\n", "s.yaml:2: defaults.extends: unknown key"),
    ("profiles:\n  fast:\n    probes:\n      nvml: {ecc_volatile_max: -1}\n",
     "s.yaml:4: profiles.fast.probes.nvml.ecc_volatile_max: must be a whole number in [0, 1e+09], got -1"),
    ("profile:\n  fast: {}\n", "s.yaml:1: profile: unknown key (did you mean 'profiles'?)"),
])
def test_site_config_validation(tmp_path, text, msg):
    s = write(tmp_path / "s.yaml", text)
    with pytest.raises(InputError) as e:
        load_site_config(str(s))
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    r = subprocess.run(CLI + ["health", "check", "--site-config", str(s)], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1


def test_drain_settings_defaults_site_and_env(tmp_path):
    assert site_drain_settings({}, env={}) == {"max_drained_fraction": 0.1, "partition": None}
    s = write(tmp_path / "s.yaml", "drain:\n  max_drained_fraction: 0.25\n  partition: gpu\n")
    site, _ = load_site_config(str(s))
    assert site_drain_settings(site, env={}) == {"max_drained_fraction": 0.25, "partition": "gpu"}
    assert site_drain_settings(str(s), env={"CLUSTEROPS_MAX_DRAINED_FRACTION": "0.5"}) == {
        "max_drained_fraction": 0.5, "partition": "gpu"}
    for bad in ("2", "nan", "ten"):
        with pytest.raises(InputError, match="CLUSTEROPS_MAX_DRAINED_FRACTION"):
            site_drain_settings(site, env={"CLUSTEROPS_MAX_DRAINED_FRACTION": bad})


def test_profiles_check_cli(tmp_path):
    good = write(tmp_path / "mine.yaml", "extends: fast\nprobes:\n  host.memory: {min_available_gb: 2}\n")
    r = subprocess.run(CLI + ["health", "profiles", "--check", str(good)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"{good}: ok (profile)"
    site = write(tmp_path / "site.yaml", "drain: {max_drained_fraction: 0.2}\n")
    r = subprocess.run(CLI + ["health", "profiles", "--check", str(site)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"{site}: ok (site config)"
    # A bad parent is found too: the whole chain is checked.
    write(tmp_path / "parent.yaml", "probes:\n  nvml: {gpu_cout: 8}\n")
    child = write(tmp_path / "child.yaml", "extends: ./parent.yaml\n")
    r = subprocess.run(CLI + ["health", "profiles", "--check", str(child)], capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert r.returncode == 2 and "parent.yaml:2: probes.nvml.gpu_cout: unknown setting (did you mean 'gpu_count'?)" in r.stderr
    r = subprocess.run(CLI + ["health", "profiles", "--check", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "nope.yaml: no such" in r.stderr


def test_site_profile_override_merges_and_runs(tmp_path):
    s = write(tmp_path / "s.yaml", "profiles:\n  fast:\n    probes:\n      host.memory: {min_available_gb: 0.5}\n"
                                   "drain: {max_drained_fraction: 0.3}\n")
    p = load_profile("fast", str(s))
    assert p.probes["host.memory"] == {"timeout_s": 5, "min_available_gb": 0.5}


def test_docs_tables_match_the_schema():
    text = (REPO / "docs" / "health.md").read_text()
    for name, table in schema.docs_tables().items():
        m = re.search(rf"<!-- schema:{re.escape(name)} -->\n(.*?)\n<!-- /schema:{re.escape(name)} -->", text, re.S)
        assert m, f"docs/health.md lacks the {name} table (python -m clusterops.schema prints them)"
        assert m.group(1) == table, f"docs/health.md's {name} table is stale: python -m clusterops.schema"
