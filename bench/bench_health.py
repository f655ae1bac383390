#!/usr/bin/env python3
"""Health-check benchmarks (figures, not assertions).

1. ``clusterops health check --profile fast`` wall time, median of N runs, against
   ``python -c pass`` measured in the same script (target: at most 0.5 s above it).
2. The all-reduce probe's busbw against a plain torch.distributed timing loop of the same
   payload, in the same run and the same process group (target: within 5%). Both are
   interleaved, several rounds, medians compared. The probe's full path (``probe_dist``:
   spawn ranks, measure, collect) is also run once and its busbw printed.

Usage: python bench/bench_health.py [--runs 10] [--ranks 2] [--size-mib 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def wall(argv, runs, env=None):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


FABRIC_TREE = HERE.parent / "tests" / "fixtures" / "fabric" / "healthy" / "t0"


def bench_fast(runs: int, fabric_tree: "Path | None" = None) -> dict:
    """The fast check's wall time; with ``fabric_tree``, its fabric probe reads that
    recorded sysfs tree (this machine has no HCA: otherwise the probe only finds no
    /sys/class/infiniband and skips), through a site config as a site would set it."""
    exe = Path(sys.executable).parent / "clusterops"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "clusterops"]
    with tempfile.TemporaryDirectory() as state:
        env = dict(os.environ, CLUSTEROPS_STATE_DIR=state)
        if fabric_tree is not None:
            site = Path(state) / "site.yaml"
            site.write_text(json.dumps({"profiles": {"fast": {"probes": {"fabric": {
                "sys_root": str(fabric_tree), "required": True, "expected_width": "4X"}}}}}))
            env["CLUSTEROPS_HEALTH_SITE"] = str(site)
        subprocess.run(cmd + ["health", "check", "--profile", "fast"], env=env, capture_output=True)  # warm caches
        base, _ = wall([sys.executable, "-c", "pass"], runs, env)
        fast, all_fast = wall(cmd + ["health", "check", "--profile", "fast"], runs, env)
        rep = json.loads(subprocess.run(cmd + ["health", "check", "--profile", "fast", "--json"], env=env,
                                        capture_output=True, text=True).stdout)
    return {"python_c_pass_s": base, "fast_check_s": fast, "above_python_s": fast - base,
            "runs": runs, "fast_check_all_s": all_fast, "internal_duration_s": rep["duration_s"],
            "probes": {r["name"]: r["duration_s"] for r in rep["results"]}}


def bench_fabric_probe(runs: int, tree: Path) -> dict:
    """The fabric probe alone, in process, on a recorded tree: median wall per check
    (the state file read, locked and rewritten each time, as on a node)."""
    from clusterops.health.probes.base import ProbeContext
    from clusterops.health.probes.fabric import probe_fabric

    with tempfile.TemporaryDirectory() as state:
        cfg = {"sys_root": str(tree), "state_file": str(Path(state) / "fabric.json"), "expected_width": "4X"}
        ctx = ProbeContext(node="bench")
        probe_fabric(cfg, ctx)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            probe_fabric(cfg, ctx)
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "best_s": min(times), "runs": runs}


# -- all-reduce: one worker process per rank ---------------------------------------------------

WORKER = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["BENCH_REPO"])
from clusterops.health.probes.dist import allreduce_bandwidth, busbw_factor
size, rounds, warmup, iters = (int(x) for x in sys.argv[1:5])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"],
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
n = dist.get_world_size()

def plain():
    t = torch.ones(size // 4)
    for _ in range(warmup):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dt = (time.perf_counter() - t0) / iters
    return size / dt / 1e9 * busbw_factor(n)

probe_bw, plain_bw = [], []
for r in range(rounds):
    order = [0, 1] if r % 2 == 0 else [1, 0]   # interleave, alternate who goes first
    for which in order:
        if which == 0:
            probe_bw.append(allreduce_bandwidth(torch, dist, torch.device("cpu"), size, warmup, iters)["busbw_gbps"])
        else:
            plain_bw.append(plain())
if dist.get_rank() == 0:
    print(json.dumps({"probe": probe_bw, "plain": plain_bw}))
dist.destroy_process_group()
"""


