"""``clusterops supervise``: run and heal a training step inside a Slurm allocation.

Its settings come from ``--spec-json`` (the resolved job spec) and from flags that override
it; there is one flag per ``supervise:`` key and Policy field, made from the table in
``clusterops.schema`` (names, types, bounds, defaults and help text).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import click

from clusterops import schema
from clusterops.errors import InputError
from clusterops.exitcodes import Supervise, epilog

EXIT_HELP = epilog(Supervise)

_OFF = ("none", "false", "no", "")


def _profile(value):
    """A health profile setting: a name, or off (None)."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    return str(value)


def _coerce(f: schema.Field, value, where: str):
    """A policy value from a resolved spec, as the Policy field's type."""
    if f.kind == "profile":
        return _profile(value)
    ok = (isinstance(value, bool) if f.kind == "bool" else
          isinstance(value, (int, float)) and not isinstance(value, bool))
    if ok and not isinstance(value, bool) and not math.isfinite(value):
        ok = False
    if not ok or (f.kind == "int" and value != int(value)):
        raise InputError(f"{where}: must be {f.type_text()}, got {value!r}")
    return {"int": int, "number": float, "bool": bool}[f.kind](value)


def policy_kwargs_from_spec(spec: dict) -> dict:
    """Policy fields from a resolved job spec (top-level node counts + `supervise:`)."""
    sup = spec.get("supervise") or {}
    if not isinstance(sup, dict):
        raise InputError("spec: supervise: must be a mapping")
    kw = {"nodes": int(spec.get("nodes") or 1)}
    gpus = spec.get("gpus_per_node") or 0
    kw["ranks_per_node"] = int(spec.get("nproc_per_node") or gpus or 1)
    fields = {f.name: f for f in schema.SUPERVISE.fields}
    for key, value in sup.items():
        f = fields.get(key)
        if f is None:
            raise InputError(f"spec: supervise.{key}: unknown key{schema.suggest(key, fields)}")
        if f.policy and (value is not None or f.kind == "profile"):
            kw[key] = _coerce(f, value, f"spec: supervise.{key}")
    # Spec semantics: `requeue: false` at the top also forbids the supervisor's requeue.
    if spec.get("requeue") is False:
        kw["requeue"] = False
    return kw


def _plain_contract(sup: dict):
    """The no-SDK settings (progress, checkpoint_glob, resume_args); flags give them as JSON."""
    import re

    from clusterops.supervisor.run import PlainContract

    def value(key, kind):
        v = sup.get(key)
        if isinstance(v, str) and kind is not str:
            try:
                v = json.loads(v)
            except ValueError as e:
                raise InputError(f"--{key.replace('_', '-')}: not valid JSON ({e})") from None
        if isinstance(v, tuple) and kind is list:
            v = list(v)
        if v is not None and not isinstance(v, kind):
            raise InputError(f"supervise.{key}: must be a {kind.__name__}, got {v!r}")
        return v

    progress = value("progress", dict) or {}
    unknown = sorted(set(progress) - {"regex"})
    if unknown:
        raise InputError(f"supervise.progress.{unknown[0]}: unknown key")
    regex = progress.get("regex")
    if progress and not isinstance(regex, str):
        raise InputError("supervise.progress.regex: required, a regular expression")
    if regex is not None:
        try:
            if re.compile(regex).groups < 1:
                raise InputError("supervise.progress.regex: needs a group for the step")
        except re.error as e:
            raise InputError(f"supervise.progress.regex: not a valid regular expression: {e}") from None
    args = value("resume_args", list) or []
    if not all(isinstance(a, str) for a in args):
        raise InputError("supervise.resume_args: must be a list of strings")
    return PlainContract(progress_regex=regex, checkpoint_glob=value("checkpoint_glob", str) or None,
                         resume_args=list(args))


def command_from_spec(spec: dict) -> list:
    python = spec.get("python") or sys.executable
    script = spec.get("script")
    if not script:
        raise InputError("spec: script: required for a supervised job")
    args = [str(a) for a in (spec.get("args") or [])]
    script = str(script)
    return ([python, script] if script.endswith(".py") else [script]) + args


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
    }
    if f.kind in ("list", "map"):
        text += " (JSON)"
    return click.option(*names, f.name, type=types[f.kind](), default=None, help=text)


