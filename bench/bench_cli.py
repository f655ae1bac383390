"""`clusterops --help` start-up time against a bare interpreter, in the same script.

Run: .venv/bin/python bench/bench_cli.py [--runs 10]
Prints the median of N runs for each and the difference (target: <= 150 ms above
`python -c pass`: no torch, no heavy imports at start).
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def timed(argv, runs):
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples), samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    exe = str(BIN / "clusterops")
    timed([exe, "--help"], 2)  # warm the page cache
    base, _ = timed([sys.executable, "-c", "pass"], args.runs)
    helpm, _ = timed([exe, "--help"], args.runs)
    sub, _ = timed([exe, "devcluster", "--help"], args.runs)
    print(f"python -c pass          median {base * 1000:7.1f} ms  (n={args.runs})")
    print(f"clusterops --help       median {helpm * 1000:7.1f} ms  (+{(helpm - base) * 1000:.1f} ms, "
          f"ratio {helpm / base:.2f}x)")
    print(f"clusterops devcluster --help median {sub * 1000:7.1f} ms  (+{(sub - base) * 1000:.1f} ms)")
    print(f"target: <= 150 ms above python -c pass -> {'OK' if helpm - base <= 0.150 else 'MISSED'}")


if __name__ == "__main__":
    main()
