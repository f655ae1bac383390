"""CLI contract: every command has --help, errors are one line with the right exit code."""

import subprocess
import sys

import click
from click.testing import CliRunner

from clusterops.cli import cli


def walk(group, ctx, path):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield path + [name], cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, ctx, path + [name])


def test_every_command_has_help_and_a_description():
    runner = CliRunner()
    ctx = click.Context(cli)
    seen = []
    for path, cmd in walk(cli, ctx, []):
        assert cmd is not None, path
        r = runner.invoke(cli, path + ["--help"])
        assert r.exit_code == 0, (path, r.output)
        assert (cmd.help or cmd.short_help), f"{' '.join(path)} has no help text"
        seen.append(path[0])
    assert {"devcluster", "slurm"} <= set(seen)


def test_registered_modules_import():
    # Every name in the lazy map resolves to a click command once its module exists.
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        assert isinstance(cli.get_command(ctx, name), click.Command), name


def test_unknown_command_and_flag_exit_2_one_line():
    for args in (["nosuchcommand"], ["devcluster", "up", "--bogus"]):
        r = subprocess.run([sys.executable, "-m", "clusterops", *args], capture_output=True, text=True)
        assert r.returncode == 2
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("Error:")


def test_no_slurm_config_is_a_clear_error(tmp_path, monkeypatch):
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "missing.conf"), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "clusterops", "slurm", "nodes"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("Error:") and "Traceback" not in r.stderr


def test_import_is_light():
    code = ("import sys, clusterops, clusterops.cli; "
            "heavy = [m for m in ('torch', 'numpy', 'pynvml', 'paramiko', 'rich', 'prometheus_client', 'psycopg') "
            "if m in sys.modules]; "
            "print(heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "[]"
