"""A run longer than one allocation: a chain of generations, and how it ends.

``chain: N`` with ``supervise:`` renders ``#SBATCH --array=1-N%1``: one Slurm job array whose
tasks run one at a time, in order (the ``%1`` throttle). Each task is a *generation*: a whole
supervised job that resumes from the latest good checkpoint of the chain's checkpoint
directory through the ordinary resume path. All generations share one job directory,
``<log_dir or workdir>/<name>-<array job id>`` (:func:`run_id`), so the chain has one
timeline, one supervisor memory (the bad nodes and the no-progress count carry over; the
restart budget is each generation's own), and
one id to ask about (``clusterops job status <array job id>``).

A generation ends one of two ways (:func:`is_final`):

- *handed on*: where a lone job would requeue itself (the time limit, preemption, too few
  healthy nodes) and a later generation is queued, the supervisor exits
  ``GENERATION_END`` instead; Slurm then starts the next task. The queued generation is the
  chain's cold spare; ``spare_nodes`` are its hot spares, held in each allocation.
- *final*: every other exit of the supervisor (training finished, a give-up, a script's
  do-not-restart code). The generation writes the chain's end marker (:data:`END_FILE`,
  atomically) *before* it cancels the queued generations (``scancel --state=PENDING`` on
  the array id, which leaves its own running task alone), and records ``chain_end``.

Whatever kills a generation before it can cancel (SIGKILL, a lost batch host, a failed
``scancel``), the next generation to start reads the marker first and, if it is there,
cancels the rest, records why, and exits ``CHAIN_ENDED`` without training: so nothing is
left in the queue after one short allocation at most. Without a marker (a generation killed
mid-training) the next generation resumes as usual.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from clusterops.exitcodes import Supervise as ExitCode

#: The chain's end marker in the shared job directory (JSON: code, reason, generation, job_id, t).
END_FILE = "chain-end.json"


@dataclass(frozen=True)
class ChainInfo:
    """Where this generation stands: the array job id (the chain's id), this task's
    generation number (1..length) and the chain's length."""

    array_id: str
    generation: int
    length: int

    @property
    def has_next(self) -> bool:
        """A later generation was submitted (it may since have been cancelled)."""
        return self.generation < self.length


def from_environment(spec: Mapping, env: Optional[Mapping[str, str]] = None) -> Optional[ChainInfo]:
    """The chain of this batch job, from the resolved spec's ``chain`` and Slurm's array
    variables; None for a job that is no chain (``chain`` 1, or no array variables: a chain's
    script run by hand outside an array)."""
    env = os.environ if env is None else env
    length = int(spec.get("chain") or 1)
    array_id = env.get("SLURM_ARRAY_JOB_ID", "")
    task = env.get("SLURM_ARRAY_TASK_ID", "")
    if length <= 1 or not array_id.isdigit() or not task.isdigit():
        return None
    return ChainInfo(array_id, int(task), length)


def run_id(spec: Mapping, env: Optional[Mapping[str, str]] = None) -> str:
    """The id the job directory is named by (``protocol.job_dir_for``): a chain's array job
    id, shared by its generations; else this job's own id (``local`` outside Slurm)."""
    env = os.environ if env is None else env
    chain = from_environment(spec, env)
    return chain.array_id if chain is not None else env.get("SLURM_JOB_ID", "local")


def is_final(code: int) -> bool:
    """Whether a generation's exit ends the chain: everything but a hand-on."""
    return int(code) != ExitCode.GENERATION_END


def end_path(job_dir: os.PathLike) -> Path:
    return Path(job_dir) / END_FILE


def read_end(job_dir: os.PathLike) -> Optional[dict]:
    """The chain's end marker, or None (none written, or one that is not a JSON object:
    a torn write cannot happen, as it is renamed into place)."""
    try:
        doc = json.loads(end_path(job_dir).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_end(job_dir: os.PathLike, doc: Mapping[str, object]) -> Path:
    """Write the end marker through a temporary name and a rename (mode 0644: a job
    directory may be shared for reading)."""
    final = end_path(job_dir)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(doc), sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, final)
    return final


#: Slurm's NO_VAL as an array task id: the record left of pending tasks cancelled together
#: (seen on 22.05: ``ArrayTaskId=4294967294``, state CANCELLED, no way to tell which tasks).
NO_VAL_TASK = 0xFFFFFFFE


def tasks_by_generation(infos, length: int = 0) -> dict:
    """generation -> Slurm's record (``JobInfo``) of the chain's tasks as ``job_tasks`` of the
    array id returns them; pending tasks that share one record (``2-3%1``) each get it, and
    with ``length`` the generations without a record of their own get the record of the
    pending tasks cancelled together, where there is one."""
    from clusterops.slurm.parse import array_task_ids

    out = {}
    lumped = None
    for info in infos:
        if info.array_task_id is not None and info.array_task_id >= NO_VAL_TASK:
            lumped = info
            continue
        ids = [info.array_task_id] if info.array_task_id is not None else array_task_ids(info.array_tasks)
        for g in ids:
            out[int(g)] = info
    if lumped is not None:
        for g in range(1, length + 1):
            out.setdefault(g, lumped)
    return out
