"""clusterops as users install it.

The wheel and the sdist are built from the working tree's files (tracked and untracked,
not ignored: no __pycache__ or .venv junk), the wheel is checked to hold every package
under ``clusterops/`` and every data file, the sdist to rebuild the same wheel. The wheel
with its ``lightning`` and ``hf`` extras is installed (not editable) into a fresh
virtualenv, and from a directory outside the source tree, with no PYTHONPATH: every module
imports from that virtualenv, every command's ``--help`` runs, ``clusterops deploy files``
writes the site files with the virtualenv's paths in them, and one supervised job runs on
the dev cluster with that install's ``clusterops supervise`` and SDK.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from clusterops.resources import _DATA as DATA_FOLDERS

REPO = Path(__file__).resolve().parents[2]
EXTRAS = "lightning,hf"
TORCH = "torch==2.13.0"   # the CPU build on this machine's disk; an unpinned torch pulls CUDA


def _run(argv, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 300)
    return subprocess.run([str(a) for a in argv], **kw)


def _clean_env(**extra) -> dict:
    """The test's environment without anything that would put the source tree (or the
    test's own virtualenv) in front of the install under test."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("CLUSTEROPS_")}
    env.update(extra)
    return env


def _source_files():
    out = _run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], timeout=60)
    assert out.returncode == 0, out.stderr
    return [p for p in out.stdout.split("\0") if p and (REPO / p).is_file()]


def code_packages() -> set:
    """Every directory under clusterops/ with an __init__.py, as a dotted name."""
    return {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "clusterops").rglob("__init__.py")
            if "__pycache__" not in p.parts}


def data_packages() -> dict:
    return {f"clusterops.{name}": folder for name, folder in DATA_FOLDERS.items()}


