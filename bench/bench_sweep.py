"""Sweep scale benchmark.

1. Sweep wall time over 4, 32 and 256 dev-cluster nodes (all slurmd on this machine),
   next to the CPU time the checks themselves used (each check job measures its own
   children's CPU with bash's ``times``). The target at 256 nodes on 2 cores:
   wall <= 1.5 x (total check CPU / cores). A baseline in the same run: the same
   checks started locally, ``cores`` at a time, with no Slurm at all.
2. SSH fan-out to 64 targets on loopback (a real sshd) at concurrency 32: hosts/s,
   for a trivial command and for the real fast check.

Usage: .venv/bin/python bench/bench_sweep.py [--sizes 4,32,256] [--runs 3] [--profile fast]
       [--port-base 26000] [--state-dir /tmp/clusterops-bench-sweep] [--no-ssh]
Prints a table and one JSON line (figures) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")


CGROUP = Path("/sys/fs/cgroup/cpuacct/clusterops-bench-sweep")


class Accounting:
    """CPU used by everything this benchmark runs (dev-cluster daemons, every slurmstepd,
    check and sbatch they fork, the sweep itself), through a cgroup-v1 cpuacct group the
    daemons and this process join; children inherit it. Other programs on the machine
    are not counted, so the orchestration overhead shows even on a busy machine."""

    def __init__(self):
        self.ok = False
        try:
            CGROUP.mkdir(exist_ok=True)
            self.ok = True
        except OSError as e:
            print(f"(no cpuacct cgroup: {e}; our own CPU not measured)")

    def join(self, pids) -> None:
        if not self.ok:
            return
        for pid in pids:
            try:
                (CGROUP / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass

    def usage_s(self) -> float:
        return int((CGROUP / "cpuacct.usage").read_text()) / 1e9 if self.ok else float("nan")

    def close(self) -> None:
        if not self.ok:
            return
        root = CGROUP.parent / "cgroup.procs"
        for pid in (CGROUP / "cgroup.procs").read_text().split():
            try:
                root.write_text(pid + "\n")
            except OSError:
                pass
        try:
            CGROUP.rmdir()
        except OSError:
            pass


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all cores, /proc/stat)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def sweep_once(n: int, profile: str, check_cmd: str, env: dict, workdir: Path, max_running: int = 0,
               acct: "Accounting" = None) -> dict:
    argv = [CLUSTEROPS, "sweep", "--nodes", f"node[1-{n}]" if n > 1 else "node1", "--profile", profile,
            "--json", "--no-history", "-q", "--timeout", "600", "--work-dir", str(workdir),
            "--max-running", str(max_running)]
    if check_cmd:
        argv += ["--check-cmd", check_cmd]
    ours0 = acct.usage_s() if acct else float("nan")
    busy0 = machine_busy_s()
    t0 = time.perf_counter()
    before = os.times()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1200)
    wall = time.perf_counter() - t0
    after = os.times()
    busy = machine_busy_s() - busy0
    ours = (acct.usage_s() if acct else float("nan")) - ours0
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        raise SystemExit(f"sweep failed (exit {out.returncode}): {out.stderr[-2000:]}")
    counts = doc["counts"]
    sweep_cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall_s": wall, "check_cpu_s": doc["check_cpu_s"], "checked": counts["pass"] + counts["warn"]
            + counts["fail"], "unreachable": counts["unreachable"], "errors": counts["error"],
            "sweep_process_cpu_s": sweep_cpu, "exit": out.returncode, "our_cpu_s": ours,
            "machine_busy_s": busy,
            "check_wall_median_s": statistics.median([x["duration_s"] for x in doc["nodes"]
                                                      if x.get("duration_s") is not None] or [0])}


def local_baseline(n: int, profile: str, check_cmd: str, cores: int) -> dict:
    """The same checks with no Slurm: `cores` at a time on this machine."""
    from clusterops.sweep import check_argv

    argv = check_argv(profile, shlex.split(check_cmd) if check_cmd else None)
    scratch = Path(tempfile.mkdtemp(prefix="bench-sweep-local-"))

    def one(i: int) -> None:
        env = dict(os.environ, CLUSTEROPS_NODE_SCRATCH=str(scratch))
        subprocess.run(argv, capture_output=True, env=env, timeout=600)

    before = os.times()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=cores) as pool:
        list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall_s": wall, "cpu_s": cpu}


def submit_rate(env: dict, n: int) -> float:
    """How fast this controller takes pinned, held submissions from 16 parallel sbatch
    (the sweep's submission path), then cancel them."""
    from clusterops.runner import Runner
    from clusterops.slurm import Slurm

    slurm = Slurm(Runner(env=env))
    ids = []

    def one(i: int) -> None:
        ids.append(slurm.submit(text="#!/bin/sh\ntrue\n", args=[f"--nodelist=node{i + 1}", "--hold",
                                                                "--job-name=bench-submit", "--output=/dev/null"]))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(one, range(n)))
    rate = n / (time.perf_counter() - t0)
    subprocess.run(["scancel", "--name=bench-submit"], env=env, capture_output=True, timeout=60)
    return round(rate, 1)


