"""Submitting: render a JobSpec, write the script into its log_dir, hand it to Slurm.

The one side effect of the launch package. Nothing is half done: on a dry run nothing is
written; a script Slurm refused is removed again, and so is a script whose companion file
could not be written. A supervised job's resolved spec goes to ``<script>.supervise.json``
beside the script (mode 0600; see :func:`write_job_files`), which the script's
``exec clusterops supervise --spec-file`` line names. The ``sbatch`` command shown to the
user comes from ``clusterops.slurm.steps.sbatch_argv`` (the Slurm layer builds every argv).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
import time as _time
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, TYPE_CHECKING, Tuple

from clusterops.errors import ClusteropsError, InputError
from clusterops.launch.render import render, spec_file_for, supervise_spec_text
from clusterops.launch.spec import EXPEDITE, JobSpec

if TYPE_CHECKING:   # annotations only: the Slurm layer is imported where it is used
    from clusterops.slurm.api import SlurmAPI


@dataclass(frozen=True)
class Submitted:
    job_id: Optional[int]  # None for a dry run
    script_path: Optional[str]
    script: str
    sbatch_argv: Tuple[str, ...]
    spec_file: Optional[str] = None  # a supervised job's spec file (a dry run: where it would go)

    def to_dict(self) -> Dict[str, Any]:
        return {"job_id": self.job_id, "script_path": self.script_path, "spec_file": self.spec_file,
                "sbatch": list(self.sbatch_argv), "dry_run": self.job_id is None}


def script_filename(spec: JobSpec, now: Optional[float] = None) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name).strip("._") or "job"
    stamp = _time.strftime("%Y%m%d-%H%M%S", _time.localtime(now if now is not None else _time.time()))
    return f"{safe}-{stamp}-{os.urandom(3).hex()}.sbatch"


def _unlink(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def write_job_files(script_path: str, script: str, spec_file: Optional[str], spec_text: Optional[str], *,
                    replace: bool = False) -> None:
    """Write the script (0755) and, for a supervised job, its spec file (0600: it can hold
    webhook URLs with tokens): both or neither. Each goes through a temporary sibling and
    a rename (never half a file); the spec file first, so a script is never there without
    the spec it names. ``replace=False``: neither may exist yet (``launch submit``'s fresh
    names); ``replace=True``: a regular file there is replaced (``launch render -o``).
    Raises ClusteropsError (or InputError for an output that is not a regular file)."""
    from clusterops.fsutil import check_output_target, write_atomic

    todo = [(script_path, script, 0o755)]
    if spec_file is not None:
        todo.insert(0, (spec_file, spec_text or "", 0o600))
    for path, _, _ in todo:
        check_output_target(path)
        if not replace and os.path.lexists(path):
            raise ClusteropsError(f"{path}: exists already; nothing written")
    existed = spec_file is not None and os.path.lexists(spec_file)
    written = []
    try:
        for path, text, mode in todo:
            write_atomic(path, text, mode, create_parents=False)
            written.append(path)
    except BaseException:
        for path in written:
            if path != spec_file or not existed:
                _unlink(path)
        raise


def submit(spec: JobSpec, slurm: Optional[SlurmAPI] = None, *, dry_run: bool = False,
           template_dirs: Sequence[str | os.PathLike] = ()) -> Submitted:
    """Render, write the script into log_dir, submit it. Nothing is written on a dry run."""
    from clusterops.slurm.steps import sbatch_argv   # here: `import clusterops.launch` stays light

    if not dry_run:
        if slurm is None:
            from clusterops.slurm.factory import connect

            slurm = connect()
        spec = check_against_cluster(spec, slurm)     # before anything is rendered or written
    path = os.path.join(spec.log_dir, script_filename(spec))
    # Always a file for a supervised job's spec (not only a large one): one way for every
    # size, tested every time, and the webhook URLs stay out of the world-readable script.
    spec_file = spec_file_for(path) if spec.supervise is not None else None
    text = render(spec, template_dirs, spec_file=spec_file)
    argv = tuple(sbatch_argv(path))
    if dry_run:
        return Submitted(None, None, text, argv, spec_file)
    try:
        os.makedirs(spec.log_dir, exist_ok=True)
    except OSError as e:
        raise ClusteropsError(f"cannot write the script to {spec.log_dir}: {e.strerror or e}") from None
    try:
        write_job_files(path, text, spec_file, supervise_spec_text(spec) if spec_file else None)
    except ClusteropsError as e:
        raise ClusteropsError(f"cannot write the script to {spec.log_dir}: {e.message}") from None
    try:
        job_id = slurm.submit(path)
    except BaseException:
        # Nothing half-done: a script that was never submitted is not left behind.
        _unlink(path)
        _unlink(spec_file)
        raise
    if spec_file:   # `clusterops job status JOBID` finds the job directory by this record
        record_submission(job_id, path, spec_file, supervise_spec_text(spec))
    return Submitted(int(job_id), path, text, argv, spec_file)



#: Slurm 25.11 brought ``--requeue=expedite``; the controller allows it with this parameter.
EXPEDITE_SINCE = (25, 11)
EXPEDITE_PARAMETER = "enable_expedited_requeue"


class SpecMismatch(InputError):
    """A spec key the cluster cannot honour (the message starts with the key); the CLI adds
    the spec file's name."""


