"""The supervisor's run settings: a resolved job spec and the flags of ``clusterops supervise``
-> one :class:`~clusterops.supervisor.run.RunConfig`.

The spec comes as JSON (``--spec-json``, or ``--spec-file``: the ``<script>.supervise.json``
that ``clusterops launch`` writes beside the script) and is validated again as a job spec;
flags override it. ``run_config`` is the one call the command makes; the pieces
(``policy_kwargs_from_spec``, ``plain_contract``, ``command_from_spec``) are the mapping from
the spec's keys to the Policy, the no-SDK contract and the training command. Values go
through ``clusterops.schema``'s one interpreter (``Checker`` with ``COERCE_KINDS``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from clusterops import protocol, schema
from clusterops.errors import InputError

_OFF = ("none", "false", "no", "")

#: A resolved spec file is read up to this size (a spec from a 256 KiB YAML file is far below).
SPEC_FILE_MAX_BYTES = 16 << 20


def profile_setting(value: Any) -> Optional[str]:
    """A health profile setting: a name, or off (None)."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    return str(value)


def _k_policy_value(c: schema.Checker, value: Any, f: schema.Field, path) -> Any:
    ok = (isinstance(value, bool) if f.kind == "bool" else
          isinstance(value, (int, float)) and not isinstance(value, bool))
    if ok and not isinstance(value, bool) and not math.isfinite(value):
        ok = False
    if not ok or (f.kind == "int" and value != int(value)):
        raise c.error(path, f"must be {f.type_text()}, got {value!r}")
    return {"int": int, "number": float, "bool": bool}[f.kind](value)


#: A Policy value from a resolved spec (JSON: ``4.0`` is the int 4), as the field's type.
COERCE_KINDS = {"int": _k_policy_value, "number": _k_policy_value, "bool": _k_policy_value,
                "profile": lambda c, v, f, path: profile_setting(v)}


class _CoerceChecker(schema.Checker):
    def null(self, f: schema.Field, path) -> bool:
        return False


def coerce(f: schema.Field, value: Any, path=("supervise",)) -> Any:
    """``value`` of the supervise key ``f`` as its Policy field's type; InputError ``spec: PATH: ...``."""
    c = _CoerceChecker(COERCE_KINDS, lambda p, message: InputError(
        f"spec: {'.'.join(str(x) for x in p)}: {message}"))
    return c.check(value, f, tuple(path))


def policy_kwargs_from_spec(spec: Mapping[str, Any]) -> dict:
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
            kw[key] = coerce(f, value, ("supervise", key))
    # Spec semantics: `requeue: false` at the top also forbids the supervisor's requeue.
    if spec.get("requeue") is False:
        kw["requeue"] = False
    return kw


def inprocess_settings(value: Any):
    """``supervise: inprocess:`` (``true`` or a mapping, validated with the spec) -> settings."""
    from clusterops.supervisor.rendezvous import InprocessSettings

    if value is True:
        return InprocessSettings()
    if not isinstance(value, Mapping):
        raise InputError(f"supervise.inprocess: must be true or a mapping, got {value!r}")
    f = schema.supervise_field("inprocess")
    known = {sub.name: sub for sub in f.fields}
    for k in value:
        if k not in known:
            raise InputError(f"supervise.inprocess.{k}: unknown key")
    return InprocessSettings(**{k: type(known[k].default)(v) for k, v in value.items()})