def bench_slurm(args) -> dict:
    from clusterops.devcluster import DevCluster, DevClusterConfig

    biggest = max(args.sizes)
    dc = DevCluster(args.state_dir)
    from clusterops.devcluster import DevClusterError

    base = args.port_base
    while True:   # ephemeral ports of other programs may sit in the range: try the next block
        t0 = time.perf_counter()
        try:
            dc.up(DevClusterConfig(nodes=biggest, gpus_per_node=0, cpus_per_node=2, port_base=base),
                  timeout_s=180)
            break
        except DevClusterError as e:
            if "in use" not in str(e) or base + 2 * biggest > 44000:
                raise
            base += biggest + 20
    up_s = time.perf_counter() - t0
    env = dict(os.environ, SLURM_CONF=str(dc.conf_path))
    cores = os.cpu_count() or 1
    max_running = args.max_running if args.max_running is not None else 8 * cores
    figures = {"devcluster_up_s": round(up_s, 2), "cores": cores, "max_running": max_running, "sizes": {}}
    work = Path(tempfile.mkdtemp(prefix="bench-sweep-work-"))
    acct = Accounting()
    acct.join([p for p in dc.daemon_pids().values() if p] + [os.getpid()])
    try:
        sweep_once(4, args.profile, args.check_cmd, env, work, max_running, acct)   # warm caches
        figures["sbatch_per_s"] = submit_rate(env, min(256, biggest))
        print(f"sbatch submissions (16 in parallel, held jobs): {figures['sbatch_per_s']} jobs/s", flush=True)
        for n in args.sizes:
            runs = [sweep_once(n, args.profile, args.check_cmd, env, work, max_running, acct)
                    for _ in range(args.runs)]
            base = local_baseline(n, args.profile, args.check_cmd, cores) if n <= args.baseline_max else None
            wall = statistics.median(r["wall_s"] for r in runs)
            cpu = statistics.median(r["check_cpu_s"] for r in runs)
            ideal = cpu / cores
            row = {"wall_s_median": round(wall, 2), "walls": [round(r["wall_s"], 2) for r in runs],
                   "check_cpu_s": round(cpu, 2), "ideal_wall_s": round(ideal, 2),
                   "wall_over_ideal": round(wall / ideal, 2) if ideal else None,
                   "checked": runs[-1]["checked"], "unreachable": runs[-1]["unreachable"],
                   "errors": runs[-1]["errors"],
                   "sweep_cli_cpu_s": round(statistics.median(r["sweep_process_cpu_s"] for r in runs), 2),
                   "check_wall_median_s": round(statistics.median(r["check_wall_median_s"] for r in runs), 3)}
            ours = statistics.median(r["our_cpu_s"] for r in runs)
            busy = statistics.median(r["machine_busy_s"] for r in runs)
            row["our_cpu_s"] = round(ours, 2)                       # checks + Slurm + sweep
            row["orchestration_cpu_s"] = round(ours - cpu, 2)       # everything but the checks
            row["orchestration_per_node_ms"] = round((ours - cpu) / n * 1000, 1)
            row["machine_busy_fraction"] = round(busy / (cores * wall), 3)
            row["others_cpu_share"] = round(max(0.0, busy - ours) / (cores * wall), 3)
            # On a quiet machine the fan-out, keeping every core busy, would take our CPU / cores.
            row["quiet_machine_wall_estimate_s"] = round(ours / cores, 2)
            row["quiet_estimate_over_ideal"] = round(ours / cpu, 2) if cpu else None
            if base:
                row["local_baseline_wall_s"] = round(base["wall_s"], 2)
                row["wall_over_local_baseline"] = round(wall / base["wall_s"], 2)
            figures["sizes"][n] = row
            print(f"nodes={n:4d} wall {wall:7.2f}s  check CPU {cpu:7.2f}s  ideal (CPU/{cores}) {ideal:6.2f}s  "
                  f"ratio {row['wall_over_ideal']}  checked {row['checked']}  unreachable {row['unreachable']}"
                  f"  | our CPU {ours:.2f}s (orchestration {row['orchestration_per_node_ms']} ms/node)"
                  f"  machine busy {row['machine_busy_fraction']:.0%}, others {row['others_cpu_share']:.0%}"
                  f"  quiet estimate {row['quiet_machine_wall_estimate_s']}s"
                  f" ({row['quiet_estimate_over_ideal']}x ideal)"
                  + (f"  local baseline {row['local_baseline_wall_s']}s" if base else ""), flush=True)
    finally:
        acct.close()
        dc.down()
    return figures


