"""The foundation's main job: a 4-node torchrun (gloo) all-reduce through clusterops' Slurm layer.

``render_allreduce_job`` returns the batch script (pure); this file, run as a script,
is the per-rank worker torchrun starts: it all-reduces ``rank + 1`` over gloo and
writes what it saw to ``<out>/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
from pathlib import Path

SCRIPT = """#!/bin/bash
#SBATCH --job-name=clusterops-allreduce
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --time=10
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# NodeAddr is how Slurm itself reaches a node; node names need not resolve.
MASTER_ADDR=$(scontrol show node "$head_node" --oneliner | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
export MASTER_ADDR MASTER_PORT
srun --kill-on-bad-exit=1 --wait=60 bash -c 'exec {python} -m torch.distributed.run \\
    --nnodes="$SLURM_NNODES" --nproc-per-node=1 --node-rank="$SLURM_NODEID" \\
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \\
    {worker} --out {out_dir}'
"""


def render_allreduce_job(*, python: str, out_dir: str, nodes: int = 4) -> str:
    # The srun body is single-quoted so $SLURM_NODEID expands on each node;
    # the values we put inside it are quoted for that inner shell.
    inner = {"python": shlex.quote(python), "out_dir": shlex.quote(out_dir),
             "worker": shlex.quote(str(Path(__file__).resolve()))}
    for k, v in inner.items():
        inner[k] = v.replace("'", "'\\''")
    return SCRIPT.format(nodes=int(nodes), **inner)


def worker(out_dir: str) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    info = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "hostname": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "master_port": os.environ.get("MASTER_PORT"),
        "allreduce": t.item(),
        "expected": world * (world + 1) / 2,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(info))
    print(json.dumps(info), flush=True)
    dist.destroy_process_group()
    return 0 if info["allreduce"] == info["expected"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    return worker(ap.parse_args().out)


if __name__ == "__main__":
    raise SystemExit(main())
