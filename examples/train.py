#!/usr/bin/env python3
"""Example training script for clusterops: small MLP, synthetic data, CPU, exact resume.

Single process:    python examples/train.py --steps 200 --ckpt-every 20 --ckpt-dir /tmp/ck --out w.pt
Many ranks (gloo): torchrun --standalone --nproc-per-node=2 examples/train.py ... (or srun-native ranks)

Deterministic: the same world size and flags give bitwise identical final weights,
however often the run is killed and resumed. Everything that decides the result is
checkpointed: model, optimizer, LR scheduler, the RNG states of python, numpy and
torch (dropout, input noise and a python-random augmentation all draw from them),
and the data position (epoch and batch inside the epoch, so no batch is repeated or
skipped after a resume).

Environment (the supervisor's contract, see clusterops.protocol): CLUSTEROPS_CKPT_DIR
(default for --ckpt-dir), CLUSTEROPS_RESUME_FROM, CLUSTEROPS_HEARTBEAT_DIR,
CLUSTEROPS_STOP_FILE (and SIGTERM/SIGUSR2), CLUSTEROPS_RESTART_COUNT. On a stop request
it saves, calls sdk.mark_stopped (the protocol's stopped marker) and prints the
"stopped" line below (the marker's fallback for the supervisor).

Output lines (rank 0, stdout, flushed):
  resume step=<N> path=<dir>               when resuming
  ckpt step=<N> path=<dir>                 per committed checkpoint
  ckpt-failed step=<N> error=<message>     a save failed; training goes on
  stopped step=<N> path=<dir> reason=<r>   stop requested: checkpoint committed, exit 0
  done step=<N> out=<file> sha256=<hex>    finished; sha256 over the final parameters
Exit codes: 0 finished or stopped cleanly; 1 error.

Stability flags for tests: --poison-batches A:B (a data window that makes the loss spike,
then NaN), --skip-batches-at / --lr-factor-at (the reference run of a rollback). A resume
whose ``sdk.resume().hint`` comes from a stability rollback skips ``hint.skip_batches``
batches and multiplies the learning rate by ``hint.lr_factor`` (printed as
``rollback-hint step=<N> skip=<K> lr_factor=<F>``). The loss goes with the heartbeat.

Fault flags for tests: --crash-at-step N (rank --crash-rank SIGKILLs itself at step N
while CLUSTEROPS_RESTART_COUNT < --crash-times, or once if --crash-marker FILE is
given and FILE does not exist yet), --hang-at-step N (stops making progress).
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

from clusterops import protocol, sdk
from clusterops.checkpoint import CheckpointError

IN_FEATURES = 32


def _pair(kind):
    def parse(text: str):
        a, sep, b = text.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: want A:B")
        return int(a), kind(b)
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every K steps (0: never)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (to slow it down)")
    p.add_argument("--out", type=Path, default=None, help="final weights file (torch.save of the model state)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help=f"checkpoint root (default ${protocol.ENV_CKPT_DIR})")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--samples", type=int, default=512, help="synthetic dataset size")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="SIGKILL rank --crash-rank when it reaches this step (0: at start)")
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--crash-times", type=int, default=1,
                   help=f"crash only while ${protocol.ENV_RESTART_COUNT} < this (a large value: always)")
    p.add_argument("--crash-marker", type=Path, default=None,
                   help="crash once: only if this file does not exist yet (then create it)")
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="stop making progress (and heartbeats) at this step, forever")
    p.add_argument("--poison-batches", type=_pair(int), default=None, metavar="A:B",
                   help="poison the data batches A..B-1 (global batch index, epochs counted): the first half "
                        "with targets x100 (a loss spike), the rest NaN (divergence)")
    p.add_argument("--skip-batches-at", type=_pair(int), default=None, metavar="STEP:K",
                   help="at step STEP skip the next K batches (what a stability rollback's hint does)")
    p.add_argument("--lr-factor-at", type=_pair(float), default=None, metavar="STEP:F",
                   help="at step STEP multiply the learning rate by F (a rollback's LR factor)")
    # Negative controls for the tests (each one breaks exact resume on purpose).
    p.add_argument("--unsafe-no-rng-restore", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unsafe-restart-epoch", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def make_dataset(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g)
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def epoch_indices(seed: int, epoch: int, n: int, rank: int, world: int) -> torch.Tensor:
    """This rank's sample order for an epoch (a fresh permutation per epoch, sharded by rank)."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[rank::world]


