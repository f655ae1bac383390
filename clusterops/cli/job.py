"""``clusterops job``: inspect supervised jobs."""

from __future__ import annotations

import click

from clusterops.cli.common import echo_json, json_option


@click.group()
def job():
    """Inspect supervised jobs: by their Slurm job id (ls, status, watch) or their directory (timeline);
    watch without an id checks every job once (for cron)."""


@job.command("ls")
@click.option("--all", "all_users", is_flag=True, help="Every user's supervised jobs (root or a Slurm administrator).")
@json_option
def ls(all_users, as_json):
    """List your supervised jobs: those Slurm knows and those your submissions recorded.

    One line a job: id, state, step, restarts, goodput, job directory. Exit 0; 2 for --all
    without the right to see other users' jobs.
    """
    from clusterops import jobs

    found = jobs.list_jobs(all_users=all_users)
    if as_json:
        echo_json({"jobs": [st.to_dict() for st in found]})
        return
    from clusterops.textsafe import terminal

    if not found:
        click.echo("no supervised jobs")
    for st in found:
        gp = f"{st.goodput:.0%}" if st.goodput is not None else "-"
        click.echo(terminal(f"{st.job_id:>8}  {st.state:<11} step {st.step if st.step is not None else '-':>6}  "
                            f"restarts {st.restarts}  requeues {st.requeues}  goodput {gp:>4}  {st.job_dir}"))


@job.command()
@click.argument("job_id")
@json_option
def status(job_id, as_json):
    """Show a supervised job by its Slurm JOB_ID.

    State, step and steps per second, time left and the end, restarts and why, goodput, the
    latest good checkpoint, the nodes dropped. The job directory is found from what the
    submission recorded, else from the job's script as Slurm shows it. Exit 0; 2 when JOB_ID
    is not a supervised job, or is another user's and you are no administrator.
    """
    from clusterops import jobs
    from clusterops.textsafe import terminal

    st = jobs.status(job_id)
    if as_json:
        echo_json(st.to_dict())
        return
    for line in jobs.describe_status(st):
        click.echo(terminal(line))


