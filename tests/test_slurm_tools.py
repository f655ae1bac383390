"""Slurm installed under a prefix (--slurm-prefix / CLUSTEROPS_SLURM_PREFIX): the layer runs
PREFIX/bin/<tool> and PREFIX/sbin/<daemon>, and a bad prefix is one line and exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.devcluster import DevCluster, DevClusterConfig
from clusterops.slurm.settings import recorded_prefix
from clusterops.errors import InputError
from clusterops.slurm import Slurm
from clusterops.slurm.tools import PREFIX_ENV, SlurmTools

CLI = [sys.executable, "-m", "clusterops"]


def fake_prefix(tmp_path: Path, tools=("sinfo",), version="99.1.2") -> Path:
    """A prefix whose bin/ holds small programs that say which Slurm they are and how they
    were called (the argv and the PATH they saw)."""
    prefix = tmp_path / "slurm-prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "sbin").mkdir()
    for name in tools:
        p = prefix / "bin" / name
        p.write_text(f'#!/bin/sh\necho "slurm {version}"\necho "argv0=$0"\necho "path=$PATH"\n'
                     f'echo "prefix=${PREFIX_ENV}"\n')
        p.chmod(0o755)
    return prefix


def test_no_prefix_leaves_names_to_path():
    t = SlurmTools()
    assert t.exe("sinfo") == "sinfo" and t.argv(["scontrol", "show", "node"])[0] == "scontrol"
    assert t.env() == {}


def test_prefix_resolves_bin_and_sbin(tmp_path):
    prefix = fake_prefix(tmp_path, tools=("sinfo",))
    (prefix / "sbin" / "slurmd").write_text("#!/bin/sh\n")
    (prefix / "sbin" / "slurmd").chmod(0o755)
    t = SlurmTools.for_prefix(prefix)
    assert t.exe("sinfo") == str(prefix / "bin" / "sinfo")
    assert t.argv(["slurmd", "-D"]) == [str(prefix / "sbin" / "slurmd"), "-D"]
    env = t.env("/usr/bin:/bin")
    assert env["PATH"].split(":")[:2] == [str(prefix / "bin"), str(prefix / "sbin")]
    assert env["PATH"].endswith(":/usr/bin:/bin") and env[PREFIX_ENV] == str(prefix)


def test_client_runs_the_prefix_programs_for_real(tmp_path, monkeypatch):
    prefix = fake_prefix(tmp_path)
    monkeypatch.setenv(PREFIX_ENV, str(prefix))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    (tmp_path / "slurm.conf").write_text("# unused by the stand-in sinfo\n")
    s = Slurm.from_environment()
    assert s.tools.prefix == prefix
    assert s.version() == (99, 1, 2)
    out = s._read(["sinfo", "--version"])
    assert f"argv0={prefix}/bin/sinfo" in out
    # What the command (and a job sbatch would submit) sees: the prefix first on PATH.
    assert f"path={prefix}/bin:{prefix}/sbin:" in out and f"prefix={prefix}" in out


@pytest.mark.parametrize("setup,needle", [
    (lambda tmp: tmp / "nope", "no such directory"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "holds no bin/ directory"),
])
def test_bad_prefix_is_an_input_error(tmp_path, setup, needle):
    with pytest.raises(InputError) as ei:
        SlurmTools.for_prefix(setup(tmp_path))
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_missing_program_in_prefix_is_an_input_error(tmp_path):
    t = SlurmTools.for_prefix(fake_prefix(tmp_path, tools=("sinfo",)))
    with pytest.raises(InputError) as ei:
        t.exe("squeue")
    assert "squeue" in str(ei.value) and str(t.prefix) in str(ei.value)


def run_cli(args, env_extra=None, tmp_path=None):
    env = dict(os.environ)
    env.pop(PREFIX_ENV, None)
    env.update(env_extra or {})
    return subprocess.run(CLI + args, capture_output=True, text=True, env=env, timeout=60)


def test_cli_devcluster_bad_prefix_exit_2_one_line(tmp_path):
    r = run_cli(["devcluster", "up", "--state-dir", str(tmp_path / "dc"), "--slurm-prefix", str(tmp_path / "nope")])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --slurm-prefix:") and "no such directory" in lines[0]
    assert not (tmp_path / "dc" / "slurm.conf").exists()     # nothing half-done


def test_cli_devcluster_prefix_without_daemons_exit_2(tmp_path):
    prefix = fake_prefix(tmp_path, tools=("sinfo", "sbatch", "scontrol"))
    r = run_cli(["devcluster", "up", "--state-dir", str(tmp_path / "dc"), "--slurm-prefix", str(prefix)])
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert "lacks slurmctld, slurmd" in line
    assert not (tmp_path / "dc" / "slurm.conf").exists()


def test_cli_env_prefix_for_queries_exit_2(tmp_path):
    r = run_cli(["slurm", "version"], {PREFIX_ENV: str(tmp_path / "nope")})
    assert r.returncode == 2
    line, = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: {PREFIX_ENV}:") and "no such directory" in line


def test_dev_cluster_records_its_prefix(tmp_path):
    # The prefix a dev cluster was started with is read back by clients of its slurm.conf.
    dc = DevCluster(tmp_path / "dc")
    dc.state.mkdir()
    assert recorded_prefix(dc.conf_path) is None
    prefix = fake_prefix(tmp_path)
    dc._write_info({"config": {**DevClusterConfig(slurm_prefix=str(prefix)).__dict__}, "pids": {}})
    assert recorded_prefix(dc.conf_path) == str(prefix)
    assert dc.tools().prefix == prefix and dc.env()[PREFIX_ENV] == str(prefix)
