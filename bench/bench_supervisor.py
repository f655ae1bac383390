#!/usr/bin/env python3
"""Supervisor benchmarks on a real dev cluster (starts its own, stops it at the end).

    python bench/bench_supervisor.py [--reps 3] [--quick] [--json FILE]

Figures (medians over --reps runs, printed as a table):
  recovery (a)  kill -9 of one rank -> first training step after the restart (target <= 30 s)
  recovery (b)  SIGSTOP of one rank: hang detected -> first step after the restart
                (the hang timeout itself excluded, reported separately; target <= 30 s)
  recovery (d)  a node lost with no spare -> first step after the requeue
                (target <= requeue delay + 30 s; the requeue delay is measured too)
  steps lost    per fault: steps done before the fault minus the step resumed from
                ((a)/(b)/(d): at most one checkpoint interval; (f) preemption: 0)
  admin drain (g)  an administrator drains a node under a run with a spare: the drain ->
                the first step on the spare; steps lost (the planned stop saves: 0)
  overhead      wall time of a fault-free supervised run against the same training run
                by plain srun (`launcher: srun`, no supervise) in the same script
                (target <= 1.05x)

Wall times come from polling (0.1 s) the ranks' beats (``TrainJob.rank_steps``) and Slurm, so they are good to
about 0.2 s.
"""

from __future__ import annotations

import argparse
import subprocess
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the fault kit lives with the tests (tests/support)

from support import faultkit as fk  # noqa: E402

STEPS = 60
CKPT_EVERY = 10


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def first_step_after(job: fk.TrainJob, attempt: int, above: int, timeout_s: float = 240.0) -> float:
    """Wall time at which a rank of `attempt` first reports a step above `above`."""
    deadline = time.monotonic() + timeout_s
    att = job.job_dir / f"attempt-{attempt}"
    while time.monotonic() < deadline:
        if any(s > above for s in job.rank_steps(att)):
            return time.time()
        time.sleep(0.1)
    raise RuntimeError(f"{job.name}: attempt {attempt} never trained past step {above}")


def max_step(job: fk.TrainJob) -> int:
    steps = job.rank_steps(job.latest_attempt())
    return max(steps) if steps else 0


def resumed_step(job: fk.TrainJob, attempt_index: int) -> int:
    res = [r for r in job.timeline() if r["event"] == "resume"]
    return res[attempt_index]["step"] or 0


def run_kill(root: Path, slurm, rep: int) -> dict:
    job = fk.TrainJob(root=root / f"a{rep}", name=f"bench-a{rep}", nodes=4, steps=STEPS, ckpt_every=CKPT_EVERY)
    job.submit()
    job.wait_step(25)
    before = max_step(job)
    job.signal_rank(2, signal.SIGKILL)
    t_fault = time.time()
    resume = None
    t_step = None
    # The new attempt's resume step is in the timeline once it launched.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and resume is None:
        res = [r for r in job.timeline() if r["event"] == "resume"]
        if len(res) >= 2:
            resume = res[1]["step"] or 0
        time.sleep(0.1)
    t_step = first_step_after(job, 1, resume)
    info = job.wait_end(slurm)
    assert info.state == "COMPLETED", info
    return {"recovery_s": t_step - t_fault, "steps_lost": before - resume}


def run_hang(root: Path, slurm, rep: int, hang_timeout_s: float = 10.0) -> dict:
    job = fk.TrainJob(root=root / f"b{rep}", name=f"bench-b{rep}", nodes=4, steps=STEPS, ckpt_every=CKPT_EVERY,
                      supervise={"hang_timeout_s": hang_timeout_s})
    job.submit()
    job.wait_step(25)
    before = max_step(job)
    job.signal_rank(1, signal.SIGSTOP)
    t_fault = time.time()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len([r for r in job.timeline() if r["event"] == "resume"]) < 2:
        time.sleep(0.1)
    lost = [r for r in job.timeline() if r["event"] == "heartbeat_lost"][0]
    resume = resumed_step(job, 1)
    t_step = first_step_after(job, 1, resume)
    info = job.wait_end(slurm)
    assert info.state == "COMPLETED", info
    return {"detect_s": lost["t"] - t_fault, "recovery_s": t_step - lost["t"], "steps_lost": before - resume}


