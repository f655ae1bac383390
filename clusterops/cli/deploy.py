"""``clusterops deploy``: write the Slurm-side and monitoring files for a site."""

from __future__ import annotations

import click

from clusterops.cli.common import echo_json, json_option
from clusterops.exitcodes import Deploy, epilog

EXIT_HELP = epilog(Deploy)


@click.group()
def deploy() -> None:
    """Files a site installs around clusterops (Slurm, cron, systemd, Grafana, Prometheus)."""


@deploy.command("files", epilog=EXIT_HELP)
@click.option("--prefix", default=None, metavar="DIR",
              help="Where clusterops is installed (DIR/bin/clusterops). Default: this install's own.")
@click.option("--out", required=True, metavar="DIR", help="Write the files here (new or empty, unless --force).")
@click.option("--force", is_flag=True, help="Write into a non-empty DIR, replacing the files deploy writes.")
@json_option
def files(prefix, out, force, as_json) -> None:
    """Write the HealthCheckProgram wrapper, prolog/epilog, slurm.conf lines, the sweep's cron
    entry and systemd service/timer, the Grafana dashboard and the Prometheus alert rules into
    --out, with this install's paths filled in. DIR/README says where each file goes."""
    from clusterops.deploy import write_files

    written = write_files(out=out, prefix=prefix, force=force)
    if as_json:
        echo_json({"files": [w.to_dict() for w in written]})
        return
    for w in written:
        click.echo(f"{w.path}  ({w.install})")
