#!/usr/bin/env python3
"""Supervised against unsupervised wall time for the Lightning and HF Trainer examples.

    python bench/bench_trainers.py [--reps 4] [--steps 200] [--json FILE] [--phases]

Starts its own 4-node dev cluster (stopped at the end). For each framework, the same
fault-free run of examples/lightning_train.py / examples/hf_train.py (one rank, 0.05 s a
step, a checkpoint every 20 steps through the integration) is submitted with
`clusterops launch submit`, once with a `supervise:` section and once by plain srun
(no supervise, the checkpoint root given through CLUSTEROPS_CKPT_DIR). Wall time: the
job seen RUNNING to the job seen ended (polled every 0.1 s); medians over --reps.
Target: supervised <= 1.05x plain.

Fairness on a shared machine: one unmeasured plain run per framework first (the first
import of torch/lightning/transformers from a cold page cache costs seconds, and it
used to land on whichever run came first: always the supervised one), and all pairs of
a framework right after its warm-up (this host keeps little page cache: with the
frameworks interleaved, the first run of a pair often imported from disk); then the pairs
alternate their order (supervised first on even repetitions, plain first on odd: an
even --reps balances it), every run starts after a settle pause (the previous job's
teardown and Slurm's bookkeeping of its end otherwise overlap the next job's start),
and each pair runs back to back, so the median of the per-pair ratios is shown next
to the ratio of the medians. The supervisor's own share is read from its timeline:
start (job RUNNING -> the training step launched) and end (the step exited -> the
job ended).

``--phases``: the same runs through bench/trainer_marks.py (the example unchanged, its
integration hooks timed), and for each mode the median time from job RUNNING to the
rank's process start, the process start to the first training hook (imports, model,
Trainer), the training loop (first hook to last), and the process exit to the job
seen ended (srun step teardown, the supervisor's end, Slurm's job completion).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support import faultkit as fk  # noqa: E402

SCRIPTS = {"lightning": REPO / "examples" / "lightning_train.py", "hf": REPO / "examples" / "hf_train.py"}


SETTLE_S = 3.0


def timed_run(job: fk.TrainJob, slurm) -> dict:
    """Submit; wall time from the job seen RUNNING to the job seen ended (polled every 0.1 s),
    and for a supervised job the supervisor's start and end shares from its timeline."""
    time.sleep(SETTLE_S)     # not measured: the previous job's teardown is over
    job.submit()
    t_run = None
    while True:
        info = slurm.job(job.job_id)
        if t_run is None and info.state == "RUNNING":
            t_run = time.time()
        if info.category in ("done", "failed"):
            assert info.state == "COMPLETED", info
            t_end = time.time()
            break
        time.sleep(0.1)
    t_run = t_run or t_end
    out = {"wall_s": t_end - t_run, "phases": phases(job, t_run, t_end)}
    tl = job.timeline()
    launch = [r["t"] for r in tl if r["event"] == "launch"]
    exits = [r["t"] for r in tl if r["event"] == "step_exit"]
    if launch and exits:
        out["sup_start_s"] = max(0.0, launch[0] - t_run)
        out["sup_end_s"] = max(0.0, t_end - exits[-1])
    return out


MARKS = REPO / "bench" / "trainer_marks.py"
PHASES = (("RUNNING -> process start", None, "start"), ("imports + setup", "start", "train_begin"),
          ("training loop", "train_begin", "train_end"), ("process exit -> job ended", "exit", None))


def phases(job: fk.TrainJob, t_run: float, t_end: float) -> dict:
    """Seconds per phase from the bench-mark lines in the job's logs (rank 0's first of each)."""
    marks = {}
    logs = sorted(job.root.rglob("*.out")) + sorted(job.root.rglob("step.log"))
    for path in logs:
        for m in re.finditer(r"bench-mark (\w+) ([\d.]+)", path.read_text(errors="replace")):
            marks.setdefault(m.group(1), float(m.group(2)))
    marks[None] = None
    out = {}
    for name, a, b in PHASES:
        ta = t_run if a is None else marks.get(a)
        tb = t_end if b is None else marks.get(b)
        if ta is not None and tb is not None:
            out[name] = tb - ta
    return out


