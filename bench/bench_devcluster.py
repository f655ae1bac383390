"""Dev cluster start time: from nothing to every node idle.

Run: .venv/bin/python bench/bench_devcluster.py [--runs 5] [--nodes 4 256]
For each size: median wall time of `DevCluster.up` (fresh state dir each run, cluster
downed between runs), the same through the CLI for the first size, and the memory the
daemons use (RSS sum). Baseline in the same script: starting one `slurmd -N` alone.
Target: 4 nodes idle in under 15 s.
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clusterops.devcluster import DevCluster, DevClusterConfig


def rss_mb(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 256])
    ap.add_argument("--port-base", type=int, default=45000)
    args = ap.parse_args()
    for n in args.nodes:
        times, mem = [], []
        runs = args.runs if n <= 32 else max(1, args.runs // 2)
        for _ in range(runs):
            state = tempfile.mkdtemp(prefix="bench-dc-")
            dc = DevCluster(state)
            t = time.perf_counter()
            dc.up(DevClusterConfig(nodes=n, port_base=args.port_base))
            times.append(time.perf_counter() - t)
            mem.append(rss_mb([p for p in dc.daemon_pids().values() if p]))
            dc.down()
            shutil.rmtree(state, ignore_errors=True)
        print(f"devcluster up --nodes {n:<4} median {statistics.median(times):6.2f} s "
              f"(min {min(times):.2f}, max {max(times):.2f}, n={runs}); daemons RSS {statistics.median(mem):7.0f} MB")
    # Through the CLI, as a user would type it.
    state = tempfile.mkdtemp(prefix="bench-dc-cli-")
    exe = str(Path(sys.executable).parent / "clusterops")
    t = time.perf_counter()
    subprocess.run([exe, "devcluster", "up", "--nodes", "4", "--state-dir", state,
                    "--port-base", str(args.port_base)], check=True, stdout=subprocess.DEVNULL)
    cli_s = time.perf_counter() - t
    subprocess.run([exe, "devcluster", "down", "--state-dir", state], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(state, ignore_errors=True)
    print(f"clusterops devcluster up --nodes 4 (CLI, one run): {cli_s:.2f} s  (target < 15 s)")


if __name__ == "__main__":
    main()
