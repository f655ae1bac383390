"""The README's main job: a 4-node dev cluster and a real multi-node torchrun job on it.

Run with ``python examples/demo_allreduce.py`` (``scripts/demo.sh`` sets up first). Prints what
happens as it goes; exit 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def allreduce_demo(slurm, nodes: int) -> bool:
    from allreduce_job import render_allreduce_job

    work = Path(tempfile.mkdtemp(prefix="clusterops-demo-"))
    out_dir = work / "ranks"
    out_dir.mkdir()
    text = render_allreduce_job(python=sys.executable, out_dir=str(out_dir), nodes=nodes)
    jid = slurm.submit(text=text, args=[f"--output={work}/job-%j.out"], workdir=str(work))
    say(f"submitted job {jid}: torchrun (gloo) on {nodes} nodes, all-reduce of rank+1")
    seen = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job = slurm.job(jid)
        if job.state != seen:
            seen = job.state
            say(f"job {jid}: {job.state} {('on ' + job.nodes) if job.nodes else ''}")
        if job.category in ("done", "failed"):
            break
        time.sleep(0.5)
    ranks = sorted((json.loads(p.read_text()) for p in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
    for r in ranks:
        say(f"  rank {r['rank']}/{r['world_size']} on {r['hostname']}: all-reduce = {r['allreduce']:g} "
            f"(expected {r['expected']:g}), master {r['master_addr']}:{r['master_port']}")
    ok = job.category == "done" and len(ranks) == nodes and all(r["allreduce"] == r["expected"] for r in ranks)
    say(f"all-reduce job: {'OK' if ok else 'FAILED'} (log: {work})")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="examples/demo_allreduce.py", description=__doc__)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--state-dir", default=None, help="dev cluster state dir")
    ap.add_argument("--keep", action="store_true", help="leave the dev cluster running afterwards")
    args = ap.parse_args(argv)

    from clusterops.devcluster import DEFAULT_STATE_DIR, DevCluster, DevClusterConfig
    from clusterops.runner import Runner
    from clusterops.slurm import Slurm

    dc = DevCluster(args.state_dir or DEFAULT_STATE_DIR)
    t0 = time.monotonic()
    info = dc.up(DevClusterConfig(nodes=args.nodes, gpus_per_node=0, cpus_per_node=2))
    say(f"dev cluster up in {time.monotonic() - t0:.1f}s: {', '.join(sorted(info['nodes']))} "
        f"(SLURM_CONF={dc.conf_path})")
    slurm = Slurm(Runner(env=dc.env()))
    ok = allreduce_demo(slurm, args.nodes)
    if not args.keep:
        dc.down()
        say("dev cluster down")
    else:
        say(f"dev cluster left running: export SLURM_CONF={dc.conf_path}")
    say("DEMO PASSED" if ok else "DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
