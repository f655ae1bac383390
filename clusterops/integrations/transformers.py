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

Stability rollback, inside the Trainer's own resume: when the supervisor rolled back
(``sdk.resume_hint`` for the restored step), ``on_train_begin`` -- after the Trainer loaded
the weights, optimizer and schedule -- multiplies the learning rate of the optimizer and
the schedule's base rates by ``lr_factor`` and adds ``(step, skip_batches)`` to
``data_skips``. The Trainer itself fast-forwards its loader by the steps already trained;
the extra skip is the script's data mapping, ``data_index(step)`` (examples/hf_train.py's
dataset maps the Trainer's position through it, so its sampler position stays the
Trainer's own). ``data_skips`` go into each checkpoint (``clusterops-data.json``, written
before the commit) and come back on every later resume.

``resume_path()`` is the directory to pass as ``resume_from_checkpoint``:
the resume variable (``protocol.ENV_RESUME_FROM``) when it verifies, else the newest good checkpoint under
the checkpoint root (``protocol.ENV_CKPT_DIR``). The Trainer has no SLURM requeue of its own and installs no
signal handlers; the SDK's (installed at ``on_train_begin``) are the only ones.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from transformers import TrainerCallback

from clusterops import checkpoint as ck
from clusterops import protocol, sdk
from clusterops.integrations import data_index, leave_process_group_at_exit, rank_layout, resume_dir, scale_lr

log = logging.getLogger(__name__)
sdk._keep_group_collectable()   # before the framework forms its group (leave_process_group_at_exit)

KIND = "hf"
DATA_FILE = "clusterops-data.json"   # the rollbacks' data skips, in each checkpoint
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

    def __init__(self, *, root: Optional[os.PathLike] = None, check_replicas: Optional[bool] = None):
        self.root = root
        # sdk.check_replicas after every step: None = under plain DDP (every rank holds the
        # whole model); not with FSDP or DeepSpeed, whose ranks hold different shards.
        self.check_replicas = check_replicas
        self.stopped = False          # train ended on a stop request (a checkpoint was committed)
        self.last_committed: Optional[Path] = None
        self.data_skips: List[Tuple[int, int]] = []   # (at_step, batches): rollbacks' data skips
        self.hint: Optional[protocol.ResumeHint] = None   # the rollback this run resumed with

    def data_index(self, step: int) -> int:
        """The data batch of the Trainer's step position ``step`` after the rollbacks' skips."""
        return data_index(step, self.data_skips)

    def skip(self, step: int, batches: int, lr_factor: float = 1.0, optimizer=None, lr_scheduler=None) -> None:
        """From step ``step`` on, pass over ``batches`` data batches; multiply the learning
        rate of ``optimizer`` and ``lr_scheduler`` by ``lr_factor`` now (what a rollback's hint
        asks; a reference run calls it at the same step)."""
        if batches:
            self.data_skips.append((step, batches))
        scale_lr([optimizer] if optimizer is not None else [], [lr_scheduler] if lr_scheduler is not None else [],
                 lr_factor)

    def _restore_skips(self, step: int) -> None:
        d = resume_dir(self.root) if step > 0 else None
        if d is None or not (d / DATA_FILE).is_file():
            return
        try:
            if json.loads((d / "trainer_state.json").read_text()).get("global_step") != step:
                return            # the Trainer resumed from somewhere else
            self.data_skips = [(int(a), int(k)) for a, k in json.loads((d / DATA_FILE).read_text())["data_skips"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{d / DATA_FILE}: not a clusterops data-skip file ({e})") from e

    def on_train_begin(self, args, state, control, **kwargs):
        sdk.install_stop_handlers()
        leave_process_group_at_exit()
        # The Trainer loaded the checkpoint (weights, optimizer, schedule) before this hook
        # and iterates its loader only after it: the data skips and a rollback's hint go here.
        self._restore_skips(state.global_step)
        self.hint = sdk.resume_hint(state.global_step) if state.global_step > 0 else None
        if self.hint is not None:
            self.skip(state.global_step, self.hint.skip_batches, self.hint.lr_factor,
                      kwargs.get("optimizer"), kwargs.get("lr_scheduler"))
            log.warning("clusterops: rollback-hint step=%d skip=%d lr_factor=%s", state.global_step,
                        self.hint.skip_batches, self.hint.lr_factor)
        sdk.heartbeat(state.global_step, force=True)

    def on_step_end(self, args, state, control, **kwargs):
        model = kwargs.get("model")
        if model is not None and self._replicated(args):
            sdk.check_replicas(state.global_step, model.parameters())   # a collective every N steps
        sdk.heartbeat(state.global_step)
        if sdk.should_stop():          # a collective: every rank calls it here, every step
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
            log.info("clusterops: stop requested (%s); saving at step %d", sdk.stop_reason(), state.global_step)
        return control

    def _replicated(self, args) -> bool:
        if self.check_replicas is not None:
            return self.check_replicas
        return (args.world_size > 1 and str(getattr(args.parallel_mode, "value", args.parallel_mode)) == "distributed"
                and not args.fsdp and not args.deepspeed)

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
                (src / DATA_FILE).write_text(json.dumps({"data_skips": [list(x) for x in self.data_skips]}))
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
