#!/usr/bin/env python3
"""A Lightning script healed by the supervisor: two lines of clusterops.

    trainer = L.Trainer(..., **trainer_layout(), callbacks=[ClusteropsCallback(every_n_steps=K)])
    trainer.fit(model, loader, ckpt_path=resume_path())

Tiny regression model built here, CPU, no downloads. Deterministic: the batch of step s
on rank r comes from a generator seeded with (seed, s, r), so where the data loader
restarts after a resume does not matter and a resumed run ends with the same weights,
bitwise, as an uninterrupted one of the same world size. One process, or many with
DDP over gloo: srun tasks (Lightning's SLURM environment: the supervisor's training
step, or the plain srun launcher) or torchrun workers; ``trainer_layout()`` sizes the
Trainer from the launcher's variables.

Stability flags for tests, as examples/train.py's: ``--poison-batches A:B`` (data batches
A..B-1: targets x100 for the first half, a loss spike, then NaN), ``--skip-batches-at
STEP:K`` and ``--lr-factor-at STEP:F`` (the reference of a rollback, through the same
``ClusteropsCallback.skip`` a rollback's hint uses). The data batch of a step is
``cb.data_index(step)``: the step past the rollbacks' skips. The loss goes with the heartbeat.

Output: ``stopped step=N`` (a stop request: checkpoint committed, exit 0) or
``done step=N out=FILE`` (finished; FILE = torch.save of the model's state_dict).

    python examples/lightning_train.py --steps 60 --ckpt-every 10 --ckpt-dir /tmp/ck --out w.pt
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from clusterops import protocol, sdk
from clusterops.integrations.lightning import ClusteropsCallback, resume_path, trainer_layout


def _pair(kind):
    def parse(text: str):
        a, b = text.split(":")
        return int(a), kind(b)
    return parse


class Regressor(L.LightningModule):
    def __init__(self, seed: int, step_sleep: float, cb: ClusteropsCallback, args):
        super().__init__()
        self.seed, self.step_sleep, self.cb, self.args = seed, step_sleep, cb, args
        self._reference_done: set = set()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.register_buffer("target", torch.linspace(-1, 1, 16))

    def on_train_batch_start(self, batch, batch_idx):
        a = self.args
        at_skip = a.skip_batches_at is not None and self.global_step == a.skip_batches_at[0]
        at_lr = a.lr_factor_at is not None and self.global_step == a.lr_factor_at[0]
        if (at_skip or at_lr) and self.global_step not in self._reference_done:
            self._reference_done.add(self.global_step)
            self.cb.skip(self.trainer, a.skip_batches_at[1] if at_skip else 0, a.lr_factor_at[1] if at_lr else 1.0)

    def training_step(self, batch, batch_idx):
        # The batch depends on (seed, data batch, rank) alone: never on where the loader
        # restarted. The data batch is the step past the rollbacks' skips.
        d = self.cb.data_index(int(self.global_step))
        g = torch.Generator().manual_seed(self.seed * 1000003 + d * 131 + self.global_rank * 7)
        x = torch.randn(8, 16, generator=g)
        y = x @ self.target
        if self.args.poison_batches is not None:
            a, b = self.args.poison_batches
            if a <= d < b:
                y = y * 100.0 if d < (a + b) // 2 else torch.full_like(y, float("nan"))
        loss = ((self.net(x).squeeze(1) - y) ** 2).mean()
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint root (default $CLUSTEROPS_CKPT_DIR)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--poison-batches", type=_pair(int), default=None, metavar="A:B",
                   help="poison the data batches A..B-1: targets x100 for the first half (a spike), then NaN")
    p.add_argument("--skip-batches-at", type=_pair(int), default=None, metavar="STEP:K",
                   help="at step STEP skip the next K data batches (what a rollback's hint does)")
    p.add_argument("--lr-factor-at", type=_pair(float), default=None, metavar="STEP:F",
                   help="at step STEP multiply the learning rate by F (a rollback's LR factor)")
    args = p.parse_args(argv)
    if args.ckpt_dir is not None:
        os.environ[protocol.ENV_CKPT_DIR] = str(args.ckpt_dir)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    L.seed_everything(args.seed, workers=True, verbose=False)
    cb = ClusteropsCallback(every_n_steps=args.ckpt_every)
    model = Regressor(args.seed, args.step_sleep, cb, args)
    loader = DataLoader(TensorDataset(torch.arange(args.steps * 4)), batch_size=1, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", **trainer_layout(), max_steps=args.steps, deterministic=True, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb])
    ckpt = resume_path()
    if ckpt:
        print(f"resume path={ckpt}", flush=True)
    trainer.fit(model, loader, ckpt_path=ckpt, weights_only=True)
    step = trainer.global_step
    if cb.stopped:
        print(f"stopped step={step} reason={sdk.stop_reason()}", flush=True)
        return 0
    if args.out is not None and trainer.is_global_zero:
        tmp = args.out.with_name(args.out.name + ".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.out)
    print(f"done step={step} out={args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