def bench_ssh(args) -> dict:
    from support.sweep_sshd import Sshd

    from clusterops.sweep import ssh as sshfan
    from clusterops.sweep import check_argv

    if not Sshd.available():
        return {"skipped": "no sshd"}
    root = Path(tempfile.mkdtemp(prefix="bench-sweep-sshd-"))
    sshd = Sshd(root).start(max_startups=200)
    acct = Accounting()
    acct.join([sshd.proc.pid, os.getpid()])     # sshd's per-connection children inherit it
    try:
        hosts = [f"h{i}" for i in range(1, args.ssh_hosts + 1)]
        files = sshd.write_client_files(hosts)
        opts = sshfan.SSHOptions(concurrency=args.ssh_concurrency, ssh_config=files["ssh_config"],
                                 known_hosts=files["known_hosts"], timeout_s=120, connect_timeout_s=30)
        out = {}
        for label, cmd, runs in (("true", "true", 3),
                                 ("fast_check", shlex.join(check_argv(args.profile, shlex.split(args.check_cmd)
                                                                      if args.check_cmd else None)), 1)):
            rates, cpus, busies = [], [], []
            for _ in range(runs):
                c0, b0 = acct.usage_s(), machine_busy_s()
                t0 = time.perf_counter()
                res = sshfan.fan_out(hosts, cmd, opts)
                wall = time.perf_counter() - t0
                cpus.append(acct.usage_s() - c0)
                busies.append((machine_busy_s() - b0) / ((os.cpu_count() or 1) * wall))
                errors = [r.error for r in res.values() if r.error]
                if errors:
                    print(f"ssh {label}: {len(errors)} errors, e.g. {errors[0]}")
                rates.append(len(hosts) / wall)
            cpu = statistics.median(cpus)
            cores = os.cpu_count() or 1
            out[label] = {"hosts": len(hosts), "concurrency": args.ssh_concurrency,
                          "hosts_per_s_median": round(statistics.median(rates), 1),
                          "runs": [round(r, 1) for r in rates],
                          "our_cpu_ms_per_host": round(cpu / len(hosts) * 1000, 1),
                          "quiet_machine_hosts_per_s_estimate": round(len(hosts) / (cpu / cores), 1),
                          "machine_busy_fraction": round(statistics.median(busies), 3)}
            print(f"ssh fan-out {label}: {len(hosts)} hosts at concurrency {args.ssh_concurrency}: "
                  f"{statistics.median(rates):.1f} hosts/s (runs {[round(r, 1) for r in rates]}); "
                  f"our CPU {out[label]['our_cpu_ms_per_host']} ms/host (client + sshd + command), "
                  f"machine busy {statistics.median(busies):.0%}; quiet-machine estimate "
                  f"{out[label]['quiet_machine_hosts_per_s_estimate']} hosts/s", flush=True)
        return out
    finally:
        acct.close()
        sshd.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,32,256")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", default="fast")
    ap.add_argument("--check-cmd", default="")
    ap.add_argument("--port-base", type=int, default=26000)  # below the ephemeral range
    ap.add_argument("--state-dir", default="/tmp/clusterops-bench-sweep-dc")
    ap.add_argument("--baseline-max", type=int, default=32, help="largest size to run the local baseline for")
    ap.add_argument("--max-running", type=int, default=None,
                    help="check jobs in flight (default 8 x cores: the dev cluster's nodes share this machine)")
    ap.add_argument("--ssh-hosts", type=int, default=64)
    ap.add_argument("--ssh-concurrency", type=int, default=32)
    ap.add_argument("--no-ssh", action="store_true")
    ap.add_argument("--no-slurm", action="store_true")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    figures = {}
    if not args.no_slurm:
        figures["slurm"] = bench_slurm(args)
    if not args.no_ssh:
        figures["ssh"] = bench_ssh(args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
