"""Self-healing for PyTorch Lightning: one callback (``pip install clusterops[lightning]``).

    from clusterops.integrations.lightning import ClusteropsCallback, resume_path, trainer_layout
    trainer = L.Trainer(max_steps=..., **trainer_layout(), callbacks=[ClusteropsCallback(every_n_steps=50)])
    trainer.fit(model, data, ckpt_path=resume_path())

Many ranks: ``trainer_layout()`` gives ``num_nodes`` and ``devices`` from the launcher
(Lightning checks both against ``SLURM_NNODES``/``SLURM_NTASKS_PER_NODE`` and refuses a
mismatch). The rest Lightning finds itself: under an srun step (the supervisor's, or
the plain srun launcher's) its ``SLURMEnvironment`` reads the rank from
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and the rendezvous from the
``MASTER_ADDR``/``MASTER_PORT`` the supervisor exports; under torchrun its
``TorchElasticEnvironment`` reads torchrun's variables.

What the callback does:
- beats the supervisor's heartbeat after every training batch (``sdk.heartbeat``), with the
  loss ``training_step`` returned (the stability guard);
- turns a stop request (the supervisor's stop file or SIGUSR2, the lead-time SIGUSR1,
  SIGTERM) into a checkpoint at the current step and a clean end of ``fit`` (all ranks
  agree through ``sdk.should_stop``); ``stopped`` is then True and the script exits 0;
- writes checkpoints (every ``every_n_steps`` and on a stop) with
  ``trainer.save_checkpoint`` into a clusterops pending checkpoint that global rank 0
  commits atomically with a manifest (``step_<N>/lightning.ckpt``), so the supervisor
  sees, verifies and resumes from them. Every rank calls the save (Lightning writes the
  file on rank 0 and then holds a barrier); with DDP the state is replicated, so rank
  0's file is the whole checkpoint and every rank resumes from it;
- applies a stability rollback inside Lightning's own resume: when the supervisor rolled
  back (``sdk.resume_hint`` for the restored step), it multiplies the restored optimizers'
  learning rate (and their schedulers' base rates) by ``lr_factor`` and adds the skip to
  ``data_skips``, pairs ``(at_step, batches)`` kept in Lightning's checkpoint with the
  callback's state. Lightning restores no loader position of its own here, so the script
  maps its step to data with ``data_index(step)`` (examples/lightning_train.py does);
- when supervised (the heartbeat variable, ``protocol.ENV_HEARTBEAT_DIR``, set), turns off Lightning's SLURM
  auto-requeue (the supervisor requeues, once) and puts the SDK's signal handlers back
  after Lightning installed its own, so SIGTERM is a save-and-stop and never
  Lightning's ``SIGTERMException`` or its ``scontrol requeue``.

``resume_path()`` is the file to pass as ``ckpt_path``: inside the resume variable
when it verifies, else the newest good checkpoint under the checkpoint root.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional, Tuple

import lightning.pytorch as pl

from clusterops import checkpoint as ck
from clusterops import protocol, sdk
from clusterops.integrations import data_index, leave_process_group_at_exit, rank_layout, resume_dir, scale_lr

log = logging.getLogger(__name__)
sdk._keep_group_collectable()   # before the framework forms its group (leave_process_group_at_exit)

CKPT_FILE = "lightning.ckpt"
KIND = "lightning"


def supervised() -> bool:
    """Running under ``clusterops supervise`` (it sets the heartbeat directory)."""
    return bool(os.environ.get(protocol.ENV_HEARTBEAT_DIR))


def trainer_layout() -> dict:
    """``num_nodes`` and ``devices`` for ``L.Trainer`` from the launcher's variables (one process: 1 and 1)."""
    lay = rank_layout()
    return {"num_nodes": lay["num_nodes"], "devices": lay["local_world_size"]}


def resume_path(root: Optional[os.PathLike] = None) -> Optional[str]:
    """``ckpt_path`` for ``Trainer.fit``: the Lightning file of the checkpoint to resume from, or None."""
    d = resume_dir(root)
    if d is None:
        return None
    path = d / CKPT_FILE
    if not path.is_file():
        log.warning("checkpoint %s has no %s (not written by this callback); starting fresh", d, CKPT_FILE)
        return None
    return str(path)


