#!/usr/bin/env python3
"""In-process recovery against torchrun's elastic restart, side by side, on a real dev cluster.

    python bench/bench_inprocess.py [--reps 3] [--json FILE]
    python bench/bench_inprocess.py --node-lost [--reps 3]
    python bench/bench_inprocess.py --sigstop [--reps 3]

Starts its own 4-node dev cluster (2 CPUs a node), runs 4 nodes x 1 rank and, per repetition,
in alternating order:

  clusterops  examples/train_recoverable.py under `clusterops supervise` with
              `supervise: inprocess: {standbys_per_node: 1}`; rank 2 SIGKILLs itself at step
              CRASH (the example's --crash-at-step, a real kill -9).
  torchrun    examples/train.py (no in-process recovery, its own checkpoints every CKPT_EVERY
              steps) under one srun of 4 torchrun agents, `--rdzv-backend=c10d
              --max-restarts=3`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (without it torchrun's
              restart never heals here, DESIGN.md); the same SIGKILL of rank 2 at step CRASH.

Figures (medians): fault -> first training step of the new generation (clusterops: the
fault is the crash marker's mtime, written just before the kill; the first step is the
`inproc_first_step` record's `at`, the moment the rendezvous heard rank 0 finish it);
torchrun: fault -> the restarted rank 0's `resume step=N` line, read every 0.05 s: a lower
bound of torchrun's figure (the step itself comes after), so the ratio favours torchrun;
steps lost (crash step minus the step training went on from); clusterops' final weights
against an uninterrupted run's (bitwise). Targets: <= 3 s, <= 0.5x torchrun, 0 steps lost.

--node-lost: 3 nodes x 1 rank + a spare (node4), one standby a node, node3 taken away at step
20 as a power cut takes it (slurmd, slurmstepds, processes; the dev cluster's
``kill_node(power_cut=True)``), node3 brought back and resumed between runs. Figures: kill ->
the new generation's first step (the node counted lost when its standby's beat stops:
RDZV_SILENT_S of it), kill -> Slurm's ``node_down`` (SlurmdTimeout: excluded from the heal,
reported), steps lost, launches, bitwise against an uninterrupted 3-rank run.

--sigstop: the clusterops run alone, rank 2 SIGSTOPs itself at step CRASH instead (the
example's --hang-at-step). Figures: SIGSTOP -> the fault heard (`inproc_fault`'s `at`: the
node's standby saw the process stopped for recover.STOPPED_S, the in-process path's hang
detection), the fault heard -> the new generation's first step (target <= 3 s), the whole,
steps lost, bitwise.
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

STEPS = 60
CKPT_EVERY = 10
CRASH = 23
RECOVERABLE = REPO / "examples" / "train_recoverable.py"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_clusterops(root: Path, slurm, rep: int, reference: Path, fault: str = "kill") -> dict:
    """One supervised in-process run; ``fault`` "kill" (kill -9) or "stop" (SIGSTOP) of rank 2."""
    marker = root / f"ip-{fault}-{rep}.crashed"
    flag = "--crash-at-step" if fault == "kill" else "--hang-at-step"
    job = fk.TrainJob(root=root / f"ip-{fault}-{rep}", name=f"ip{rep}", nodes=4, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.1, script=RECOVERABLE, supervise={"inprocess": {"standbys_per_node": 1}},
                      train_args=[flag, str(CRASH), "--crash-rank", "2", "--crash-marker", str(marker)])
    job.submit()
    info = job.wait_end(slurm, timeout_s=600)
    tl = job.timeline()
    first = [r for r in tl if r["event"] == "inproc_first_step"]
    rdzv = [r for r in tl if r["event"] == "inproc_rendezvous"]
    state = [r for r in tl if r["event"] == "inproc_state"]
    heard = [r for r in tl if r["event"] == "inproc_fault"]
    if info.state != "COMPLETED" or not first or not heard or not marker.exists():
        raise RuntimeError(f"clusterops run {rep}: {info.state}, first steps {first}")
    fault_at = marker.stat().st_mtime
    return {"fault_to_first_step_s": round(first[0]["at"] - fault_at, 3),
            "fault_to_heard_s": round(heard[0]["at"] - fault_at, 3),
            "heard_to_first_step_s": round(first[0]["at"] - heard[0]["at"], 3),
            "rendezvous_wait_s": rdzv[0]["wait_s"], "state_transfer_s": state[0]["seconds"] if state else None,
            "steps_lost": CRASH - rdzv[0]["step"], "launches": sum(r["event"] == "launch" for r in tl),
            "bitwise": fk.same_weights(job.out, reference)}


def run_node_lost(root: Path, slurm, dc, rep: int, reference: Path) -> dict:
    from clusterops.runner import Runner

    job = fk.TrainJob(root=root / f"nl-{rep}", name=f"nl{rep}", nodes=3, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.8, script=RECOVERABLE,
                      supervise={"inprocess": {"standbys_per_node": 1}, "spare_nodes": 1})
    job.submit()
    job.wait_step(20, timeout_s=300)
    killed_at = time.time()
    dc.kill_node("node3", power_cut=True)
    info = job.wait_end(slurm, timeout_s=600)
    tl = job.timeline()
    first = [r for r in tl if r["event"] == "inproc_first_step"]
    rdzv = [r for r in tl if r["event"] == "inproc_rendezvous"]
    down = [r for r in tl if r["event"] == "node_down"]
    lost = [r for r in tl if r["event"] == "inproc_node_lost"]
    if info.state != "COMPLETED" or not first or not rdzv:
        raise RuntimeError(f"node-lost run {rep}: {info.state}, first steps {first}")
    dc.start_node("node3")
    run = Runner(env=dc.env()).run
    deadline = time.monotonic() + 120
    while dc.node_states().get("node3") != "idle" and time.monotonic() < deadline:
        run(["scontrol", "update", "NodeName=node3", "State=RESUME"], timeout_s=30, check=False)
        time.sleep(1)
    return {"kill_to_first_step_s": round(first[0]["at"] - killed_at, 3),
            "kill_to_node_lost_s": round(lost[0]["at"] - killed_at, 3) if lost else None,
            "kill_to_slurm_node_down_s": round(down[0]["t"] - killed_at, 1) if down else None,
            "moved_to": [m["to"] for m in rdzv[0]["replaced"]],
            "steps_lost": first[0]["step"] - 1 - rdzv[0]["step"],
            "launches": sum(r["event"] == "launch" for r in tl), "bitwise": fk.same_weights(job.out, reference)}


def main_node_lost(args, root: Path, slurm, dc) -> int:
    reference = root / "ref3" / "final.pt"
    fk.run_local(3, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(reference)],
                 workdir=root / "ref3", script=RECOVERABLE)
    raw = []
    for rep in range(args.reps):
        raw.append(run_node_lost(root, slurm, dc, rep, reference))
        log(f"node-lost run {rep}: {raw[-1]}")
    med = {k: statistics.median(r[k] for r in raw if r[k] is not None)
           for k in ("kill_to_first_step_s", "kill_to_node_lost_s", "kill_to_slurm_node_down_s")}
    print()
    print(f"{'figure (medians of ' + str(args.reps) + ')':60} {'value':>9}")
    print(f"{'node lost (power cut) -> first step on the spare (s)':60} {med['kill_to_first_step_s']:9.2f}")
    print(f"{'  of which: -> the node counted lost (its silence) (s)':60} {med['kill_to_node_lost_s']:9.2f}")
    print(f"{'node lost -> Slurm reports it down (SlurmdTimeout; excluded) (s)':60} "
          f"{med['kill_to_slurm_node_down_s']:9.1f}")
    print(f"{'steps lost (max) / launches (max)':60} {max(r['steps_lost'] for r in raw):5d} / "
          f"{max(r['launches'] for r in raw)}")
    print(f"{'rank moved to the spare, bitwise equal (all runs)':60} "
          f"{str(all(r['moved_to'] == ['node4'] and r['bitwise'] for r in raw)):>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


def main_sigstop(args, root: Path, slurm, reference: Path) -> int:
    raw = []
    for rep in range(args.reps):
        raw.append(run_clusterops(root, slurm, rep, reference, fault="stop"))
        log(f"sigstop run {rep}: {raw[-1]}")
    med = {k: statistics.median(r[k] for r in raw)
           for k in ("fault_to_heard_s", "heard_to_first_step_s", "fault_to_first_step_s")}
    print()
    print(f"{'figure (medians of ' + str(args.reps) + ')':60} {'value':>9}  target")
    print(f"{'SIGSTOP -> fault heard (the standby sees it stopped) (s)':60} {med['fault_to_heard_s']:9.2f}")
    print(f"{'fault heard -> first step of the new generation (s)':60} {med['heard_to_first_step_s']:9.2f}  <= 3")
    print(f"{'SIGSTOP -> first step of the new generation (s)':60} {med['fault_to_first_step_s']:9.2f}")
    print(f"{'steps lost (max) / launches (max)':60} {max(r['steps_lost'] for r in raw):5d} / "
          f"{max(r['launches'] for r in raw)}")
    print(f"{'final weights bitwise equal (all runs)':60} {str(all(r['bitwise'] for r in raw)):>9}  True")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


def run_torchrun(root: Path, slurm, rep: int) -> dict:
    from clusterops.runner import free_port

    marker = root / f"tr-{rep}.crashed"
    d = root / f"tr-{rep}"
    hb = d / "hb"
    hb.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    job = fk.TrainJob(root=d, name=f"tr{rep}", nodes=4, steps=STEPS, ckpt_every=CKPT_EVERY, step_sleep=0.1,
                      train_args=["--crash-at-step", str(CRASH), "--crash-rank", "2", "--crash-marker", str(marker),
                                  "--ckpt-dir", str(d / "ckpt")])
    spec = job.spec()
    spec.pop("supervise")
    spec.update({"launcher": "torchrun", "nproc_per_node": 1,
                 "launcher_args": ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                   f"--rdzv-id=bench{rep}", "--max-restarts=3"]})
    spec["env"] = dict(spec["env"], TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    job.spec = lambda: spec   # the TrainJob writes this spec
    job.submit()
    resumed_at, resumed_step = None, None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = job.batch_log()
        m = re.search(r"resume step=(\d+)", text)
        if m and marker.exists():
            resumed_at, resumed_step = time.time(), int(m.group(1))
            break
        try:
            if slurm.job(job.job_id).category in ("done", "failed"):
                break
        except Exception:
            pass
        time.sleep(0.05)
    info = job.wait_end(slurm, timeout_s=600)
    if resumed_at is None or info.state != "COMPLETED":
        raise RuntimeError(f"torchrun run {rep}: {info.state}, resumed {resumed_step}\n{job.batch_log()[-2000:]}")
    return {"fault_to_resume_line_s": round(resumed_at - marker.stat().st_mtime, 3),
            "steps_lost": CRASH - resumed_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--node-lost", action="store_true", help="the node-lost case instead (see the docstring)")
    ap.add_argument("--sigstop", action="store_true", help="a SIGSTOPped rank instead (see the docstring)")
    args = ap.parse_args(argv)

    from clusterops.devcluster import DevCluster, DevClusterConfig
    from clusterops.slurm import Slurm
    from conftest import pick_port_base

    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-dc-"))
    root = Path(tempfile.mkdtemp(prefix="clusterops-bench-ip-"))
    dc = DevCluster(state)
    dc.up(DevClusterConfig(nodes=4, cpus_per_node=2, port_base=pick_port_base(4)))
    os.environ["SLURM_CONF"] = str(dc.conf_path)
    slurm = Slurm.from_environment()
    if args.node_lost:
        try:
            return main_node_lost(args, root, slurm, dc)
        finally:
            dc.down()
    reference = root / "ref" / "final.pt"
    fk.run_local(4, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(reference)],
                 workdir=root / "ref", script=RECOVERABLE)
    if args.sigstop:
        try:
            return main_sigstop(args, root, slurm, reference)
        finally:
            dc.down()
    raw = {"clusterops": [], "torchrun": []}
    try:
        for rep in range(args.reps):
            order = ("clusterops", "torchrun") if rep % 2 == 0 else ("torchrun", "clusterops")
            for which in order:
                r = run_clusterops(root, slurm, rep, reference) if which == "clusterops" else run_torchrun(root, slurm, rep)
                raw[which].append(r)
                log(f"{which} run {rep}: {r}")
    finally:
        dc.down()
    ip = statistics.median(r["fault_to_first_step_s"] for r in raw["clusterops"])
    tr = statistics.median(r["fault_to_resume_line_s"] for r in raw["torchrun"])
    print()
    print(f"{'figure (medians of ' + str(args.reps) + ')':60} {'value':>9}  target")
    print(f"{'clusterops in-process: kill -9 -> first step of new gen (s)':60} {ip:9.2f}  <= 3")
    print(f"{'torchrun elastic: kill -9 -> restarted rank 0 resumes (s)':60} {tr:9.2f}  (lower bound)")
    print(f"{'ratio clusterops / torchrun':60} {ip / tr:9.2f}  <= 0.5")
    print(f"{'clusterops steps lost (max)':60} {max(r['steps_lost'] for r in raw['clusterops']):9d}  0")
    print(f"{'torchrun steps lost (max)':60} {max(r['steps_lost'] for r in raw['torchrun']):9d}")
    print(f"{'clusterops rendezvous wait (s)':60} "
          f"{statistics.median(r['rendezvous_wait_s'] for r in raw['clusterops']):9.3f}")
    print(f"{'clusterops final weights bitwise equal (all runs)':60} "
          f"{str(all(r['bitwise'] for r in raw['clusterops'])):>9}  True")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
