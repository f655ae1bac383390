"""A sharded (FSDP2) model saved and resumed through clusterops.sdk.

    torchrun --standalone --nproc-per-node=4 examples/fsdp_train.py --ckpt-dir /tmp/ck --steps 40

Each layer and the root are wrapped with ``torch.distributed.fsdp.fully_shard``: every
rank holds 1/W of each parameter and of the AdamW state (DTensors sharded on dim 0).
The state handed to ``sdk.save`` is the sharded state dict from
``torch.distributed.checkpoint.state_dict``, so each rank writes only its own shards
(``dcp/`` in the checkpoint); ``sdk.resume(template=...)`` reads back, into the same
DTensors, what this rank owns -- with any number of ranks, so a checkpoint saved by 4
ranks restores on 2 (the ``min_nodes`` shrink).

The batch of step s is drawn from a generator seeded with (seed, s): the data does not
depend on the RNG state, so a run killed and resumed on the same world size ends with
the same weights, bit for bit, as one that was never interrupted. The per-rank RNG
states are restored only when the world size is unchanged (see docs/checkpoint.md).

At the end rank 0 gathers the full state (model and optimizer, unsharded, on CPU),
writes it with torch.save to --out, and prints ``done step=N out=PATH sha256=HEX``
(the hash of the model weights, in a fixed order).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from clusterops import sdk

WIDTH = 64


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank, before sharding
    return nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 4))


def batch(seed: int, step: int, rank: int, world: int, size: int):
    """Rank `rank`'s part of the global batch of `step` (independent of any RNG state)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size * world, 16, generator=g)
    y = torch.randn(size * world, 4, generator=g)
    return x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]


def sharded_state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def full_state(model, opt) -> dict:
    """The unsharded state (collective: every rank calls it), on CPU; empty except on rank 0."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, opt, options=opts)}


def weights_sha(model_sd: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(model_sd):
        h.update(k.encode())
        h.update(model_sd[k].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--crash-at-step", type=int, default=None, help="this rank SIGKILLs itself after the step")
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--out", default=None, help="rank 0 writes the full state here at the end")
    a = ap.parse_args(argv)

    d = sdk.init_distributed("gloo")
    sdk.install_stop_handlers()
    model = build_model(a.seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start = 0
    template = sharded_state(model, opt)
    r = sdk.resume(root=a.ckpt_dir, template=template)
    if r is not None:
        set_model_state_dict(model, r.state["model"])
        set_optimizer_state_dict(model, opt, r.state["optim"])
        start = r.step
        if d.rank == 0:
            print(f"resume step={start} from={r.path} saved_by={r.manifest.get('world_size')} ranks "
                  f"rng_restored={r.rng_restored}", flush=True)

    step = start
    for step in range(start, a.steps):
        x, y = batch(a.seed, step, d.rank, d.world_size, a.batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        sdk.heartbeat(done)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if a.crash_at_step is not None and done == a.crash_at_step and d.rank == a.crash_rank:
            print(f"crash step={done} rank={d.rank}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if a.ckpt_dir and done % a.ckpt_every == 0 and done < a.steps:
            path = sdk.save(sharded_state(model, opt), done, root=a.ckpt_dir, async_=a.async_save)
            if d.rank == 0:
                print(f"ckpt step={done} path={path}", flush=True)
        if sdk.should_stop():
            path = sdk.save(sharded_state(model, opt), done, root=a.ckpt_dir) if a.ckpt_dir else None
            sdk.mark_stopped(done, path)
            if d.rank == 0:
                print(f"stopped step={done} path={path} reason={sdk.stop_reason()}", flush=True)
            sdk.wait()
            sdk.shutdown()
            return 0
    sdk.wait()
    full = full_state(model, opt)
    if d.rank == 0:
        if a.out:
            torch.save(full, a.out)
        print(f"done step={a.steps} out={a.out} sha256={weights_sha(full['model'])}", flush=True)
    dist.barrier()
    sdk.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
