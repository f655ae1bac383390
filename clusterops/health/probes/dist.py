"""torch-distributed test and all-reduce bandwidth.

Every rank (one per GPU, or a few per CPU node) initialises the process group (NCCL on
GPUs, gloo on CPUs), allocates on its device, all-reduces a tensor of ones and checks
the result equals the world size, passes a barrier, then (optionally) measures all-reduce
bandwidth: warm-up, timed iterations per payload size, the reduced values checked, and
algbw/busbw as nccl-tests defines them (busbw = algbw * 2(n-1)/n), in GB/s.

Each rank writes ``rank<R>.json`` into a result directory shared by the ranks (on a real
cluster: a shared filesystem; the default is under $SLURM_SUBMIT_DIR) at every stage, so
a rank that hangs or dies is reported with the stage it last reached, and a rank that
never started is reported as missing, by rank and host. Rank 0 (or whoever calls
``collect_report``) waits for every rank up to the deadline and writes the report.
Everything runs under a deadline: a rank's work runs in a worker thread and the rank
exits when the deadline passes, whatever torch is doing.

Run as one task per node under srun/torchrun:
    srun --ntasks-per-node=1 clusterops health dist --result-dir DIR
or, for one node's local GPUs, from ``clusterops health check`` (profile probe ``dist``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from clusterops.health.probes.base import ProbeContext, ProbeResult
from clusterops.jsonout import dumps
from clusterops.runner import free_port

FINAL = ("pass", "fail")


@dataclass
class DistOptions:
    result_dir: str
    timeout_s: float = 60.0
    backend: str = "auto"               # auto | nccl | gloo
    sizes_bytes: Sequence[int] = ()     # all-reduce bandwidth payloads; empty -> no bandwidth test
    warmup: int = 5
    iters: int = 20
    min_busbw_gbps: Optional[float] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    report_path: Optional[str] = None
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


# -- rank identity ---------------------------------------------------------------------------

def rank_info(env: Mapping[str, str]) -> Dict[str, Any]:
    """rank/world/local rank from torchrun (RANK...) or srun (SLURM_PROCID...)."""
    def first(*keys, default=None):
        for k in keys:
            if env.get(k) not in (None, ""):
                return env[k]
        return default

    rank = int(first("RANK", "SLURM_PROCID", default=0))
    world = int(first("WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS", default=1))
    local = int(first("LOCAL_RANK", "SLURM_LOCALID", default=0))
    addr = first("MASTER_ADDR")
    if not addr:
        nodes = first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        if nodes:
            import hostlist

            addr = node_address(hostlist.expand_hostlist(nodes)[0])
        else:
            addr = "127.0.0.1"
    port = first("MASTER_PORT")
    if not port:
        # Same on every rank of a step, spread over a range so parallel steps rarely collide.
        job = int(first("SLURM_JOB_ID", default=0)) + int(first("SLURM_STEP_ID", default=0) or 0)
        port = 20000 + job % 20000
    return {"rank": rank, "world_size": world, "local_rank": local, "master_addr": addr,
            "master_port": int(port), "host": socket.gethostname(),
            "node": env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]}


def node_address(name: str) -> str:
    """The rendezvous address of a Slurm node: the Slurm layer's one rule (its name when it
    resolves, else its NodeAddr), asked with a short bound."""
    from clusterops.slurm.factory import connect

    return connect(read_attempts=2, timeout_s=10).node_address(name)


def expected_hosts(env: Mapping[str, str], world: int) -> Dict[int, str]:
    """rank -> node for srun block distribution (SLURM_STEP_NODELIST + SLURM_STEP_TASKS_PER_NODE),
    so a rank that never started is still named by its host."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodes or not tpn:
        return {}
    import hostlist

    names = hostlist.expand_hostlist(nodes)
    counts: List[int] = []
    for part in tpn.split(","):  # "2(x3),1"
        if "(x" in part:
            n, rep = part.split("(x")
            counts.extend([int(n)] * int(rep.rstrip(")")))
        elif part:
            counts.append(int(part))
    out, r = {}, 0
    for name, c in zip(names, counts):
        for _ in range(c):
            out[r] = name
            r += 1
    return {k: v for k, v in out.items() if k < world}


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(dumps(data, indent=None))   # strict JSON: a NaN figure is null, not NaN
    os.replace(tmp, path)


# -- the measurement ------------------------------------------------------------------------