def make_job(root: Path, kind: str, tag: str, steps: int, supervised: bool, marks: bool = False) -> fk.TrainJob:
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    mode = "sup" if supervised else "plain"
    job = fk.TrainJob(root=root / f"{kind}-{mode}{tag}", name=f"bt-{kind}-{mode}{tag}", nodes=1, steps=steps,
                      ckpt_every=20, step_sleep=0.05, script=MARKS if marks else SCRIPTS[kind],
                      spec_extra={"env": env})
    if marks:
        env["BENCH_TRAINER"] = kind
    if not supervised:
        job.spec_extra = {"supervise": None, "env": dict(env, CLUSTEROPS_CKPT_DIR=str(job.root / "ckpt"))}
    return job


def pair(root: Path, slurm, kind: str, rep: int, steps: int, marks: bool = False) -> dict:
    order = (True, False) if rep % 2 == 0 else (False, True)
    got = {}
    for supervised in order:
        got[supervised] = timed_run(make_job(root, kind, str(rep), steps, supervised, marks), slurm)
    sup, plain = got[True], got[False]
    return {"supervised_s": sup["wall_s"], "plain_s": plain["wall_s"], "ratio": sup["wall_s"] / plain["wall_s"],
            "sup_start_s": sup.get("sup_start_s"), "sup_end_s": sup.get("sup_end_s"),
            "plain_first": not order[0], "sup_phases": sup["phases"], "plain_phases": plain["phases"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4, help="pairs per framework (even: the orders balance)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--phases", action="store_true", help="run through bench/trainer_marks.py; time each phase")
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
        for kind in SCRIPTS:
            # Warm-up, not measured: the framework's files into the page cache (this host
            # keeps little page cache, so each framework's pairs run together, after it).
            w = timed_run(make_job(root, kind, "-warmup", args.steps, False, args.phases), slurm)
            print(f"{kind} warm-up (plain, not counted): {w['wall_s']:.1f}s", flush=True)
            for rep in range(args.reps):
                r = pair(root, slurm, kind, rep, args.steps, args.phases)
                raw[kind].append(r)
                print(f"{kind} pair {rep} ({'plain' if r['plain_first'] else 'supervised'} first): "
                      f"supervised {r['supervised_s']:.1f}s, plain srun {r['plain_s']:.1f}s, ratio {r['ratio']:.3f}; "
                      f"supervisor start {r['sup_start_s']:.2f}s, end {r['sup_end_s']:.2f}s", flush=True)
    finally:
        dc.down()
    print(f"\n{'framework':10} {'supervised (s)':>15} {'plain (s)':>10} {'ratio of medians':>17} "
          f"{'median pair ratio':>18} {'sup. start (s)':>15} {'sup. end (s)':>13}   target <= 1.05")
    summary = {}
    for kind, rs in raw.items():
        s = statistics.median(r["supervised_s"] for r in rs)
        p = statistics.median(r["plain_s"] for r in rs)
        pr = statistics.median(r["ratio"] for r in rs)
        st = statistics.median(r["sup_start_s"] for r in rs)
        en = statistics.median(r["sup_end_s"] for r in rs)
        summary[kind] = {"supervised_s": s, "plain_s": p, "ratio_of_medians": s / p, "median_pair_ratio": pr,
                         "sup_start_s": st, "sup_end_s": en}
        print(f"{kind:10} {s:15.1f} {p:10.1f} {s / p:17.3f} {pr:18.3f} {st:15.2f} {en:13.2f}")
    if args.phases:
        print(f"\n{'framework':10} {'phase':28} {'supervised (s)':>15} {'plain (s)':>10}")
        for kind, rs in raw.items():
            for name, _, _ in PHASES:
                sv = [r["sup_phases"][name] for r in rs if name in r["sup_phases"]]
                pv = [r["plain_phases"][name] for r in rs if name in r["plain_phases"]]
                if sv and pv:
                    print(f"{kind:10} {name:28} {statistics.median(sv):15.2f} {statistics.median(pv):10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"raw": raw, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
