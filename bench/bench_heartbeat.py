#!/usr/bin/env python3
"""The heartbeat channel at scale, by simulation on one machine.

    python bench/bench_heartbeat.py [--nodes 64,512,2048] [--modes net,file,rank-files]
                                    [--hang-timeout-s 10] [--json FILE]

For each channel mode and node count (8 ranks a node), the real supervisor code runs in
this process -- ``SupervisorRun``'s watch loop and state machine, the real channel
(:mod:`clusterops.supervisor.channel`: UDP receiver thread on 127.0.0.1, file fallback) --
against a fake Slurm, and a load generator process plays the job's nodes through the real
sending side (:class:`clusterops.heartbeat.NodeSender`'s transmit with the real codec, each
rank with a busy time per step so the straggler detector runs as in a real job, or
``protocol.write_heartbeat`` per rank for the old channel). After a warm-up and a
steady-state window, one random rank goes silent at a random moment; the run ends when
the supervisor records ``heartbeat_lost``.

Modes: ``net`` (one UDP datagram per node and second), ``file`` (the forced fallback: one
``node-<N>`` file per node and second in the heartbeat directory), ``rank-files`` (the
old channel: one file per rank and second, the baseline).

Figures per run:
  sup CPU       CPU seconds of the supervisor process (all threads) per wall second over
                the steady window (target < 10% of one core)
  fs ops/int    shared-filesystem metadata operations per 1 s interval in the steady
                window, both sides: a file write is 2 (create, rename), a directory scan
                1, a file read 2 (stat, open); counted at the channel functions (target:
                0 for net, <= nodes for the file fallback)
  detect        heartbeat_lost time minus the moment the rank went silent (target <=
                hang_timeout_s + 2 s), and whether it named the right rank and node
  gen lag       the generator's mean interval (1.0 s when it keeps up)

What it does not measure: the node-local side (each rank's beat into /dev/shm, the
interval's winner reading its node's 8 files). That cost is spread over the nodes, not
the supervisor or the shared filesystem; it is timed separately, per rank beat, below the
table. The heartbeat directory lives on the local disk here, standing in for the shared
filesystem.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clusterops import heartbeat as hbc  # noqa: E402
from clusterops import protocol  # noqa: E402
from clusterops import supervisor as sv  # noqa: E402
from clusterops.supervisor import channel as ch  # noqa: E402
from clusterops.supervisor import timeline as tl  # noqa: E402
from clusterops.supervisor.run import RunConfig, SupervisorRun  # noqa: E402

PPN = 8
JOB = "777"


# ----------------------------------------------------------------------------- generator
def generate(args) -> None:
    """The training step: every node's ranks, through the real sending side."""
    addr = os.environ[protocol.ENV_HEARTBEAT_ADDR]
    hb_dir = os.environ[protocol.ENV_HEARTBEAT_DIR]
    nodes = [f"n{i:04d}" for i in range(args.nodes)]
    rng = random.Random(args.seed)
    victim = rng.randrange(args.nodes * PPN)
    t0 = time.time()
    silent_at = t0 + args.silent_after_s + rng.uniform(0, 3)
    local = tempfile.mkdtemp(prefix="bench-hb-local-", dir=hbc.local_root())
    senders = [hbc.NodeSender(addr, hb_dir, i * PPN, node=n, root=local) for i, n in enumerate(nodes)] if addr else []
    order = sorted(range(len(senders)), key=lambda i: senders[i].phase_s)
    stats = {"victim": victim, "victim_node": nodes[victim // PPN], "silent_at": None, "intervals": []}
    step, victim_t, victim_step, last_t = 0, None, None, t0
    try:
        start = time.time()
        while True:
            step += 1
            writes = 0
            if start >= silent_at and victim_t is None:
                victim_t, victim_step = last_t + hbc.node_phase(nodes[victim // PPN]), step - 1
                stats["silent_at"] = victim_t
            for i in order:
                s = senders[i]
                # Each node sends at its phase in the interval (clusterops.heartbeat.node_phase).
                time.sleep(max(0.0, start + s.phase_s - time.time()))
                beats = []
                for r in range(i * PPN, (i + 1) * PPN):
                    if r == victim and victim_t is not None:
                        beats.append(hbc.RankBeat(r, victim_step, int(1000 * (time.time() - victim_t)), 1000, -1))
                    else:
                        # busy time per step (100 ms +-25%): the straggler detector's input,
                        # so its pass over the nodes is part of the supervisor's CPU
                        beats.append(hbc.RankBeat(r, step, 0, 1000, 75 + rng.randrange(51)))
                s.seq += 1
                before = s.file_writes
                s.transmit(hbc.encode(hbc.Datagram(s.token, s.node, s.seq, tuple(beats))))
                writes += s.file_writes - before
            if not addr:
                for r in range(args.nodes * PPN):
                    if r == victim and victim_t is not None:
                        continue
                    protocol.write_heartbeat(hb_dir, r, step)
                    writes += 1
            last_t = start
            stats["intervals"].append([start, 2 * writes])
            with open(args.stats + ".tmp", "w") as f:
                json.dump(stats, f)
            os.replace(args.stats + ".tmp", args.stats)
            start = max(start + 1.0, time.time())
            time.sleep(max(0.0, start - time.time()))
    finally:
        shutil.rmtree(local, ignore_errors=True)


# ----------------------------------------------------------------------------- the fakes
class Detected(BaseException):
    """The supervisor killed the step for a hang: the run is over for the bench."""


class Proc:
    def __init__(self, popen=None, rc=None):
        self.popen, self.returncode = popen, rc
        self.pid = popen.pid if popen else 2 ** 22 + 7

    def poll(self):
        return self.popen.poll() if self.popen else self.returncode

    def wait(self, timeout=None):
        return self.popen.wait(timeout) if self.popen else self.returncode


class BenchRunner:
    def __init__(self, args, nodes, stats):
        self.args, self.nodes, self.stats = args, nodes, stats
        self.step = None
        self.spawned_at = None

    def spawn(self, argv, *, log_path, env=None, cwd=None, unset=()):
        name = next((a.split("=", 1)[1] for a in argv if a.startswith("--job-name=")), "")
        if name.startswith("clusterops-train-"):
            full = dict(os.environ)
            full.update(env or {})
            cmd = [sys.executable, __file__, "--generate", "--nodes", str(self.nodes), "--seed", str(self.args.seed),
                   "--silent-after-s", str(self.args.warm_s + self.args.window_s), "--stats", str(self.stats)]
            self.step = Proc(subprocess.Popen(cmd, env=full, start_new_session=True,
                                              stdout=open(log_path, "w"), stderr=subprocess.STDOUT))
            self.spawned_at = time.time()
            return self.step
        out = next((a.split("=", 1)[1] for a in argv if a.startswith("--output=")), None)
        if out:
            Path(out).write_text("=== bench: no stacks ===\n")
        return Proc(rc=0)


class BenchSlurm:
    def __init__(self, names, runner):
        self.names, self.runner = names, runner

    def job(self, job_id):
        return SimpleNamespace(job_id=int(job_id), preempt_time=None)

    def steps(self, job_id):
        return [("0", "clusterops-train-0")]

    def nodes(self, names=None):
        return [SimpleNamespace(name=n, is_down=False, drained=False, state="ALLOCATED", flags=frozenset(),
                                reason=None, partitions=("batch",)) for n in (names or self.names)]

    def node_address(self, name):
        return "127.0.0.1"

    def cancel(self, job_id, *, signal=None, step=None, **kw):
        if signal == "KILL":
            raise Detected()

    def requeue(self, job_id, **kw):
        raise Detected()

    def drain(self, nodes, reason):
        pass


# ----------------------------------------------------------------------------- one run
def run_one(args, mode: str, nodes: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"bench-hb-{mode}-{nodes}-"))
    os.environ[ch.MODE_ENV] = mode
    names = [f"n{i:04d}" for i in range(nodes)]
    stats_path = root / "gen.json"
    runner = BenchRunner(args, nodes, stats_path)
    slurm = BenchSlurm(names, runner)
    policy = sv.Policy(nodes=nodes, ranks_per_node=PPN, hang_timeout_s=args.hang_timeout_s, startup_timeout_s=120,
                       preflight=None, progress_interval_s=30)
    cfg = RunConfig(command=["python", "train.py"], job_dir=root / "job", ckpt_dir=root / "ckpt", policy=policy,
                    nodes=names, job_id=JOB, poll_s=1.0, node_poll_s=10.0)
    run = SupervisorRun(cfg, slurm=slurm, runner=runner, sleep=lambda s: time.sleep(s), echo=lambda line: None)
    sample = {}

    def sampler():
        while runner.spawned_at is None:
            time.sleep(0.05)
        for key, at in (("a", args.warm_s), ("b", args.warm_s + args.window_s)):
            time.sleep(max(0.0, runner.spawned_at + at - time.time()))
            c = run.channel
            sample[key] = (time.time(), time.process_time(), c.file_scans, c.files_read)
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        run.run()
    except Detected:
        pass
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        if runner.step and runner.step.popen.poll() is None:
            os.killpg(runner.step.popen.pid, signal.SIGKILL)
            runner.step.popen.wait()
    th.join(timeout=5)
    gen = json.loads(stats_path.read_text())
    lost = [r for r in tl.read(cfg.job_dir) if r["event"] == "heartbeat_lost"]
    (wa, ca, sa, fa), (wb, cb, sb, fb) = sample["a"], sample["b"]
    window = [w for t, w in gen["intervals"] if runner.spawned_at + args.warm_s <= t < runner.spawned_at + args.warm_s
              + args.window_s]
    starts = [t for t, _ in gen["intervals"]]
    res = {
        "mode": mode, "nodes": nodes, "ranks": nodes * PPN,
        "sup_cpu": (cb - ca) / (wb - wa),
        "fs_ops_per_interval": (sum(window) + (sb - sa) + 2 * (fb - fa)) / max(len(window), 1),
        "sup_fs_ops_per_interval": ((sb - sa) + 2 * (fb - fa)) / max(len(window), 1),
        "gen_interval_s": (starts[-1] - starts[0]) / max(len(starts) - 1, 1),
        "detect_s": (lost[0]["t"] - gen["silent_at"]) if lost and gen["silent_at"] else None,
        "named": bool(lost) and gen["victim"] in lost[0]["ranks"] and gen["victim_node"] in lost[0]["nodes"]
        and lost[0]["culprits"] == [gen["victim"]],
    }
    shutil.rmtree(root, ignore_errors=True)
    return res


def local_beat_us(n: int = 4000) -> float:
    """Mean cost of one rank's full NodeSender.beat (node-local file, slot, the winner's send)."""
    root = tempfile.mkdtemp(prefix="bench-hb-beat-", dir=hbc.local_root())
    try:
        senders = [hbc.NodeSender("127.0.0.1:9/x", root, r, node=f"n{r // PPN}", root=root) for r in range(n)]
        for s in senders:
            s.beat(1)
        time.sleep(1.0)
        t = time.perf_counter()
        for s in senders:
            s.beat(2)
        return (time.perf_counter() - t) / n * 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="64,512,2048")
    ap.add_argument("--modes", default="net,file,rank-files")
    ap.add_argument("--hang-timeout-s", type=float, default=10.0)
    ap.add_argument("--warm-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--json")
    ap.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--silent-after-s", type=float, default=15.0, help=argparse.SUPPRESS)
    ap.add_argument("--stats", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        args.nodes = int(args.nodes)
        generate(args)
        return 0
    results = []
    print(f"{'mode':<11}{'nodes':>6}{'ranks':>7}{'sup CPU':>9}{'fs ops/int':>12}{'(sup side)':>11}"
          f"{'detect s':>10}{'named':>7}{'gen int s':>10}")
    for mode in args.modes.split(","):
        for n in (int(x) for x in args.nodes.split(",")):
            r = run_one(args, mode, n)
            results.append(r)
            det = "-" if r["detect_s"] is None else f"{r['detect_s']:.1f}"
            print(f"{mode:<11}{n:>6}{r['ranks']:>7}{r['sup_cpu'] * 100:>8.1f}%{r['fs_ops_per_interval']:>12.0f}"
                  f"{r['sup_fs_ops_per_interval']:>11.0f}{det:>10}{'yes' if r['named'] else 'NO':>7}"
                  f"{r['gen_interval_s']:>10.2f}", flush=True)
    us = local_beat_us()
    print(f"node-local side, per rank beat (NodeSender.beat into {hbc.local_root()}): {us:.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "local_beat_us": us,
                                               "hang_timeout_s": args.hang_timeout_s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
