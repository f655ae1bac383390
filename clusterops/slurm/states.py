"""One table for every Slurm job state.

Each state maps to one of four categories the rest of clusterops reasons with:
``pending`` (not running yet, will or may run), ``running``, ``done`` (ended
well) and ``failed`` (ended badly). States come from ``job_state`` in
squeue/scontrol output; Slurm 23.02+ reports a list of a base state and flags
(e.g. ``["PENDING", "REQUEUED"]``), which ``categorize`` folds the same way.
"""

from __future__ import annotations

from typing import Iterable, Union

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"

JOB_STATES = {
    # base states
    "PENDING": PENDING,
    "RUNNING": RUNNING,
    "SUSPENDED": RUNNING,      # holds its allocation, will continue
    "COMPLETED": DONE,
    "CANCELLED": FAILED,
    "FAILED": FAILED,
    "TIMEOUT": FAILED,
    "NODE_FAIL": FAILED,
    "PREEMPTED": FAILED,       # without requeue the job is over
    "BOOT_FAIL": FAILED,
    "DEADLINE": FAILED,
    "OUT_OF_MEMORY": FAILED,
    # transitional states / flags reported as the state by scontrol and squeue
    "COMPLETING": RUNNING,     # still cleaning up on its nodes
    "CONFIGURING": RUNNING,    # nodes booting for it
    "REQUEUED": PENDING,
    "REQUEUE_FED": PENDING,
    "REQUEUE_HOLD": PENDING,
    "RESIZING": RUNNING,
    "RESV_DEL_HOLD": PENDING,
    "REVOKED": FAILED,         # federation sibling ran it elsewhere
    "SIGNALING": RUNNING,
    "SPECIAL_EXIT": PENDING,   # requeued on special exit code, held
    "STAGE_OUT": RUNNING,
    "STOPPED": RUNNING,
    "LAUNCH_FAILED": FAILED,
    "UPDATE_DB": RUNNING,
    "POWER_UP_NODE": PENDING,
}


def base_state(state: Union[str, Iterable[str], None]) -> str:
    """The base state name from a string (``"CANCELLED by 0"``) or a 23.02+ list."""
    if state is None:
        return "UNKNOWN"
    if isinstance(state, str):
        return state.split()[0].upper() if state.strip() else "UNKNOWN"
    items = [s.upper() for s in state]
    return items[0] if items else "UNKNOWN"


def categorize(state: Union[str, Iterable[str], None]) -> str:
    """pending / running / done / failed for any job state shape; unknown states count as running
    only if they say so, otherwise as failed (never as done)."""
    if state is not None and not isinstance(state, str):
        items = [s.upper() for s in state]
        base = items[0] if items else "UNKNOWN"
        # A job that is PENDING with REQUEUED, or RUNNING with COMPLETING, is what its base says;
        # an ended base with a requeue flag is on its way back to pending.
        if JOB_STATES.get(base) in (DONE, FAILED) and any(f in items[1:] for f in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")):
            return PENDING
        return JOB_STATES.get(base, FAILED)
    return JOB_STATES.get(base_state(state), FAILED)
