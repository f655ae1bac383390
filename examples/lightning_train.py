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


class Regressor(L.LightningModule):
    def __init__(self, seed: int, step_sleep: float):
        super().__init__()
        self.seed, self.step_sleep = seed, step_sleep
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.register_buffer("target", torch.linspace(-1, 1, 16))

    def training_step(self, batch, batch_idx):
        # The batch depends on (seed, step, rank) alone: never on where the loader restarted.
        g = torch.Generator().manual_seed(self.seed * 1000003 + int(self.global_step) * 131 + self.global_rank * 7)
        x = torch.randn(8, 16, generator=g)
        loss = ((self.net(x).squeeze(1) - x @ self.target) ** 2).mean()
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
    args = p.parse_args(argv)
    if args.ckpt_dir is not None:
        os.environ[protocol.ENV_CKPT_DIR] = str(args.ckpt_dir)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    L.seed_everything(args.seed, workers=True, verbose=False)
    model = Regressor(args.seed, args.step_sleep)
    loader = DataLoader(TensorDataset(torch.arange(args.steps * 4)), batch_size=1, shuffle=False)
    cb = ClusteropsCallback(every_n_steps=args.ckpt_every)
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