def run_node_requeue(root: Path, slurm, dc, rep: int) -> dict:
    job = fk.TrainJob(root=root / f"d{rep}", name=f"bench-d{rep}", nodes=3, steps=STEPS, ckpt_every=CKPT_EVERY)
    job.submit()
    job.wait_step(20)
    before = max_step(job)
    dc.kill_node("node3")
    t_fault = time.time()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            tl = job.timeline()
            if [r for r in tl if r["event"] == "resume" and r["incarnation"] == 1]:
                break
            time.sleep(0.1)
        tl = job.timeline()
        rq = [r for r in tl if r["event"] == "requeue"][0]
        start1 = [r for r in tl if r["event"] == "start" and r["incarnation"] == 1][0]
        resume = [r for r in tl if r["event"] == "resume" and r["incarnation"] == 1][0]["step"] or 0
        attempt = max(int(p.name.split("-")[1]) for p in job.job_dir.glob("attempt-*"))
        t_step = first_step_after(job, attempt, resume)
        info = job.wait_end(slurm)
        assert info.state == "COMPLETED", info
    finally:
        dc.start_node("node3")
        time.sleep(2)
        slurm.resume(["node3"]) if slurm.node("node3").drained else None
    return {"recovery_s": t_step - t_fault, "requeue_delay_s": start1["t"] - rq["t"], "steps_lost": before - resume}


def run_preempt(root: Path, slurm, rep: int) -> dict:
    job = fk.TrainJob(root=root / f"f{rep}", name=f"bench-f{rep}", nodes=4, steps=STEPS, ckpt_every=25)
    job.submit()
    job.wait_step(18)
    slurm.signal(job.job_id, "TERM", full=True)
    info = job.wait_end(slurm)
    assert info.state == "COMPLETED", info
    tl = job.timeline()
    stopped = [r for r in tl if r["event"] == "stopped"][0]
    beats = [r["max_step"] for r in tl if r["event"] == "progress" and r["incarnation"] == 0]
    resume = [r for r in tl if r["event"] == "resume" and r["incarnation"] == 1][0]["step"]
    return {"steps_lost": max(max(beats, default=0) - resume, 0), "stopped_at": stopped["ckpt_step"], "resumed_at": resume}


def run_admin_drain(root: Path, slurm, rep: int) -> dict:
    """An administrator drains node3 under the run (3 nodes and a spare): the drain -> the
    first step on the spare, and the steps lost (the ranks' last beat before the planned
    stop minus the step the relaunch resumed from)."""
    # Slow enough steps that the run is still going when the node poll sees the drain.
    job = fk.TrainJob(root=root / f"g{rep}", name=f"bench-g{rep}", nodes=3, steps=120, ckpt_every=CKPT_EVERY,
                      step_sleep=0.2, supervise={"spare_nodes": 1, "drain_bad_nodes": True})
    job.submit()
    try:
        job.wait_step(25)
        # The administrator's command, as they type it (not clusterops' drain: its reason is theirs).
        subprocess.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=maintenance"],
                       check=True, capture_output=True, timeout=30)
        t_drain = time.time()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len([r for r in job.timeline() if r["event"] == "resume"]) < 2:
            time.sleep(0.1)
        resume = resumed_step(job, 1)
        t_step = first_step_after(job, 1, resume)
        info = job.wait_end(slurm)
        assert info.state == "COMPLETED", info
    finally:
        subprocess.run(["scontrol", "update", "NodeName=node3", "State=RESUME"], capture_output=True, timeout=30)
    # The steps done before the swap: the planned stop's checkpoint (the step the ranks reached)
    # or their last beat, whichever is later (beats go out once a second and may lag it).
    done = list(job.rank_steps(job.job_dir / "attempt-0"))
    done += [r["ckpt_step"] for r in job.timeline() if r["event"] == "stopped" and r.get("ckpt_step") is not None]
    return {"swap_s": t_step - t_drain, "steps_lost": max(done, default=resume) - resume}


def timed_run(job: fk.TrainJob, slurm) -> float:
    """Wall time from the job seen RUNNING to the job seen ended (polled every 0.1 s)."""
    job.submit()
    t_run = None
    while True:
        info = slurm.job(job.job_id)
        if t_run is None and info.state == "RUNNING":
            t_run = time.monotonic()
        if info.category in ("done", "failed"):
            assert info.state == "COMPLETED", info
            return time.monotonic() - (t_run or time.monotonic())
        time.sleep(0.1)


