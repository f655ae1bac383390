#!/usr/bin/env python3
"""The clusterops main demo: a self-healing 4-node training job on a real dev cluster.

    python examples/demo.py [--state-dir DIR] [--keep-cluster] [--chart FILE.svg]

1. brings up a 4-node Slurm dev cluster on this machine (or reuses a running one);
2. runs the example training uninterrupted on 4 local gloo ranks: the reference;
3. submits the same training through `clusterops launch submit` with a `supervise:`
   section (4 nodes, one rank per node, checkpoints every 10 steps);
4. kills one rank with SIGKILL mid-run;
5. prints the supervisor's timeline as the job heals itself (restart from the latest
   good checkpoint inside the allocation);
6. checks: the job completed, it restarted once without a requeue, no committed
   checkpoint is damaged, and the final weights are bitwise identical to the reference.

Exit 0 only if every check passes. Takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the fault kit lives with the tests (tests/support)

from support import faultkit as fk  # noqa: E402
from clusterops.supervisor import timeline as tl  # noqa: E402


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Tail:
    """Prints timeline records as they appear."""

    def __init__(self, job: fk.TrainJob):
        self.job = job
        self.seen = 0

    def __call__(self) -> None:
        recs = self.job.timeline()
        for r in recs[self.seen:]:
            if r["event"] != "progress":
                print(f"    timeline: {tl.describe(r)}", flush=True)
        self.seen = len(recs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-dir", default=None, help="dev cluster state dir (default: a fresh temporary one)")
    ap.add_argument("--port-base", type=int, default=None, help="dev cluster port base (default: a free range)")
    ap.add_argument("--keep-cluster", action="store_true", help="leave the dev cluster running")
    ap.add_argument("--work-dir", default=None, help="where the job's files go (default: a temporary dir)")
    ap.add_argument("--chart", default=None, help="also write the timeline chart here (.svg or .html)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)

    from clusterops.devcluster import DevCluster, DevClusterConfig, free_port_base
    from clusterops.slurm import Slurm

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="clusterops-demo-"))
    state = Path(args.state_dir or tempfile.mkdtemp(prefix="clusterops-demo-dc-"))
    dc = DevCluster(state)
    started = not dc.running()
    port_base = args.port_base or (free_port_base(4) if started else None)
    t0 = time.monotonic()
    if started:
        say(f"bringing up a 4-node Slurm dev cluster in {state}")
        dc.up(DevClusterConfig(nodes=4, gpus_per_node=0, cpus_per_node=2, port_base=port_base))
    elif dc.config().nodes < 4:
        raise SystemExit(f"the dev cluster in {state} has fewer than 4 nodes")
    else:
        say(f"using the running dev cluster in {state}")
    os.environ["SLURM_CONF"] = str(dc.conf_path)
    say(f"cluster up in {time.monotonic() - t0:.1f}s: {dc.node_states()}")
    checks = {}
    try:
        job = fk.TrainJob(root=work / "job", name="demo-selfheal", nodes=4, steps=args.steps, ckpt_every=10,
                          step_sleep=0.1, supervise={"hang_timeout_s": 30})
        say("reference: the same training uninterrupted on 4 local gloo ranks")
        ref_dir = work / "reference"
        out = fk.run_local(4, ["--steps", str(args.steps), "--ckpt-every", "10", "--step-sleep", "0",
                               "--out", str(ref_dir / "final.pt")], workdir=ref_dir)
        say("  " + [ln for ln in out.splitlines() if ln.startswith("done")][-1])

        job.write_spec()
        say(f"submitting {job.spec_path} through `clusterops launch submit` (supervise: 4 nodes, 1 rank each)")
        jid = job.submit()
        say(f"job {jid} submitted; its timeline: {job.job_dir / tl.FILE_NAME}")
        tail = Tail(job)
        slurm = Slurm.from_environment()
        deadline = time.monotonic() + 180
        while (job.progress() or 0) < 25:
            tail()
            if time.monotonic() > deadline:
                raise SystemExit("the job never reached step 25")
            time.sleep(0.3)
        pids = job.signal_rank(2, signal.SIGKILL)
        fault_t = time.time()
        say(f"FAULT: kill -9 rank 2 (pid {pids[0]}, on node3) at step {job.progress()}")
        while True:
            tail()
            try:
                info = slurm.job(jid)
            except Exception:  # noqa: BLE001 - a flaky poll is not the end
                info = None
            if info and info.category in ("done", "failed") and info.state not in ("REQUEUED",):
                break
            if time.monotonic() > deadline + 240:
                raise SystemExit("the job did not end in time")
            time.sleep(0.5)
        tail()
        recs = job.timeline()
        after = [r for r in recs if r["event"] == "progress" and r["t"] > fault_t and r.get("incarnation") == 0
                 and any(x["event"] == "launch" and x.get("attempt") == 1 and x["t"] <= r["t"] for x in recs)]
        say(f"job {jid} ended: {info.state}, exit code {info.exit_code}")
        print()
        print(tl.format_text(recs))
        print()
        s = tl.summary(recs)
        checks["job completed with exit code 0"] = info.state == "COMPLETED" and info.exit_code == 0
        checks["healed inside the allocation (1 restart, no requeue)"] = s["restarts"] == 1 and s["requeues"] == 0
        checks["no committed checkpoint damaged"] = fk.damaged_checkpoints(job.ckpt_dir) == []
        checks["final weights bitwise identical to the uninterrupted run"] = (
            job.out.exists() and fk.same_weights(job.out, ref_dir / "final.pt"))
        if after:
            say(f"recovery: fault -> first training step after restart in {after[0]['t'] - fault_t:.1f}s "
                "(sampled every 2 s)")
        g = tl.goodput_report(recs)
        if g is not None:
            say("goodput " + tl.format_goodput(g).removeprefix("-- goodput "))
            checks["goodput figures account for the whole wall time"] = abs(
                g["productive_s"] + sum(g["lost_s"].values()) - g["wall_s"]) < 0.05 and g["restarts"] == 1
        if args.chart:
            tl.write_chart(recs, args.chart, title=f"demo job {jid}")
            say(f"chart written to {args.chart}")
    finally:
        if started and not args.keep_cluster:
            say("stopping the dev cluster")
            dc.down()
    ok = all(checks.values()) and bool(checks)
    for name, passed in checks.items():
        print(f"  [{'PASS' if passed else 'FAIL'}] {name}")
    print("DEMO PASSED" if ok else "DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