def check_against_cluster(spec: JobSpec, slurm: SlurmAPI) -> JobSpec:
    """What only the cluster can say of a spec, before anything is written or submitted;
    returns the spec to render. ``segment`` needs Slurm 24.05+ (``--segment``) and at most the
    partition's nodes; ``requeue: expedite`` needs a cluster that allows it
    (:func:`expedite_problem`), and a supervised job's requeue becomes an expedited one
    where the cluster allows it."""
    if spec.requeue == EXPEDITE:
        why = expedite_problem(slurm)
        if why:
            raise SpecMismatch(f"requeue: expedite: {why}; use requeue: true")
    elif spec.requeue is True and spec.supervise is not None and expedite_problem(slurm) is None:
        spec = dataclasses.replace(spec, requeue=EXPEDITE)
    if spec.segment:
        _check_segment(spec, slurm)
    return spec


def expedite_problem(slurm: SlurmAPI) -> Optional[str]:
    """Why this cluster cannot give a job Slurm 25.11's expedited requeue, or None.

    ``sbatch --requeue=expedite`` is refused unless the controller is 25.11 or newer and its
    ``SlurmctldParameters`` has ``enable_expedited_requeue`` (slurmctld's job_mgr.c: "Expedited
    requeue requested but not enabled"). Both come from one ``scontrol show config`` (the
    controller's own version, not the client tools'). A controller that cannot be asked is a
    problem too: the ordinary requeue is then the safe choice."""
    from clusterops.slurm.parse import parse_config_version
    from clusterops.slurm.privilege import parse_config

    try:
        text = slurm.show_config()
        version = parse_config_version(text)
    except ClusteropsError as e:
        return f"cannot read the cluster's configuration ({e.message})"
    except ValueError as e:
        return f"cannot read the cluster's configuration ({e})"
    if version < EXPEDITE_SINCE:
        return (f"Slurm {version[0]}.{version[1]:02d} has no expedited requeue "
                f"({EXPEDITE_SINCE[0]}.{EXPEDITE_SINCE[1]:02d}+)")
    params = parse_config(text).get("SlurmctldParameters", "")
    if EXPEDITE_PARAMETER not in {p.strip() for p in params.split(",")}:
        return f"the cluster's SlurmctldParameters lacks {EXPEDITE_PARAMETER}"
    return None


def _check_segment(spec: JobSpec, slurm: SlurmAPI) -> None:
    version = slurm.version()
    if version < (24, 5):
        raise SpecMismatch(f"segment: --segment needs Slurm 24.05 or newer (topology/block); this cluster's "
                         f"Slurm is {version[0]}.{version[1]:02d}")
    where = spec.partition or "the cluster"
    count = len(slurm.partition_nodes(spec.partition)) if spec.partition else len(slurm.nodes())
    if spec.segment > count:
        raise SpecMismatch(f"segment: {spec.segment} is larger than {where} ({count} node(s))")


# -- the submitting user's record of supervised jobs (clusterops.jobs reads it) --------------
REGISTRY_ENV = "CLUSTEROPS_JOBS_DIR"


def registry_dir() -> Path:
    """Where this user's submissions are recorded: ``$CLUSTEROPS_JOBS_DIR``, else
    ``$XDG_STATE_HOME/clusterops/jobs``, else ``~/.local/state/clusterops/jobs``."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV])
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "clusterops" / "jobs"


def record_submission(job_id: Any, script: str, spec_file: str, spec_text: str) -> Optional[Path]:
    """Record a supervised job's submission: its directory by the supervisor's rule
    (:func:`clusterops.protocol.job_dir_for`), script and spec file, mode 0600 in a 0700
    registry. Never fails the submission: an unwritable registry returns None (the job is
    then found through Slurm, from its script)."""
    import json
    import pwd

    from clusterops import protocol

    try:
        spec = json.loads(spec_text)
        jd = protocol.job_dir_for(spec, str(job_id))
        d = registry_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        body = {"job_id": str(job_id), "job_dir": str(jd), "ckpt_dir": str(protocol.ckpt_dir_for(spec, jd)),
                "script": script, "spec_file": spec_file, "name": spec.get("name"),
                "submitted_at": round(_time.time(), 3), "user": pwd.getpwuid(os.getuid()).pw_name}
        return protocol.write_private(d / f"{int(job_id)}.json", (json.dumps(body, sort_keys=True) + "\n").encode())
    except (OSError, ValueError, TypeError, KeyError):
        return None