def run_overhead(root: Path, slurm, rep: int, steps: int) -> dict:
    common = dict(nodes=4, steps=steps, ckpt_every=CKPT_EVERY, step_sleep=0.05)
    sup = fk.TrainJob(root=root / f"o-sup{rep}", name=f"bench-sup{rep}", **common)
    plain = fk.TrainJob(root=root / f"o-plain{rep}", name=f"bench-plain{rep}", **common)
    # The same training by plain srun ranks: no supervise section, checkpoints to the same
    # kind of place through the same environment variable.
    spec = plain.spec()
    spec.pop("supervise")
    spec["env"] = dict(spec["env"], CLUSTEROPS_CKPT_DIR=str(plain.root / "ckpt"))
    plain.spec_extra = {"supervise": None, "env": spec["env"]}
    w_sup = timed_run(sup, slurm)
    w_plain = timed_run(plain, slurm)
    return {"supervised_s": w_sup, "plain_srun_s": w_plain}


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per figure (default 3)")
    ap.add_argument("--quick", action="store_true", help="one repetition of each, shorter overhead runs")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--skip", default="", help="comma list of figures to skip: a,b,d,f,g,overhead")
    args = ap.parse_args(argv)
    reps = 1 if args.quick else args.reps
    skip = set(filter(None, args.skip.split(",")))

    from clusterops.devcluster import DevCluster, DevClusterConfig
    from clusterops.slurm import Slurm

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import pick_port_base  # the tests' free-port picker

    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-dc-"))
    root = Path(tempfile.mkdtemp(prefix="clusterops-bench-sup-"))
    dc = DevCluster(state)
    dc.up(DevClusterConfig(nodes=4, cpus_per_node=2, port_base=pick_port_base(4)))
    os.environ["SLURM_CONF"] = str(dc.conf_path)
    slurm = Slurm.from_environment()
    raw = {"a": [], "b": [], "d": [], "f": [], "g": [], "overhead": []}
    try:
        for rep in range(reps):
            if "overhead" not in skip:
                r = run_overhead(root, slurm, rep, steps=120 if args.quick else 200)
                raw["overhead"].append(r)
                log(f"overhead run {rep}: supervised {r['supervised_s']:.1f}s, plain srun {r['plain_srun_s']:.1f}s")
            if "a" not in skip:
                raw["a"].append(run_kill(root, slurm, rep))
                log(f"(a) kill -9: {raw['a'][-1]}")
            if "b" not in skip:
                raw["b"].append(run_hang(root, slurm, rep))
                log(f"(b) SIGSTOP: {raw['b'][-1]}")
        if "d" not in skip:
            raw["d"].append(run_node_requeue(root, slurm, dc, 0))
            log(f"(d) node lost, requeue: {raw['d'][-1]}")
        if "f" not in skip:
            raw["f"].append(run_preempt(root, slurm, 0))
            log(f"(f) preemption: {raw['f'][-1]}")
        if "g" not in skip:
            for rep in range(reps):
                raw["g"].append(run_admin_drain(root, slurm, rep))
                log(f"(g) admin drain: {raw['g'][-1]}")
    finally:
        dc.down()

    print()
    print(f"{'figure':58} {'median':>9}  target")
    if raw["a"]:
        print(f"{'(a) kill -9: fault -> first step after restart (s)':58} {med([r['recovery_s'] for r in raw['a']]):9.1f}  <= 30")
        print(f"{'(a) steps lost':58} {med([r['steps_lost'] for r in raw['a']]):9.0f}  <= {CKPT_EVERY}")
    if raw["b"]:
        print(f"{'(b) SIGSTOP: detection (hang timeout 10 s) (s)':58} {med([r['detect_s'] for r in raw['b']]):9.1f}  ~10")
        print(f"{'(b) SIGSTOP: detected -> first step after restart (s)':58} {med([r['recovery_s'] for r in raw['b']]):9.1f}  <= 30")
        print(f"{'(b) steps lost':58} {med([r['steps_lost'] for r in raw['b']]):9.0f}  <= {CKPT_EVERY}")
    if raw["d"]:
        d = raw["d"][0]
        print(f"{'(d) requeue delay (requeue -> next incarnation) (s)':58} {d['requeue_delay_s']:9.1f}")
        print(f"{'(d) node lost: fault -> first step after requeue (s)':58} {d['recovery_s']:9.1f}  <= {d['requeue_delay_s'] + 30:.0f}")
        print(f"{'(d) steps lost':58} {d['steps_lost']:9.0f}  <= {CKPT_EVERY}")
    if raw["f"]:
        print(f"{'(f) preemption: steps lost':58} {raw['f'][0]['steps_lost']:9.0f}  0")
    if raw["g"]:
        print(f"{'(g) admin drain: drain -> first step on the spare (s)':58} {med([r['swap_s'] for r in raw['g']]):9.1f}")
        print(f"{'(g) steps lost':58} {med([r['steps_lost'] for r in raw['g']]):9.0f}  0")
    if raw["overhead"]:
        s = med([r["supervised_s"] for r in raw["overhead"]])
        p = med([r["plain_srun_s"] for r in raw["overhead"]])
        print(f"{'fault-free wall, supervised (s)':58} {s:9.1f}")
        print(f"{'fault-free wall, plain srun (s)':58} {p:9.1f}")
        print(f"{'overhead ratio supervised / plain':58} {s / p:9.3f}  <= 1.05")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