def wheel_packages(names) -> set:
    return {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheel and the sdist built from a copy of the working tree's current files."""
    root = tmp_path_factory.mktemp("build")
    src = root / "src"
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    dist = root / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run([sys.executable, "-m", "build", "-q", "--sdist", "--outdir", dist, src])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    wheel, = dist.glob("clusterops-*.whl")
    sdist, = dist.glob("clusterops-*.tar.gz")
    return SimpleNamespace(root=root, src=src, wheel=wheel, sdist=sdist)


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """A fresh virtualenv with the wheel and its extras installed, and a directory that is
    not the source tree to run it from."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    r = _run([sys.executable, "-m", "venv", venv])
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    # --no-compile: torch's tens of thousands of .pyc are most of an install's time.
    r = _run([py, "-m", "pip", "install", "-q", "--no-compile", TORCH, f"{built.wheel}[{EXTRAS}]"],
             env=_clean_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return SimpleNamespace(venv=venv, py=py, exe=venv / "bin" / "clusterops", cwd=elsewhere,
                           site=Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                          cwd=elsewhere, env=_clean_env()).stdout.strip()))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_holds_every_package_and_data_file_and_the_sdist_rebuilds_it(built):
    names = zipfile.ZipFile(built.wheel).namelist()
    want = code_packages() | set(data_packages())
    assert wheel_packages(names) == want, f"missing {sorted(want - wheel_packages(names))}"
    assert "clusterops.integrations" in want
    tracked = set(_source_files())
    for pkg, folder in data_packages().items():
        shipped = {n.split("/", 2)[2] for n in names if n.startswith(f"clusterops/{pkg.split('.')[1]}/")}
        in_tree = {Path(p).relative_to(folder).as_posix() for p in tracked if p.startswith(f"{folder}/")}
        assert shipped == in_tree, (pkg, sorted(in_tree ^ shipped))
    # The sdist: the build files, the package, the data; no tests; and it builds the same wheel.
    with tarfile.open(built.sdist) as tf:
        members = {m.split("/", 1)[1] for m in tf.getnames() if "/" in m}
        tf.extractall(built.root / "sdist", filter="data")
    for must in ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md",
                 "slurm/clusterops-healthcheck.sh", "deploy/prometheus/clusterops-alerts.yml"):
        assert must in members, must
    assert not any(m.startswith("tests/") for m in members)
    assert {p for p in tracked if p.startswith("clusterops/")} <= members
    top, = (built.root / "sdist").iterdir()
    again = built.root / "again"
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", again, top])
    assert r.returncode == 0, r.stderr[-3000:]
    rebuilt, = again.glob("*.whl")
    content = [n for n in names if ".dist-info/" not in n]
    assert sorted(n for n in zipfile.ZipFile(rebuilt).namelist() if ".dist-info/" not in n) == sorted(content)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_imports_every_module_and_every_command_helps(installed):
    probe = r"""
import importlib, json, pkgutil, sys
import clusterops, clusterops.cli
light = 'torch' not in sys.modules
mods = {}
for m in pkgutil.walk_packages(clusterops.__path__, 'clusterops.'):
    mods[m.name] = importlib.import_module(m.name).__file__
mods['clusterops'] = clusterops.__file__
import click
def walk(group, ctx, path):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield path + [name]
        if isinstance(cmd, click.Group):
            yield from walk(cmd, ctx, path + [name])
paths = list(walk(clusterops.cli.cli, click.Context(clusterops.cli.cli), []))
# Every command's --help through the installed CLI, in this one process (one process per
# command is a minute of interpreter starts on two cores; the groups get their own below).
from click.testing import CliRunner
helps = {}
for path in paths:
    r = CliRunner().invoke(clusterops.cli.cli, path + ["--help"], prog_name="clusterops")
    helps[" ".join(path)] = [r.exit_code, r.output[:200]]
print(json.dumps({"light": light, "modules": mods, "commands": paths, "helps": helps}))
"""
    r = _run([installed.py, "-c", probe], cwd=installed.cwd, env=_clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["light"], "import clusterops.cli imported torch"
    expected = {".".join(p.with_suffix("").relative_to(REPO).parts).removesuffix(".__init__")
                for p in (REPO / "clusterops").rglob("*.py") if "__pycache__" not in p.parts}
    expected |= set(data_packages())
    assert set(got["modules"]) == expected, sorted(expected ^ set(got["modules"]))
    assert "clusterops.integrations.lightning" in got["modules"]
    for name, where in got["modules"].items():
        assert Path(where).is_relative_to(installed.site) and str(REPO) not in where, (name, where)
    paths = got["commands"]
    assert ["deploy", "files"] in paths and ["supervise"] in paths and len(paths) > 20
    for path, (code, text) in got["helps"].items():
        assert code == 0 and text.startswith(f"Usage: clusterops {path} "), (path, code, text)
    # The console script itself, for the top level and each command group.
    for path in [[]] + [p for p in paths if len(p) == 1]:
        r = _run([installed.exe, *path, "--help"], cwd=installed.cwd, env=_clean_env(), timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("Usage: clusterops"), (path, r.stderr[-1000:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_wheel_writes_the_site_files_for_its_own_prefix(installed, tmp_path):
    out = tmp_path / "site"
    r = _run([installed.exe, "deploy", "files", "--out", out, "--json"], cwd=installed.cwd, env=_clean_env())
    assert r.returncode == 0, r.stderr
    files = {Path(f["path"]).relative_to(out).as_posix(): f for f in json.loads(r.stdout)["files"]}
    exe = f"{installed.venv}/bin/clusterops"
    for rel in ("slurm/clusterops-healthcheck.sh", "slurm/prolog.sh", "slurm/epilog.sh",
                "cron.d/clusterops-sweep", "systemd/clusterops-sweep.service"):
        text = (out / rel).read_text()
        assert exe in text and "/opt/clusterops" not in text and str(REPO) not in text, rel
    for rel in ("slurm/clusterops-healthcheck.sh", "slurm/prolog.sh", "slurm/epilog.sh"):
        assert files[rel]["mode"] == "0755" and os.access(out / rel, os.X_OK)
        r = _run(["bash", "-n", out / rel])
        assert r.returncode == 0, (rel, r.stderr)
    assert f"HealthCheckProgram={out}/slurm/clusterops-healthcheck.sh" in (out / "slurm/slurm.conf.health").read_text()
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found (scripts/setup.sh installs Debian's prometheus package)"
    r = _run([promtool, "check", "rules", out / "prometheus/clusterops-alerts.yml"])
    assert r.returncode == 0, r.stdout + r.stderr
    # (`promtool test rules` on the shipped file is tests/test_deploy.py's; the installed copy is the same.)
    assert (out / "prometheus/clusterops-alerts.test.yml").read_bytes() == \
        (REPO / "deploy/prometheus/clusterops-alerts.test.yml").read_bytes()
    # The rendered wrapper really runs the installed command (a usage error reaches it: exit 2).
    r = _run([out / "slurm/clusterops-healthcheck.sh"], cwd=installed.cwd,
             env=_clean_env(CLUSTEROPS_HEALTH_PROFILE="no-such-profile", CLUSTEROPS_HEALTH_LOG=str(tmp_path / "h.log")))
    assert r.returncode == 2 and "no-such-profile" in (tmp_path / "h.log").read_text(), r.stderr
    # A bad prefix: exit 2, one line, nothing written.
    r = _run([installed.exe, "deploy", "files", "--prefix", tmp_path / "nowhere", "--out", tmp_path / "site2"],
             cwd=installed.cwd, env=_clean_env())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nowhere" in r.stderr, r.stderr
    assert not (tmp_path / "site2").exists()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_supervised_job_runs_on_the_dev_cluster_from_the_installed_wheel(installed, cluster, tmp_path):
    from support import faultkit as fk

    from clusterops.slurm.factory import connect
    from clusterops.supervisor import timeline as tl

    bindir = installed.venv / "bin"
    job = fk.TrainJob(root=tmp_path / "job", name="installed", nodes=2, steps=20, ckpt_every=5, step_sleep=0.05,
                      python=str(installed.py),
                      spec_extra={"setup": [f"export PATH={bindir}:$PATH", "unset PYTHONPATH",
                                            "echo \"supervisor-at $(command -v clusterops)\"",
                                            "python -c 'import clusterops; print(\"clusterops-at\", clusterops.__file__)'"]})
    spec = job.write_spec()
    r = _run([installed.exe, "launch", "submit", spec, "--json"], cwd=installed.cwd, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    job.job_id = int(json.loads(r.stdout)["job_id"])
    info = job.wait_end(connect(), timeout_s=300)
    story = tl.format_text(job.timeline())
    log = job.batch_log()
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{log[-3000:]}"
    assert job.timeline_events("done") and job.out.exists(), story
    # The batch script's clusterops (the supervisor: `exec clusterops supervise`) and the
    # package it imports are the fresh install's, not the source tree's.
    assert f"supervisor-at {bindir}/clusterops" in log, log[-2000:]
    assert f"clusterops-at {installed.site}/clusterops/__init__.py" in log, log[-2000:]
    # The ranks ran with the install's python (the SDK they import is the install's).
    cmd = (job.latest_attempt() / "command.txt").read_text()
    assert str(installed.py) in cmd.splitlines()[0] and str(REPO / "clusterops") not in cmd, cmd[:500]
