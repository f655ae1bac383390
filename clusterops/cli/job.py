"""``clusterops job``: inspect supervised jobs."""

from __future__ import annotations

import click

from clusterops.cli.common import echo_json, json_option


@click.group()
def job():
    """Inspect supervised jobs (their timeline)."""


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
