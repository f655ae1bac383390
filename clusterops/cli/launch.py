"""``clusterops launch``: render and submit sbatch scripts from a YAML job spec."""

from __future__ import annotations

import sys

import click

from clusterops.cli.common import echo_json, json_option
from clusterops.exitcodes import Launch, epilog

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a spec key (value parsed as YAML; dotted keys reach nested ones, "
         "e.g. supervise.spare_nodes=1). Repeatable.")
templates_option = click.option(
    "--templates", "template_dirs", multiple=True, metavar="DIR",
    type=click.Path(file_okay=False),
    help="Site templates directory searched before $CLUSTEROPS_TEMPLATES and the built-in "
         "templates. Repeatable.")


@click.group(epilog=epilog(Launch))
def launch() -> None:
    """Render and submit sbatch scripts from a YAML job spec.

    \b
    A job spec names the launcher (torchrun, accelerate, deepspeed or srun), the
    script, its arguments and the Slurm resources; see docs/launch.md for every key.
    """


@launch.command()
@click.argument("spec", type=click.Path(dir_okay=True))
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write the script to this file (default: standard output).")
@set_option
@templates_option
def render(spec: str, output: str | None, overrides, template_dirs) -> None:
    """Print (or write) the sbatch script for SPEC. Submits nothing.

    With -o, FILE must be a regular file or not exist yet: a symlink, device
    (/dev/null), FIFO or directory is refused (exit 2) and left untouched. The
    script is written to a temporary file beside FILE and renamed over it (mode
    0755), so FILE is never half written. A supervised job's resolved spec then goes
    to FILE.supervise.json (mode 0600), which the script names; on standard output
    it rides on the script's last line, and a spec too large for that is refused.

    A job whose command could not start (one argument or environment value over the
    kernel's 128 KiB, or all of them over ARG_MAX) is refused, naming the key (exit 2).
    """
    from clusterops import launch as lib
    from clusterops.errors import ClusteropsError, InputError
    from clusterops.fsutil import check_output_target

    if output:
        check_output_target(output)   # before any work: nothing is rendered for a bad -o
    job = lib.load_spec(spec, overrides, template_dirs)
    spec_file = lib.spec_file_for(output) if output and job.supervise is not None else None
    if spec_file:
        check_output_target(spec_file)
    text = lib.render(job, template_dirs, spec_file=spec_file)
    if output:
        try:
            lib.write_job_files(output, text, spec_file, lib.supervise_spec_text(job) if spec_file else None,
                                replace=True)
        except ClusteropsError as e:
            raise InputError(f"-o {e.message}") from None
        if spec_file:
            click.echo(f"spec: {spec_file}", err=True)
    else:
        click.echo(text, nl=False)


@launch.command()
@click.argument("spec", type=click.Path(dir_okay=True))
@set_option
@templates_option
@click.option("--dry-run", is_flag=True, help="Render and show what would be submitted; write and submit nothing.")
@json_option
def submit(spec: str, overrides, template_dirs, dry_run: bool, as_json: bool) -> None:
    """Render SPEC, write the script into its log_dir and submit it (prints the job id).

    With --json: {"job_id", "script_path", "spec_file", "sbatch", "dry_run"} (and "script" on a
    dry run). A supervised job's resolved spec goes to SCRIPT.supervise.json (mode 0600)
    beside the script; both are removed again if sbatch refuses the job.
    """
    from clusterops import launch as lib

    job = lib.load_spec(spec, overrides, template_dirs)
    slurm = None
    if not dry_run:
        from clusterops.cli.common import slurm_client

        slurm = slurm_client()
    from clusterops.errors import InputError
    from clusterops.launch.submit import SpecMismatch

    try:
        result = lib.submit(job, slurm, dry_run=dry_run, template_dirs=template_dirs)
    except SpecMismatch as e:
        raise InputError(f"{spec}: {e.message}") from None
    if as_json:
        data = result.to_dict()
        if dry_run:
            data["script"] = result.script
        echo_json(data)
    elif dry_run:
        click.echo(result.script, nl=False)
        click.echo(f"# dry run: would write the script into {job.log_dir} and run sbatch --parsable on it",
                   err=True)
    else:
        click.echo(result.job_id)
        click.echo(f"script: {result.script_path}", err=True)


@launch.command()
@templates_option
@json_option
def templates(template_dirs, as_json: bool) -> None:
    """List the available templates, where each comes from and what it shadows."""
    from clusterops import launch as lib

    found = lib.list_templates(template_dirs)
    if as_json:
        echo_json({"search_path": [{"dir": str(d), "origin": o}
                                   for d, o in lib.template_search_path(template_dirs)],
                   "templates": found})
        return
    click.echo("Search path (first match wins):")
    for d, origin in lib.template_search_path(template_dirs):
        click.echo(f"  {d}  ({origin})")
    click.echo("Templates:")
    width = max((len(t["name"]) for t in found), default=4)
    for t in found:
        kind = "launcher" if t["launcher"] else "base"
        line = f"  {t['name']:<{width}}  {kind:<8}  {t['path']}  ({t['origin']})"
        if t["shadows"]:
            line += f"  shadows {', '.join(t['shadows'])}"
        click.echo(line)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(launch())
