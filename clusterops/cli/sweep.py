"""``clusterops sweep``: the fleet health sweep, made for cron."""

from __future__ import annotations

import shlex
import signal
import sys

import click

from clusterops.cli.common import echo_json, json_option
from clusterops.exitcodes import Sweep, epilog


class _Progress:
    """A rich progress bar on a terminal, plain lines otherwise (cron mail, logs)."""

    def __init__(self, live: bool, quiet: bool):
        self.live = live
        self.quiet = quiet
        self.total = 0
        self.done = 0
        self.failed = 0
        self.bar = None
        self.task = None
        import threading

        self.lock = threading.Lock()

    def targets(self, n: int) -> None:
        self.total = n
        if self.live and not self.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("[red]{task.fields[failed]} failed[/red]"),
                                TextColumn("{task.fields[left]} remaining"), TimeElapsedColumn(),
                                transient=True, console=_console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task("sweep", total=n, failed=0, left=n)
        elif not self.quiet:
            click.echo(f"sweep: {n} target nodes", err=True)

    def result(self, r) -> None:
        # Called from the sweep's worker threads too.
        with self.lock:
            self.done += 1
            if r.failing or r.status == "error":
                self.failed += 1
            if self.bar is not None:
                self.bar.update(self.task, advance=1, failed=self.failed, left=self.total - self.done)
            elif not self.quiet:
                extra = f" ({r.detail})" if r.detail else ""
                click.echo(f"[{self.done}/{self.total}] {r.node}: {r.status}{extra}", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _summary(doc: dict) -> None:
    from rich.table import Table

    counts = doc["counts"]
    table = Table(title=f"sweep {doc['sweep_id']} ({doc['duration_s']:.1f} s)", show_lines=False)
    for col in ("node", "status", "detail", "check s", "TFLOPS", "busbw", "action"):
        table.add_column(col)
    applied = {a["node"]: a["action"] for a in doc["applied"]}
    planned = {a["node"]: a["action"] for a in (doc["plan"] or {}).get("actions", [])}
    colors = {"pass": "green", "warn": "yellow", "fail": "red", "unreachable": "red", "error": "magenta",
              "skipped": "dim"}
    for n in doc["nodes"]:
        m = n.get("metrics") or {}
        action = applied.get(n["node"]) or (f"(would {planned[n['node']]})"
                                            if planned.get(n["node"]) in ("drain", "resume") else "")
        status = n["status"] + (" straggler" if n.get("stragglers") else "")
        table.add_row(n["node"], f"[{colors.get(n['status'], '')}]{status}[/]", n.get("detail") or "",
                      "" if n.get("duration_s") is None else f"{n['duration_s']:.2f}",
                      f"{m['matmul_tflops']:.4g}" if "matmul_tflops" in m else "",
                      f"{m['busbw_gbps']:.4g}" if "busbw_gbps" in m else "", action)
    con = _console()
    con.print(table)
    con.print(" ".join(f"{k}={v}" for k, v in counts.items()) + f"  check CPU {doc['check_cpu_s']:.1f} s",
              soft_wrap=True)


@click.command("sweep", epilog=epilog(Sweep))
@click.option("--partition", "-p", help="Sweep the nodes of this partition.")
@click.option("--nodes", "-w", "nodes", metavar="HOSTLIST", help="Sweep these nodes (e.g. gpu[001-128]).")
@click.option("--profile", default="fast", show_default=True, help="Health profile name or YAML file.")
@click.option("--via", type=click.Choice(["slurm", "ssh"]), default="slurm", show_default=True,
              help="Run checks as Slurm jobs (idle nodes only) or over SSH.")
@click.option("--concurrency", type=int, default=32, show_default=True,
              help="Parallel SSH sessions / parallel sbatch calls.")
@click.option("--max-running", type=int, default=0, show_default=True,
              help="Slurm: at most this many check jobs in flight (0: every node at once). Set it when "
                   "many nodes share one host (the dev cluster).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Seconds a node's check may take (Slurm: from submission) before it is unreachable.")
@click.option("--drain", is_flag=True, help="Drain failing nodes, resume clusterops-drained nodes that pass.")
@click.option("--max-drain-fraction", type=float, default=0.1, show_default=True,
              help="Safety guard: drain none if more than this fraction of swept nodes would go.")
@click.option("--flap-k", type=int, default=3, show_default=True, help="Flapping: failed in K ...")
@click.option("--flap-n", type=int, default=5, show_default=True, help="... of the last N sweeps.")
@click.option("--straggler-tolerance", type=float, default=0.10, show_default=True,
              help="A node below (1 - T) x the fleet median TFLOPS/busbw is a straggler.")
@click.option("--drain-stragglers", is_flag=True, help="Drain stragglers too (needs --drain).")
@click.option("--dry-run", is_flag=True, help="Check and print the plan; change no node.")
@click.option("--pairs", is_flag=True, help="Also a 2-node all-reduce on pairs of healthy nodes (Slurm).")
@json_option
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Write a self-contained HTML report.")
@click.option("--prometheus", "prom_path", type=click.Path(dir_okay=False),
              help="Write a node_exporter textfile (atomically).")
@click.option("--db", "db_path", metavar="PATH|URL",
              help="History database: a SQLite path or postgresql://user@host/db [default: $CLUSTEROPS_SWEEP_DB, "
                   "$CLUSTEROPS_HISTORY_DB, /var/lib/clusterops/sweep.db as root].")
@click.option("--no-history", is_flag=True, help="Do not read or write the history database.")
@click.option("--retention-days", type=float, default=90.0, show_default=True, help="Prune history older than this.")
@click.option("--work-dir", type=click.Path(file_okay=False),
              help="Where check jobs write results (Slurm; must be shared with the nodes).")
@click.option("--keep-work-dir", is_flag=True, help="Keep the check jobs' result files (debugging).")
@click.option("--check-cmd", help="Command replacing `clusterops health check --json` (shell-split; "
                                  "--profile is appended).")
@click.option("--accept-new-hosts", is_flag=True, help="SSH: accept and record unknown host keys.")
@click.option("--ssh-config", type=click.Path(dir_okay=False), help="SSH client config [~/.ssh/config].")
@click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file [~/.ssh/known_hosts].")
@click.option("--ssh-key", type=click.Path(dir_okay=False), help="Private key for SSH.")
@click.option("--ssh-user", help="SSH user [from config, else current user].")
@click.option("--ssh-port", type=int, help="SSH port [from config, else 22].")
@click.option("--connect-timeout", "connect_timeout_s", type=float, default=10.0, show_default=True,
              help="SSH: seconds for TCP connect and handshake.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--notify-config", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="YAML whose notify: list names webhooks told of drains, resumes, guard trips and a sweep that "
                   "could not run [default: the health site config, $CLUSTEROPS_HEALTH_SITE].")
def sweep(partition, nodes, profile, via, concurrency, max_running, timeout_s, drain, max_drain_fraction, flap_k, flap_n,
          straggler_tolerance, drain_stragglers, dry_run, pairs, as_json, report_path, prom_path, db_path,
          no_history, retention_days, work_dir, keep_work_dir, check_cmd, accept_new_hosts, ssh_config, known_hosts,
          ssh_key, ssh_user, ssh_port, connect_timeout_s, quiet, notify_config):
    """Health-check a fleet of nodes; optionally drain the bad and resume the recovered.

    Via Slurm (default) each idle node gets a short exclusive job pinned to it that runs
    `clusterops health check --json`; busy nodes are skipped and listed, never disturbed;
    nodes drained by clusterops are rechecked inside a maintenance reservation. A check
    that does not come back within --timeout makes its node `unreachable`, never healthy.

    Every argument is checked (flags, hostlist, profile, output paths) before
    Slurm is asked anything or any node is touched; a bad one is exit 2.
    """
    from clusterops import sweep as sw
    from clusterops.errors import InputError
    from clusterops.sweep.session import SweepSession

    if check_cmd is not None:
        try:
            check_argv = shlex.split(check_cmd)
        except ValueError as e:
            raise InputError(f"--check-cmd: cannot split {check_cmd!r}: {e}") from None
    else:
        check_argv = None
    opts = sw.SweepOptions(
        partition=partition, nodes=nodes, profile=profile, via=via, concurrency=concurrency, max_running=max_running, drain=drain,
        max_drain_fraction=max_drain_fraction, dry_run=dry_run, timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s, pairs=pairs, flap_k=flap_k, flap_n=flap_n,
        straggler_tolerance=straggler_tolerance, drain_stragglers=drain_stragglers,
        check_cmd=check_argv, work_dir=work_dir, keep_work_dir=keep_work_dir,
        accept_new_hosts=accept_new_hosts, ssh_config=ssh_config, known_hosts=known_hosts, ssh_key=ssh_key,
        ssh_user=ssh_user, ssh_port=ssh_port)
    session = SweepSession(opts, db=db_path, no_history=no_history, retention_days=retention_days,
                           report_path=report_path, prom_path=prom_path, notify_config=notify_config,
                           warn=lambda m: click.echo(f"warning: {m}", err=True))
    signal.signal(signal.SIGTERM, _terminate)
    outcome = session.run(_Progress(live=sys.stderr.isatty() and not as_json, quiet=quiet))
    if outcome.locked:
        click.echo(f"Error: {outcome.locked}", err=True)
        return outcome.exit_code
    doc = outcome.doc
    if as_json:
        echo_json(doc)
    else:
        _summary(doc)
        plan = outcome.report.plan
        if plan is not None:
            verb = "would " if (dry_run or not drain) else ""
            for a in plan.actions:
                if a.action in ("drain", "resume"):
                    click.echo(f"{verb}{a.action} {a.node}: {a.reason or a.why}")
    for e in outcome.report.errors:
        click.echo(f"warning: {e}", err=True)
    if outcome.guard_message:
        # Loud, on stderr, where cron mail and journald will show it.
        bar = "!" * 78
        click.echo(f"{bar}\n{outcome.guard_message}\n{bar}", err=True)
    if outcome.write_errors:
        click.echo(f"Error: {'; '.join(outcome.write_errors)}", err=True)
    return outcome.exit_code


def _terminate(signum, frame):
    # systemd stops a unit with SIGTERM: unwind, so check jobs are cancelled, drains
    # put back and the reservation deleted.
    raise SystemExit(128 + signum)
