"""`clusterops devcluster`: a real multi-node Slurm cluster on this machine."""

from __future__ import annotations

import os

import click

from clusterops.cli.common import echo_json, json_option

STATE_DIR_HELP = "Where the cluster keeps its config, logs and state (env CLUSTEROPS_DEVCLUSTER_DIR)."


def _state_dir_option(f):
    from clusterops.devcluster import DEFAULT_STATE_DIR

    return click.option("--state-dir", type=click.Path(file_okay=False),
                        default=lambda: os.environ.get("CLUSTEROPS_DEVCLUSTER_DIR", DEFAULT_STATE_DIR),
                        show_default=DEFAULT_STATE_DIR, help=STATE_DIR_HELP)(f)


@click.group()
def devcluster() -> None:
    """Start, stop and inspect a dev cluster: munged, slurmctld and one `slurmd -N nodeK`
    per node, all on 127.0.0.1.

    After `up`, point Slurm's commands at it with the printed `export SLURM_CONF=...`
    (clusterops itself finds the default dev cluster on its own when this machine has no
    /etc/slurm/slurm.conf).
    """


@devcluster.command()
@click.option("--nodes", "nodes", type=int, default=4, show_default=True, help="Number of nodes (node1..nodeN).")
@click.option("--gpus-per-node", type=int, default=0, show_default=True, help="Counted GPUs (gres) per node.")
@click.option("--gpu-type", default=None, metavar="TYPE",
              help="Declare the GPUs with a gres type (gpu:TYPE:N), e.g. mi300x or h100.")
@click.option("--cpus-per-node", type=int, default=2, show_default=True, help="CPUs each node declares.")
@click.option("--port-base", type=int, default=None, help="slurmctld port; nodes use the next N ports [17000].")
@click.option("--slurm-prefix", metavar="DIR", default=None,
              help="Run Slurm from DIR/bin and DIR/sbin (e.g. /opt/slurm-25.11) instead of PATH "
                   "(env CLUSTEROPS_SLURM_PREFIX).")
@click.option("--topology", type=click.Choice(["tree", "block"]), default=None,
              help="A Slurm topology: topology/block (Slurm 23.11+) or topology/tree (a leaf switch per domain).")
@click.option("--domain", "domains", multiple=True, metavar="HOSTLIST",
              help="One topology domain (a block or a leaf switch), e.g. node[1,3]; repeat. "
                   "Default: consecutive pairs.")
@click.option("--restd", is_flag=True, default=False,
              help="Also run slurmrestd (JWT auth) on a UNIX socket and on 127.0.0.1 at the port after "
                   "the nodes'; prints CLUSTEROPS_SLURM_URL and CLUSTEROPS_SLURM_JWT_KEY.")
@click.option("--expedited-requeue", is_flag=True, default=False,
              help="SlurmctldParameters=enable_expedited_requeue (Slurm 25.11+): supervised jobs then get "
                   "--requeue=expedite.")
@_state_dir_option
@json_option
def up(nodes: int, gpus_per_node: int, gpu_type, cpus_per_node: int, port_base, slurm_prefix, topology, domains,
       restd: bool, expedited_requeue: bool, state_dir: str, as_json: bool) -> None:
    """Bring the cluster up and wait until every node is idle (idempotent).

    With --slurm-prefix the daemons and clients come from that installation; clusterops
    commands then find it on their own (the prefix is recorded in the state dir), and
    Slurm's own commands need the printed PATH. Another prefix than last time starts the
    controller from an empty state (a newer slurmctld refuses an older one's state).
    """
    from clusterops.devcluster import DEFAULT_PORT_BASE, DevCluster, DevClusterConfig
    from clusterops.slurm.tools import PREFIX_ENV, check_prefix

    source = "--slurm-prefix"
    if slurm_prefix is None and os.environ.get(PREFIX_ENV):
        slurm_prefix, source = os.environ[PREFIX_ENV], PREFIX_ENV
    if slurm_prefix is not None:
        slurm_prefix = str(check_prefix(slurm_prefix, source))
    cfg = DevClusterConfig(nodes=nodes, gpus_per_node=gpus_per_node, gpu_type=gpu_type, cpus_per_node=cpus_per_node,
                           port_base=port_base or DEFAULT_PORT_BASE, slurm_prefix=slurm_prefix,
                           topology=topology, domains=tuple(domains), restd=restd,
                           expedited_requeue=expedited_requeue)
    dc = DevCluster(state_dir)
    info = dc.up(cfg)
    if restd:
        info["restd"] = {**dc.restd_urls(), "jwt_key": str(dc.jwt_key)}
    if as_json:
        echo_json(info)
        return
    click.echo(f"dev cluster up: {cfg.nodes} nodes ({cfg.hostlist}), {cfg.gpus_per_node} GPUs/node, "
               f"state in {info['state_dir']}" + (f", Slurm from {slurm_prefix}" if slurm_prefix else ""))
    click.echo(f"export SLURM_CONF={info['slurm_conf']}")
    if slurm_prefix:
        click.echo(f"export PATH={slurm_prefix}/bin:$PATH")
    if restd:
        click.echo(f"export CLUSTEROPS_SLURM_URL={info['restd']['unix']}")
        click.echo(f"export CLUSTEROPS_SLURM_JWT_KEY={info['restd']['jwt_key']}")


@devcluster.command()
@_state_dir_option
@json_option
def down(state_dir: str, as_json: bool) -> None:
    """Stop every daemon and job process of the cluster."""
    from clusterops.devcluster import DevCluster

    pids = DevCluster(state_dir).down()
    if as_json:
        echo_json({"stopped_pids": pids})
    else:
        click.echo(f"dev cluster down ({len(pids)} processes stopped)")


@devcluster.command()
@_state_dir_option
@json_option
@click.pass_context
def status(ctx: click.Context, state_dir: str, as_json: bool) -> None:
    """Show daemons and node states. Exit 1 when the cluster is not running."""
    from clusterops.devcluster import DevCluster

    info = DevCluster(state_dir).status()
    if as_json:
        echo_json(info)
    else:
        click.echo(f"state dir: {info['state_dir']}  running: {'yes' if info['running'] else 'no'}")
        for name, d in sorted(info.get("daemons", {}).items()):
            click.echo(f"  {name:<16} pid {d['pid']:<8} {'alive' if d['alive'] else 'DEAD'}")
        for node, state in sorted(info.get("nodes", {}).items()):
            click.echo(f"  {node:<16} {state}")
    ctx.exit(0 if info["running"] else 1)
