#!/usr/bin/env python3
"""Slurm 25.11's expedited requeue against the ordinary one, on two dev clusters of its own.

    PATH=/opt/slurm-25.11/bin:/opt/slurm-25.11/sbin:$PATH \\
        python bench/bench_expedite.py --prefix /opt/slurm-25.11 [--reps 3] [--cred-expire 60]

Both clusters are the same (2 nodes, ``cred_expire`` = --cred-expire, the ordinary requeue's
delay) but for ``SlurmctldParameters=enable_expedited_requeue`` on one: there `launch submit`
gives the supervised job ``--requeue=expedite``, on the other ``--requeue``. Each rep submits
the example training (2 ranks), waits for step 10, sends the batch shell the lead signal
(USR1): the supervisor saves, stops and requeues. Figure: the supervisor's ``requeue`` record
-> the next incarnation's first record and -> its first training step. Medians over --reps,
and the ratio ordinary / expedited. Needs Slurm 25.11 or newer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the fault kit lives with the tests (tests/support)

from support import faultkit as fk  # noqa: E402
from support.wait import wait_for  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def one_requeue(root: Path, slurm, name: str) -> dict:
    """A supervised run stopped by its lead signal and requeued -> seconds to the next start."""
    job = fk.TrainJob(root=root / name, name=name, nodes=2, steps=200, ckpt_every=10, step_sleep=0.1,
                      supervise={"stop_timeout_s": 20})
    job.submit()
    job.wait_step(10, timeout_s=240)
    slurm.signal(job.job_id, "USR1", batch=True)

    def next_incarnation():
        recs = job.timeline()
        req = [r for r in recs if r.get("event") == "requeue"]
        start = [r for r in recs if r.get("incarnation") == 1]
        step = [r for r in start if r.get("event") == "progress"]
        return (req[0], start[0], step[0]) if req and start and step else None

    req, start, step = wait_for(next_incarnation, 400, f"{name}: the next incarnation's first step",
                                   interval_s=0.5)
    script = next((job.root / "logs").glob("*.sbatch")).read_text()
    slurm.cancel(job.job_id)
    return {"expedited": "--requeue=expedite" in script, "to_start_s": start["t"] - req["t"],
            "to_step_s": step["t"] - req["t"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default=os.environ.get("CLUSTEROPS_SLURM_PREFIX") or None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cred-expire", type=int, default=60)
    args = ap.parse_args(argv)
    from clusterops.devcluster import DevCluster, DevClusterConfig, free_port_base
    from clusterops.slurm.factory import connect

    results = {}
    for mode in ("expedite", "ordinary"):
        state = Path(tempfile.mkdtemp(prefix=f"clusterops-bench-{mode}-"))
        dc = DevCluster(state)
        dc.up(DevClusterConfig(nodes=2, port_base=free_port_base(3), slurm_prefix=args.prefix,
                               expedited_requeue=mode == "expedite", cred_expire_s=args.cred_expire))
        os.environ["SLURM_CONF"] = str(dc.conf_path)
        try:
            slurm = connect()
            runs = []
            for rep in range(args.reps):
                r = one_requeue(state / "jobs", slurm, f"{mode}-{rep}")
                assert r["expedited"] == (mode == "expedite"), r
                log(f"{mode} rep {rep}: requeue -> next start {r['to_start_s']:.1f} s, first step {r['to_step_s']:.1f} s")
                runs.append(r)
            results[mode] = runs
        finally:
            dc.down()
            shutil.rmtree(state, ignore_errors=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("to_start_s", "to_step_s")} for m, rs in results.items()}
    print(f"\ncred_expire {args.cred_expire} s, {args.reps} reps each, medians")
    print(f"{'':40} {'expedited':>10} {'ordinary':>10} {'ratio':>7}")
    for k, label in (("to_start_s", "requeue -> next incarnation starts (s)"),
                     ("to_step_s", "requeue -> its first training step (s)")):
        e, o = med["expedite"][k], med["ordinary"][k]
        print(f"{label:40} {e:10.1f} {o:10.1f} {o / e:6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
