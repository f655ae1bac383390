"""`pip install .` (not editable) into a fresh virtualenv, then the CLI from another directory."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pip_install_into_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # Build from a copy so the install cannot lean on the source tree's files.
    src = tmp_path / "src"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(src)], check=True)
    for rel in ("templates", "health", "clusterops", "setup.cfg"):
        # Take the working tree's current files (the clone has only what was committed).
        subprocess.run(["cp", "-a", str(REPO / rel), str(src / Path(rel).parent)], check=True)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    exe = venv / "bin" / "clusterops"
    r = subprocess.run([str(exe), "--help"], cwd=elsewhere, capture_output=True, text=True)
    assert r.returncode == 0 and "devcluster" in r.stdout and "slurm" in r.stdout, r.stderr
    # Data installed inside the package, found without the source tree.
    probe = ("import importlib.resources as r, clusterops; "
             "t = sorted(p.name for p in r.files('clusterops.templates').iterdir()); "
             "h = sorted(p.name for p in r.files('clusterops.health_profiles').iterdir()); "
             "print(clusterops.__file__); print(t); print(h)")
    r = subprocess.run([str(py), "-c", probe], cwd=elsewhere, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    where, templates, profiles = r.stdout.splitlines()
    assert str(venv) in where and str(REPO) not in where
    installed_templates = {n for n in eval(templates) if n.endswith(".j2")}
    installed_profiles = {n for n in eval(profiles) if n.endswith(".yaml")}
    assert installed_templates and installed_templates == {p.name for p in (REPO / "templates").glob("*.j2")}
    assert installed_profiles and installed_profiles == {p.name for p in (REPO / "health").glob("*.yaml")}
    # torch is an extra, never imported at start.
    r = subprocess.run([str(py), "-c", "import clusterops.cli, sys; assert 'torch' not in sys.modules"],
                       cwd=elsewhere, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
