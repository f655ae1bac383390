"""The Slurm layer's two backends side by side: pyslurm (RPCs in-process) against the CLI
tools, on the same dev cluster.

Run: .venv/bin/python bench/bench_pyslurm.py [--prefix /opt/slurm-25.11] [--queries 1000]
     [--node-reads 256] [--submits 256]
Starts a 4-node dev cluster from the prefix (Slurm 25.11, the version pyslurm 25.11.x is
built for), then for each backend, through the layer's own methods: job-state queries
(``job(id)`` of a held job), node-state reads (``node(name)``, round robin over the nodes)
and submissions (``submit`` of a held one-line script; all cancelled afterwards). Prints
per-operation medians, p90s, totals and the CLI/pyslurm ratio, as a table and as JSON;
then the wall time of a one-shot ``clusterops slurm job ID --json`` process per backend
(cli, pyslurm, auto), where pyslurm's import is paid once per command.
The two backends alternate in blocks of 32 so a slow patch of the shared machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from clusterops.devcluster import DevCluster, DevClusterConfig

BLOCK = 32


def pick_port_base() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import pick_port_base as pick

    return pick(4)


def timed(fn, n, i0=0):
    out = []
    for i in range(i0, i0 + n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def run_op(clients, op, total):
    samples = {name: [] for name in clients}
    done = 0
    while done < total:
        n = min(BLOCK, total - done)
        for name, c in clients.items():
            samples[name] += timed(lambda i, c=c: op(c, i), n, done)
        done += n
    return samples


def summary(samples):
    s = sorted(samples)
    return {"n": len(s), "median_ms": round(statistics.median(s) * 1e3, 2),
            "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 2), "total_s": round(sum(s), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default=os.environ.get("CLUSTEROPS_SLURM_PREFIX") or "/opt/slurm-25.11")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--node-reads", type=int, default=256)
    ap.add_argument("--submits", type=int, default=256)
    ap.add_argument("--oneshots", type=int, default=10)
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-pyslurm-"))
    dc = DevCluster(state)
    cfg = DevClusterConfig(nodes=4, gpus_per_node=4, cpus_per_node=2, port_base=pick_port_base(),
                           slurm_prefix=args.prefix)
    dc.up(cfg)
    os.environ.update(dc.env())
    work = state / "jobs"
    work.mkdir()
    try:
        from clusterops.slurm.factory import connect
        from clusterops.slurm.settings import SlurmSettings

        base = SlurmSettings.from_environment()
        clients = {"cli": connect(replace(base, backend="cli")),
                   "pyslurm": connect(replace(base, backend="pyslurm"))}
        auto = connect(replace(base, backend="auto"))
        cli = clients["cli"]
        ctld = ".".join(map(str, cli.controller_version()))
        script = work / "held.sh"
        script.write_text("#!/bin/bash\ntrue\n")
        held = cli.submit(script, ["--hold", "--job-name=bench-query", f"--output={work}/q.out"])
        names = cfg.node_names
        results = {}
        results["job-state query"] = run_op(clients, lambda c, i: c.job(held), args.queries)
        results["node-state read"] = run_op(clients, lambda c, i: c.node(names[i % len(names)]), args.node_reads)
        submitted = []
        results["submission"] = run_op(
            clients, lambda c, i: submitted.append(
                c.submit(script, ["--hold", "--job-name=bench-submit", f"--output={work}/s.out"])),
            args.submits)
        # A one-shot command pays for its backend once: `clusterops slurm job ID` as a
        # process, per backend (pyslurm: the import of libslurm and auto's version check).
        from clusterops.runner import Runner

        shots = {}
        for name in ("cli", "pyslurm", "auto"):
            env = {"CLUSTEROPS_SLURM_BACKEND": name}
            argv = [sys.executable, "-m", "clusterops", "slurm", "job", str(held), "--json"]
            shots[name] = timed(lambda i: Runner().run(argv, timeout_s=60, env=env), args.oneshots)
        # Every submission is a real job: check they are all there, then cancel them.
        assert len(set(submitted)) == 2 * args.submits, "a submission returned a job id twice"
        listed = {j.job_id for j in cli.jobs(submitted)}
        assert listed == set(submitted), f"{len(set(submitted) - listed)} submitted jobs are missing"
        for jid in submitted + [held]:
            clients["pyslurm"].cancel(jid)

        report = {"controller": ctld, "auto_backend": auto.backend, "ops": {}}
        print(f"Slurm {ctld}, 4-node dev cluster; `auto` chose: {auto.backend}")
        print(f"{'operation':18} {'n':>5} {'cli median':>11} {'pyslurm median':>15} {'ratio':>6}"
              f" {'cli total':>10} {'pyslurm total':>14}")
        for op, by in results.items():
            c, p = summary(by["cli"]), summary(by["pyslurm"])
            ratio = round(c["median_ms"] / p["median_ms"], 1)
            report["ops"][op] = {"cli": c, "pyslurm": p, "ratio_cli_over_pyslurm": ratio}
            print(f"{op:18} {c['n']:>5} {c['median_ms']:>9.2f}ms {p['median_ms']:>13.2f}ms {ratio:>5.1f}x"
                  f" {c['total_s']:>9.2f}s {p['total_s']:>13.2f}s")
        for name, samples in shots.items():
            report.setdefault("oneshot_command", {})[name] = summary(samples)
        print("one-shot `clusterops slurm job ID --json` (a process each): " + ", ".join(
            f"{name} {summary(v)['median_ms']:.0f} ms" for name, v in shots.items()) + " (medians)")
        print(json.dumps(report))
    finally:
        dc.down()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