def busbw_factor(n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n."""
    return 2.0 * (n - 1) / n if n > 1 else 1.0


def allreduce_bandwidth(torch, dist, device, size_bytes: int, warmup: int, iters: int) -> Dict[str, Any]:
    """Timed all-reduce of ``size_bytes`` of float32; the time is averaged over ranks (nccl-tests)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = max(1, size_bytes // 4)
    t = torch.zeros(n, dtype=torch.float32, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if str(device).startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        dist.all_reduce(t)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    sync()
    dt = (time.perf_counter() - t0) / iters
    # Average over ranks, as nccl-tests does (they end the loop within one collective of each other).
    avg = torch.tensor([dt], dtype=torch.float64, device=device)
    dist.all_reduce(avg)
    dt = float(avg.item()) / world
    # Values: zeros summed stay zeros; then one exact reduction of rank+1.
    ok = bool((t == 0).all().item())
    t.fill_(rank + 1)
    dist.all_reduce(t)
    ok = ok and bool((t == world * (world + 1) / 2).all().item())
    algbw = n * 4 / dt / 1e9
    return {"size_bytes": n * 4, "time_s": dt, "algbw_gbps": round(algbw, 4),
            "busbw_gbps": round(algbw * busbw_factor(world), 4), "correct": ok}


class _Progress:
    def __init__(self, path: Path, base: Dict[str, Any]):
        self.path, self.data = path, dict(base)

    def stage(self, name: str, **extra) -> None:
        self.data.update(stage=name, time=time.time(), **extra)
        _write_json(self.path, self.data)


def _rank_work(opts: DistOptions, info: Dict[str, Any], prog: _Progress, out: Dict[str, Any]) -> None:
    from datetime import timedelta

    prog.stage("import")
    import torch
    import torch.distributed as dist

    backend = opts.backend
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", info["local_rank"] % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    out.update(backend=backend, device=str(device))
    prog.stage("init", backend=backend, device=str(device))
    t0 = time.perf_counter()
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
                            rank=info["rank"], world_size=info["world_size"],
                            timeout=timedelta(seconds=max(1.0, opts.timeout_s)), **kwargs)
    out["init_s"] = round(time.perf_counter() - t0, 3)
    prog.stage("alloc")
    x = torch.ones(1024, dtype=torch.float32, device=device)
    prog.stage("allreduce")
    dist.all_reduce(x)
    if backend == "nccl":
        torch.cuda.synchronize(device)
    got = float(x[0].item())
    if not bool((x == info["world_size"]).all().item()):
        raise RuntimeError(f"all-reduce result {got:g} != world size {info['world_size']}")
    prog.stage("barrier")
    dist.barrier()
    bw = []
    for size in opts.sizes_bytes:
        prog.stage(f"bandwidth {int(size)}B")
        r = allreduce_bandwidth(torch, dist, device, int(size), opts.warmup, opts.iters)
        bw.append(r)
        if not r["correct"]:
            raise RuntimeError(f"all-reduce of {int(size)} bytes gave wrong values")
    out["bandwidth"] = bw
    prog.stage("done")
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_rank(opts: DistOptions) -> int:
    """One rank's whole test under the deadline; rank 0 also writes/prints the report.
    Returns the process exit code (0 pass)."""
    start = time.time()
    info = rank_info(opts.env)
    rdir = Path(opts.result_dir)
    prog = _Progress(rdir / f"rank{info['rank']}.json",
                     {k: info[k] for k in ("rank", "world_size", "local_rank", "host", "node")} |
                     {"pid": os.getpid(), "start": start, "status": "running"})
    prog.stage("started")
    out: Dict[str, Any] = {}
    err: List[str] = []

    def work():
        try:
            _rank_work(opts, info, prog, out)
        except BaseException as e:  # report, never raise out of the thread
            err.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])

    th = threading.Thread(target=work, name="dist-rank", daemon=True)
    th.start()
    th.join(opts.timeout_s)
    if th.is_alive():
        prog.data.update(status="fail", error=f"timed out after {opts.timeout_s:g}s at stage {prog.data.get('stage')}")
    elif err:
        prog.data.update(status="fail", error=f"{err[0]} (at stage {prog.data.get('stage')})")
    else:
        prog.data.update(status="pass", **out)
    prog.data["end"] = time.time()
    _write_json(prog.path, prog.data)
    code = 0 if prog.data["status"] == "pass" else 1
    if info["rank"] == 0:
        # The other ranks hit their own deadline about when this one does; a few seconds
        # cover start-up skew between nodes.
        rep = collect_report(rdir, info["world_size"], deadline=start + opts.timeout_s + 5,
                             hosts=expected_hosts(opts.env, info["world_size"]),
                             min_busbw_gbps=opts.min_busbw_gbps)
        if opts.report_path:
            _write_json(Path(opts.report_path), rep)
        _write_json(rdir / "report.json", rep)
        code = 0 if rep["status"] == "pass" else 1
        print(dumps(rep), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave now: a hung collective's threads (or NCCL's) must not hold the process.
    os._exit(code)


