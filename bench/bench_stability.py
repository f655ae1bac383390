#!/usr/bin/env python3
"""The stability guard's cost: a fault-free supervised run with the guard on against off, on
a real dev cluster (starts its own, stops it at the end), and the SDK's per-call cost.

    python bench/bench_stability.py [--reps 3] [--steps 200] [--json FILE]

Figures:
  wall on / off   wall time of the same fault-free supervised run of examples/train.py
                  (4 ranks, gloo, ``--step-sleep 0.05``, a checkpoint every 10 steps) with
                  ``supervise: {stability: {on_spike: rollback, on_nan: rollback}}`` and
                  without it; the runs alternate (off, on, on, off, ...) so that a drift of
                  the machine's load hits both; median over ``--reps`` pairs
  ratio           median on / median off (target <= 1.01, within noise)
  findings        loss_spike / nan records in the guard-on runs (must be 0: the run is healthy)
  sdk us/call     ``sdk.heartbeat(step, loss=...)`` against ``sdk.heartbeat(step)`` between
                  beats (the common case: no I/O), microseconds per call, median of 5 x 200k
  machine ms      the supervisor's CPU per heartbeat snapshot (the real state machine, fed
                  simulated snapshots with every rank's loss) with the guard on and off, at
                  ``--sim-ranks`` ranks, median of 5 runs of 120 snapshots (``--sim-only``:
                  this and the SDK figure, no dev cluster)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))   # the fault kit lives with the tests (tests/support)
sys.path.insert(0, str(REPO / "bench"))

from support import faultkit as fk  # noqa: E402

GUARD = {"on_spike": "rollback", "on_nan": "rollback"}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sdk_call_us(loss: bool, n: int = 200_000) -> float:
    from clusterops import protocol, sdk

    os.environ[protocol.ENV_HEARTBEAT_DIR] = tempfile.mkdtemp(prefix="bench-stab-hb-")
    os.environ.pop(protocol.ENV_HEARTBEAT_ADDR, None)
    sdk._reset()
    sdk.heartbeat(0, force=True)          # the next calls fall between beats
    t = time.perf_counter()
    if loss:
        for i in range(n):
            sdk.heartbeat(i, loss=0.5)
    else:
        for i in range(n):
            sdk.heartbeat(i)
    return (time.perf_counter() - t) / n * 1e6


def machine_ms(ranks: int, guard: bool, snapshots: int = 120) -> float:
    """Supervisor CPU (ms) per Heartbeats snapshot of ``ranks`` ranks, guard on or off."""
    import random

    from clusterops.supervisor import Heartbeats, Policy, StepLaunched, Supervisor
    from clusterops.supervisor.stability import StabilityConfig

    nodes = max(1, ranks // 8)
    policy = Policy(nodes=nodes, ranks_per_node=max(1, ranks // nodes), preflight=None, liveness_check=False,
                    detect_stragglers=False, hang_timeout_s=1e9)
    s = Supervisor(policy, [f"n{i:05d}" for i in range(nodes)],
                   stability=StabilityConfig(**GUARD) if guard else None)
    s.start(0.0)
    s.handle(StepLaunched(0.0))
    rnd = random.Random(1)
    cpu = 0.0
    for b in range(1, snapshots + 1):
        step = 5 * b
        loss = 2.0 * 0.99 ** b
        beats = {r: (step, float(b)) for r in range(ranks)}
        signals = {r: (step, loss * rnd.uniform(0.98, 1.02), 1.0) for r in range(ranks)} if guard else {}
        ev = Heartbeats(float(b), beats, signals=signals)
        t = time.process_time()
        s.handle(ev)
        cpu += time.process_time() - t
    return cpu / snapshots * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="pairs of runs (default 3)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--sim-ranks", default="8,2048,16384", help="rank counts of the machine figure")
    ap.add_argument("--sim-only", action="store_true", help="only the SDK and machine figures (no dev cluster)")
    args = ap.parse_args(argv)
    sim = {}
    for n in [int(x) for x in args.sim_ranks.split(",") if x]:
        sim[n] = {arm: statistics.median(machine_ms(n, arm == "on") for _ in range(5)) for arm in ("off", "on")}
    sdk_fig = {k: statistics.median(sdk_call_us(k) for _ in range(5)) for k in (False, True)}
    print(f"{'figure':52} {'value':>9}")
    print(f"{'sdk.heartbeat(step) between beats (us/call)':52} {sdk_fig[False]:9.2f}")
    print(f"{'sdk.heartbeat(step, loss=x) between beats (us/call)':52} {sdk_fig[True]:9.2f}")
    for n, v in sim.items():
        print(f"{f'machine ms/snapshot at {n} ranks, guard off / on':52} {v['off']:9.3f} / {v['on']:.3f}")
    if args.sim_only:
        if args.json:
            Path(args.json).write_text(json.dumps({"sdk_us": sdk_fig, "machine_ms": sim}, indent=2))
        return 0

    from bench_supervisor import timed_run
    from clusterops.devcluster import DevCluster, DevClusterConfig
    from clusterops.slurm import Slurm
    from conftest import pick_port_base  # the tests' free-port picker

    sdk = sdk_fig
    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-dc-"))
    root = Path(tempfile.mkdtemp(prefix="clusterops-bench-stab-"))
    dc = DevCluster(state)
    dc.up(DevClusterConfig(nodes=4, cpus_per_node=2, port_base=pick_port_base(4)))
    os.environ["SLURM_CONF"] = str(dc.conf_path)
    slurm = Slurm.from_environment()
    raw = {"off": [], "on": [], "findings": 0}
    try:
        for rep in range(args.reps):
            order = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for arm in order:
                job = fk.TrainJob(root=root / f"{arm}{rep}", name=f"bench-stab-{arm}{rep}", nodes=4,
                                  steps=args.steps, ckpt_every=10, step_sleep=0.05,
                                  supervise={"stability": GUARD} if arm == "on" else {})
                w = timed_run(job, slurm)
                raw[arm].append(w)
                if arm == "on":
                    raw["findings"] += len(job.timeline_events("loss_spike", "nan"))
                log(f"rep {rep} guard {arm}: {w:.2f}s")
    finally:
        dc.down()
    on, off = statistics.median(raw["on"]), statistics.median(raw["off"])
    raw["sdk_us"] = {"plain": sdk[False], "loss": sdk[True]}
    raw["machine_ms"] = sim
    print()
    print(f"{'figure':52} {'value':>9}  target")
    print(f"{'fault-free wall, guard off (s)':52} {off:9.2f}")
    print(f"{'fault-free wall, guard on (s)':52} {on:9.2f}")
    print(f"{'ratio on / off':52} {on / off:9.3f}  <= 1.01")
    print(f"{'findings in the healthy guard-on runs':52} {raw['findings']:9d}  0")
    print(f"{'sdk.heartbeat(step) between beats (us/call)':52} {sdk[False]:9.2f}")
    print(f"{'sdk.heartbeat(step, loss=x) between beats (us/call)':52} {sdk[True]:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
