"""``clusterops health history``: a node's trend from the sweep database.

A plain click command (not a group) so the health group can attach it, and it also
works on its own (``python -m clusterops.cli.history``).
"""

from __future__ import annotations

import click

from clusterops.cli.common import echo_json, json_option


def _fmt_time(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))


@click.command("history")
@click.argument("node", required=False)
@click.option("--probe", help="Only this probe (e.g. check, matmul, fleet:matmul_tflops).")
@click.option("--since", help="Only rows newer than this: 30m, 12h, 7d, 2w or an ISO date.")
@click.option("--limit", type=int, default=30, show_default=True, help="At most this many rows (the newest).")
@click.option("--source", type=click.Choice(["all", "sweep", "check"]), default="all", show_default=True,
              help="Rows from sweeps, from the nodes' own health checks, or both.")
@click.option("--db", "db_path", metavar="PATH|URL",
              help="History database: a SQLite path or postgresql://user@host/db [default: "
                   "$CLUSTEROPS_SWEEP_DB, $CLUSTEROPS_HISTORY_DB, /var/lib/clusterops/sweep.db as root].")
@json_option
def history(node, probe, since, limit, source, db_path, as_json):
    """Show sweep and health-check history: with NODE, that node's results over time
    (with --probe, one probe's trend, e.g. its TFLOPS over the last 30 sweeps); without,
    each node's latest verdict."""
    from clusterops.errors import InputError
    from clusterops.history import History, default_target, parse_since, parse_target, sparkline, trend

    if limit is not None and limit < 1:
        raise InputError(f"--limit: must be at least 1, got {limit}")
    t0 = parse_since(since) if since else None
    target = parse_target(db_path if db_path else default_target())
    src = None if source == "all" else source
    with History.open(target, create=False) as h:
        if node is None and probe is None:
            rows = h.latest(since=t0, source=src)
        else:
            rows = h.rows(node=node, probe=probe, since=t0, limit=limit, source=src)
    values = [r.value for r in rows]
    summary = trend(values) if probe else None
    if as_json:
        out = {"db": target.display, "node": node, "probe": probe, "rows": [r.to_dict() for r in rows]}
        if summary is not None:
            out["trend"] = summary
        echo_json(out)
        return 0
    if not rows:
        click.echo("no history rows match")
        return 1 if node else 0
    from clusterops.textsafe import terminal

    for r in rows:
        # Every field is stored text (a probe's detail, an admin's node name): control
        # characters are shown escaped, never sent to the terminal.
        val = "" if r.value is None else f"{r.value:.4g}{(' ' + terminal(r.unit)) if r.unit else ''}"
        detail = f"  {terminal(r.detail)}" if r.detail else ""
        click.echo(f"{_fmt_time(r.time)}  {terminal(r.node):<12} {terminal(r.probe):<22} {terminal(r.status):<11} "
                   f"{val:<14} {terminal(r.source or 'sweep'):<6}{detail}")
    if summary and summary["n"]:
        click.echo(f"trend ({summary['n']} values): {sparkline(values)}  min {summary['min']:.4g}  "
                   f"median {summary['median']:.4g}  max {summary['max']:.4g}  last {summary['last']:.4g}")
    return 0


def main(argv=None) -> None:
    """Standalone entry (``python -m clusterops.cli.history``), with the same one-line
    errors and exit codes as under ``clusterops health``."""
    from clusterops.cli import run_command

    run_command(history, argv, "clusterops-history")


if __name__ == "__main__":
    main()