# -- the report ------------------------------------------------------------------------------

def read_ranks(rdir: Path) -> Dict[int, Dict[str, Any]]:
    out = {}
    for p in rdir.glob("rank*.json"):
        try:
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue
    return out


def collect_report(rdir: Path, world: int, *, deadline: float, hosts: Optional[Dict[int, str]] = None,
                   min_busbw_gbps: Optional[float] = None, poll_s: float = 0.2) -> Dict[str, Any]:
    """Wait (until ``deadline``, epoch seconds) for every rank's final result, then judge."""
    rdir = Path(rdir)
    while True:
        ranks = read_ranks(rdir)
        if all(ranks.get(r, {}).get("status") in FINAL for r in range(world)) or time.time() >= deadline:
            break
        time.sleep(poll_s)
    hosts = hosts or {}
    missing, stuck, failed = [], [], []
    for r in range(world):
        d = ranks.get(r)
        where = (d or {}).get("node") or hosts.get(r, "?")
        if d is None:
            missing.append(f"rank {r} ({where}) did not answer: no result")
        elif d.get("status") not in FINAL:
            stuck.append(f"rank {r} ({where}, pid {d.get('pid')}) stopped answering at stage {d.get('stage')}")
        elif d["status"] == "fail":
            failed.append((r, where, d.get("error", "failed")))
    culprits = missing + stuck
    problems: List[str] = list(culprits)
    if failed:
        if culprits:  # the others only waited for the culprit
            rs = ",".join(str(r) for r, _, _ in failed)
            problems.append(f"ranks {rs} failed waiting for them")
        else:
            problems.extend(f"rank {r} ({w}): {e}" for r, w, e in failed[:4])
    # Bandwidth: every rank holds the same (rank-averaged) figures; rank 0's are reported.
    bw = (ranks.get(0) or {}).get("bandwidth") or []
    # The largest payload's busbw is the figure that matters (small ones are latency-bound).
    busbw = max(bw, key=lambda b: b["size_bytes"])["busbw_gbps"] if bw else None
    bw_fail = (min_busbw_gbps is not None and busbw is not None and not problems
               and busbw < float(min_busbw_gbps))
    status = "fail" if problems or bw_fail else "pass"
    if problems:
        detail = "; ".join(problems[:4]) + "; check those hosts (network, GPU, hung process) and drain if it repeats"
    elif bw_fail:
        detail = (f"all-reduce busbw {busbw:.2f} GB/s < {min_busbw_gbps} GB/s: check the network "
                  "(IB ports, NCCL env, NVLink)")
    else:
        detail = f"{world} ranks: init, all-reduce == world size, barrier ok"
        if busbw is not None:
            detail += f"; busbw {busbw:.2f} GB/s"
    return {"status": status, "world_size": world, "detail": detail,
            "missing": [int(m.split()[1]) for m in missing],
            "stuck": [int(s.split()[1]) for s in stuck],
            "failed": [r for r, _, _ in failed], "bandwidth": bw, "busbw_gbps": busbw,
            "min_busbw_gbps": min_busbw_gbps,
            "ranks": {str(r): ranks[r] for r in sorted(ranks)}}


def report_results(rep: Dict[str, Any]) -> List[ProbeResult]:
    """A dist report -> probe results ``dist.allreduce`` and (with bandwidth) ``dist.busbw``."""
    test_ok = not (rep["missing"] or rep["stuck"] or rep["failed"])
    out = [ProbeResult("dist.allreduce", "pass" if test_ok else "fail", value=rep["world_size"], unit="ranks",
                       threshold=rep["world_size"], detail=rep["detail"] if not test_ok else
                       f"{rep['world_size']} ranks: init, all-reduce == world size, barrier ok",
                       data={k: rep[k] for k in ("missing", "stuck", "failed")} |
                            {"ranks": {r: {k: v for k, v in d.items() if k in
                                           ("node", "host", "stage", "status", "error", "backend", "init_s")}
                                       for r, d in rep["ranks"].items()}})]
    if rep.get("bandwidth"):
        busbw, thr = rep["busbw_gbps"], rep.get("min_busbw_gbps")
        st = "pass" if (thr is None or busbw >= float(thr)) else "fail"
        if not test_ok:
            st = "fail"
        out.append(ProbeResult("dist.busbw", st, value=busbw, unit="GB/s", threshold=thr,
                               detail=(f"all-reduce busbw {busbw:.2f} GB/s" if st == "pass" else
                                       f"all-reduce busbw {busbw:.2f} GB/s < {thr} GB/s: check NVLink/IB and NCCL settings"),
                               data={"sizes": rep["bandwidth"]}))
    return out


