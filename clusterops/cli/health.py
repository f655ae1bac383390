"""``clusterops health``: node health checks (thin layer over clusterops.health)."""

from __future__ import annotations

import os
import sys

import click

from clusterops.cli.common import echo_json, json_option
from clusterops.exitcodes import HealthCheck, epilog

profile_option = click.option(
    "--profile", "profile_name", default="fast", show_default=True, metavar="NAME|PATH",
    help="Built-in profile (fast, preflight, deep) or a YAML profile file.")
site_option = click.option(
    "--site-config", type=click.Path(dir_okay=False), default=None, metavar="FILE",
    help="Site overrides (profiles, GPU-model figures). Default: $CLUSTEROPS_HEALTH_SITE.")


@click.group()
def health() -> None:
    """Node health probes and checks.

    \b
    Profiles: fast (NVML, XID, host; for HealthCheckProgram), preflight (fast +
    torch-distributed test + quick matmul), deep (everything, DCGM, bandwidth sweep).
    """


@health.command(epilog=epilog(HealthCheck))
@profile_option
@site_option
@json_option
@click.option("--prometheus", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write a Prometheus textfile (node_exporter textfile collector), atomically.")
@click.option("--drain-on-fail", is_flag=True,
              help="Drain this node in Slurm with reason 'clusterops:health:<profile>: <probe>: <detail>' "
                   "when a probe fails (never for an error); resume it when a later check re-checks that "
                   "probe and it passes. Guarded: past the site's drain.max_drained_fraction of the "
                   "partition the node is left in service (exit 3).")
@click.option("--node", default=None, help="This node's Slurm name (default: $SLURMD_NODENAME, else short hostname).")
@click.option("--drain-timeout-s", type=float, default=20.0, show_default=True,
              help="Upper bound on the Slurm calls of --drain-on-fail.")
@click.option("--db", "db_target", default=None, metavar="PATH|URL",
              help="Record this check in the fleet history: postgresql://user@host/db or a SQLite path "
                   "[default: $CLUSTEROPS_HISTORY_DB, else the site config's history.db; none: not recorded]. "
                   "Through a bounded local spool: a database that is down never fails the check.")
def check(profile_name, site_config, as_json, prometheus, drain_on_fail, node, drain_timeout_s, db_target):
    """Run a health profile on this node."""
    from clusterops.health import format_table
    from clusterops.health.flow import CheckRequest, check_node

    out = check_node(CheckRequest(profile=profile_name, site_config=site_config, node=node,
                                  drain_on_fail=drain_on_fail, drain_timeout_s=drain_timeout_s, db=db_target,
                                  prometheus=prometheus),
                     warn=lambda m: click.echo(f"warning: {m}", err=True))
    slurm_line, stderr_line = out.notes(drain_on_fail)
    if as_json:
        echo_json(out.report)
    else:
        click.echo(format_table(out.report))
        if slurm_line:
            click.echo(slurm_line)
    if stderr_line:
        click.echo(stderr_line, err=True)
    if out.hung:
        # A probe thread is stuck (maybe in the kernel): do not wait for it at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(out.exit_code)
    return out.exit_code


@health.command()
@click.argument("name", required=False)
@site_option
@json_option
@click.option("--check", "check_path", default=None, metavar="FILE",
              help="Validate a profile or site-config FILE completely (its parents too) and run nothing.")
def profiles(name, site_config, as_json, check_path):
    """List the profiles, or show one profile's resolved values (with site overrides).

    \b
    With --check FILE: exit 0 and one line when FILE is a valid profile or site
    config; exit 2 and one line naming file, line and key when it is not.
    """
    from clusterops.health import builtin_profiles, load_profile
    from clusterops.health.flow import validate_file

    if check_path:
        if name:
            raise click.UsageError("give a profile NAME or --check FILE, not both")
        what = validate_file(check_path, site_config)
        if as_json:
            echo_json({"file": check_path, "kind": what, "ok": True})
        else:
            click.echo(f"{check_path}: ok ({what})")
        return 0
    names = [name] if name else builtin_profiles()
    resolved = [load_profile(n, site_config) for n in names]
    if as_json:
        echo_json([p.to_dict() for p in resolved] if not name else resolved[0].to_dict())
        return 0
    import yaml

    for p in resolved:
        if not name:
            click.echo(f"{p.name:<10} {p.description}  ({len(p.probes)} probes: {', '.join(p.probes)})")
            continue
        click.echo(yaml.safe_dump(p.to_dict(), sort_keys=False, default_flow_style=None).rstrip())
    return 0


@health.command()
@click.option("--result-dir", type=click.Path(file_okay=False), default=None,
              help="Directory shared by all ranks for their results "
                   "(default: $SLURM_SUBMIT_DIR/.clusterops-dist/<job>.<step>).")
@click.option("--timeout-s", type=float, default=60.0, show_default=True, help="Each rank's deadline.")
@click.option("--backend", type=click.Choice(["auto", "nccl", "gloo"]), default="auto", show_default=True)
@click.option("--size", "sizes", multiple=True, metavar="BYTES",
              help="All-reduce bandwidth payload (repeatable; K/M/G suffixes). None: no bandwidth test.")
@click.option("--warmup", type=int, default=5, show_default=True)
@click.option("--iters", type=int, default=20, show_default=True)
@click.option("--min-busbw-gbps", type=float, default=None, help="Fail below this busbw (GB/s).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
              help="Rank 0 also writes the JSON report here.")
def dist(result_dir, timeout_s, backend, sizes, warmup, iters, min_busbw_gbps, report_path):
    """torch-distributed test + all-reduce bandwidth, one task per node (or per GPU).

    \b
    Run under srun or torchrun, e.g.:
      srun --ntasks-per-node=1 clusterops health dist --size 256M
    Every rank checks init, all-reduce == world size and a barrier under a deadline;
    rank 0 prints the JSON report naming any rank/host that failed or did not answer.
    Exit 0 pass, 1 fail (rank 0 speaks for the whole test).
    """
    from clusterops.health.flow import dist_rank

    return dist_rank(result_dir=result_dir, sizes=sizes, timeout_s=timeout_s, backend=backend, warmup=warmup,
                     iters=iters, min_busbw_gbps=min_busbw_gbps, report_path=report_path)


@health.command()
@click.option("--report-dir", type=click.Path(file_okay=False), required=True,
              help="Where this task writes <role>.json (server.json, client.json).")
@click.option("--profile", default=None,
              help="Health profile (name or file) whose probes.ibbw settings to use. Default: the built-in defaults.")
@click.option("--site-config", default=None, type=click.Path(dir_okay=False),
              help="Health site config (default $CLUSTEROPS_HEALTH_SITE).")
@click.option("--peer", default=None, help="The server's address (client side). Default: $MASTER_ADDR.")
@click.option("--role", type=click.Choice(["server", "client"]), default=None,
              help="Default: server for $SLURM_PROCID 0, else client.")
@click.option("--device", default=None, help="Test this HCA only (e.g. mlx5_0). Default: every ACTIVE port.")
@click.option("--tcp-port", type=click.IntRange(1024, 65000), default=None, help="First rail's port [profile: 18515].")
@click.option("--size", "size", default=None, metavar="BYTES", help="Message size [profile: 1M].")
@click.option("--iters", type=click.IntRange(1, 10_000_000), default=None, help="[profile: 2000]")
@click.option("--timeout-s", type=click.FloatRange(min=1.0), default=None, help="Per rail [profile's timeout_s].")
@click.option("--gpudirect/--no-gpudirect", default=None,
              help="GPU memory buffers (--use_cuda) where the node has an NVIDIA GPU [profile].")
@click.option("--gpu", type=click.IntRange(0, 63), default=None, help="The GPU for --gpudirect [profile: 0].")
def ibbw(report_dir, profile, site_config, peer, role, device, tcp_port, size, iters, timeout_s, gpudirect, gpu):
    """ib_write_bw (perftest) between two nodes, one task per node, on every rail.

    \b
    Run as one step over two nodes, e.g.:
      srun --nodes=2 --ntasks-per-node=1 clusterops health ibbw --profile deep --report-dir out
    No ib_write_bw or no HCA: skip with the reason. Exit 0 unless fail or error.
    """
    from clusterops.health.flow import ibbw_rank

    doc = ibbw_rank(report_dir, profile=profile, site_config=site_config, size=size, peer=peer, role=role,
                    device=device, tcp_port=tcp_port, iters=iters, timeout_s=timeout_s, gpudirect=gpudirect,
                    gpu=gpu)
    click.echo(f"{doc['role']}: {doc['status']}: {doc['detail']}")
    return 1 if doc["status"] in ("fail", "error") else 0


@health.command("xid-ack")
@click.option("--state-file", type=click.Path(dir_okay=False), default=None,
              help="XID state file (default: the one the xid probe uses for this node).")
@click.option("--node", default=None)
def xid_ack(state_file, node):
    """Acknowledge open Xid failures after the GPU was reset (a reboot clears them by itself)."""
    from clusterops.health.flow import ack_xids

    n, path = ack_xids(state_file, node)
    click.echo(f"{n} open Xid event(s) acknowledged in {path}")
    return 0


# The sweep helper's history command lives in its own module when installed.
try:
    from clusterops.cli.history import history  # noqa: E402

    health.add_command(history)
except ImportError:
    pass
from clusterops.cli.quarantine import quarantine  # noqa: E402

health.add_command(quarantine)