@job.command()
@click.argument("job_id", required=False)
@json_option
@click.option("--interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between polls.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="Without JOB_ID: flag a job with more restarts and requeues than this within --window-s.")
@click.option("--window-s", type=click.FloatRange(min=1), default=3600.0, show_default=True,
              help="Without JOB_ID: the window of --max-restarts, in seconds.")
@click.option("--stall-s", type=click.FloatRange(min=1), default=None,
              help="Without JOB_ID: flag a running job whose latest good checkpoint is older than this.")
@click.option("--cancel", is_flag=True, help="Without JOB_ID: cancel each flagged job (a chain: all of it).")
@click.option("--notify-config", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Without JOB_ID: YAML whose notify: list names the webhooks told of each flag (job_flagged).")
@click.option("--prometheus", "prom_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Without JOB_ID: write the flags as a Prometheus textfile, atomically.")
def watch(job_id, as_json, interval, max_restarts, window_s, stall_s, cancel, notify_config, prom_path):
    """Follow a supervised job until it ends; without JOB_ID, check every supervised job once (cron).

    With JOB_ID: its events as they come, and its progress. On a terminal, a live progress
    line under the events; piped, plain lines (or one JSON object a line with --json:
    {"event": ...} records and {"status": ...}). Exit 0 when the job completed, 1 when it
    ended otherwise, 2 when JOB_ID is not a supervised job.

    Without JOB_ID: one pass over the supervised jobs and chains Slurm knows (every user's for
    root or a Slurm administrator, else yours), flagging restart storms (--max-restarts in
    --window-s), stalled runs (--stall-s) and chains with no generation queued although
    training has not finished; a line (or --json object) per flag, a webhook event each, the
    --prometheus textfile, and --cancel. Exit 0 when nothing was flagged, 1 when something
    was, 2 on a usage error.
    """
    import sys
    import time

    cron = (max_restarts, stall_s, notify_config, prom_path)
    if job_id is None:
        _watch_all(max_restarts, window_s, stall_s, cancel, notify_config, prom_path, as_json)
        return
    if any(v is not None for v in cron) or cancel:
        raise click.UsageError("--max-restarts, --stall-s, --cancel, --notify-config and --prometheus "
                               "check every job: give them without JOB_ID")

    from clusterops import jobs
    from clusterops.jsonout import dumps
    from clusterops.supervisor import timeline as tl
    from clusterops.textsafe import terminal

    live = sys.stdout.isatty() and not as_json
    state = {"line": ""}

    def emit(kind, value):
        if as_json:
            click.echo(dumps({kind: value if kind == "event" else value.to_dict()}))
            return
        if kind == "event":
            if value.get("event") == tl.E.PROGRESS:
                return
            if live and state["line"]:
                click.echo("\r\033[K", nl=False)
            stamp = time.strftime("%H:%M:%S", time.gmtime(value.get("t") or 0))
            click.echo(f"{stamp} {terminal(tl.describe(value))}")
            if live and state["line"]:
                click.echo(state["line"], nl=False)
        else:
            rate = f"{value.steps_per_s:.2f}/s" if value.steps_per_s is not None else "?/s"
            line = terminal(f"[{value.state}] step {value.step if value.step is not None else '?'} ({rate}), "
                            f"restarts {value.restarts}" + (f", left {int(value.time_left_s)} s"
                                                           if value.time_left_s is not None else ""))
            if live:
                state["line"] = line
                click.echo("\r\033[K" + line, nl=False)
            elif line != state["line"]:
                state["line"] = line
                click.echo(line)

    st = jobs.watch(job_id, emit, poll_s=interval)
    if live:
        click.echo("")
    if not as_json:
        click.echo(terminal(f"job {st.job_id} ended: {st.state}" + (f", {st.outcome}" if st.outcome else "")))
    sys.exit(0 if st.state == "COMPLETED" else 1)


def _watch_all(max_restarts, window_s, stall_s, cancel, notify_config, prom_path, as_json):
    import sys
    import time

    from clusterops import jobwatch, notify
    from clusterops.textsafe import terminal

    targets = notify.load_config(notify_config) if notify_config else []
    rules = jobwatch.Rules(max_restarts=max_restarts, window_s=window_s, stall_s=stall_s)
    now = time.time()
    found = jobwatch.scan(rules, cancel=cancel, now=now)
    failed = jobwatch.notify(found, targets)
    docs = [f.to_dict() for f in found]
    if prom_path:
        jobwatch.metrics(docs, when=now).write_textfile(prom_path)
    if as_json:
        echo_json({"flagged": docs, "notify_failed": [d.to_dict() for d in failed]})
    else:
        for f in found:
            click.echo(terminal(f"{f.job_id:>8}  {f.user or '?':<10} {f.flag:<14} {f.detail}"
                                + ({True: " (cancelled)", False: " (cancel failed)"}.get(f.cancelled, ""))))
        for d in failed:
            click.echo(terminal(f"notify: {d.error}"), err=True)
    sys.exit(1 if found else 0)


@job.command()
@click.argument("job_dir", type=click.Path())
@json_option
@click.option("--chart", type=click.Path(dir_okay=False),
              help="Also write a self-contained chart: FILE.svg, or FILE.html (chart + event table).")
@click.option("--progress", is_flag=True, help="Include the periodic step samples in the text output.")
@click.option("--prometheus", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write the job's metrics (restarts, requeues, goodput, outcome) as a Prometheus "
                   "textfile, atomically.")
@click.option("--job-label", default=None, help="The job label of --prometheus [default: the job id, else JOB_DIR's name].")
def timeline(job_dir, as_json, chart, progress, prometheus, job_label):
    """Print the timeline of a supervised job (JOB_DIR/timeline.jsonl).

    Every event and decision of every incarnation: preflight, launch, heartbeat lost,
    failures with their classification, restarts, nodes dropped, checkpoints, stop
    requests, requeues, give-up. Lines that cannot be read (torn by a crash mid-write,
    garbage) are skipped, counted and named on stderr ("skipped_lines" with --json).
    Exit 0; 2 when JOB_DIR holds no timeline.
    """
    from clusterops.supervisor import timeline as tl

    records, skipped = tl.load(job_dir)
    if chart:
        tl.write_chart(records, chart, title=f"supervised job {job_dir}")
    if prometheus:
        import os

        ids = [r.get("job_id") for r in records if r.get("job_id")]
        label = job_label or (str(ids[-1]) if ids else os.path.basename(os.path.abspath(job_dir)))
        tl.job_metrics(records, label).write_textfile(prometheus)
    if skipped:
        shown = ", ".join(f"{n} ({why})" for n, why in skipped[:10]) + (" ..." if len(skipped) > 10 else "")
        click.echo(f"warning: {tl.timeline_path(job_dir)}: skipped {len(skipped)} unreadable line(s): {shown}",
                   err=True)
    summary = dict(tl.summary(records), skipped_lines=len(skipped), goodput=tl.goodput_report(records))
    if as_json:
        echo_json({"records": records, "summary": summary,
                   "skipped_lines": [{"line": n, "why": why} for n, why in skipped]})
        return
    from clusterops.textsafe import terminal

    click.echo(tl.format_text(records, progress=progress))   # each line escaped (stored text)
    s = summary
    click.echo(terminal(f"-- {s['launches']} launch(es), {s['restarts']} restart(s), {s['requeues']} requeue(s); "
               f"outcome: {s['outcome'] or 'running'}"
               + (f" (exit {s['exit_code']})" if s["exit_code"] is not None else "")
               + (f"; {len(s['stragglers'])} straggler(s): "
                  + ", ".join(f"{x['node']} ({x['action']})" for x in s["stragglers"]) if s["stragglers"] else "")
               + (f"; {len(skipped)} unreadable line(s) skipped" if skipped else "")
               + (f"; chart: {chart}" if chart else "")))
    if s["goodput"] is not None:
        click.echo(terminal(tl.format_goodput(s["goodput"]), multiline=True))
