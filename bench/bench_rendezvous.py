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
The survivors join as the ranks do (clusterops.recover.send_join: one sealed line appended
to join/<G>, one round trip). Every value is sealed with the attempt's secret as in a real
job (clusterops.rdzvstore); --unsealed replaces sealing by the identity on both sides (the
baseline: what the seal costs), --compare runs both, alternating, side by side.
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


def unseal() -> None:
    """--unsealed: sealing is the identity (the baseline that shows what the seal costs)."""
    from clusterops import rdzvstore

    rdzvstore.Sealer.seal = lambda self, key, value: value.encode() if isinstance(value, str) else bytes(value)
    rdzvstore.Sealer.open = lambda self, key, blob: None if blob is None else bytes(blob)


def clients(addr: str, nodes: int, ppn: int, spn: int, threads: int, go_file: str, unsealed: bool = False) -> None:
    from clusterops import protocol, rdzvstore
    from clusterops.recover import send_join, send_report

    if unsealed:
        unseal()
    procs = [(f"node{i}", local, i * (ppn + spn) + local) for i in range(nodes) for local in range(ppn + spn)]
    stores = [rdzvstore.connect(addr, 120) for _ in range(threads)]
    report, join = send_report, send_join      # the ranks' own protocol (clusterops.recover)

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
        stores[k].raw.wait([key])
        value = stores[k].peek(key)
        while value is None:
            time.sleep(0.001)
            value = stores[k].peek(key)
        json.loads(value)
        seen.setdefault(gen, []).append(time.time())

    each(lambda k: fetch(k, 0))
    plan0 = json.loads(stores[0].peek(protocol.rdzv_key("plan", 0)))
    while not Path(go_file).exists():
        time.sleep(0.01)
    victim = next(u for u, r in plan0["ranks"].items() if r == 5)
    t_dead = time.time()
    report(stores[0], f"node0:{1000 + ppn}", "dead", dead=victim)
    survivors = sorted((u, r) for u, r in plan0["ranks"].items() if r != 5)
    uid_of = {r: u for u, r in survivors}
    each(lambda k: [join(stores[k], 1, u, r, 100) for u, r in survivors[k::threads]])
    t_joined = time.time()
    each(lambda k: fetch(k, 1))
    print(json.dumps({"t_dead": t_dead, "t_joined": t_joined, "t_plan1_first": min(seen[1]),
                      "t_plan1_all": max(seen[1])}), flush=True)


def one(args, rep: int, unsealed: bool = False) -> dict:
    import tempfile

    from clusterops.runner import Runner
    from clusterops.supervisor.membership import Membership
    from clusterops.supervisor.rendezvous import RendezvousHost

    from clusterops import rdzvstore

    sealed = (rdzvstore.Sealer.seal, rdzvstore.Sealer.open)
    if unsealed:
        unseal()
    nodes = [f"node{i}" for i in range(args.nodes)]
    m = Membership(nodes, args.ppn, 1, timeout_s=120, unresponsive_s=120)
    h = RendezvousHost(m, bind_host="127.0.0.1", store_timeout_s=120).start()
    go = Path(tempfile.mkdtemp()) / "go"
    out = Path(tempfile.mkdtemp()) / "clients.log"
    p = Runner().spawn([sys.executable, __file__, "--clients", h.addr, "--nodes", str(args.nodes), "--ppn",
                        str(args.ppn), "--threads", str(args.threads), "--go", str(go)]
                       + (["--unsealed"] if unsealed else []), log_path=str(out))
    while m.plan is None:
        time.sleep(0.05)
    time.sleep(1.0)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    go.touch()
    while p.poll() is None:
        time.sleep(0.05)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    h.close()
    rdzvstore.Sealer.seal, rdzvstore.Sealer.open = sealed
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
    ap.add_argument("--unsealed", action="store_true",
                    help="sealing replaced by the identity on both sides: the baseline of what the seal costs")
    ap.add_argument("--compare", action="store_true", help="sealed and unsealed, alternating, side by side")
    ap.add_argument("--clients", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.clients:
        clients(args.clients, args.nodes, args.ppn, 1, args.threads, args.go, args.unsealed)
        return 0
    kinds = ["sealed", "unsealed"] if args.compare else (["unsealed"] if args.unsealed else ["sealed"])
    runs = {k: [] for k in kinds}
    for rep in range(args.reps):
        order = kinds if rep % 2 == 0 else kinds[::-1]      # alternating, when both are run
        for kind in order:
            runs[kind].append(one(args, rep, unsealed=kind == "unsealed"))
            print(f"[bench] run {rep} ({kind}): {runs[kind][-1]}", flush=True)
    print()
    print(f"{args.nodes} nodes x {args.ppn} ranks (+1 standby a node), one rank lost, medians of {args.reps}:")
    print(f"  {'':28} " + " ".join(f"{k:>15}" for k in kinds))
    for k, target in (("dead_to_plan_s", "<= 1 s"), ("dead_to_all_fetched_s", ""), ("clients_report_s", ""),
                      ("host_wait_s", ""), ("host_cpu_s", ""), ("host_peak_rss_mb", "")):
        vals = " ".join(f"{statistics.median(r[k] for r in runs[kind]):15.3f}" for kind in kinds)
        print(f"  {k:28} {vals}  {target}")
    if len(kinds) == 2:
        a, b = (statistics.median(r["dead_to_plan_s"] for r in runs[k]) for k in kinds)
        print(f"  ratio sealed / unsealed (dead -> plan): {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
