"""deploy/: the Prometheus alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`), every alert has a test that fires it, and every metric the
rules and the Grafana dashboard use is one clusterops really exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from clusterops import health, report
from clusterops.supervisor import timeline
from clusterops.metrics import CATALOGUE

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "clusterops-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "clusterops-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "clusterops-fleet.json"
METRIC = re.compile(r"\bclusterops_[a-z0-9_]+")


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not found (scripts/setup.sh installs Debian's prometheus package)")
    return path


def _alerts():
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _dashboard_exprs():
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
    return exprs


def test_rules_pass_promtool_check():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


def test_rule_unit_tests_pass():
    r = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                       timeout=120, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired, quiet = set(), set()
    for t in tests:
        for a in t.get("alert_rule_test", []):
            (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "alerts no test fires"
    # Every alert is also checked not to fire (before its `for:`, or on healthy series),
    # except the ones that fire on a single sample by design.
    assert names - quiet <= {"ClusteropsNodeFlapping"}


def test_dashboard_queries_are_valid_promql(tmp_path):
    # promtool parses every dashboard query as a recording rule.
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e}
                                                        for i, (_, e) in enumerate(_dashboard_exprs())]}]}
    tmp = tmp_path / "dashboard-queries.yml"
    tmp.write_text(yaml.safe_dump(rules))
    r = subprocess.run([promtool(), "check", "rules", str(tmp)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "d:q", "expr": "sum(("}]}]}))
    assert subprocess.run([promtool(), "check", "rules", str(bad)], capture_output=True).returncode != 0


def test_dashboard_shows_what_the_fleet_team_asked_for():
    dash = json.loads(DASHBOARD.read_text())
    used = {m for _, e in _dashboard_exprs() for m in METRIC.findall(e)}
    for needed in ("clusterops_sweep_nodes", "clusterops_health_status", "clusterops_sweep_drained_nodes",
                   "clusterops_sweep_node_straggler", "clusterops_sweep_guard_tripped",
                   "clusterops_sweep_timestamp_seconds", "clusterops_job_restarts", "clusterops_job_goodput_ratio"):
        assert needed in used, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dash["panels"] for t in p.get("targets", []))


def _exported_families():
    """Metric families clusterops really writes: rendered from a health report, a sweep
    document that has every kind of node and action, and a job timeline."""
    from prometheus_client.parser import text_string_to_metric_families

    hrep = {"node": "n1", "profile": "fast", "status": "fail", "exit_code": 3, "duration_s": 1.0, "time": 1.0,
            "results": [{"name": "matmul", "status": "fail", "value": 1.0, "unit": "TFLOPS"}]}
    sdoc = {"sweep_id": "s", "started": 0.0, "finished": 1.0, "duration_s": 1.0, "exit_code": 3,
            "counts": {"pass": 1, "fail": 1, "stragglers": 1}, "medians": {"matmul_tflops": 9.0},
            "nodes": [{"node": "n1", "status": "pass", "healthy": True, "duration_s": 1.0,
                       "metrics": {"matmul_tflops": 9.0, "busbw_gbps": 3.0, "h2d_gbps": 50.0,
                                   "fabric_errors": 2.0, "fabric_flaps": 1.0}, "stragglers": ["matmul_tflops"],
                       "versions": "driver 570.133.20, VBIOS 96.00.99.00.01", "version_outlier": ""}],
            "plan": {"guard_tripped": True, "actions": [{"node": "n2", "action": "keep", "why": "still failing",
                                                         "reason": "clusterops:health:fast: x: y"}]},
            "applied": [{"node": "n2", "action": "keep", "reason": "clusterops:health:fast: x: y"}],
            "pairs": [{"nodes": ["n1", "n2"], "status": "pass", "busbw_gbps": 1.0,
                       "ib_write_bw": {"status": "pass", "gbps": 393.0,
                                       "rails": [{"rail": "mlx5_0/1", "status": "pass", "gbps": 393.0}]}}]}
    recs = [{"t": 1.0, "event": "launch", "resume_step": 0}, {"t": 2.0, "event": "progress", "step": 5},
            {"t": 3.0, "event": "restart", "cause": "crash"}, {"t": 4.0, "event": "launch", "resume_step": 5},
            {"t": 5.0, "event": "progress", "step": 6, "slowest": ["n2", 1.1]},
            {"t": 5.5, "event": "straggler", "node": "n3", "ratio": 2.0, "action": "replace"},
            {"t": 5.6, "event": "inproc_fault", "gen": 0}, {"t": 5.7, "event": "inproc_first_step", "gen": 1,
                                                           "fault_to_step_s": 0.1},
            {"t": 6.0, "event": "give_up", "code": 5}]
    from clusterops import jobwatch

    flagged = [{"job_id": "7", "user": "alice", "flag": "stalled"}]
    text = health.prometheus_text(hrep) + report.prometheus_text(sdoc) + timeline.prometheus_text(recs, "j") \
        + jobwatch.prometheus_text(flagged, when=1.0)
    return {f.name for f in text_string_to_metric_families(text)}


def test_every_metric_used_is_one_clusterops_exports():
    exported = _exported_families()
    assert exported == set(CATALOGUE), "the catalogue names a metric no code writes, or the reverse"
    used = {m for _, e in _dashboard_exprs() for m in METRIC.findall(e)}
    used |= {m for a in _alerts() for m in METRIC.findall(a["expr"])}
    unknown = used - exported
    assert not unknown, f"dashboard/rules use metrics clusterops does not export: {sorted(unknown)}"
    # The rule tests feed only exported series too (a typo there would test nothing).
    fed = {m for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for s in t["input_series"]
           for m in METRIC.findall(s["series"])}
    assert fed <= exported, sorted(fed - exported)


# -- `clusterops deploy files`: the shipped files written out for a site -----------------
from clusterops import deploy as dp  # noqa: E402
from clusterops.errors import InputError  # noqa: E402
from clusterops.resources import _DATA, data_dir  # noqa: E402

SHELL = ("slurm/clusterops-healthcheck.sh", "slurm/prolog.sh", "slurm/epilog.sh")


def deploy_cli(*args, cwd=None):
    import sys

    return subprocess.run([sys.executable, "-m", "clusterops", "deploy", "files", *map(str, args)],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def fake_prefix(root: Path, name: str = "pre+fix@1") -> Path:
    """An install prefix with an executable bin/clusterops (what --prefix checks)."""
    exe = root / name / "bin" / "clusterops"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return root / name


def tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_every_shipped_file_is_written_with_the_prefix_and_out_filled_in(tmp_path):
    prefix, out = fake_prefix(tmp_path), tmp_path / "site"
    r = deploy_cli("--prefix", prefix, "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    listed = {Path(f["path"]).relative_to(out).as_posix(): f["mode"] for f in json.loads(r.stdout)["files"]}
    on_disk = tree(out)
    assert set(listed) == set(on_disk) == {f.out for f in dp.FILES} | {dp.README}
    assert all(f"{on_disk[k][1]:04o}" == m for k, m in listed.items())
    for f in dp.FILES:
        src = (data_dir(f.package) / f.source).read_text().splitlines()
        got = on_disk[f.out][0].decode().splitlines()
        assert len(src) == len(got), f.out
        for a, b in zip(src, got):
            # Only the install's paths change, line for line.
            want = (a.replace("file:///opt/clusterops/docs/sweep.md", f"file://{out}/README")
                     .replace("/opt/clusterops/bin/clusterops", f"{prefix}/bin/clusterops")
                     .replace("/opt/clusterops/slurm/", f"{out}/slurm/"))
            assert b == want, (f.out, a, b)
        assert "/opt/clusterops" not in "\n".join(got), f.out
    for rel in SHELL:
        assert on_disk[rel][1] == 0o755 and f"{prefix}/bin/clusterops" in on_disk[rel][0].decode()
        assert subprocess.run(["bash", "-n", str(out / rel)], capture_output=True).returncode == 0, rel
    conf = (out / "slurm/slurm.conf.health").read_text()
    assert f"HealthCheckProgram={out}/slurm/clusterops-healthcheck.sh\n" in conf
    assert f"{prefix}/bin/clusterops sweep " in (out / "cron.d/clusterops-sweep").read_text()
    assert f"ExecStart={prefix}/bin/clusterops sweep " in (out / "systemd/clusterops-sweep.service").read_text()
    assert json.loads((out / "grafana/clusterops-fleet.json").read_text()) == json.loads(DASHBOARD.read_text())
    # The rules and their unit tests are written as shipped (the tests above run promtool on those).
    assert (out / "prometheus/clusterops-alerts.yml").read_bytes() == RULES.read_bytes()
    assert (out / "prometheus/clusterops-alerts.test.yml").read_bytes() == RULE_TESTS.read_bytes()
    # Nothing staged is left next to DIR.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pre+fix@1", "site"]


def test_the_default_prefix_is_the_running_install(tmp_path):
    import sys

    r = deploy_cli("--out", tmp_path / "site")
    assert r.returncode == 0, r.stderr
    assert f"CLUSTEROPS=${{CLUSTEROPS:-{sys.prefix}/bin/clusterops}}" in \
        (tmp_path / "site/slurm/clusterops-healthcheck.sh").read_text()


@pytest.mark.parametrize("bad", ["relative/prefix", "/with space", "/per%cent", "/dollar$HOME", "/semi;colon",
                                 "/no/such/prefix", "NOT_EXECUTABLE", "/new\nline", "/trailing\n"])
def test_a_bad_prefix_is_exit_2_one_line_and_nothing_written(tmp_path, bad):
    if bad == "NOT_EXECUTABLE":
        bad = str(fake_prefix(tmp_path, "noexec"))
        (Path(bad) / "bin" / "clusterops").chmod(0o644)
    elif bad.startswith("/") and bad != "/no/such/prefix":
        # A real install at that path, so the refusal is for its spelling alone.
        bad = str(fake_prefix(tmp_path, bad[1:]))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(InputError) as e:
        dp.write_files(prefix=bad, out=str(tmp_path / "site"))
    assert e.value.exit_code == 2 and e.value.message.startswith(f"--prefix {bad!r}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_bad_prefix_from_the_command_line_is_one_error_line_exit_2(tmp_path):
    r = deploy_cli("--prefix", "/per%cent\nx", "--out", tmp_path / "site")
    assert r.returncode == 2 and r.stderr.startswith("Error: --prefix"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_an_out_dir_that_is_not_plain_is_refused(tmp_path):
    prefix = fake_prefix(tmp_path)
    r = deploy_cli("--prefix", prefix, "--out", tmp_path / "a b")
    assert r.returncode == 2 and r.stderr.startswith("Error: --out") and not (tmp_path / "a b").exists(), r.stderr
    r = deploy_cli("--prefix", prefix, "--out", tmp_path / "no" / "parent")
    assert r.returncode == 2 and "does not exist" in r.stderr and not (tmp_path / "no").exists(), r.stderr


def test_a_non_empty_out_is_refused_unless_force_and_force_leaves_other_files(tmp_path):
    prefix, out = fake_prefix(tmp_path), tmp_path / "site"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    r = deploy_cli("--prefix", prefix, "--out", out)
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    r = deploy_cli("--prefix", prefix, "--out", out, "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "mine.txt").read_text() == "keep me" and (out / "slurm/prolog.sh").is_file()
    # Again over its own output: the files are replaced, the same.
    first = tree(out)
    assert deploy_cli("--prefix", prefix, "--out", out, "--force").returncode == 0
    assert tree(out) == first
    # An empty existing DIR needs no --force.
    (tmp_path / "empty").mkdir()
    assert deploy_cli("--prefix", prefix, "--out", tmp_path / "empty").returncode == 0


def test_deploy_never_writes_through_a_symlink(tmp_path):
    prefix = fake_prefix(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # DIR itself a symlink: refused, its target untouched.
    (tmp_path / "link").symlink_to(elsewhere)
    r = deploy_cli("--prefix", prefix, "--out", tmp_path / "link", "--force")
    assert r.returncode == 2 and "symlink" in r.stderr, r.stderr
    assert list(elsewhere.iterdir()) == []
    # A symlink planted at a file's name (--force): the link is replaced, its target untouched.
    out = tmp_path / "site"
    (out / "slurm").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (out / "slurm" / "prolog.sh").symlink_to(victim)
    r = deploy_cli("--prefix", prefix, "--out", out, "--force")
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious"
    assert not (out / "slurm/prolog.sh").is_symlink() and "health check" in (out / "slurm/prolog.sh").read_text()
    # A symlinked subdirectory: refused before anything is written.
    out2 = tmp_path / "site2"
    out2.mkdir()
    (out2 / "systemd").symlink_to(elsewhere)
    r = deploy_cli("--prefix", prefix, "--out", out2, "--force")
    assert r.returncode == 2 and "systemd" in r.stderr and "nothing written" in r.stderr, r.stderr
    assert list(elsewhere.iterdir()) == [] and [p.name for p in out2.iterdir()] == ["systemd"]


def test_a_shipped_file_naming_another_install_path_is_a_bug_not_a_silent_miss(tmp_path):
    with pytest.raises(RuntimeError, match="names /opt/clusterops"):
        dp.render("run /opt/clusterops/share/x\n", prefix="/p", out=tmp_path, name="x")


def test_the_shipped_files_are_package_data():
    # Every file deploy writes comes from a data package setup.cfg installs.
    for f in dp.FILES:
        assert f.package in _DATA and (data_dir(f.package) / f.source).is_file(), f
    assert data_dir("site_files") == REPO / "slurm" and data_dir("deploy_files") == REPO / "deploy"


def test_setup_finds_every_code_package_and_maps_every_data_package():
    """The package list setuptools builds from (no hand-kept list): every directory under
    clusterops/ with an __init__.py, plus each data folder under its installed name."""
    import sys

    code = ("import json; from distutils.core import run_setup; "
            "d = run_setup('setup.py', stop_after='config'); "
            "print(json.dumps({'packages': d.packages, 'package_dir': d.package_dir}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "clusterops").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    data = {f"clusterops.{k}": v for k, v in _DATA.items()}
    assert "clusterops.integrations" in on_disk
    assert sorted(got["packages"]) == sorted(on_disk | set(data))
    assert {k: v for k, v in got["package_dir"].items() if k} == data


def test_the_files_are_readable_by_everyone_whatever_the_umask(tmp_path):
    prefix = fake_prefix(tmp_path)
    (tmp_path / "empty").mkdir(mode=0o755)    # an existing DIR keeps its own mode
    old = os.umask(0o077)
    try:
        dp.write_files(prefix=str(prefix), out=str(tmp_path / "site"))
        dp.write_files(prefix=str(prefix), out=str(tmp_path / "empty"))
    finally:
        os.umask(old)
    for d in ("site", "empty"):
        for p in [tmp_path / d, *(tmp_path / d).rglob("*")]:
            mode = p.stat().st_mode & 0o777
            assert mode in ((0o755,) if p.is_dir() or p.name.endswith(".sh") else (0o644,)), (p, oct(mode))
