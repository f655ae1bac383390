"""The SDK's many-rank round trip is exact (torchrun, gloo, DCP; 2 and 4 local ranks).

Each rank saves a state with what DCP used to flatten away or mangle (an optimizer's
empty ``"state"``, empty dicts/lists/tuples, an int key, an OrderedDict, numpy arrays,
bf16/fp8 tensors, bytes, NaN), resumes it, and compares it with what it saved; the resumed
state is saved again and resumed again. Then plain ``opt.state_dict()`` of SGD (with and
without momentum), Adam and AdamW, before and after their first step, with a StepLR
scheduler's state, under DDP: saved, resumed into fresh objects (``load_state_dict``) that
then hold exactly what the run held, trained on, saved again, and (2 ranks) bitwise equal
to an uninterrupted run. A state one rank
cannot save is refused on every rank with nothing written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import math, os, struct, sys
from collections import OrderedDict
from pathlib import Path
import numpy as np, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from clusterops import sdk
from clusterops.checkpoint import codec

torch.set_num_threads(1)
d = sdk.init_distributed("gloo")
base = Path(sys.argv[1])
rank, world = d.rank, d.world_size

def same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], f"{path}: {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"

# 1. the structure DCP used to lose
torch.manual_seed(0)   # plain tensors are replicated: DCP stores one rank's copy
m = torch.nn.Linear(3, 2)
state = {"o": torch.optim.SGD(m.parameters(), lr=0.1).state_dict(), "empty": {}, 7: "x", "l": [], "t": (),
         "od": OrderedDict([("b", 1), ("a", [{}])]), "np": np.arange(6, dtype=">i4").reshape(2, 3),
         "bf": torch.arange(4.0).bfloat16(), "f8": torch.arange(4.0).to(torch.float8_e4m3fn),
         "f8b": torch.arange(4.0).to(torch.float8_e5m2), "b": b"\x00\xff", "nan": float("nan"), None: -0.0,
         "model": m.state_dict()}
root = base / "structure"
sdk.save(state, 10, root=root, rank_state={"rank": rank, "a": np.ones(2)})
r = sdk.resume(root=root)
same(r.state, state)
same(r.rank_state, {"rank": rank, "a": np.ones(2)}, "rank_state")
sdk.save(r.state, 11, root=root, rank_state=r.rank_state)      # resumed, saved again
r2 = sdk.resume(root=root)
assert r2.step == 11
same(r2.state, state)
sdk.save(state, 12, root=root, async_=True)
sdk.wait()
same(sdk.resume(root=root).state, state)
print(f"structure ok rank={rank}", flush=True)

# 2. a state one rank cannot save: refused on every rank, nothing written
bad = dict(state, odd={1, 2} if rank == world - 1 else [1, 2])
try:
    sdk.save(bad, 13, root=root)
    raise SystemExit("the set was saved")
except codec.UnsaveableState as e:
    assert "state['odd']: cannot save a set" in e.message, e.message
assert sdk.resume(root=root).step == 12
print(f"refused ok rank={rank}", flush=True)

# 3. optimizers and a scheduler: interrupted == uninterrupted, bitwise
STEPS = 5
OPTS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)}

def build(name, seed):
    torch.manual_seed(seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    opt = OPTS[name](model.parameters())
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

def train(model, opt, sched, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()

def ckpt(model, opt, sched):
    return {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}

for name in OPTS:
    ref = build(name, 1)
    for s in range(STEPS):
        train(*ref, s)
    for at in (0, 2):          # before the first step (empty "state"), and after two
        root = base / f"{name}_{at}"
        run = build(name, 1)
        for s in range(at):
            train(*run, s)
        sdk.save(ckpt(*run), at, root=root)
        fresh = build(name, 99)  # other weights: only the checkpoint can make it equal
        r = sdk.resume(root=root)
        assert r.step == at
        fresh[0].module.load_state_dict(r.state["model"])
        fresh[1].load_state_dict(r.state["opt"])
        fresh[2].load_state_dict(r.state["sched"])
        same(ckpt(*fresh), ckpt(*run), f"{name}@{at} loaded")   # what the run had, bit for bit
        for s in range(at, STEPS):
            train(*fresh, s)
            sdk.save(ckpt(*fresh), s + 1, root=root)   # the resumed state saves again
        r = sdk.resume(root=root)
        same(r.state, ckpt(*fresh), f"{name}@{at} resumed again")
        # Bitwise against the uninterrupted run with 2 ranks. With 4, a fresh DDP's first
        # step (before it rebuilds its buckets) sums gradients in another order on gloo, so
        # the run itself would differ from the uninterrupted one without any checkpoint.
        if world == 2:
            same(ckpt(*fresh), ckpt(*ref), f"{name}@{at}")
print(f"optimizers ok rank={rank}", flush=True)
sdk.shutdown()
'''


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", [2, 4])
def test_many_rank_round_trip_is_exact_and_optimizers_resume_bitwise(tmp_path, ranks):
    script = tmp_path / "codec_ranks.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTEROPS_")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", str(script), str(tmp_path / "ck")],
                       env=env, capture_output=True, text=True, timeout=380, cwd=ROOT)
    out = p.stdout + p.stderr[-4000:]
    assert p.returncode == 0, out
    for what in ("structure", "refused", "optimizers"):
        assert p.stdout.count(f"{what} ok rank=") == ranks, out
