"""Self-healing for training frameworks: one module per framework, imported on demand.

``clusterops.integrations.lightning`` (extra ``clusterops[lightning]``) holds a
Lightning callback, ``clusterops.integrations.transformers`` (extra ``clusterops[hf]``)
a Hugging Face ``TrainerCallback``. Each module imports its framework itself; this package imports
nothing, so ``import clusterops`` and the CLI never load a framework. The shared
pieces, :func:`resume_dir` and :func:`rank_layout`, use only the SDK's environment
contract and the launcher's variables; :func:`scale_lr` and :func:`data_index` are the
stability rollback's LR factor and data skip, applied by both callbacks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, Optional

log = logging.getLogger(__name__)


def _env_int(*names: str) -> Optional[int]:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


_leave_registered = False


def leave_process_group_at_exit() -> None:
    """Leave torch's process group when the process exits (registered once).

    torch 2.13's gloo process group, left to the interpreter's teardown, sometimes aborts
    the process ("terminate called without an active exception", SIGABRT) after the
    script returned 0: a worker thread of the group asks for the GIL while Python shuts
    down. The frameworks do not leave the group themselves; the callbacks register this at
    the start of training, and their modules import torch.distributed.nn.functional before
    any group exists (clusterops.sdk._keep_group_collectable), without which the group
    would outlive ``destroy_process_group()`` (docs/supervisor.md, "A rank that aborts at
    exit"). The supervisor reads such an abort as the program's, never the node's.
    """
    global _leave_registered
    if _leave_registered:
        return
    import atexit

    def leave() -> None:
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(leave)
    _leave_registered = True


def rank_layout() -> Dict[str, int]:
    """This process's place in the job, from the launcher's variables, with no collective.

    torchrun's (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) win; else an
    srun task's (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_NTASKS_PER_NODE``,
    what the supervisor's training step and the plain srun launcher give every rank);
    else one process. Keys: rank, world_size, local_rank, local_world_size, num_nodes.
    """
    world = _env_int("WORLD_SIZE")
    if world is not None:
        rank = _env_int("RANK") or 0
        local = _env_int("LOCAL_RANK") or 0
        per_node = _env_int("LOCAL_WORLD_SIZE") or world
    elif _env_int("SLURM_NTASKS") is not None and os.environ.get("SLURM_STEP_ID") is not None:
        world = _env_int("SLURM_NTASKS") or 1
        rank = _env_int("SLURM_PROCID") or 0
        local = _env_int("SLURM_LOCALID") or 0
        # SLURM_NTASKS_PER_NODE may read "2(x3)" on uneven layouts; an even step is required.
        raw = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        per_node = int(raw.split("(")[0]) if raw.split("(")[0].isdigit() else world
    else:
        world, rank, local, per_node = 1, 0, 0, 1
    per_node = max(1, min(per_node, world))
    return {"rank": rank, "world_size": world, "local_rank": local, "local_world_size": per_node,
            "num_nodes": max(1, world // per_node)}


def resume_dir(root: Optional[os.PathLike] = None, *, deep: bool = True) -> Optional[Path]:
    """The committed checkpoint directory to resume from, or None.

    the resume variable (``protocol.ENV_RESUME_FROM``) when it verifies (the supervisor chose and verified it),
    else the newest good one under the checkpoint root (``root`` or
    the checkpoint root (``protocol.ENV_CKPT_DIR``)); bad ones are skipped and logged.
    """
    from clusterops import checkpoint as ck
    from clusterops import protocol

    explicit = os.environ.get(protocol.ENV_RESUME_FROM)
    if explicit:
        info = ck.verify(explicit, deep=deep)
        if info.ok:
            return Path(explicit)
        log.warning("%s=%s is not a good checkpoint (%s); looking for the newest good one",
                    protocol.ENV_RESUME_FROM, explicit, "; ".join(info.problems))
    r = root or os.environ.get(protocol.ENV_CKPT_DIR)
    if not r:
        return None
    found = ck.find_latest_good(r, deep=deep)
    for bad in found.skipped:
        log.warning("skipped bad checkpoint %s: %s", bad.path, "; ".join(bad.problems))
    return found.latest.path if found.latest else None


def scale_lr(optimizers, schedulers, factor: float) -> None:
    """Multiply the learning rate by ``factor`` (a stability rollback's ``lr_factor``) in
    every param group of ``optimizers`` and in the base rates of ``schedulers`` (a schedule
    recomputes the group's rate from its base at every step). Both are saved in the
    framework's checkpoints, so the lower rate holds after later resumes."""
    if factor == 1.0:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor
    for sch in schedulers:
        sch = getattr(sch, "scheduler", sch)     # accelerate's wrapper holds the schedule
        if hasattr(sch, "base_lrs"):
            sch.base_lrs = [b * factor for b in sch.base_lrs]


def data_index(step: int, skips) -> int:
    """The data batch a run trains on at optimizer step ``step`` after the data skips
    ``skips`` (pairs ``(at_step, batches)``: from step ``at_step`` on, ``batches`` more are
    passed over; a rollback's ``skip_batches``). A callback keeps the pairs in its
    checkpoints; the script maps its steps to data with this (the examples do)."""
    return step + sum(k for at, k in skips if step >= at)
