#!/usr/bin/env python3
"""Example training through the SDK's recoverable loop (clusterops.recover): heals in-process.

The same small MLP, synthetic data and flags as examples/train.py, written for
``recover.run(train, state)``: everything a rank needs to take over from a lost one is in
``State`` (model, optimizer, LR scheduler, step, epoch and batch), and per-rank randomness
comes from (seed, rank, step) (``recover.seed_step``), so a rank that takes over at step N
draws what the lost one would have. Under ``clusterops supervise`` with ``inprocess:`` a
kill -9 of a rank costs no relaunch and no step; without it (plain srun/torchrun, or the
relaunch fallback) it resumes from its checkpoints like examples/train.py, bit for bit.

Output lines (rank 0): ``resume step=N path=P``, ``ckpt step=N path=P``, ``generation gen=G
rank=R step=N restored=1`` (each process, when it starts a generation), ``done step=N
out=F sha256=H``. Fault flags: --crash-at-step N --crash-rank R (SIGKILL itself once: only
while --crash-marker FILE does not exist), --hang-at-step N (SIGSTOP itself once, with the
same marker), --second-crash-at-step N (SIGKILL again, marker --second-crash-marker; rank
--second-crash-rank, default the same; --second-crash-gate FILE: wait for FILE first),
--crash-when-restored MARKER (the process that takes --crash-rank over SIGKILLs itself
once the state reached it, before its first step). A stop request (SIGTERM, SIGUSR2, the
stop file) saves the step reached, writes the stopped marker, prints ``stopped step=N
path=P reason=R`` and exits 0 without the final output.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from clusterops import protocol, recover, sdk
from clusterops.checkpoint import CheckpointError

IN_FEATURES = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every K steps (0: never)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--crash-marker", type=Path, default=None)
    p.add_argument("--second-crash-at-step", type=int, default=None,
                   help="the same rank SIGKILLs itself again here (once: --second-crash-marker)")
    p.add_argument("--second-crash-marker", type=Path, default=None)
    p.add_argument("--second-crash-rank", type=int, default=None,
                   help="the rank of the second SIGKILL (default: --crash-rank)")
    p.add_argument("--second-crash-gate", type=Path, default=None,
                   help="before the second SIGKILL, wait (60 s at most) until this file exists")
    p.add_argument("--crash-when-restored", type=Path, default=None, metavar="MARKER",
                   help="the process that takes --crash-rank over SIGKILLs itself once it has received the "
                        "state, before its first step (once: while MARKER does not exist)")
    return p.parse_args(argv)


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


class State:
    """All of the run that a peer can hand over: what recover.run broadcasts."""

    def __init__(self, args):
        torch.manual_seed(args.seed)           # identical initial weights on every rank
        self.model = Model(args.hidden)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=50, gamma=0.7)
        self.step, self.epoch, self.batch = 0, 0, 0

    def state_dict(self) -> dict:
        # FQN-keyed model/optimizer state: the form torch.distributed.checkpoint round-trips.
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(),
                "data": {"step": self.step, "epoch": self.epoch, "batch": self.batch}}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step, self.epoch, self.batch = (int(sd["data"][k]) for k in ("step", "epoch", "batch"))


def make_dataset(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g)
    return x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)


def epoch_indices(seed: int, epoch: int, n: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randperm(n, generator=g)[rank::world]


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fault_once(args, step: int, rank: int) -> None:
    """--crash-at-step / --hang-at-step / --second-crash-at-step: each once per run (its marker
    file says it happened)."""
    second = args.crash_rank if args.second_crash_rank is None else args.second_crash_rank
    for at, sig, marker, who in ((args.crash_at_step, signal.SIGKILL, args.crash_marker, args.crash_rank),
                                 (args.hang_at_step, signal.SIGSTOP, args.crash_marker, args.crash_rank),
                                 (args.second_crash_at_step, signal.SIGKILL, args.second_crash_marker, second)):
        if rank != who or at is None or step != at or marker is None or marker.exists():
            continue
        marker.write_text(f"{sig.name} at step {step}\n")
        if marker == args.second_crash_marker and args.second_crash_gate is not None:
            deadline = time.monotonic() + 60
            while not args.second_crash_gate.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        print(f"fault step={step} rank={rank} signal={sig.name}", flush=True)
        os.kill(os.getpid(), sig)


def crash_when_restored(args, gen: recover.Generation) -> None:
    """--crash-when-restored: a fault during the recovery itself (the state received, no
    step done yet)."""
    marker = args.crash_when_restored
    if marker is None or not gen.restored or gen.rank != args.crash_rank or marker.exists():
        return
    marker.write_text(f"SIGKILL when restored at step {gen.step}\n")
    print(f"fault restored step={gen.step} rank={gen.rank} signal=SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if torch.cuda.is_available():     # on the CPU, one thread, these ops are deterministic already;
        torch.use_deterministic_algorithms(True)     # the call imports torch._inductor (0.6 CPU-s a rank)
    state = State(args)                        # a standby has all of this ready
    x_all, y_all = make_dataset(args.seed, args.samples)
    loss_fn = nn.MSELoss()
    have_ckpt = bool(os.environ.get(protocol.ENV_CKPT_DIR))

    def train(gen: recover.Generation):
        rank, world = gen.rank, gen.world_size
        print(f"generation gen={gen.gen} rank={rank} step={state.step} restored={int(gen.restored)}", flush=True)
        if not gen.restored and have_ckpt:
            r = sdk.resume(restore_rng=False)   # randomness is seeded per step, not restored
            if r is not None:
                state.load_state_dict(r.state)
                if rank == 0:
                    print(f"resume step={state.step} path={r.path}", flush=True)
            state.resumed_at = state.step
        per_rank = len(range(rank, args.samples, world))
        batches = per_rank // args.batch_size
        if batches < 1:
            print(f"error: --samples {args.samples} too small for {world} ranks x batch {args.batch_size}",
                  file=sys.stderr, flush=True)
            raise SystemExit(1)
        crash_when_restored(args, gen)
        order = epoch_indices(args.seed, state.epoch, args.samples, rank, world)
        sdk.heartbeat(state.step, force=True)
        state.model.train()
        while state.step < args.steps:
            fault_once(args, state.step, rank)
            recover.seed_step(args.seed, rank, state.step)
            with sdk.compute():
                idx = order[state.batch * args.batch_size:(state.batch + 1) * args.batch_size]
                x = x_all[idx] + torch.from_numpy(np.random.normal(0.0, 0.01, size=(len(idx), IN_FEATURES))
                                                  .astype(np.float32))
                if random.random() < 0.25:
                    x = x * 1.0001
                state.opt.zero_grad(set_to_none=True)
                loss = loss_fn(state.model(x), y_all[idx])
                loss.backward()
            if world > 1:
                import torch.distributed as dist

                for p in state.model.parameters():   # fixed order: history-free, bitwise on resume
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            with sdk.compute():
                state.opt.step()
                state.sched.step()
                state.step += 1
                state.batch += 1
                if state.batch >= batches:
                    state.epoch, state.batch = state.epoch + 1, 0
                    order = epoch_indices(args.seed, state.epoch, args.samples, rank, world)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            sdk.heartbeat(state.step)
            if state.step < args.steps and sdk.should_stop():
                # A stop request (the time limit's lead, preemption, the supervisor): save the
                # step reached, say so, end without the final output; the next run resumes here.
                path = sdk.save(state.state_dict(), state.step) if have_ckpt else None
                sdk.mark_stopped(state.step, path)
                state.stopped = True
                if rank == 0:
                    print(protocol.stopped_line(state.step, path, sdk.stop_reason()), flush=True)
                return rank
            if have_ckpt and args.ckpt_every and state.step % args.ckpt_every == 0 and state.step < args.steps:
                try:
                    path = sdk.save(state.state_dict(), state.step)
                    if rank == 0:
                        print(f"ckpt step={state.step} path={path}", flush=True)
                except CheckpointError as e:
                    if rank == 0:
                        print(f"ckpt-failed step={state.step} error={e}", flush=True)
        sdk.heartbeat(state.step, force=True)
        return rank

    rank = recover.run(train, state)
    if rank is None:
        return 0                               # a standby nobody needed
    if getattr(state, "stopped", False):
        sdk.shutdown()
        return 0                               # stopped on request: saved, no final output
    if have_ckpt and args.ckpt_every and state.step > getattr(state, "resumed_at", 0):
        sdk.save(state.state_dict(), state.step)
    digest = params_sha256(state.model)
    if args.out is not None and rank == 0:
        tmp = args.out.with_name(args.out.name + ".tmp")
        torch.save(state.model.state_dict(), tmp)
        os.replace(tmp, args.out)
    if rank == 0:
        print(f"done step={state.step} out={args.out} sha256={digest}", flush=True)
    sdk.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
