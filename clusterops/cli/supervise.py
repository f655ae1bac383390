"""``clusterops supervise``: run and heal a training step inside a Slurm allocation.

Its settings come from ``--spec-file`` or ``--spec-json`` (the resolved job spec) and from flags that override
it; there is one flag per ``supervise:`` key and Policy field, made from the table in
``clusterops.schema`` (names, types, bounds, defaults and help text). The command parses
them, makes one call (``clusterops.supervisor.config.run_config``: spec + flags -> RunConfig)
and runs it.
"""

from __future__ import annotations

import click

from clusterops import schema
from clusterops.exitcodes import Supervise, epilog

EXIT_HELP = epilog(Supervise)

#: The stop signals the batch script noted while its setup ran (comma-separated names),
#: written by templates/base.sh.j2 just before it execs this command.
EARLY_SIGNALS_ENV = "CLUSTEROPS_EARLY_SIGNALS"


def hold_stop_signals() -> list:
    """Catch the lead-time SIGUSR1 and SIGTERM from here on, before the heavy imports.

    The batch script ignores both from just before its ``exec`` (an ignored signal stays
    ignored across exec), so one that comes while Python starts is lost, not fatal; from
    here it is kept, with those the script noted (``$CLUSTEROPS_EARLY_SIGNALS``, taken out
    of the environment so the ranks do not inherit it), for the run to take over
    (``SupervisorRun.install_signals``). Returns the list the handlers append to."""
    import os
    import signal

    names = {"USR1": signal.SIGUSR1, "TERM": signal.SIGTERM}
    got = [names[n] for n in (os.environ.pop(EARLY_SIGNALS_ENV, "") or "").split(",") if n in names]
    for sig in names.values():
        signal.signal(sig, lambda signum, frame: got.append(signum))
    return got


def _setting_option(f: schema.Field):
    """The click option of one supervise key / Policy field, from the table."""
    names = schema.cli_flags(f)
    default = schema.default_doc(f)
    text = (f.doc + (f" (default {default})" if default else "")).replace("`", "")
    if f.kind == "bool":
        return click.option(f"{names[0]}/--no-{names[0][2:]}", f.name, default=None, help=text)
    types = {
        "int": lambda: click.IntRange(None if f.min is None else int(f.min), None if f.max is None else int(f.max)),
        "number": lambda: click.FloatRange(f.min, f.max, min_open=f.gt),
        "path": lambda: click.Path(file_okay=False),
        "profile": lambda: click.STRING,
        "str": lambda: click.STRING,
        "list": lambda: click.STRING,   # JSON, e.g. '["--resume", "{ckpt}"]'
        "map": lambda: click.STRING,    # JSON, e.g. '{"regex": "step=(\\d+)"}'
        "exitcodes": lambda: click.STRING,   # JSON, e.g. '{"42": "requeue"}'
        "trackers": lambda: click.STRING,    # JSON, e.g. '[{"kind": "tensorboard"}]'
    }
    if f.kind in ("list", "map", "exitcodes", "trackers"):
        text += " (JSON)"
    return click.option(*names, f.name, type=types[f.kind](), default=None, help=text)


def _settings_options(command):
    """Every supervise key and Policy field becomes a flag (the table's order, top down)."""
    for f in reversed(schema.SUPERVISE.fields + schema.POLICY_ONLY):
        command = _setting_option(f)(command)
    return command


@click.command(context_settings={"ignore_unknown_options": False}, epilog=EXIT_HELP)
@click.option("--spec-json", help="The resolved job spec as JSON (what `clusterops launch render` puts on "
                                   "the script's last line when it writes to standard output).")
@click.option("--spec-file", type=click.Path(dir_okay=False),
              help="A file holding the resolved job spec as JSON (what `clusterops launch submit` and "
                   "`render -o` write beside the script).")
@_settings_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def supervise(spec_json, spec_file, command, **settings):
    """Run the training COMMAND (after --) on the allocation's nodes and heal it.

    Runs inside a Slurm batch job (the script rendered by `clusterops launch` with a
    `supervise:` section ends with `exec clusterops supervise --spec-file ...`). One
    srun task per rank; failures, hangs, lost nodes, the time limit and preemption are
    handled as docs/supervisor.md describes; every decision goes to
    JOB_DIR/timeline.jsonl (`clusterops job timeline JOB_DIR`).
    """
    early = hold_stop_signals()
    from clusterops.supervisor.config import load_resolved_spec, run_config
    from clusterops.supervisor.run import SupervisorRun

    cfg = run_config(load_resolved_spec(spec_json, spec_file), command, settings)
    return SupervisorRun(cfg, echo=lambda s: click.echo(s), early_signals=early).run()