def _json_flag(value: Any, flag: str) -> Any:
    """A setting that a flag gives as JSON text (the spec gives it as YAML): parsed, else as is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise InputError(f"{flag}: not valid JSON ({e})") from None


def exit_codes(sup: Mapping[str, Any]) -> Dict[int, str]:
    """``supervise: exit_codes:`` merged over the published defaults -> {code: action}
    (validated with the spec; a flag gives it as JSON); InputError for a bad one."""
    v = _json_flag(sup.get("exit_codes"), "--exit-codes")
    merged = dict(schema.DEFAULT_EXIT_CODES)
    if v is not None:
        c = schema.Checker(schema.KINDS, lambda path, message: InputError(
            f"spec: supervise.exit_codes{''.join('.' + str(p) for p in path[2:])}: {message}"))
        merged.update(c.check(v, schema.supervise_field("exit_codes"), ("supervise", "exit_codes")))
    return merged


def plain_contract(sup: Mapping[str, Any]):
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
    unknown = sorted(set(progress) - {"regex", "loss_regex"})
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
    loss_regex = progress.get("loss_regex")
    if loss_regex is not None:
        try:
            if not isinstance(loss_regex, str) or re.compile(loss_regex).groups < 1:
                raise InputError("supervise.progress.loss_regex: needs a group for the loss")
        except re.error as e:
            raise InputError(f"supervise.progress.loss_regex: not a valid regular expression: {e}") from None
    args = value("resume_args", list) or []
    if not all(isinstance(a, str) for a in args):
        raise InputError("supervise.resume_args: must be a list of strings")
    return PlainContract(progress_regex=regex, checkpoint_glob=value("checkpoint_glob", str) or None,
                         resume_args=list(args), loss_regex=loss_regex)


def stability_config(sup: Mapping[str, Any]):
    """The stability guard's settings (``supervise.stability``; a flag gives it as JSON), None
    when off; InputError ``spec: supervise.stability.KEY: ...`` for a bad value."""
    from clusterops.supervisor.stability import StabilityConfig

    v = _json_flag(sup.get("stability"), "--stability")
    if v is None or v is False:
        return None
    if v is True:
        v = {}
    if not isinstance(v, dict):
        raise InputError(f"spec: supervise.stability: must be a mapping, got {v!r}")
    fields = {f.name: f for f in schema.STABILITY_FIELDS}
    kw = {}
    for key, value in v.items():
        f = fields.get(key)
        if f is None:
            raise InputError(f"spec: supervise.stability.{key}: unknown key{schema.suggest(key, fields)}")
        if value is not None:
            kw[key] = (coerce(f, value, ("supervise", "stability", key)) if f.kind in COERCE_KINDS
                       else _ENUM_CHECK.check(value, f, ("supervise", "stability", key)))
    cfg = StabilityConfig(**kw)
    bad = schema.problems(cfg, schema.STABILITY_FIELDS)
    if bad:
        raise InputError(f"spec: supervise.stability.{bad[0]}")
    return cfg


_ENUM_CHECK = _CoerceChecker(schema.KINDS, lambda p, message: InputError(
    f"spec: {'.'.join(str(x) for x in p)}: {message}"))


def read_spec_file(path: str) -> str:
    """The text of a --spec-file: a regular file, bounded, UTF-8; else InputError (exit 2)."""
    from clusterops.fsutil import read_regular

    try:
        raw, cut = read_regular(path, SPEC_FILE_MAX_BYTES)
    except OSError as e:
        raise InputError(f"--spec-file {path}: cannot read: {e.strerror or e}") from None
    if cut:
        raise InputError(f"--spec-file {path}: larger than {SPEC_FILE_MAX_BYTES >> 20} MiB; not a job spec")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--spec-file {path}: not UTF-8 text (byte {e.start})") from None


def command_from_spec(spec: Mapping[str, Any]) -> list:
    python = spec.get("python") or sys.executable
    script = spec.get("script")
    if not script:
        raise InputError("spec: script: required for a supervised job")
    args = [str(a) for a in (spec.get("args") or [])]
    script = str(script)
    return ([python, script] if script.endswith(".py") else [script]) + args


def load_resolved_spec(spec_json: Optional[str] = None, spec_file: Optional[str] = None) -> dict:
    """The resolved job spec of ``--spec-json`` / ``--spec-file`` (validated again, defaults
    filled, ``nproc_per_node`` the ranks per node); {} when neither is given."""
    if spec_json and spec_file:
        raise InputError("--spec-file: give --spec-json or --spec-file, not both")
    where = "--spec-json"
    if spec_file:
        where, spec_json = f"--spec-file {spec_file}", read_spec_file(spec_file)
    if not spec_json:
        return {}
    try:
        spec = json.loads(spec_json)
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise InputError(f"{where}: must be a JSON object")
    from clusterops.launch import JobSpec

    job_spec = JobSpec.from_dict(spec, source=where)   # validates, fills defaults
    out = job_spec.to_dict()
    out["nproc_per_node"] = job_spec.procs_per_node
    return out


def run_config(spec: Mapping[str, Any], command: Sequence[str], settings: Mapping[str, Any]):
    """The RunConfig of one supervised job: the resolved ``spec`` (may be {}), the training
    ``command`` (after ``--``; else the spec's) and the flag ``settings`` (name -> value,
    None: not given), which override the spec; the allocation's facts from the SLURM_*
    environment. InputError (exit 2) on bad input."""
    from clusterops import supervisor as sv
    from clusterops.supervisor.run import RunConfig

    kw = policy_kwargs_from_spec(spec) if spec else {}
    # Flags override the spec; supervise keys that are not Policy fields go to the run below.
    for f in schema.policy_fields():
        value = settings.get(f.name)
        if value is not None:
            kw[f.name] = profile_setting(value) if f.kind == "profile" else value

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
    plain = plain_contract(sup)
    from clusterops.supervisor import chain

    # A chain's generations share one directory, named by the array's id (chain.run_id).
    jd = protocol.job_dir_for(dict(spec, supervise=sup), chain.run_id(spec))
    cd = protocol.ckpt_dir_for(dict(spec, supervise=sup), jd)
    if "nodes" not in kw:
        alloc = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        if alloc:
            kw["nodes"] = max(1, int(alloc) - int(kw.get("spare_nodes") or 0))
    policy = sv.Policy(**kw)
    problems = policy.validate()
    if problems:
        raise InputError(f"supervise: {problems[0]}")
    env = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
    extra: dict = {}
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
    if sup.get("inprocess") not in (None, False):
        extra["inprocess"] = inprocess_settings(sup["inprocess"])
    srun_args = list(spec.get("srun_args") or [])
    if spec.get("container_image"):
        srun_args.append(f"--container-image={spec['container_image']}")
        if spec.get("container_mounts"):
            srun_args.append(f"--container-mounts={spec['container_mounts']}")
    extra["srun_args"] = srun_args
    extra["notify_urls"] = list(spec.get("notify") or [])
    extra["plain"] = plain
    extra["stability"] = stability_config(sup)
    st = extra["stability"]
    if st is not None and (plain.progress_regex or plain.checkpoint_glob):
        # A replay needs the SDK on the ranks: it ends the replay, keeps it from saving, and
        # reports the losses; a script without it would train on and save.
        for key in ("on_nan", "on_spike"):
            if getattr(st, key) == "replay":
                raise InputError(f"spec: supervise.stability.{key}: replay needs a script that uses the SDK "
                                 f"(sdk.heartbeat); this one is read through supervise.progress/checkpoint_glob: "
                                 f"use rollback")
    extra["exit_codes"] = exit_codes(sup)
    from clusterops import trackers

    extra["trackers"] = trackers.parse(sup.get("trackers"))
    extra["job_name"] = str(spec.get("name") or jd.name)
    if spec.get("signal_lead_s"):
        extra["signal_lead_s"] = int(spec["signal_lead_s"])
    extra["chain"] = chain.from_environment(spec)
    from clusterops.launch.spec import EXPEDITE

    extra["expedited_requeue"] = spec.get("requeue") == EXPEDITE
    if spec.get("launcher") == "torchrun":
        extra["launcher"] = "torchrun"      # one agent per node; the other launchers: srun-native ranks
    return RunConfig.from_environment(cmd, jd, cd, policy, env=env, workdir=spec.get("workdir"),
                                      cpus_per_task=spec.get("cpus_per_task"), **extra)