def average_gradients(model: nn.Module, world: int) -> None:
    """Data parallelism by hand: one all-reduce per parameter, always in the same order.

    Why not DistributedDataParallel: its reducer is not history-free (it rebuilds its
    gradient buckets after the first iteration), so a DDP built fresh after a resume
    does not reduce the first resumed step exactly as the long-running one did. With
    more than two ranks a floating-point sum depends on that order, and the weights
    drift in the last bits: measured here, a 4-rank DDP run killed and resumed ends
    different from the uninterrupted one (even with one parameter per bucket), a
    2-rank one does not. Here every reduction depends only on the tensor, never on
    history, and 2-4 ranks resume bit for bit.
    """
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def say(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)


def maybe_crash(args, step: int, rank: int) -> None:
    if args.crash_at_step is None or step != args.crash_at_step or rank != args.crash_rank:
        return
    if args.crash_marker is not None:
        if args.crash_marker.exists():
            return
        args.crash_marker.write_text(f"crashed at step {step}\n")
    elif sdk.restart_count() >= args.crash_times:
        return
    print(f"crash step={step} rank={rank}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if torch.cuda.is_available():     # on the CPU, one thread, these ops are deterministic already;
        torch.use_deterministic_algorithms(True)     # the call imports torch._inductor (0.6 CPU-s a rank)
    d = sdk.init_distributed()
    rank, world = d.rank, d.world_size
    if args.ckpt_dir is not None:
        os.environ[protocol.ENV_CKPT_DIR] = str(args.ckpt_dir)
    have_ckpt = bool(os.environ.get(protocol.ENV_CKPT_DIR))

    # Identical initial weights on every rank; then per-rank randomness.
    torch.manual_seed(args.seed)
    model = Model(args.hidden)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + 7919 * (rank + 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)
    x_all, y_all = make_dataset(args.seed, args.samples)
    per_rank = len(range(rank, args.samples, world))
    batches_per_epoch = per_rank // args.batch_size
    if batches_per_epoch < 1:
        print(f"error: --samples {args.samples} too small for {world} ranks x batch {args.batch_size}",
              file=sys.stderr)
        return 1

    def skip(epoch: int, batch: int, k: int):
        g = epoch * batches_per_epoch + batch + k
        return g // batches_per_epoch, g % batches_per_epoch

    def scale_lr(f: float) -> None:
        for group in opt.param_groups:
            group["lr"] *= f

    step, epoch, batch = 0, 0, 0
    if have_ckpt:
        r = sdk.resume(restore_rng=not args.unsafe_no_rng_restore)
        if r is not None:
            set_state_dict(model, opt, model_state_dict=r.state["model"], optim_state_dict=r.state["optim"])
            sched.load_state_dict(r.state["sched"])
            step = r.step
            epoch, batch = int(r.state["data"]["epoch"]), int(r.state["data"]["batch"])
            if args.unsafe_restart_epoch:
                batch = 0
            if batch >= batches_per_epoch:
                # Resumed with fewer/more ranks than saved it: the epoch's shard per rank changed
                # size. Start the next epoch rather than index past this rank's shard.
                epoch, batch = epoch + 1, 0
            say(rank, f"resume step={step} path={r.path}")
            if r.hint is not None:
                # The supervisor rolled back past a loss spike: skip the data that preceded it.
                epoch, batch = skip(epoch, batch, r.hint.skip_batches)
                scale_lr(r.hint.lr_factor)
                say(rank, f"rollback-hint step={step} skip={r.hint.skip_batches} lr_factor={r.hint.lr_factor}")

    start_step = step
    sdk.heartbeat(step, force=True)  # alive (and where we start) before the first step
    loss_fn = nn.MSELoss()
    order = epoch_indices(args.seed, epoch, args.samples, rank, world)

    def state_now():
        # FQN-keyed model/optimizer state: the form torch.distributed.checkpoint round-trips.
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(),
                "data": {"epoch": epoch, "batch": batch}}

    def checkpoint(at: int, async_: bool):
        try:
            path = sdk.save(state_now(), at, async_=async_)
            if path is not None:
                say(rank, f"ckpt step={at} path={path}")
            return path
        except CheckpointError as e:
            say(rank, f"ckpt-failed step={at} error={e}")
            return None

    def drain_async():
        try:
            path = sdk.wait()
            if path is not None:
                say(rank, f"ckpt step={sdk.last_async_step()} path={path}")
        except CheckpointError as e:
            say(rank, f"ckpt-failed step={sdk.last_async_step()} error={e}")

    t0 = time.monotonic()
    model.train()
    while step < args.steps:
        maybe_crash(args, step, rank)
        if args.hang_at_step is not None and step == args.hang_at_step:
            while True:
                time.sleep(1)
        if args.skip_batches_at is not None and step == args.skip_batches_at[0]:
            epoch, batch = skip(epoch, batch, args.skip_batches_at[1])
            order = epoch_indices(args.seed, epoch, args.samples, rank, world)
        if args.lr_factor_at is not None and step == args.lr_factor_at[0]:
            scale_lr(args.lr_factor_at[1])
        # This rank's own work goes in sdk.compute() blocks, the gradient all-reduce (where a
        # fast rank waits for a slow one) outside: the supervisor tells a straggler by it.
        with sdk.compute():
            idx = order[batch * args.batch_size:(batch + 1) * args.batch_size]
            x, y = x_all[idx], y_all[idx]
            if args.poison_batches is not None:
                a, b = args.poison_batches
                g = epoch * batches_per_epoch + batch
                if a <= g < b:
                    y = y * 100.0 if g < (a + b) // 2 else torch.full_like(y, float("nan"))
            x = x + torch.from_numpy(np.random.normal(0.0, 0.01, size=tuple(x.shape)).astype(np.float32))
            if random.random() < 0.25:
                x = x.flip(0).flip(0) * 1.0001
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
        if world > 1:
            average_gradients(model, world)
        with sdk.compute():
            opt.step()
            sched.step()
            step += 1
            batch += 1
            if batch >= batches_per_epoch:
                epoch, batch = epoch + 1, 0
                order = epoch_indices(args.seed, epoch, args.samples, rank, world)
            if args.step_sleep:
                time.sleep(args.step_sleep)   # stands for more compute
        sdk.heartbeat(step, loss=loss.item())
        if sdk.async_done():
            drain_async()
        stop = sdk.should_stop()
        if have_ckpt and args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps and not stop:
            drain_async()
            checkpoint(step, args.async_save)
        if stop and step < args.steps:
            drain_async()
            path = checkpoint(step, False) if have_ckpt else None
            sdk.mark_stopped(step, path)
            say(rank, protocol.stopped_line(step, path, sdk.stop_reason()))
            sdk.shutdown()
            return 0
    drain_async()
    sdk.heartbeat(step, force=True)
    if have_ckpt and args.ckpt_every and step > start_step:
        checkpoint(step, False)
    digest = params_sha256(model)
    if args.out is not None and rank == 0:
        tmp = args.out.with_name(args.out.name + ".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, args.out)
    say(rank, f"done step={step} out={args.out} sha256={digest} elapsed_s={time.monotonic() - t0:.2f}")
    sdk.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
