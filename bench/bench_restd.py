"""The Slurm layer's REST backend (slurmrestd) beside the CLI tools and, where it can serve
the controller, pyslurm, on the same dev cluster.

Run: .venv/bin/python bench/bench_restd.py [--prefix DIR] [--queries 300] [--node-reads 300]
     [--drains 40] [--oneshots 10]
Starts a 4-node dev cluster with slurmrestd (``restd=True``; the Slurm on PATH, or the
prefix's), then for each backend, through the layer's own methods: job-state queries
(``job(id)`` of a held job), node-state reads (``node(name)``, round robin), and a drain
(``drain`` then ``resume`` of node4, counted as one operation). The REST client talks to
slurmrestd over its UNIX socket with tokens signed with the cluster's key. Where the server's
plugin version has no node update (v0.0.38, Slurm 22.05) the REST backend's drain is the CLI
client's, and the table says so. Prints medians, p90s and the ratios to the CLI as a table and
as JSON; then the wall time of a one-shot ``clusterops slurm job ID --json`` per backend.
Backends alternate in blocks of 32 (bench_pyslurm.py's ``run_op``) so a slow patch of the
shared machine hits all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pyslurm import run_op, summary, timed  # noqa: E402

from clusterops.devcluster import DevCluster, DevClusterConfig, free_port_base  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default=os.environ.get("CLUSTEROPS_SLURM_PREFIX") or None)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--node-reads", type=int, default=300)
    ap.add_argument("--drains", type=int, default=40)
    ap.add_argument("--oneshots", type=int, default=10)
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="clusterops-bench-restd-"))
    dc = DevCluster(state)
    cfg = DevClusterConfig(nodes=4, gpus_per_node=4, cpus_per_node=2, port_base=free_port_base(5),
                           slurm_prefix=args.prefix, restd=True)
    dc.up(cfg)
    os.environ.update(dc.env())
    work = state / "jobs"
    work.mkdir()
    try:
        from clusterops.slurm.factory import connect
        from clusterops.slurm.pyslurm_backend import mismatch
        from clusterops.slurm.settings import SlurmSettings

        base = SlurmSettings.from_environment()
        url = dc.restd_urls()["unix"]
        clients = {"cli": connect(replace(base, backend="cli"))}
        cli = clients["cli"]
        ctld = cli.controller_version()
        if mismatch(ctld) is None:
            clients["pyslurm"] = connect(replace(base, backend="pyslurm"))
        clients["rest"] = connect(replace(base, backend="rest", url=url, jwt_key=str(dc.jwt_key)))
        rest = clients["rest"]
        script = work / "held.sh"
        script.write_text("#!/bin/bash\ntrue\n")
        held = cli.submit(script, ["--hold", "--job-name=bench-query", f"--output={work}/q.out"])
        names = cfg.node_names

        def drain_cycle(c, i):
            c.drain("node4", f"clusterops: bench: drain {i}")
            c.resume("node4")

        results = {
            "job-state query": run_op(clients, lambda c, i: c.job(held), args.queries),
            "node-state read": run_op(clients, lambda c, i: c.node(names[i % len(names)]), args.node_reads),
            "drain+resume": run_op(clients, drain_cycle, args.drains),
        }
        assert cli.node("node4").is_idle or not cli.node("node4").drained
        from clusterops.runner import Runner

        shots = {}
        for name in clients:
            env = {"CLUSTEROPS_SLURM_BACKEND": name}
            if name == "rest":
                env.update({"CLUSTEROPS_SLURM_URL": url, "CLUSTEROPS_SLURM_JWT_KEY": str(dc.jwt_key)})
            argv = [sys.executable, "-m", "clusterops", "slurm", "job", str(held), "--json"]
            shots[name] = timed(lambda i: Runner().run(argv, timeout_s=60, env=env), args.oneshots)
        cli.cancel(held)

        drain_note = "" if rest.adapter.node_update else " (rest: via the CLI client, no node update in " \
                                                         f"{rest.adapter.version})"
        version = f"{ctld[0]}.{ctld[1]:02d}." + ".".join(map(str, ctld[2:]))
        report = {"controller": version, "rest_plugin": rest.adapter.version, "ops": {}}
        print(f"Slurm {version}, 4-node dev cluster; slurmrestd plugin {rest.adapter.version} over its UNIX socket")
        head = f"{'operation':16} {'n':>4}" + "".join(f" {n + ' median':>15}" for n in clients) + \
            "".join(f" {'cli/' + n:>11}" for n in clients if n != "cli")
        print(head)
        for op, by in results.items():
            s = {n: summary(v) for n, v in by.items()}
            ratios = {n: round(s["cli"]["median_ms"] / s[n]["median_ms"], 2) for n in clients if n != "cli"}
            report["ops"][op] = {"summary": s, "ratio_cli_over": ratios}
            print(f"{op:16} {s['cli']['n']:>4}" + "".join(f" {s[n]['median_ms']:>13.2f}ms" for n in clients) +
                  "".join(f" {ratios[n]:>10.2f}x" for n in ratios) + (drain_note if op == "drain+resume" else ""))
        report["oneshot_command"] = {n: summary(v) for n, v in shots.items()}
        print("one-shot `clusterops slurm job ID --json` (a process each): " + ", ".join(
            f"{n} {summary(v)['median_ms']:.0f} ms" for n, v in shots.items()) + " (medians)")
        print(json.dumps(report))
    finally:
        dc.down()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
