"""``clusterops supervise``: run and heal a training step inside a Slurm allocation."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from clusterops.errors import InputError

EXIT_HELP = """\b
Exit codes:
  0  training finished
  1  failed for good (e.g. the requeue itself failed)
  2  usage or input error
  3  no progress: latest checkpoint unchanged across K restarts
  4  requeue budget spent (SLURM_RESTART_COUNT reached max_requeues)
  5  in-allocation restart budget spent
  6  too few healthy nodes and requeueing not allowed
  7  stopped (time limit / preemption) with checkpoint saved, requeue not allowed
"""

# Keys of the spec's `supervise:` mapping -> (Policy field, type).
SUPERVISE_KEYS = {
    "ckpt_dir": None, "job_dir": None, "verify_deep": None, "step_wait_s": None,
    "hang_timeout_s": ("hang_timeout_s", float), "startup_timeout_s": ("startup_timeout_s", float),
    "stop_timeout_s": ("stop_timeout_s", float), "kill_timeout_s": ("kill_timeout_s", float),
    "max_restarts": ("max_restarts", int), "max_requeues": ("max_requeues", int),
    "no_progress_restarts": ("no_progress_restarts", int), "spare_nodes": ("spare_nodes", int),
    "min_nodes": ("min_nodes", int), "preflight": ("preflight", str),
    "preflight_timeout_s": ("preflight_timeout_s", float), "postmortem": ("postmortem", str),
    "drain_bad_nodes": ("drain_bad_nodes", bool), "node_fail_threshold": ("node_fail_threshold", int),
    "ranks_per_node": ("ranks_per_node", int), "requeue": ("requeue", bool),
    "liveness_check": ("liveness_check", bool), "liveness_timeout_s": ("liveness_timeout_s", float),
    "hang_blame_margin_s": ("hang_blame_margin_s", float),
}


def policy_kwargs_from_spec(spec: dict) -> dict:
    """Policy fields from a resolved job spec (top-level node counts + `supervise:`)."""
    sup = spec.get("supervise") or {}
    if not isinstance(sup, dict):
        raise InputError("spec: supervise: must be a mapping")
    kw = {"nodes": int(spec.get("nodes") or 1)}
    gpus = spec.get("gpus_per_node") or 0
    kw["ranks_per_node"] = int(spec.get("nproc_per_node") or gpus or 1)
    for key, value in sup.items():
        if key not in SUPERVISE_KEYS:
            import difflib

            near = difflib.get_close_matches(key, list(SUPERVISE_KEYS), n=1)
            raise InputError(f"spec: supervise.{key}: unknown key" + (f" (did you mean {near[0]}?)" if near else ""))
        target = SUPERVISE_KEYS[key]
        if target is None:
            continue
        name, typ = target
        if key in ("preflight", "postmortem"):
            kw[name] = None if value in (False, None, "", "false", "none") else str(value)
        elif value is not None:
            try:
                kw[name] = typ(value)
            except (TypeError, ValueError):
                raise InputError(f"spec: supervise.{key}: expected {typ.__name__}, got {value!r}") from None
    # Spec semantics: `requeue: false` at the top also forbids the supervisor's requeue.
    if spec.get("requeue") is False:
        kw["requeue"] = False
    return kw


def command_from_spec(spec: dict) -> list:
    python = spec.get("python") or sys.executable
    script = spec.get("script")
    if not script:
        raise InputError("spec: script: required for a supervised job")
    args = [str(a) for a in (spec.get("args") or [])]
    script = str(script)
    return ([python, script] if script.endswith(".py") else [script]) + args


@click.command(context_settings={"ignore_unknown_options": False}, epilog=EXIT_HELP)
@click.option("--spec-json", help="The resolved job spec as JSON (what `clusterops launch` renders).")
@click.option("--job-dir", type=click.Path(file_okay=False), help="Where the timeline and attempt logs go.")
@click.option("--ckpt-dir", type=click.Path(file_okay=False), help="Checkpoint root (default JOB_DIR/ckpt).")
@click.option("--nodes", type=int, help="Training nodes (default: the allocation minus --spares).")
@click.option("--nodes-min", type=int, help="Continue on this many nodes when some are lost.")
@click.option("--spares", type=int, help="Allocated nodes kept as spares.")
@click.option("--ranks-per-node", type=int, help="Training processes per node (default 1).")
@click.option("--hang-timeout-s", type=float, help="No heartbeat progress for this long is a hang (default 300).")
@click.option("--startup-timeout-s", type=float, help="Time a rank gets to its first heartbeat (default 600).")
@click.option("--stop-timeout-s", type=float, help="Time the ranks get to save after a stop (default 120).")
@click.option("--max-restarts", type=int, help="In-allocation restarts (default 5).")
@click.option("--max-requeues", type=int, help="Requeues, against SLURM_RESTART_COUNT (default 3).")
@click.option("--no-progress-restarts", type=int, help="Give up after K restarts without a new checkpoint (default 3).")
@click.option("--preflight", help="Health profile run on every node first ('none' to skip; default preflight).")
@click.option("--postmortem", help="Health profile run on the step's nodes after a failure (default: a liveness check).")
@click.option("--drain-bad-nodes/--no-drain-bad-nodes", default=None, help="Drain nodes judged bad.")
@click.option("--no-requeue", is_flag=True, help="Never requeue the job; give up instead.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def supervise(spec_json, job_dir, ckpt_dir, nodes, nodes_min, spares, ranks_per_node, hang_timeout_s,
              startup_timeout_s, stop_timeout_s, max_restarts, max_requeues, no_progress_restarts, preflight,
              postmortem, drain_bad_nodes, no_requeue, command):
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
    overrides = {"nodes": nodes, "min_nodes": nodes_min, "spare_nodes": spares, "ranks_per_node": ranks_per_node,
                 "hang_timeout_s": hang_timeout_s, "startup_timeout_s": startup_timeout_s,
                 "stop_timeout_s": stop_timeout_s, "max_restarts": max_restarts, "max_requeues": max_requeues,
                 "no_progress_restarts": no_progress_restarts, "drain_bad_nodes": drain_bad_nodes}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    if preflight is not None:
        kw["preflight"] = None if preflight.lower() in ("none", "false", "no", "") else preflight
    if postmortem is not None:
        kw["postmortem"] = None if postmortem.lower() in ("none", "false", "no", "") else postmortem
    if no_requeue:
        kw["requeue"] = False

    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        if not spec:
            raise InputError("COMMAND: give the training command after --, or --spec-json")
        cmd = command_from_spec(spec)
    sup = spec.get("supervise") or {}
    job_id = os.environ.get("SLURM_JOB_ID", "local")
    base = spec.get("log_dir") or spec.get("workdir") or os.getcwd()
    jd = Path(job_dir or sup.get("job_dir") or Path(base) / f"{spec.get('name') or 'job'}-{job_id}")
    cd = Path(ckpt_dir or sup.get("ckpt_dir") or jd / "ckpt")
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
    cfg = RunConfig.from_environment(cmd, jd, cd, policy, env=env, workdir=spec.get("workdir"),
                                     cpus_per_task=spec.get("cpus_per_task"), **extra)
    code = SupervisorRun(cfg, echo=lambda s: click.echo(s)).run()
    return code
