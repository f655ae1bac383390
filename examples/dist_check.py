#!/usr/bin/env python3
"""A tiny distributed check: is the rendezvous right, and does a collective work?

Each rank joins the process group (gloo by default, so it runs on CPUs), prints
what its launcher gave it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, hostname), all-reduces a tensor of ones and checks that every
element equals the world size. With ``--out DIR`` each rank writes one JSON
line to ``DIR/rank<RANK>.json``.

``--hold-s S`` keeps the ranks alive for up to S seconds after the check; a
SIGUSR1 (the lead-time signal that a clusterops batch script forwards) ends the
hold early and is recorded with its arrival time, so tests can see that the
signal reached the training processes.

Works under torchrun, accelerate and deepspeed (they set RANK and friends) and
under plain srun (falls back to SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID).
Exit status: 0 when the all-reduce result is right, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for one JSON line per rank (rank<RANK>.json)")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo)")
    parser.add_argument("--hold-s", type=float, default=0.0,
                        help="stay alive up to this many seconds after the check; SIGUSR1 ends it early")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)  # the deepspeed launcher passes this
    args = parser.parse_args(argv)

    signals = []

    def on_signal(signum, frame):
        signals.append({"signal": signal.Signals(signum).name, "time": time.time()})

    # Installed before anything slow, so an early lead-time signal is not lost.
    signal.signal(signal.SIGUSR1, on_signal)

    import datetime

    import torch
    import torch.distributed as dist

    rank = _env_int("RANK", "SLURM_PROCID")
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    if args.local_rank is not None:
        local_rank = args.local_rank
    master_addr = os.environ.get("MASTER_ADDR", "")
    master_port = os.environ.get("MASTER_PORT", "")

    if world_size == 1 and not master_addr:
        # Alone, outside any launcher: a rendezvous with itself on this machine.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            master_addr, master_port = "127.0.0.1", str(sock.getsockname()[1])
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=master_port)
    started = time.time()
    dist.init_process_group(backend=args.backend, init_method="env://", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout_s))
    ones = torch.ones(4)
    dist.all_reduce(ones)
    allreduce = ones.tolist()
    ok = all(v == float(world_size) for v in allreduce)
    # Everyone must agree: gather the peers' view of the rendezvous as well.
    views = [None] * world_size
    dist.all_gather_object(views, {"rank": rank, "master_addr": master_addr, "master_port": master_port})

    record = {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "hostname": socket.gethostname(),
        "slurm_nodeid": os.environ.get("SLURM_NODEID"),
        "slurm_procid": os.environ.get("SLURM_PROCID"),
        "slurmd_nodename": os.environ.get("SLURMD_NODENAME"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "chain_link": os.environ.get("CLUSTEROPS_CHAIN_LINK"),
        "allreduce": allreduce,
        "ok": ok,
        "peers": views,
        "init_s": round(time.time() - started, 3),
        "pid": os.getpid(),
    }
    print(f"rank {rank}/{world_size} local_rank {local_rank} on {record['hostname']} "
          f"({record['slurmd_nodename']}) master {master_addr}:{master_port} "
          f"allreduce {allreduce} {'OK' if ok else 'WRONG'}", flush=True)

    if args.hold_s > 0:
        deadline = time.monotonic() + args.hold_s
        while not signals and time.monotonic() < deadline:
            time.sleep(0.2)
    record["signals"] = signals
    record["end"] = time.time()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"rank{rank}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        os.replace(tmp, path)
    if signals:
        print(f"rank {rank}: received {', '.join(s['signal'] for s in signals)}", flush=True)
    # No barrier here: after a lead-time signal ranks may leave at different times.
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
