"""Self-healing for the Hugging Face Trainer: one callback (``pip install clusterops[hf]``).

    from clusterops.integrations.transformers import ClusteropsTrainerCallback, resume_path
    trainer = Trainer(model, args, train_dataset=..., callbacks=[ClusteropsTrainerCallback()])
    trainer.train(resume_from_checkpoint=resume_path())

What the callback does:
- beats the supervisor's heartbeat after every optimizer step (``sdk.heartbeat``), and hands
  it the loss and grad norm the Trainer logs (``on_log``) for the stability guard;
- turns a stop request (the supervisor's stop file or SIGUSR2, the lead-time SIGUSR1,
  SIGTERM) into a save at the current step and the end of ``train`` (``should_save``
  and ``should_training_stop``; all ranks agree through ``sdk.should_stop``);
  ``stopped`` is then True and the script exits 0;
- after the Trainer wrote a checkpoint (``save_steps`` or a stop), rank 0 moves its
  files (``output_dir/checkpoint-<N>``) into a clusterops pending checkpoint and
  commits it atomically with a manifest (``step_<N>``, kind ``hf``) under the
  checkpoint root, so the supervisor sees, verifies and resumes from it. The
  Trainer reads a committed directory as it is (the manifest is one more file).

Many ranks: the Trainer (through ``accelerate``) takes its rank and world only from
torchrun's variables (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), which an srun task
does not have. Importing this module therefore exports them from the srun task's
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (:func:`export_rank_env`) when
the task is one of several and torchrun's are absent: import it before building
``TrainingArguments`` (which sets up the process group). The rendezvous is the
``MASTER_ADDR``/``MASTER_PORT`` the supervisor exports to its training step. On CPU the
Trainer joins with gloo. Every rank writes its part of a save (rank 0 the model,
optimizer and state; each rank its RNG state); the callback holds a barrier before
rank 0 commits, so the commit holds every rank's part, and every rank resumes from it.

``resume_path()`` is the directory to pass as ``resume_from_checkpoint``:
the resume variable (``protocol.ENV_RESUME_FROM``) when it verifies, else the newest good checkpoint under
the checkpoint root (``protocol.ENV_CKPT_DIR``). The Trainer has no SLURM requeue of its own and installs no
signal handlers; the SDK's (installed at ``on_train_begin``) are the only ones.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from transformers import TrainerCallback

from clusterops import checkpoint as ck
from clusterops import sdk
from clusterops.integrations import leave_process_group_at_exit, rank_layout, resume_dir

log = logging.getLogger(__name__)

KIND = "hf"
PREFIX = "checkpoint-"      # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


def export_rank_env() -> bool:
    """Give an srun task of a many-rank step torchrun's rank variables; True when it set them.

    Nothing changes when ``WORLD_SIZE`` is already set (torchrun, or the user) or the
    process is alone. Called on import (module docstring).
    """
    if os.environ.get("WORLD_SIZE"):
        return False
    lay = rank_layout()
    if lay["world_size"] <= 1:
        return False
    os.environ.update({"RANK": str(lay["rank"]), "WORLD_SIZE": str(lay["world_size"]),
                       "LOCAL_RANK": str(lay["local_rank"]), "LOCAL_WORLD_SIZE": str(lay["local_world_size"])})
    return True


export_rank_env()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def resume_path(root: Optional[os.PathLike] = None) -> Optional[str]:
    """``resume_from_checkpoint`` for ``Trainer.train``: a committed checkpoint directory, or None."""
    d = resume_dir(root)
    if d is None:
        return None
    if not (d / "trainer_state.json").is_file():
        log.warning("checkpoint %s has no trainer_state.json (not written by this callback); starting fresh", d)
        return None
    return str(d)


class ClusteropsTrainerCallback(TrainerCallback):
    """Heartbeat, stop-and-save and atomic commits for ``transformers.Trainer`` (module docstring)."""

    def __init__(self, *, root: Optional[os.PathLike] = None):
        self.root = root
        self.stopped = False          # train ended on a stop request (a checkpoint was committed)
        self.last_committed: Optional[Path] = None

    def on_train_begin(self, args, state, control, **kwargs):
        sdk.install_stop_handlers()
        leave_process_group_at_exit()
        sdk.heartbeat(state.global_step, force=True)

    def on_step_end(self, args, state, control, **kwargs):
        sdk.heartbeat(state.global_step)
        if sdk.should_stop():          # a collective: every rank calls it here, every step
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
            log.info("clusterops: stop requested (%s); saving at step %d", sdk.stop_reason(), state.global_step)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        # The Trainer's logged loss and grad norm (every `logging_steps`) for the supervisor's
        # stability guard: floats already, no device sync of ours.
        logs = logs or {}
        if "loss" in logs or "grad_norm" in logs:
            sdk.heartbeat(state.global_step, loss=logs.get("loss"), grad_norm=logs.get("grad_norm"))
        return control

    def on_save(self, args, state, control, **kwargs):
        # Every rank wrote its part (its RNG state at least) before this hook; the commit
        # must hold them all, and no rank may write into the directory once it moved.
        _barrier()
        if state.is_world_process_zero:
            src = Path(args.output_dir) / f"{PREFIX}{state.global_step}"
            if src.is_dir():
                self.last_committed = self.commit(src, state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        sdk.heartbeat(state.global_step, force=True)

    def commit(self, src: Path, step: int) -> Path:
        """Move the Trainer's checkpoint directory into a clusterops commit (rank 0)."""
        root = sdk.ckpt_root(self.root)
        pending = ck.PendingCheckpoint(root, step)
        try:
            for p in sorted(src.rglob("*")):
                rel = p.relative_to(src)
                dest = pending.path / rel
                if p.is_dir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(p), str(dest))
                with open(dest, "rb") as f:
                    os.fsync(f.fileno())
                pending.record_file(str(rel))
            path = pending.commit(world_size=rank_layout()["world_size"], kind=KIND,
                                  meta={"restart_count": sdk.restart_count(), "framework": "transformers"})
        except BaseException as e:
            if not pending.committed:
                pending.abort()
            raise ck.wrap_save_error(e, root, step) from e
        shutil.rmtree(src, ignore_errors=True)
        log.info("clusterops: checkpoint step %d committed at %s", step, path)
        return path
