"""`clusterops slurm`: the Slurm access layer from the command line.

Handy for scripts and for checking what clusterops sees: every query has --json.
Unknown jobs or nodes exit 1 with a one-line error; bad arguments exit 2.
"""

from __future__ import annotations

import click

from clusterops.cli.common import echo_json, json_option, slurm_client


@click.group()
def slurm() -> None:
    """Query and act on Slurm jobs and nodes through clusterops' Slurm layer."""


@slurm.command()
@json_option
def version(as_json: bool) -> None:
    """Print the Slurm version."""
    v = slurm_client().version()
    if as_json:
        echo_json({"version": list(v)})
    else:
        click.echo(".".join(str(x) for x in v))


@slurm.command()
@click.argument("job_ids", nargs=-1, type=int)
@json_option
def jobs(job_ids, as_json: bool) -> None:
    """List jobs (all, or JOB_IDS)."""
    found = slurm_client().jobs(job_ids or None)
    if as_json:
        echo_json([j.to_dict() for j in found])
        return
    for j in found:
        click.echo(f"{j.job_id:<8} {j.name[:20]:<20} {j.state:<12} {j.category:<8} "
                   f"restarts={j.restart_count} nodes={j.nodes or '-'} reason={j.reason or '-'}")


@slurm.command()
@click.argument("job_id")
@json_option
def job(job_id: str, as_json: bool) -> None:
    """Describe one job."""
    j = slurm_client().job(job_id)
    if as_json:
        echo_json(j.to_dict())
        return
    for k, v in j.to_dict().items():
        click.echo(f"{k:<16} {v}")


@slurm.command()
@click.argument("names", required=False)
@json_option
def nodes(names, as_json: bool) -> None:
    """List nodes (all, or a hostlist such as node[1-3])."""
    found = slurm_client().nodes(names)
    if as_json:
        echo_json([n.to_dict() for n in found])
        return
    for n in found:
        flags = "+".join(sorted(n.flags)) or "-"
        who = f" [{n.reason_user}]" if n.reason_user else ""
        click.echo(f"{n.name:<12} {n.state:<10} {flags:<20} {n.reason or ''}{who}")


@slurm.command()
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("sbatch_args", nargs=-1)
@json_option
def submit(script: str, sbatch_args, as_json: bool) -> None:
    """Submit SCRIPT with extra sbatch arguments (after --); prints the job id."""
    jid = slurm_client().submit(script, list(sbatch_args))
    echo_json({"job_id": jid}) if as_json else click.echo(jid)


def _job_action(name: str, doc: str):
    @slurm.command(name=name, help=doc)
    @click.argument("job_id")
    def cmd(job_id: str) -> None:
        getattr(slurm_client(), name)(job_id)
        click.echo(f"{name}: {job_id}")

    return cmd


for _name, _doc in (("requeue", "Requeue a job."), ("hold", "Hold a pending job."),
                    ("release", "Release a held job.")):
    _job_action(_name, _doc)


@slurm.command()
@click.argument("job_id")
@click.option("--signal", "sig", default=None, help="Send this signal instead of ending the job.")
@click.option("--batch", is_flag=True, help="Only the batch shell.")
@click.option("--full", is_flag=True, help="The batch shell and every step.")
@click.option("--step", type=int, default=None, help="Only this step.")
def cancel(job_id: str, sig, batch: bool, full: bool, step) -> None:
    """Cancel a job, or signal it (scancel)."""
    slurm_client().cancel(job_id, signal=sig, batch=batch, full=full, step=step)


@slurm.command()
@click.argument("job_id")
@click.argument("fields", nargs=-1, required=True)
def update(job_id: str, fields) -> None:
    """Update a job: FIELDS are Key=Value (e.g. ExcNodeList=node3 TimeLimit=30)."""
    from clusterops.errors import InputError

    kv = {}
    for f in fields:
        if "=" not in f:
            raise InputError(f"field {f!r}: expected Key=Value")
        k, v = f.split("=", 1)
        kv[k] = v
    slurm_client().update_job(job_id, **kv)


@slurm.command()
@click.argument("nodes")
@click.option("--reason", required=True, help="Why; written as 'clusterops:admin: <reason>'.")
def drain(nodes: str, reason: str) -> None:
    """Drain NODES with an administrator's clusterops reason.

    Checks and sweeps never lift such a drain; `clusterops slurm resume` does.
    """
    from clusterops import drains

    text = reason.strip()
    if text.startswith(drains.PREFIX):
        text = text[len(drains.PREFIX):].strip()
    if not text:
        from clusterops.errors import InputError

        raise InputError("--reason: say why the nodes are drained")
    reason = drains.make_reason(drains.ADMIN, text)
    slurm_client().drain(nodes, reason)
    click.echo(f"drained {nodes}: {reason}")


@slurm.command()
@click.argument("nodes")
def resume(nodes: str) -> None:
    """Resume NODES that clusterops drained (any origin: this is the administrator's lift).

    A node drained by someone else (a reason not starting 'clusterops:') is refused and
    nothing is resumed; resume such nodes with scontrol.
    """
    slurm_client().resume(nodes)
    click.echo(f"resumed {nodes}")
