"""The ``clusterops`` command: a thin click layer over the library.

Subcommand groups live in their own modules and are imported only when they are
invoked (or listed in --help), so ``clusterops --help`` stays fast: no torch, no
rich, no pynvml at start. Library errors become a one-line ``Error:`` and the exit
code they carry (see clusterops.errors).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

import click

from clusterops import __version__
from clusterops.exitcodes import Common, epilog

# name -> "module:attribute"; each module owns its command group.
COMMANDS = {
    "ckpt": "clusterops.cli.ckpt:ckpt",
    "deploy": "clusterops.cli.deploy:deploy",
    "devcluster": "clusterops.cli.devcluster:devcluster",
    "health": "clusterops.cli.health:health",
    "job": "clusterops.cli.job:job",
    "launch": "clusterops.cli.launch:launch",
    "slurm": "clusterops.cli.slurmcmd:slurm",
    "supervise": "clusterops.cli.supervise:supervise",
    "sweep": "clusterops.cli.sweep:sweep",
}

SHORT_HELP = {
    "ckpt": "List, verify, prune and shrink checkpoints.",
    "deploy": "Write the Slurm, cron, systemd and monitoring files for a site.",
    "devcluster": "Run a real multi-node Slurm cluster on this machine.",
    "health": "Node health probes and checks.",
    "job": "Inspect supervised jobs (timeline).",
    "launch": "Render and submit sbatch scripts from a YAML job spec.",
    "slurm": "Query and act on Slurm jobs and nodes.",
    "supervise": "Run and heal a training step inside a Slurm allocation.",
    "sweep": "Sweep a fleet of nodes with health checks (for cron).",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(n for n in COMMANDS if _available(n))

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                return None
            raise
        return getattr(mod, attr)

    def format_commands(self, ctx, formatter):
        # Short help without importing every subcommand module.
        rows = [(n, SHORT_HELP.get(n, "")) for n in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _available(name: str) -> bool:
    module = COMMANDS[name].split(":")[0]
    return importlib.util.find_spec(module) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=epilog(Common))
@click.version_option(__version__, prog_name="clusterops")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv: debug, shows every command run).")
def cli(verbose: int) -> None:
    """clusterops: Slurm cluster operations for large-scale PyTorch training."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv=None) -> None:
    run_command(cli, argv, "clusterops")


# Control characters and everything str.splitlines() breaks on, escaped so that an error
# message naming a hostile key or value ("a\rb", "x\u2028y") stays one line.
_ONE_LINE = {c: f"\\x{c:02x}" for c in range(32)}
_ONE_LINE.update({0x7F: "\\x7f", 0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def one_line(message: str) -> str:
    """``message`` on one line (control characters and line separators escaped)."""
    return str(message).translate(_ONE_LINE)


def run_command(command: click.Command, argv=None, prog_name: str = "clusterops") -> None:
    """Run a click command with clusterops' error contract: one-line ``Error:`` messages and
    the exit code each error carries (2 for usage errors)."""
    from clusterops.errors import ClusteropsError

    try:
        # standalone_mode=False hands back ctx.exit(code) or a command's int return value.
        rv = command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.UsageError as e:
        # One line, naming the command to ask for help (exit 2).
        cmd = e.ctx.command_path if e.ctx else prog_name
        click.echo(f"Error: {one_line(e.format_message())} (see '{cmd} --help')", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"Error: {one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    except ClusteropsError as e:
        click.echo(f"Error: {one_line(e.message)}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # Output piped into `head`; quiet exit.
        os._exit(0)
    sys.exit(rv if isinstance(rv, int) else 0)
