#!/usr/bin/env python3
"""The in-process rendezvous at the seed's scale, by simulation: 2,048 nodes x 8 ranks (plus one
standby a node) of simulated clients against the real rendezvous host
(clusterops.supervisor.rendezvous: torch's TCPStore, the Membership decisions).

    python bench/bench_rendezvous.py [--nodes 2048] [--ppn 8] [--threads 16] [--reps 3] [--compare]

Per repetition: a fresh host; the clients (one other process, --threads store connections,
each reporting for its share of the 18,432 processes) say hello and fetch generation 0's
plan; then a standby reports one rank dead and the 16,383 survivors report that they
rejoin, all at once; figure: the dead report -> generation 1's plan readable by the clients
(<= 1 s), and -> every connection has fetched it. The host's CPU seconds and peak memory
(this process: the host only; the clients run in another) are reported. Simulated clients
share a connection per thread: each real rank would hold its own and fetch the plan itself,
so the fetch figure is the store's time to serve it --threads times, not 16k times.
The survivors join as the ranks do (clusterops.recover.send_join: one append to join/<G>,
one round trip); --old-protocol sends each join as a report (rep/n: two round trips, the
protocol before join/<G>), --compare runs both, alternating, side by side.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def clients(addr: str, nodes: int, ppn: int, spn: int, threads: int, go_file: str, old_protocol: bool = False) -> None:
    import datetime

    import torch.distributed as dist

    from clusterops import protocol
    from clusterops.recover import send_join, send_report

    host, port, token = protocol.parse_rdzv_addr(addr)
    procs = [(f"node{i}", local, i * (ppn + spn) + local) for i in range(nodes) for local in range(ppn + spn)]
    stores = [dist.PrefixStore(token, dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                    timeout=datetime.timedelta(seconds=120)))
              for _ in range(threads)]

    report = send_report      # the ranks' own protocol (clusterops.recover)
    if old_protocol:          # --old-protocol: every report, joins too, through rep/n (two round trips)
        def join(st, gen, rank, step):
            send_report(st, uid_of[rank], "join", gen=gen, rank=rank, step=step)
    else:
        join = send_join

    def each(fn):
        ts = [threading.Thread(target=fn, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    each(lambda k: [report(stores[k], f"{n}:{1000 + local}", "hello", node=n, local=local, task=task)
                    for n, local, task in procs[k::threads]])
    seen = {}

    def fetch(k, gen):
        key = protocol.rdzv_key("plan", gen)
        stores[k].wait([key])
        json.loads(stores[k].get(key))
        seen.setdefault(gen, []).append(time.time())

    each(lambda k: fetch(k, 0))
    plan0 = json.loads(stores[0].get(protocol.rdzv_key("plan", 0)))
    while not Path(go_file).exists():
        time.sleep(0.01)
    victim = next(u for u, r in plan0["ranks"].items() if r == 5)
    t_dead = time.time()
    report(stores[0], f"node0:{1000 + ppn}", "dead", dead=victim)
    survivors = sorted((u, r) for u, r in plan0["ranks"].items() if r != 5)
    uid_of = {r: u for u, r in survivors}
    each(lambda k: [join(stores[k], 1, r, 100) for u, r in survivors[k::threads]])
    t_joined = time.time()
    each(lambda k: fetch(k, 1))
    print(json.dumps({"t_dead": t_dead, "t_joined": t_joined, "t_plan1_first": min(seen[1]),
                      "t_plan1_all": max(seen[1])}), flush=True)


def one(args, rep: int, old_protocol: bool = False) -> dict:
    import tempfile

    from clusterops.runner import Runner
    from clusterops.supervisor.membership import Membership
    from clusterops.supervisor.rendezvous import RendezvousHost

    nodes = [f"node{i}" for i in range(args.nodes)]
    m = Membership(nodes, args.ppn, 1, timeout_s=120, unresponsive_s=120)
    h = RendezvousHost(m, bind_host="127.0.0.1", store_timeout_s=120).start()
    go = Path(tempfile.mkdtemp()) / "go"
    out = Path(tempfile.mkdtemp()) / "clients.log"
    p = Runner().spawn([sys.executable, __file__, "--clients", h.addr, "--nodes", str(args.nodes), "--ppn",
                        str(args.ppn), "--threads", str(args.threads), "--go", str(go)]
                       + (["--old-protocol"] if old_protocol else []), log_path=str(out))
    while m.plan is None:
        time.sleep(0.05)
    time.sleep(1.0)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    go.touch()
    while p.poll() is None:
        time.sleep(0.05)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    h.close()
    text = out.read_text()
    try:
        r = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"clients failed:\n{text[-2000:]}")
    plan_at = next(n.data for n in h.drain_notes() if n.kind == "inproc_rendezvous")
    return {"dead_to_plan_s": round(r["t_plan1_first"] - r["t_dead"], 3),
            "dead_to_all_fetched_s": round(r["t_plan1_all"] - r["t_dead"], 3),
            "clients_report_s": round(r["t_joined"] - r["t_dead"], 3),
            "host_wait_s": plan_at["wait_s"],
            "host_cpu_s": round((cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), 3),
            "host_peak_rss_mb": round(cpu1.ru_maxrss / 1024, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--ppn", type=int, default=8)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--old-protocol", action="store_true",
                    help="the joins as two-round-trip reports (rep/n), as before join/<G>: the before figure")
    ap.add_argument("--compare", action="store_true", help="both protocols, alternating, side by side")
    ap.add_argument("--clients", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.clients:
        clients(args.clients, args.nodes, args.ppn, 1, args.threads, args.go, args.old_protocol)
        return 0
    kinds = ["join/<G>", "rep/n"] if args.compare else (["rep/n"] if args.old_protocol else ["join/<G>"])
    runs = {k: [] for k in kinds}
    for rep in range(args.reps):
        order = kinds if rep % 2 == 0 else kinds[::-1]      # alternating, when both are run
        for kind in order:
            runs[kind].append(one(args, rep, old_protocol=kind == "rep/n"))
            print(f"[bench] run {rep} ({kind} joins): {runs[kind][-1]}", flush=True)
    print()
    print(f"{args.nodes} nodes x {args.ppn} ranks (+1 standby a node), one rank lost, medians of {args.reps}:")
    print(f"  {'':28} " + " ".join(f"{k + ' joins':>15}" for k in kinds))
    for k, target in (("dead_to_plan_s", "<= 1 s"), ("dead_to_all_fetched_s", ""), ("clients_report_s", ""),
                      ("host_wait_s", ""), ("host_cpu_s", ""), ("host_peak_rss_mb", "")):
        vals = " ".join(f"{statistics.median(r[k] for r in runs[kind]):15.3f}" for kind in kinds)
        print(f"  {k:28} {vals}  {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
