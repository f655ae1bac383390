"""Submitting: render a JobSpec, write the script into its log_dir, hand it to Slurm.

The one side effect of the launch package. Nothing is half done: on a dry run nothing is
written; a script Slurm refused is removed again. The ``sbatch`` command shown to the user
comes from ``clusterops.slurm.steps.sbatch_argv`` (the Slurm layer builds every argv).
"""

from __future__ import annotations

import os
import re
import time as _time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, TYPE_CHECKING, Tuple

from clusterops.errors import ClusteropsError
from clusterops.launch.render import render
from clusterops.launch.spec import JobSpec

if TYPE_CHECKING:   # annotations only: the Slurm layer is imported where it is used
    from clusterops.slurm.api import SlurmAPI


@dataclass(frozen=True)
class Submitted:
    job_id: Optional[int]  # None for a dry run
    script_path: Optional[str]
    script: str
    sbatch_argv: Tuple[str, ...]

    def to_dict(self) -> Dict[str, Any]:
        return {"job_id": self.job_id, "script_path": self.script_path,
                "sbatch": list(self.sbatch_argv), "dry_run": self.job_id is None}


def script_filename(spec: JobSpec, now: Optional[float] = None) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name).strip("._") or "job"
    stamp = _time.strftime("%Y%m%d-%H%M%S", _time.localtime(now if now is not None else _time.time()))
    return f"{safe}-{stamp}-{os.urandom(3).hex()}.sbatch"


def submit(spec: JobSpec, slurm: Optional[SlurmAPI] = None, *, dry_run: bool = False,
           template_dirs: Sequence[str | os.PathLike] = ()) -> Submitted:
    """Render, write the script into log_dir, submit it. Nothing is written on a dry run."""
    from clusterops.slurm.steps import sbatch_argv   # here: `import clusterops.launch` stays light

    text = render(spec, template_dirs)
    path = os.path.join(spec.log_dir, script_filename(spec))
    argv = tuple(sbatch_argv(path))
    if dry_run:
        return Submitted(None, None, text, argv)
    try:
        os.makedirs(spec.log_dir, exist_ok=True)
        with open(path, "x") as f:
            f.write(text)
        os.chmod(path, 0o755)
    except OSError as e:
        raise ClusteropsError(f"cannot write the script to {spec.log_dir}: {e.strerror or e}") from None
    if slurm is None:
        from clusterops.slurm.factory import connect

        slurm = connect()
    try:
        job_id = slurm.submit(path)
    except BaseException:
        # Nothing half-done: a script that was never submitted is not left behind.
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return Submitted(int(job_id), path, text, argv)

