#!/usr/bin/env python3
"""Supervised against unsupervised wall time for the Lightning and HF Trainer examples.

    python bench/bench_trainers.py [--reps 3] [--steps 200]

Starts its own 4-node dev cluster (stopped at the end). For each framework, the same
fault-free run of examples/lightning_train.py / examples/hf_train.py (one rank, 0.05 s a
step, a checkpoint every 20 steps through the integration) is submitted with
`clusterops launch submit`, once with a `supervise:` section and once by plain srun
(no supervise, the checkpoint root given through CLUSTEROPS_CKPT_DIR). Wall time: the
job seen RUNNING to the job seen ended (polled every 0.1 s); medians over --reps.
Target: supervised <= 1.05x plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from support import faultkit as fk  # noqa: E402
from bench_supervisor import timed_run  # noqa: E402

SCRIPTS = {"lightning": REPO / "examples" / "lightning_train.py", "hf": REPO / "examples" / "hf_train.py"}


def pair(root: Path, slurm, kind: str, rep: int, steps: int) -> dict:
    common = dict(nodes=1, steps=steps, ckpt_every=20, step_sleep=0.05, script=SCRIPTS[kind])
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    sup = fk.TrainJob(root=root / f"{kind}-sup{rep}", name=f"bt-{kind}-sup{rep}", spec_extra={"env": env}, **common)
    plain = fk.TrainJob(root=root / f"{kind}-plain{rep}", name=f"bt-{kind}-plain{rep}", **common)
    plain.spec_extra = {"supervise": None, "env": dict(env, CLUSTEROPS_CKPT_DIR=str(plain.root / "ckpt"))}
    return {"supervised_s": timed_run(sup, slurm), "plain_s": timed_run(plain, slurm)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)

    from clusterops.devcluster import DevCluster, DevClusterConfig
    from clusterops.slurm import Slurm
    from conftest import pick_port_base

    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-dc-"))
    root = Path(tempfile.mkdtemp(prefix="clusterops-bench-tr-"))
    dc = DevCluster(state)
    dc.up(DevClusterConfig(nodes=4, cpus_per_node=2, port_base=pick_port_base(4)))
    os.environ["SLURM_CONF"] = str(dc.conf_path)
    slurm = Slurm.from_environment()
    raw = {k: [] for k in SCRIPTS}
    try:
        for rep in range(args.reps):
            for kind in SCRIPTS:
                r = pair(root, slurm, kind, rep, args.steps)
                raw[kind].append(r)
                print(f"{kind} run {rep}: supervised {r['supervised_s']:.1f}s, plain srun {r['plain_s']:.1f}s",
                      flush=True)
    finally:
        dc.down()
    print(f"\n{'framework':12} {'supervised (s)':>15} {'plain (s)':>10} {'ratio':>7}  target <= 1.05")
    for kind, rs in raw.items():
        s = statistics.median(r["supervised_s"] for r in rs)
        p = statistics.median(r["plain_s"] for r in rs)
        print(f"{kind:12} {s:15.1f} {p:10.1f} {s / p:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
