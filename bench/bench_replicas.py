#!/usr/bin/env python3
"""The replica check's cost: a fault-free supervised run that checks its replicas against
the same run that does not, on a real dev cluster (starts its own, stops it at the end), and
the digest's cost per check for a 1B-parameter state by simulation.

    python bench/bench_replicas.py [--reps 3] [--steps 300] [--every 100] [--json FILE]
    python bench/bench_replicas.py --sim-only

Figures:
  wall on / off   wall time of the same fault-free supervised run of a plain DDP script
                  (tests/support/user_scripts.py: 3 nodes x 1 rank, gloo, ``--step-sleep
                  0.02``, a checkpoint every 50 steps) calling ``sdk.check_replicas`` after
                  every step with ``supervise: replica_check_every: EVERY`` (default 100,
                  the default interval) and without the call; the runs alternate (off, on,
                  on, off, ...) so that a drift of the machine's load hits both; median over
                  ``--reps`` pairs
  ratio           median on / median off (target <= 1.01)
  suspects        sdc_suspect records in the runs (must be 0: the replicas agree)
  digest s/1B     ``clusterops.replicas.digest`` over float32 and bf16 tensors of 32M
                  elements on this machine's CPU, scaled to 1B parameters (one pass over the
                  memory: linear in the size), median of 5; the all-gather adds one
                  collective of 16 bytes a rank (measured with the gloo ranks of a 3-rank
                  local group: ``allgather us``)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from support import faultkit as fk  # noqa: E402
from support.user_scripts import USER_SCRIPT  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def digest_s_per_billion(dtype_name: str, n: int = 32 << 20) -> float:
    import torch

    from clusterops.replicas import digest

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    # A model-like list: tensors of a few sizes adding up to n elements.
    sizes = [n // 2, n // 4, n // 8, n // 8]
    tensors = [torch.randn(s).to(dtype) for s in sizes]
    digest(tensors)                       # warm-up
    times = []
    for _ in range(5):
        t = time.perf_counter()
        digest(tensors)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * (1e9 / n)


ALLGATHER = r"""
import os, statistics, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.zeros(2, dtype=torch.int64)
out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
for _ in range(20):
    dist.all_gather(out, x)
ts = []
for _ in range(200):
    t = time.perf_counter(); dist.all_gather(out, x); ts.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(statistics.median(ts) * 1e6, flush=True)
dist.destroy_process_group()
"""


def allgather_us(world: int = 3) -> float:
    from clusterops.runner import free_port

    port = str(free_port("127.0.0.1"))
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(world),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", ALLGATHER], env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return float(outs[0].strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="pairs of runs (default 3)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=100, help="replica_check_every (default 100, the default)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--sim-only", action="store_true", help="only the digest and all-gather figures")
    args = ap.parse_args(argv)
    sim = {d: digest_s_per_billion(d) for d in ("float32", "bfloat16")}
    ag = allgather_us()
    print(f"{'figure':56} {'value':>9}")
    for d, v in sim.items():
        print(f"{f'digest of 1B {d} parameters, this CPU, 1 thread (s)':56} {v:9.3f}")
    print(f"{'all-gather of the 16-byte digests, 3 gloo ranks (us)':56} {ag:9.1f}")
    raw = {"digest_s_per_1B": sim, "allgather_us": ag}
    if args.sim_only:
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=2))
        return 0

    from bench_supervisor import timed_run
    from clusterops.devcluster import DevCluster, DevClusterConfig
    from clusterops.slurm import Slurm
    from conftest import pick_port_base

    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-dc-"))
    root = Path(tempfile.mkdtemp(prefix="clusterops-bench-rep-"))
    script = root / "user_ddp.py"
    script.write_text(USER_SCRIPT)
    dc = DevCluster(state)
    dc.up(DevClusterConfig(nodes=4, cpus_per_node=2, port_base=pick_port_base(4)))
    os.environ["SLURM_CONF"] = str(dc.conf_path)
    slurm = Slurm.from_environment()
    raw.update({"off": [], "on": [], "suspects": 0})
    try:
        for rep in range(args.reps):
            order = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for arm in order:
                job = fk.TrainJob(root=root / f"{arm}{rep}", name=f"bench-rep-{arm}{rep}", nodes=3,
                                  steps=args.steps, ckpt_every=50, step_sleep=0.02, script=script,
                                  train_args=["--check-replicas"] if arm == "on" else [],
                                  supervise={"replica_check_every": args.every})
                w = timed_run(job, slurm)
                raw[arm].append(w)
                raw["suspects"] += len(job.timeline_events("sdc_suspect"))
                log(f"rep {rep} check {arm}: {w:.2f}s")
    finally:
        dc.down()
    on, off = statistics.median(raw["on"]), statistics.median(raw["off"])
    print()
    print(f"{'figure':56} {'value':>9}  target")
    print(f"{'fault-free wall, no replica check (s)':56} {off:9.2f}")
    print(f"{f'fault-free wall, a replica check every {args.every} steps (s)':56} {on:9.2f}")
    print(f"{'ratio on / off':56} {on / off:9.3f}  <= 1.01")
    print(f"{'sdc_suspect records in the healthy runs':56} {raw['suspects']:9d}  0")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
