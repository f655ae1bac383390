"""``clusterops health quarantine list|clear``: repeat offenders, listed and cleared by a person.

Under ``health`` because the quarantine is a health verdict on a node or GPU, next to
``health history`` that reads the same database; the logic is ``clusterops.quarantine``.
"""

from __future__ import annotations

import click

from clusterops.cli.common import echo_json, json_option

db_option = click.option("--db", "db_path", metavar="PATH|URL",
                         help="History database [default: $CLUSTEROPS_SWEEP_DB, $CLUSTEROPS_HISTORY_DB, "
                              "the default SQLite file].")
site_option = click.option("--site-config", default=None, metavar="FILE",
                           help="Site config with the quarantine: settings. Default: $CLUSTEROPS_HEALTH_SITE.")


@click.group("quarantine")
def quarantine() -> None:
    """Repeat offenders: nodes and GPUs blamed `quarantine.blames` times within
    `quarantine.window_s`, drained until a person clears them."""


@quarantine.command("list")
@db_option
@site_option
@json_option
def list_cmd(db_path, site_config, as_json):
    """List the nodes and GPUs that are repeat offenders now (and the nodes Slurm holds
    with a quarantine drain)."""
    from clusterops.quarantine import list_quarantine

    doc = list_quarantine(db_path, site_config)
    if as_json:
        echo_json(doc)
        return 0
    from clusterops.textsafe import terminal

    if not doc["offenders"] and not doc["drained"]:
        click.echo("no repeat offenders")
    for o in doc["offenders"]:
        subject = o["node"] if o["kind"] == "node" else f"{o['node']} GPU {o['gpu_uuid']}"
        click.echo(f"{terminal(subject):<30} {o['count']} blames ({', '.join(o['sources'])})")
    for n in doc["drained"]:
        click.echo(f"{terminal(n['node']):<30} drained: {terminal(n['reason'])}")
    return 0


@quarantine.command("clear")
@click.argument("node")
@click.option("--gpu", "gpu_uuid", default=None, metavar="UUID", help="Clear only this GPU's blames.")
@db_option
@site_option
@json_option
def clear_cmd(node, gpu_uuid, db_path, site_config, as_json):
    """Clear NODE's quarantine: its blames (only GPU UUID's with --gpu) stop counting, and
    its quarantine drain is lifted once it is no longer a repeat offender."""
    from clusterops.quarantine import clear

    doc = clear(node, gpu_uuid, db_path, site_config)
    if as_json:
        echo_json(doc)
    else:
        click.echo(f"{node}: {doc['cleared']} blame(s) cleared; slurm: {doc['slurm']}")
    return 0
