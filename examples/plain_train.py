#!/usr/bin/env python3
"""A training script that knows nothing of clusterops, and how the supervisor still heals it.

No clusterops import: it prints ``step=N`` after each step (rank 0), saves its own
checkpoints with torch.save (write ``.tmp``, then rename), resumes from ``--resume
PATH``, and on SIGUSR1 (the lead-time signal) or SIGTERM (preemption) saves at the
current step and exits 0. A job spec supervises it with:

    supervise:
      progress: {regex: 'step[= ](\\d+)'}
      checkpoint_glob: 'ckpt_*.pt'
      resume_args: [--resume, '{ckpt}']

Ranks: torchrun's RANK/WORLD_SIZE or srun's SLURM_PROCID/SLURM_NTASKS, with
MASTER_ADDR/MASTER_PORT; gloo on CPU. Deterministic: the batch of step s is drawn from
a generator seeded with (seed, s, rank), so a run resumed from any checkpoint ends
with the same weights, bitwise, as one that never stopped.

    python examples/plain_train.py --steps 60 --ckpt-every 10 --ckpt-dir /tmp/ck --out w.pt
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
# Imported before init_process_group(): first imported later (the first optimizer or DDP
# model imports torch._dynamo, which imports it), its functions' default arguments would
# hold the group past destroy_process_group(), and a worker thread of that group can
# abort the process as Python shuts down (torch 2.13; docs/supervisor.md).
import torch.distributed.nn  # noqa: F401
import torch.nn as nn

STOP = {"signal": None}


def on_signal(signum, frame):
    STOP["signal"] = signal.Signals(signum).name


def env_int(*names, default):
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def save(model, opt, step, ckpt_dir: Path, skipped: int = 0) -> Path:
    path = ckpt_dir / f"ckpt_{step:07d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "skipped": skipped}, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    # The stability guard's flags (tests): a data window whose targets are NaN, and what a
    # rollback's resume_args ({skip_batches}, {lr_factor}) or its reference run pass.
    p.add_argument("--poison-batches", default=None, metavar="A:B", help="data batches A..B-1 have NaN targets")
    p.add_argument("--skip-batches", type=int, default=0, help="on --resume: skip this many batches")
    p.add_argument("--lr-factor", type=float, default=1.0, help="on --resume: multiply the learning rate")
    p.add_argument("--skip-batches-at", default=None, metavar="STEP:K", help="at STEP skip K batches")
    p.add_argument("--lr-factor-at", default=None, metavar="STEP:F", help="at STEP multiply the LR by F")
    args = p.parse_args(argv)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, on_signal)
    torch.set_num_threads(1)
    if torch.cuda.is_available():     # on the CPU, one thread, these ops are deterministic already;
        torch.use_deterministic_algorithms(True)     # the call imports torch._inductor (0.6 CPU-s a rank)
    rank = env_int("RANK", "SLURM_PROCID", default=0)
    world = env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    skipped = 0      # batches skipped so far: the data position is step + skipped
    if args.resume is not None:
        state = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        skipped = int(state.get("skipped", 0)) + args.skip_batches
        for group in opt.param_groups:
            group["lr"] *= args.lr_factor
        if rank == 0:
            print(f"resumed from {args.resume} at step {step} skip={args.skip_batches} lr_factor={args.lr_factor}",
                  flush=True)
    poison = tuple(int(v) for v in args.poison_batches.split(":")) if args.poison_batches else None
    skip_at = tuple(int(v) for v in args.skip_batches_at.split(":")) if args.skip_batches_at else None
    lr_at = args.lr_factor_at.split(":") if args.lr_factor_at else None
    target = torch.linspace(-1, 1, 16)
    while step < args.steps:
        if skip_at is not None and step == skip_at[0]:
            skipped += skip_at[1]
        if lr_at is not None and step == int(lr_at[0]):
            for group in opt.param_groups:
                group["lr"] *= float(lr_at[1])
        data = step + skipped
        g = torch.Generator().manual_seed(args.seed * 1000003 + data * 131 + rank)
        x = torch.randn(8, 16, generator=g)
        y = x @ target
        if poison is not None and poison[0] <= data < poison[1]:
            y = y * float("nan")
        loss = ((model(x).squeeze(1) - y) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0:
            print(f"step={step} loss={loss.item():.6f}", flush=True)
        # Every rank stops at the same step: agree on the flag (one small all-reduce).
        flag = torch.tensor([1 if STOP["signal"] else 0])
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stopping = bool(flag.item()) and step < args.steps
        if rank == 0 and (stopping or (args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps)):
            path = save(model, opt, step, args.ckpt_dir, skipped)
            print(f"saved {path}", flush=True)
        if stopping:
            if world > 1:
                dist.barrier()      # rank 0's checkpoint is on disk before anyone leaves
                dist.destroy_process_group()
            print(f"rank {rank} stopping on {STOP['signal'] or 'another rank'}", flush=True)
            return 0
    if rank == 0 and args.out is not None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.out)
        print(f"done steps={step} out={args.out}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