def _settings_options(command):
    """Every supervise key and Policy field becomes a flag (the table's order, top down)."""
    for f in reversed(schema.SUPERVISE.fields + schema.POLICY_ONLY):
        command = _setting_option(f)(command)
    return command


@click.command(context_settings={"ignore_unknown_options": False}, epilog=EXIT_HELP)
@click.option("--spec-json", help="The resolved job spec as JSON (what `clusterops launch` renders).")
@_settings_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def supervise(spec_json, command, **settings):
    """Run the training COMMAND (after --) on the allocation's nodes and heal it.

    Runs inside a Slurm batch job (the script rendered by `clusterops launch` with a
    `supervise:` section ends with `exec clusterops supervise --spec-json ...`). One
    srun task per rank; failures, hangs, lost nodes, the time limit and preemption are
    handled as docs/supervisor.md describes; every decision goes to
    JOB_DIR/timeline.jsonl (`clusterops job timeline JOB_DIR`).
    """
    from clusterops import supervisor as sv
    from clusterops.supervisor.run import RunConfig, SupervisorRun

    spec = {}
    if spec_json:
        try:
            spec = json.loads(spec_json)
        except ValueError as e:
            raise InputError(f"--spec-json: not valid JSON ({e})") from None
        if not isinstance(spec, dict):
            raise InputError("--spec-json: must be a JSON object")
        from clusterops.launch import JobSpec

        job_spec = JobSpec.from_dict(spec, source="--spec-json")   # validates, fills defaults
        spec = job_spec.to_dict()
        spec["nproc_per_node"] = job_spec.procs_per_node
    kw = policy_kwargs_from_spec(spec) if spec else {}
    # Flags override the spec; supervise keys that are not Policy fields go to the run below.
    for f in schema.policy_fields():
        value = settings.get(f.name)
        if value is not None:
            kw[f.name] = _profile(value) if f.kind == "profile" else value

    sup_keys = {f.name for f in schema.SUPERVISE.fields if not f.policy}
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        if not spec:
            raise InputError("COMMAND: give the training command after --, or --spec-json")
        cmd = command_from_spec(spec)
    sup = dict(spec.get("supervise") or {})
    sup.update({k: v for k, v in settings.items() if v is not None and k in sup_keys})
    plain = _plain_contract(sup)
    job_id = os.environ.get("SLURM_JOB_ID", "local")
    base = spec.get("log_dir") or spec.get("workdir") or os.getcwd()
    jd = Path(sup.get("job_dir") or Path(base) / f"{spec.get('name') or 'job'}-{job_id}")
    cd = Path(sup.get("ckpt_dir") or jd / "ckpt")
    if "nodes" not in kw:
        alloc = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        if alloc:
            kw["nodes"] = max(1, int(alloc) - int(kw.get("spare_nodes") or 0))
    policy = sv.Policy(**kw)
    problems = policy.validate()
    if problems:
        raise InputError(f"supervise: {problems[0]}")
    env = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
    extra = {}
    mode = sup.get("job_dir_mode")
    if mode is not None:
        if str(mode) not in schema.JOB_DIR_MODES:
            raise InputError(f"supervise.job_dir_mode: must be one of {', '.join(schema.JOB_DIR_MODES)}, "
                             f"got {mode!r}")
        extra["job_dir_mode"] = int(str(mode), 8)
    if "verify_deep" in sup:
        extra["deep_verify"] = bool(sup["verify_deep"])
    if "step_wait_s" in sup:
        extra["step_wait_s"] = int(sup["step_wait_s"])
    elif spec.get("srun_wait_s"):
        extra["step_wait_s"] = int(spec["srun_wait_s"])
    srun_args = list(spec.get("srun_args") or [])
    if spec.get("container_image"):
        srun_args.append(f"--container-image={spec['container_image']}")
        if spec.get("container_mounts"):
            srun_args.append(f"--container-mounts={spec['container_mounts']}")
    extra["srun_args"] = srun_args
    extra["notify_urls"] = list(spec.get("notify") or [])
    extra["plain"] = plain
    if spec.get("launcher") == "torchrun":
        extra["launcher"] = "torchrun"      # one agent per node; the other launchers: srun-native ranks
    cfg = RunConfig.from_environment(cmd, jd, cd, policy, env=env, workdir=spec.get("workdir"),
                                     cpus_per_task=spec.get("cpus_per_task"), **extra)
    code = SupervisorRun(cfg, echo=lambda s: click.echo(s)).run()
    return code