def _loss_of(outputs):
    """The loss ``training_step`` returned (a tensor, or a dict's ``loss``), for the stability
    guard; None when there is none. A tensor on a GPU costs a device sync per batch."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None or not hasattr(loss, "detach"):
        return None
    return loss.detach()


class ClusteropsCallback(pl.Callback):
    """Heartbeat, stop-and-save, atomic checkpoints and the requeue rule (module docstring)."""

    def __init__(self, every_n_steps: int = 0, *, root: Optional[os.PathLike] = None,
                 check_replicas: Optional[bool] = None):
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.root = root
        # sdk.check_replicas after every step: None = when the strategy replicates the whole
        # model on every rank (DDP); sharded strategies (FSDP, DeepSpeed) hold different shards.
        self.check_replicas = check_replicas
        self.stopped = False          # fit ended on a stop request (a checkpoint was committed)
        self.last_saved: Optional[int] = None
        self.data_skips: List[Tuple[int, int]] = []   # (at_step, batches): rollbacks' data skips
        self.hint: Optional[protocol.ResumeHint] = None   # the rollback this run resumed with

    # -- state in Lightning's checkpoint -------------------------------------------------
    def state_dict(self) -> dict:
        return {"data_skips": [list(s) for s in self.data_skips]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.data_skips = [(int(a), int(k)) for a, k in state_dict.get("data_skips", [])]

    def data_index(self, step: int) -> int:
        """The data batch of optimizer step ``step`` after the rollbacks' skips."""
        return data_index(step, self.data_skips)

    def skip(self, trainer: "pl.Trainer", batches: int, lr_factor: float = 1.0) -> None:
        """From the current step on, pass over ``batches`` data batches and multiply the
        learning rate by ``lr_factor`` (what a rollback's hint asks; a reference run calls it
        at the same step)."""
        if batches:
            self.data_skips.append((trainer.global_step, batches))
        scale_lr(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs], lr_factor)

    # -- the requeue rule --------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        sdk.install_stop_handlers()
        if not supervised():
            return
        from lightning.fabric.plugins.environments import SLURMEnvironment

        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            # Lightning would answer the lead-time signal with `scontrol requeue` and its
            # own checkpoint: two requeuers. Under the supervisor, the supervisor requeues.
            env._auto_requeue = False
            log.info("clusterops: Lightning's SLURM auto-requeue turned off (the supervisor requeues)")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Trainer.fit registered Lightning's SIGTERM handler (and maybe its requeue handler)
        # just before this hook; ours go back on top, so a signal is a stop request only.
        sdk.install_stop_handlers(force=True)
        leave_process_group_at_exit()
        # The checkpoint (weights, optimizers, schedulers, our data_skips) is restored by
        # now: a rollback's skip and LR factor go on top of it.
        self.hint = sdk.resume_hint(trainer.global_step)
        if self.hint is not None:
            self.skip(trainer, self.hint.skip_batches, self.hint.lr_factor)
            log.warning("clusterops: rollback-hint step=%d skip=%d lr_factor=%s", trainer.global_step,
                        self.hint.skip_batches, self.hint.lr_factor)
        sdk.heartbeat(trainer.global_step, force=True)

    # -- every step ----------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._replicated(trainer):
            sdk.check_replicas(step, pl_module.parameters())   # a collective every N steps, else a modulo
        sdk.heartbeat(step, loss=_loss_of(outputs))
        stop = sdk.should_stop()       # a collective: every rank calls it here, every batch
        due = self.every_n_steps and step % self.every_n_steps == 0 and step != self.last_saved
        if stop or due:
            if step != self.last_saved:
                self.save(trainer)
        if stop:
            self.stopped = True
            trainer.should_stop = True
            log.info("clusterops: stop requested (%s); checkpoint at step %d, ending fit", sdk.stop_reason(), step)

    def _replicated(self, trainer) -> bool:
        if self.check_replicas is not None:
            return self.check_replicas
        return trainer.world_size > 1 and type(trainer.strategy).__name__ == "DDPStrategy"

    def on_train_end(self, trainer, pl_module) -> None:
        sdk.heartbeat(trainer.global_step, force=True)

    # -- saving --------------------------------------------------------------------------
    def save(self, trainer: "pl.Trainer") -> Optional[Path]:
        """Commit Lightning's full checkpoint at the current step (collective); rank 0 returns the path."""
        step = trainer.global_step
        root = sdk.ckpt_root(self.root)
        pending = ck.PendingCheckpoint(root, step) if trainer.is_global_zero else None
        target = pending.path / CKPT_FILE if pending is not None else root / CKPT_FILE  # only rank 0 writes
        try:
            trainer.save_checkpoint(str(target))     # every rank; Lightning writes on rank 0, then a barrier
            if pending is None:
                self.last_saved = step
                return None
            with open(target, "rb") as f:
                os.fsync(f.fileno())
            pending.record_file(CKPT_FILE)
            path = pending.commit(world_size=trainer.world_size, kind=KIND,
                                  meta={"restart_count": sdk.restart_count(), "framework": "lightning"})
        except BaseException as e:
            if pending is not None and not pending.committed:
                pending.abort()
            raise ck.wrap_save_error(e, root, step) from e
        self.last_saved = step
        log.info("clusterops: checkpoint step %d committed at %s", step, path)
        return path