def bench_allreduce(ranks: int, size: int, rounds: int, warmup: int, iters: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), BENCH_REPO=str(HERE.parent))
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(size), str(rounds), str(warmup), str(iters)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    data = json.loads(outs[0].strip().splitlines()[-1])
    p, q = statistics.median(data["probe"]), statistics.median(data["plain"])
    bp, bq = max(data["probe"]), max(data["plain"])
    return {"ranks": ranks, "size_bytes": size, "probe_busbw_gbps": p, "plain_busbw_gbps": q,
            "ratio_probe_over_plain": p / q, "best_probe_gbps": bp, "best_plain_gbps": bq,
            "best_ratio": bp / bq, "probe_all": data["probe"], "plain_all": data["plain"]}


def bench_probe_end_to_end(ranks: int, size: int, warmup: int, iters: int) -> dict:
    from clusterops.health.probes.base import ProbeContext
    from clusterops.health.probes.dist import probe_dist

    t0 = time.perf_counter()
    res = probe_dist({"cpu_ranks": ranks, "sizes_bytes": [size], "warmup": warmup, "iters": iters,
                      "test_timeout_s": 120}, ProbeContext())
    return {"wall_s": time.perf_counter() - t0,
            "results": {r.name: (r.status, r.value) for r in res}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-allreduce", action="store_true")
    a = ap.parse_args()

    for label, tree in (("fabric probe skips (no HCA here)", None),
                        (f"fabric probe on the recorded tree {FABRIC_TREE.relative_to(HERE.parent)}", FABRIC_TREE)):
        f = bench_fast(a.runs, tree)
        print(f"health check --profile fast, {label}: median {f['fast_check_s'] * 1000:.0f} ms over {f['runs']} "
              f"runs; python -c pass: {f['python_c_pass_s'] * 1000:.0f} ms; above: "
              f"{f['above_python_s'] * 1000:.0f} ms (target <= 500 ms); in-process check "
              f"{f['internal_duration_s'] * 1000:.0f} ms")
        print("  per probe (s):", json.dumps(f["probes"]))
    fb = bench_fabric_probe(max(50, a.runs), FABRIC_TREE)
    print(f"fabric probe alone (5 ports, in process): median {fb['median_s'] * 1000:.2f} ms, best "
          f"{fb['best_s'] * 1000:.2f} ms over {fb['runs']} runs")
    if a.skip_allreduce:
        return
    size = a.size_mib << 20
    ar = bench_allreduce(a.ranks, size, a.rounds, a.warmup, a.iters)
    print(f"all-reduce {a.size_mib} MiB x {a.ranks} gloo ranks: probe busbw {ar['probe_busbw_gbps']:.3f} GB/s, "
          f"plain loop {ar['plain_busbw_gbps']:.3f} GB/s, ratio {ar['ratio_probe_over_plain']:.3f} "
          f"(target within 5%: 0.95-1.05); medians of {a.rounds} interleaved rounds; best of rounds: "
          f"{ar['best_probe_gbps']:.3f} vs {ar['best_plain_gbps']:.3f} GB/s, ratio {ar['best_ratio']:.3f}")
    print("  probe:", [round(x, 3) for x in ar["probe_all"]], " plain:", [round(x, 3) for x in ar["plain_all"]])
    e2e = bench_probe_end_to_end(a.ranks, size, a.warmup, a.iters)
    print(f"probe_dist end to end ({a.ranks} local ranks, spawn+init+test+bandwidth): {e2e['wall_s']:.1f} s, "
          f"{e2e['results']}")


if __name__ == "__main__":
    main()
