#!/usr/bin/env python3
"""A plain PyTorch DDP script, written the way the PyTorch tutorials teach: env:// only.

It knows nothing of clusterops or Slurm. ``dist.init_process_group("gloo")`` is called
with no rank, world size or address: torch reads RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT from the environment (the env:// contract), and the script takes its local
rank from LOCAL_RANK, as torchrun would give it. The launcher must provide all of them;
clusterops does, unsupervised (templates/srun.sh.j2) and under ``supervise:``.

Its own checkpoints (``ckpt_<step>.pt``: torch.save to a ``.tmp`` name, then rename),
``step=N`` lines on rank 0, ``--resume PATH``, and a save-and-exit-0 on SIGUSR1 or SIGTERM:

    supervise:
      progress: {regex: 'step=(\\d+)'}
      checkpoint_glob: 'ckpt_*.pt'
      resume_args: [--resume, '{ckpt}']

``--env-record DIR`` writes each rank's view of the env:// variables to DIR/rank<R>.json
(so a test can check what every task was given). Deterministic: the batch of step s is
drawn from a generator seeded with (seed, s, rank), so a resumed run ends bitwise equal to
one that never stopped. That also needs DDP's gradient buckets to be the same in both:
DDP rebuilds them after the first iteration of a process (in gradient-ready order), which
changes where each value sits in the all-reduced buffer, and so the order of the sums;
``find_unused_parameters=True`` keeps the first layout for good.
"""

from __future__ import annotations

import argparse
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
STOP = {"signal": None}


def on_signal(signum, frame):
    STOP["signal"] = signal.Signals(signum).name


def save(model, opt, step: int, ckpt_dir: Path) -> Path:
    path = ckpt_dir / f"ckpt_{step:07d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
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
    p.add_argument("--env-record", type=Path, default=None)
    args = p.parse_args(argv)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, on_signal)
    torch.set_num_threads(1)
    if torch.cuda.is_available():     # on the CPU, one thread, these ops are deterministic already;
        torch.use_deterministic_algorithms(True)     # the call imports torch._inductor (0.6 CPU-s a rank)

    dist.init_process_group("gloo")             # env://: everything from the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])  # what a GPU script passes to set_device
    if args.env_record is not None:
        args.env_record.mkdir(parents=True, exist_ok=True)
        seen = {k: os.environ.get(k) for k in ENV_VARS}
        seen.update(dist_rank=rank, dist_world=world, slurm_procid=os.environ.get("SLURM_PROCID"),
                    slurm_nodeid=os.environ.get("SLURM_NODEID"), pid=os.getpid())
        (args.env_record / f"rank{rank}.json").write_text(json.dumps(seen))
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    if args.resume is not None:
        state = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)
    target = torch.linspace(-1, 1, 16)
    while step < args.steps:
        g = torch.Generator().manual_seed(args.seed * 1000003 + step * 131 + rank)
        x = torch.randn(8, 16, generator=g)
        loss = ((model(x).squeeze(1) - x @ target) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()                         # DDP averages the gradients over the ranks
        opt.step()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0:
            print(f"step={step} loss={loss.item():.6f} local_rank={local_rank}", flush=True)
        # Every rank stops at the same step: agree on the flag.
        flag = torch.tensor([1 if STOP["signal"] else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stopping = bool(flag.item()) and step < args.steps
        if rank == 0 and (stopping or (args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps)):
            print(f"saved {save(model, opt, step, args.ckpt_dir)}", flush=True)
        if stopping:
            dist.barrier()                      # rank 0's checkpoint is on disk before anyone leaves
            del model, opt
            dist.destroy_process_group()
            print(f"rank {rank} stopping on {STOP['signal'] or 'another rank'}", flush=True)
            return 0
    if rank == 0 and args.out is not None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        torch.save(model.module.state_dict(), tmp)
        os.replace(tmp, args.out)
        print(f"done steps={step} out={args.out}", flush=True)
    dist.barrier()
    del model, opt                              # DDP's reducer goes before its process group
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
