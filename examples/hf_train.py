#!/usr/bin/env python3
"""A Hugging Face Trainer script healed by the supervisor: two lines of clusterops.

    trainer = Trainer(..., callbacks=[ClusteropsTrainerCallback()])
    trainer.train(resume_from_checkpoint=resume_path())

Tiny regression model and synthetic dataset built here, CPU, no hub downloads
(HF_HUB_OFFLINE=1). Deterministic with the Trainer's own seed and data order (it skips
the batches already seen when it resumes mid-epoch). One process, or many with DDP
over gloo: srun tasks (importing the integration gives them torchrun's rank variables,
before TrainingArguments is built) or torchrun workers.

Stability flags for tests, as examples/train.py's: ``--poison-batches A:B`` (data batches
A..B-1: targets x100 for the first half, a loss spike, then NaN), ``--skip-batches-at
STEP:K`` and ``--lr-factor-at STEP:F`` (the reference of a rollback, through the same
``ClusteropsTrainerCallback.skip`` a rollback's hint uses). The data are a stream: the
samples of the Trainer's step position s come from data batch ``cb.data_index(s)`` (a
sequential sampler; the Trainer fast-forwards it by itself on a resume). The Trainer logs
loss and grad norm every step (NaN unfiltered): the stability guard's signals.

Output: ``stopped step=N`` (a stop request: checkpoint committed, exit 0) or
``done step=N out=FILE`` (finished; FILE = torch.save of the model's state_dict).

    python examples/hf_train.py --steps 60 --ckpt-every 10 --ckpt-dir /tmp/ck --out w.pt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from clusterops import protocol, sdk  # noqa: E402
from clusterops.integrations import rank_layout  # noqa: E402
from clusterops.integrations.transformers import ClusteropsTrainerCallback, resume_path  # noqa: E402

BATCH = 8


class Regressor(nn.Module):
    def __init__(self, step_sleep: float):
        super().__init__()
        self.step_sleep = step_sleep
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x, y):
        if self.step_sleep and self.training:
            time.sleep(self.step_sleep)
        pred = self.net(x).squeeze(1)
        return {"loss": ((pred - y) ** 2).mean(), "logits": pred}


class Stream(torch.utils.data.Dataset):
    """Sample i of the Trainer's sequential order: step position i // G (G samples a step
    over all ranks), mapped to its data batch past the rollbacks' skips; each data batch
    is drawn from (seed, batch). Pure in i and the skips, so a loader that reads ahead
    gets what the step will use."""

    def __init__(self, steps: int, seed: int, cb: ClusteropsTrainerCallback, poison):
        self.per_step = BATCH * rank_layout()["world_size"]
        self.n, self.seed, self.cb, self.poison = steps * self.per_step, seed, cb, poison
        self.w = torch.linspace(-1, 1, 16)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        step, j = divmod(i, self.per_step)
        d = self.cb.data_index(step)
        x = torch.randn(self.per_step, 16, generator=torch.Generator().manual_seed(self.seed * 1000003 + d))[j]
        y = x @ self.w
        if self.poison is not None and self.poison[0] <= d < self.poison[1]:
            a, b = self.poison
            y = y * 100.0 if d < (a + b) // 2 else torch.full_like(y, float("nan"))
        return {"x": x, "y": y}


class Reference(TrainerCallback):
    """--lr-factor-at: the LR factor at the step a rollback would apply it."""

    def __init__(self, cb: ClusteropsTrainerCallback, at):
        self.cb, self.at = cb, at

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.at is not None and state.global_step == self.at[0]:
            self.cb.skip(state.global_step, 0, self.at[1], optimizer, lr_scheduler)
            self.at = None


def _pair(kind):
    def parse(text: str):
        a, b = text.split(":")
        return int(a), kind(b)
    return parse


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
                   help="from step STEP on skip K more data batches (what a rollback's hint does)")
    p.add_argument("--lr-factor-at", type=_pair(float), default=None, metavar="STEP:F",
                   help="at step STEP multiply the learning rate by F (a rollback's LR factor)")
    args = p.parse_args(argv)
    if args.ckpt_dir is not None:
        os.environ[protocol.ENV_CKPT_DIR] = str(args.ckpt_dir)
    root = sdk.ckpt_root()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = Regressor(args.step_sleep)
    targs = TrainingArguments(
        output_dir=str(root / "hf-out"), max_steps=args.steps, per_device_train_batch_size=BATCH,
        learning_rate=1e-2, lr_scheduler_type="constant", seed=args.seed, data_seed=args.seed,
        save_strategy="steps" if args.ckpt_every else "no", save_steps=args.ckpt_every or 1,
        logging_strategy="steps", logging_steps=1, logging_nan_inf_filter=False, report_to="none",
        train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, full_determinism=True, remove_unused_columns=False,
        ddp_find_unused_parameters=False)
    cb = ClusteropsTrainerCallback()
    if args.skip_batches_at is not None:      # a data skip is a pure mapping: known from the start
        cb.data_skips.append(args.skip_batches_at)
    trainer = Trainer(model=model, args=targs, train_dataset=Stream(args.steps, args.seed, cb, args.poison_batches),
                      callbacks=[cb, Reference(cb, args.lr_factor_at)])
    ckpt = resume_path()
    if ckpt:
        print(f"resume path={ckpt}", flush=True)
        done = json.loads((Path(ckpt) / "trainer_state.json").read_text())["global_step"] >= args.steps
    if ckpt and done:
        # The last checkpoint is the end (killed after saving it): the Trainer would take
        # one step more; load the weights instead.
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(Path(ckpt) / "model.safetensors")))
        trainer.state.global_step = args.steps
    else:
        trainer.train(resume_from_checkpoint=ckpt)
    step = trainer.state.global_step
    if cb.stopped:
        print(f"stopped step={step} reason={sdk.stop_reason()}", flush=True)
        return 0
    if args.out is not None and trainer.is_world_process_zero():
        tmp = args.out.with_name(args.out.name + ".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.out)
    print(f"done step={step} out={args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
