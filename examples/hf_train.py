#!/usr/bin/env python3
"""A Hugging Face Trainer script healed by the supervisor: two lines of clusterops.

    trainer = Trainer(..., callbacks=[ClusteropsTrainerCallback()])
    trainer.train(resume_from_checkpoint=resume_path())

Tiny regression model and synthetic dataset built here, CPU, no hub downloads
(HF_HUB_OFFLINE=1). Deterministic with the Trainer's own seed and data order (it skips
the batches already seen when it resumes mid-epoch). One process, or many with DDP
over gloo: srun tasks (importing the integration gives them torchrun's rank variables,
before TrainingArguments is built) or torchrun workers.

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
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from clusterops import protocol, sdk  # noqa: E402
from clusterops.integrations.transformers import ClusteropsTrainerCallback, resume_path  # noqa: E402


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


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 16)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


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
    root = sdk.ckpt_root()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = Regressor(args.step_sleep)
    targs = TrainingArguments(
        output_dir=str(root / "hf-out"), max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=1e-2, lr_scheduler_type="constant", seed=args.seed, data_seed=args.seed,
        save_strategy="steps" if args.ckpt_every else "no", save_steps=args.ckpt_every or 1,
        logging_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, full_determinism=True, remove_unused_columns=False,
        ddp_find_unused_parameters=False)
    cb = ClusteropsTrainerCallback()
    trainer = Trainer(model=model, args=targs, train_dataset=Synthetic(256, args.seed), callbacks=[cb])
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