# -- the probe: this node's local ranks --------------------------------------------------------

def _local_ranks(cfg: Dict[str, Any], ctx: ProbeContext) -> int:
    if cfg.get("local_ranks"):
        return int(cfg["local_ranks"])
    gpus = ctx.cache.get("gpu_count")
    if gpus:
        return int(gpus)
    vis = ctx.env.get("CUDA_VISIBLE_DEVICES")
    if vis and vis.strip() not in ("", "NoDevFiles"):
        return len([v for v in vis.split(",") if v.strip()])
    if os.path.exists("/dev/nvidia0"):
        return len([p for p in os.listdir("/dev") if p.startswith("nvidia") and p[6:].isdigit()])
    return int(cfg.get("cpu_ranks", 2))


def busbw_floor(cfg: Dict[str, Any], ctx: ProbeContext, world: int) -> Optional[float]:
    """The busbw floor: the profile's ``min_busbw_gbps``, else the GPU model's
    ``allreduce_busbw_gbps`` (a figure for a full 8-GPU node, so only with 8 ranks or more;
    the model is the one the nvml or amd probe found earlier in the check)."""
    if cfg.get("min_busbw_gbps") is not None:
        return float(cfg["min_busbw_gbps"])
    model = ctx.cache.get("gpu_model")
    figure = (ctx.gpu_models.get(model) or {}).get("allreduce_busbw_gbps") if model else None
    return float(figure) if figure and world >= 8 else None


def probe_dist(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    """Run the test over this node's GPUs (or ``cpu_ranks`` gloo ranks) as local processes."""
    world = _local_ranks(cfg, ctx)
    timeout_s = float(cfg.get("test_timeout_s", 0.7 * float(cfg.get("timeout_s", 60))))
    on_gpu = bool(ctx.cache.get("gpu_count"))
    sizes = [int(s) for s in (cfg.get("sizes_bytes", []) if on_gpu or "cpu_sizes_bytes" not in cfg
                              else cfg["cpu_sizes_bytes"])]
    with tempfile.TemporaryDirectory(prefix="clusterops-dist-") as d:
        port = free_port("127.0.0.1")
        procs = []
        argv = [sys.executable, "-m", "clusterops.health.probes.dist", "--result-dir", d,
                "--timeout-s", str(timeout_s), "--backend", cfg.get("backend", "auto"),
                "--warmup", str(cfg.get("warmup", 5)), "--iters", str(cfg.get("iters", 20))]
        for s in sizes:
            argv += ["--size", str(s)]
        for r in range(world):
            env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(ctx.runner.spawn(argv, log_path=os.path.join(d, f"log{r}.txt"), env=env))
        deadline = time.time() + timeout_s + 10
        try:
            rep = collect_report(Path(d), world, deadline=deadline,
                                 min_busbw_gbps=busbw_floor(cfg, ctx, world) if on_gpu else cfg.get("min_busbw_gbps"))
        finally:
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, min(5.0, deadline - time.time())))
                except Exception:
                    try:
                        os.killpg(p.pid, 9)
                    except OSError:
                        pass
                    p.wait()
        res = report_results(rep)
        if res[0].status == "fail":
            logs = []
            for r in rep.get("failed", [])[:1] + rep.get("stuck", [])[:1]:
                try:
                    tail = Path(d, f"log{r}.txt").read_text().strip().splitlines()[-1:]
                    logs.extend(f"rank{r}: {t}" for t in tail)
                except OSError:
                    pass
            res[0].data["log_tail"] = logs
        return res


# -- python -m clusterops.health.probes.dist (a local rank, spawned by probe_dist) ------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m clusterops.health.probes.dist")
    ap.add_argument("--result-dir", required=True)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--size", type=int, action="append", default=[])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--min-busbw-gbps", type=float, default=None)
    a = ap.parse_args(argv)
    return run_rank(DistOptions(result_dir=a.result_dir, timeout_s=a.timeout_s, backend=a.backend,
                                sizes_bytes=a.size, warmup=a.warmup, iters=a.iters,
                                min_busbw_gbps=a.min_busbw_gbps))


if __name__ == "__main__":
    sys.exit(main())
