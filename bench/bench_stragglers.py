#!/usr/bin/env python3
"""Straggler detection at scale: what it costs the supervisor, how soon it names a slow
node, and whether noise alone ever names one. By simulation, on the real state machine.

    python bench/bench_stragglers.py [--nodes 64,512,2048] [--ranks-per-node 8] [--beats 60]
                                     [--reps 3] [--json FILE]

For each node count the real ``Supervisor`` (clusterops.supervisor.machine) is launched
and fed one ``Heartbeats`` snapshot a simulated second, with every rank's
(step, step_ms, busy_ms) as the channel's ``timings()`` gives it: a synchronous job, busy
time 100 ms +-25 % noise per rank and beat, and from beat 30 on one node's ranks at
``--slow`` x that. The same run with ``detect_stragglers: false`` is the baseline (the
hang check alone), in the same process.

Figures per node count (median over ``--reps`` runs):
  ms/snapshot     supervisor CPU per heartbeat snapshot, detection on
  base ms         the same with detection off
  ratio           ms/snapshot over base ms
  detect beats    beats from the slowdown to the ``straggler`` record (default window 10)
  false           ``straggler`` records naming another node (must be 0)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clusterops.supervisor import Heartbeats, Policy, Record, StepLaunched, Supervisor  # noqa: E402


def one_run(nodes: int, rpn: int, beats: int, slow_from: int, slow: float, detect: bool, seed: int):
    names = [f"n{i:05d}" for i in range(nodes)]
    policy = Policy(nodes=nodes, ranks_per_node=rpn, preflight=None, liveness_check=False,
                    detect_stragglers=detect, hang_timeout_s=1e9)
    s = Supervisor(policy, names)
    s.start(0.0)
    s.handle(StepLaunched(0.0))
    rnd = random.Random(seed)
    victim = names[rnd.randrange(nodes)]
    ranks = nodes * rpn
    cpu = 0.0
    found = []
    step = 0
    for b in range(1, beats + 1):
        step += 5
        timing = {}
        for r in range(ranks):
            busy = 100 * rnd.uniform(0.75, 1.25)
            if b >= slow_from and names[r // rpn] == victim:
                busy *= slow
            timing[r] = (step, 500, int(busy))
        beats_map = {r: (step, float(b)) for r in range(ranks)}
        ev = Heartbeats(float(b), beats_map, timing=timing)
        t0 = time.process_time()
        acts = s.handle(ev)
        cpu += time.process_time() - t0
        found += [(b, a.data["node"]) for a in acts if isinstance(a, Record) and a.kind == "straggler"]
    right = [b for b, n in found if n == victim]
    return {"ms_per_snapshot": 1000 * cpu / beats,
            "detect_beats": (right[0] - slow_from) if right else None,
            "false": sum(1 for _, n in found if n != victim)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="64,512,2048")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--beats", type=int, default=60)
    ap.add_argument("--slow-from", type=int, default=30)
    ap.add_argument("--slow", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rows = []
    print(f"{'nodes':>6} {'ranks':>6} {'ms/snapshot':>12} {'base ms':>8} {'ratio':>6} {'detect beats':>13} "
          f"{'false':>6}")
    for n in [int(x) for x in a.nodes.split(",")]:
        on = [one_run(n, a.ranks_per_node, a.beats, a.slow_from, a.slow, True, seed) for seed in range(a.reps)]
        off = [one_run(n, a.ranks_per_node, a.beats, a.slow_from, a.slow, False, seed) for seed in range(a.reps)]
        ms = statistics.median(r["ms_per_snapshot"] for r in on)
        base = statistics.median(r["ms_per_snapshot"] for r in off)
        det = [r["detect_beats"] for r in on]
        row = {"nodes": n, "ranks": n * a.ranks_per_node, "ms_per_snapshot": round(ms, 2),
               "base_ms": round(base, 2), "ratio": round(ms / base, 2) if base else None,
               "detect_beats": None if None in det else statistics.median(det),
               "missed": det.count(None), "false": sum(r["false"] for r in on)}
        rows.append(row)
        print(f"{n:>6} {row['ranks']:>6} {ms:>12.2f} {base:>8.2f} {row['ratio']:>6} "
              f"{str(row['detect_beats']):>13} {row['false']:>6}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
