#!/usr/bin/env python3
"""A sharded (FSDP2) model that heals in-process: ``recover.run(train, state, sharded=True)``.

examples/fsdp_train.py's model, data and state dicts (imported from it), trained through
clusterops.recover on gloo CPU. No survivor holds a lost rank's shards, so after a fault
every rank of the new generation -- the survivors and the standby that took the lost rank --
rebuilds the model with ``fully_shard`` on the new group (the old group is destroyed, and an
FSDP2 module is bound to the mesh it was wrapped on) and resumes from the latest good DCP
checkpoint through ``sdk.resume(template=...)``; the steps since it are recomputed. The batch
of step s depends on (seed, s) alone, so the run ends bit for bit where an uninterrupted one
does. Without the supervisor's rendezvous (plain srun/torchrun, or the relaunch fallback) it is
an ordinary checkpointed FSDP2 run.

Output lines (rank 0): ``generation gen=G rank=R from_checkpoint=0|1`` (every process, when it
starts a generation), ``resume step=N path=P``, ``ckpt step=N path=P``, ``done step=N out=F
sha256=H`` (the full model and optimizer state, unsharded, written by rank 0 to --out as
fsdp_train.py does). Fault flags: --crash-at-step N --crash-rank R: that rank SIGKILLs itself
when it is about to train step N, once (only while --crash-marker FILE does not exist).
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
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_train import batch, build_model, full_state, sharded_state, weights_sha  # noqa: E402

from clusterops import protocol, recover, sdk  # noqa: E402
from clusterops.checkpoint import CheckpointError  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every K steps (0: never)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes the full state here at the end")
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=2)
    p.add_argument("--crash-marker", type=Path, default=None)
    return p.parse_args(argv)


class State:
    """What recover.run needs of a sharded run: the step reached, and a way to drop what is
    bound to a broken group."""

    def __init__(self):
        self.step = 0
        self.model = None
        self.opt = None

    def discard(self) -> None:
        self.model = self.opt = None


def shard(seed: int, world: int):
    """The model and its optimizer, sharded over this generation's default group."""
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def crash_once(args, step: int, rank: int) -> None:
    if (args.crash_at_step is None or step != args.crash_at_step or rank != args.crash_rank
            or args.crash_marker is None or args.crash_marker.exists()):
        return
    args.crash_marker.write_text(f"SIGKILL at step {step}\n")
    print(f"fault step={step} rank={rank} signal=SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    have_ckpt = bool(os.environ.get(protocol.ENV_CKPT_DIR))
    state = State()

    def train(gen: recover.Generation):
        rank, world = gen.rank, gen.world_size
        print(f"generation gen={gen.gen} rank={rank} from_checkpoint={int(gen.from_checkpoint)}", flush=True)
        state.model, state.opt = shard(args.seed, world)
        state.step = 0
        # Always asked (None without a checkpoint): after a fault, the recovery's report comes from it.
        r = sdk.resume(template=sharded_state(state.model, state.opt), restore_rng=False)
        if r is not None:
            set_model_state_dict(state.model, r.state["model"])
            set_optimizer_state_dict(state.model, state.opt, r.state["optim"])
            state.step = r.step
            if rank == 0:
                print(f"resume step={r.step} path={r.path}", flush=True)
        sdk.heartbeat(state.step, force=True)
        while state.step < args.steps:
            crash_once(args, state.step, rank)
            x, y = batch(args.seed, state.step, rank, world, args.batch_size)
            loss = nn.functional.mse_loss(state.model(x), y)
            state.opt.zero_grad(set_to_none=True)
            loss.backward()
            state.opt.step()
            state.step += 1
            sdk.heartbeat(state.step)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if have_ckpt and args.ckpt_every and state.step % args.ckpt_every == 0 and state.step < args.steps:
                try:
                    path = sdk.save(sharded_state(state.model, state.opt), state.step)
                    if rank == 0:
                        print(f"ckpt step={state.step} path={path}", flush=True)
                except CheckpointError as e:
                    if rank == 0:
                        print(f"ckpt-failed step={state.step} error={e}", flush=True)
        sdk.heartbeat(state.step, force=True)
        return rank

    rank = recover.run(train, state, sharded=True)
    if rank is None:
        return 0                               # a standby nobody needed
    full = full_state(state.model, state.opt)  # collective: every rank
    if rank == 0:
        if args.out is not None:
            tmp = args.out.with_name(args.out.name + ".tmp")
            torch.save(full, tmp)
            os.replace(tmp, args.out)
        print(f"done step={state.step} out={args.out} sha256={weights_sha(full['model'])}", flush=True)
    dist.barrier()
    sdk.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
